//! TMA descriptors (CUtensorMap) for the Hopper kernel's operands. They
//! embed the global address, so they are encoded on the host for every call
//! (a few microseconds) and passed to the kernel by value.

use super::driver::check;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// A row-major [rows, cols] matrix read in boxes of [box_rows, box_cols],
/// box_cols * 2 bytes = 128 so that each box row is one 128-byte swizzle
/// row. Reads past the matrix return zeros; stores past it are dropped.
pub fn row_major_2d(
    ptr: u64,
    rows: u32,
    cols: u32,
    box_rows: u32,
    box_cols: u32,
    dtype: Dtype,
) -> Result<sys::CUtensorMap> {
    if ptr % 16 != 0 || (u64::from(cols) * 2) % 16 != 0 {
        return Err(Error::Invalid(format!(
            "TMA needs 16-byte aligned rows: pointer {ptr:#x}, row of {cols} elements"
        )));
    }
    let data_type = match dtype {
        Dtype::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        Dtype::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    };
    let dims = [u64::from(cols), u64::from(rows)];
    let strides = [u64::from(cols) * 2];
    let boxes = [box_cols, box_rows];
    let element_strides = [1u32, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has the rank the call names; map is a valid out pointer.
    check(
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                data_type,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        },
        "cuTensorMapEncodeTiled",
    )?;
    Ok(map)
}
