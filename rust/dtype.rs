//! The 16-bit element types the kernels take, as Python names them.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16,
    F16,
}

impl Dtype {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "bfloat16" | "bf16" => Ok(Dtype::Bf16),
            "float16" | "fp16" | "half" => Ok(Dtype::F16),
            other => Err(Error::Invalid(format!(
                "dtype: expected bfloat16 or float16, got {other}"
            ))),
        }
    }

    pub fn bytes(self) -> u32 {
        2
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "float16",
        }
    }
}
