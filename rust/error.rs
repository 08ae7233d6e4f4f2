//! One error type for everything below the Python bindings; the bindings map
//! `Invalid` to ValueError and the rest to RuntimeError.

use crate::plan::PlanError;
use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// Bad arguments, detected before anything is enqueued.
    Invalid(String),
    Plan(PlanError),
    /// A CUDA driver call failed: the call and the driver's name for the code.
    Cuda {
        call: &'static str,
        code: u32,
        name: String,
    },
    /// NVRTC failed; `log` holds the compiler's output when there is one.
    Nvrtc {
        what: String,
        log: String,
    },
    Nccl {
        call: &'static str,
        code: i32,
        message: String,
    },
    /// A library or file the run needs could not be found or loaded.
    Missing(String),
    Io(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid(m) | Error::Missing(m) | Error::Io(m) => write!(f, "{m}"),
            Error::Plan(e) => write!(f, "{e}"),
            Error::Cuda { call, code, name } => write!(f, "{call} failed: {name} ({code})"),
            Error::Nvrtc { what, log } if log.is_empty() => write!(f, "NVRTC: {what}"),
            Error::Nvrtc { what, log } => write!(f, "NVRTC: {what}\n{log}"),
            Error::Nccl {
                call,
                code,
                message,
            } => write!(f, "{call} failed: {message} ({code})"),
        }
    }
}

impl std::error::Error for Error {}

impl From<PlanError> for Error {
    fn from(e: PlanError) -> Self {
        Error::Plan(e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}
