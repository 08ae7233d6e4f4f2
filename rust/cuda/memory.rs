//! Small device buffers owned by the library (counters, tile tables).

use super::driver::check;
use crate::error::Result;
use cudarc::driver::sys;

/// A device allocation in the primary context of the device that was bound
/// when it was made; freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
}

// SAFETY: a device pointer is plain data; the driver API is thread-safe.
unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `words` zeroed 32-bit words (zeroed synchronously, before any
    /// stream can see the buffer).
    pub fn zeroed_u32(words: usize) -> Result<Self> {
        let bytes = words.max(1) * 4;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; the caller bound a context.
        unsafe {
            check(sys::cuMemAlloc_v2(&mut ptr, bytes), "cuMemAlloc")?;
            let buf = DeviceBuffer { ptr, bytes };
            check(sys::cuMemsetD32_v2(ptr, 0, words.max(1)), "cuMemsetD32")?;
            Ok(buf)
        }
    }

    /// Uploads a table of 32-bit words, synchronously.
    pub fn from_u32(data: &[u32]) -> Result<Self> {
        let buf = Self::zeroed_u32(data.len())?;
        if !data.is_empty() {
            // SAFETY: the buffer holds data.len() words.
            check(
                unsafe { sys::cuMemcpyHtoD_v2(buf.ptr, data.as_ptr().cast(), data.len() * 4) },
                "cuMemcpyHtoD",
            )?;
        }
        Ok(buf)
    }
}

/// Sets every byte of `buf` from `offset` on to `value`, synchronously.
pub fn fill_from(buf: &DeviceBuffer, offset: u64, value: u8) -> Result<()> {
    let Some(len) = (buf.bytes as u64).checked_sub(offset) else {
        return Ok(());
    };
    // SAFETY: [offset, bytes) lies within the allocation; the caller bound its context.
    unsafe {
        check(
            sys::cuMemsetD8_v2(buf.ptr + offset, value, len as usize),
            "cuMemsetD8",
        )?;
        check(sys::cuCtxSynchronize(), "cuCtxSynchronize")
    }
}

/// Reads one 32-bit word of device memory, synchronously (the bound
/// context's device, or one mapped into it).
pub fn read_u32(ptr: sys::CUdeviceptr) -> Result<u32> {
    let mut word = 0u32;
    // SAFETY: valid out pointer for 4 bytes; the caller names a device word.
    check(
        unsafe { sys::cuMemcpyDtoH_v2((&mut word as *mut u32).cast(), ptr, 4) },
        "cuMemcpyDtoH",
    )?;
    Ok(word)
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc; an error at teardown has no one to report to.
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}
