//! Driver loading, error checking and the per-device primary context.

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// Turns a driver return code into a Result naming the call.
pub fn check(code: sys::CUresult, call: &'static str) -> Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    unsafe { sys::cuGetErrorName(code, &mut name) };
    let name = if name.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: the driver returns a NUL-terminated static string.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    };
    Err(Error::Cuda {
        call,
        code: code as u32,
        name,
    })
}

/// cudarc panics when the driver library is absent; ask first so that a
/// machine without a GPU gets an error, not a panic.
pub fn ensure_driver() -> Result<()> {
    // A present driver stays present: probe (dlopen) until it is found once.
    static FOUND: AtomicBool = AtomicBool::new(false);
    if FOUND.load(Ordering::Relaxed) {
        return Ok(());
    }
    // SAFETY: only probes whether libcuda can be opened.
    if unsafe { sys::is_culib_present() } {
        FOUND.store(true, Ordering::Relaxed);
        Ok(())
    } else {
        Err(Error::Missing(
            "the NVIDIA driver library (libcuda.so.1) could not be loaded: no CUDA GPU driver on this machine".into(),
        ))
    }
}

/// What the ops need to know about a device.
#[derive(Debug, Clone, Copy)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub context: usize,
    pub sms: u32,
    pub major: i32,
    pub minor: i32,
}

impl DeviceInfo {
    /// NVRTC target: the arch-specific Hopper target where wgmma/TMA exist.
    pub fn arch(&self) -> String {
        let suffix = if self.major == 9 && self.minor == 0 {
            "a"
        } else {
            ""
        };
        format!("sm_{}{}{}", self.major, self.minor, suffix)
    }
}

static DEVICES: Mutex<Option<HashMap<i32, DeviceInfo>>> = Mutex::new(None);

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out pointer and device handle.
    check(
        unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

/// Makes torch's primary context of `ordinal` current on this thread and
/// returns the device's facts. The context is retained once and never
/// released: torch owns its lifetime.
pub fn bind(ordinal: i32) -> Result<DeviceInfo> {
    ensure_driver()?;
    let mut guard = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
    let devices = guard.get_or_insert_with(HashMap::new);
    let info = match devices.get(&ordinal) {
        Some(info) => *info,
        None => {
            // SAFETY: plain driver calls with valid out pointers.
            unsafe {
                check(sys::cuInit(0), "cuInit")?;
                let mut dev: sys::CUdevice = 0;
                check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                check(
                    sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                    "cuDevicePrimaryCtxRetain",
                )?;
                use sys::CUdevice_attribute::*;
                let info = DeviceInfo {
                    ordinal,
                    context: ctx as usize,
                    sms: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
                    major: attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    minor: attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                };
                devices.insert(ordinal, info);
                info
            }
        }
    };
    // SAFETY: the context was retained above and stays alive.
    check(
        unsafe { sys::cuCtxSetCurrent(info.context as sys::CUcontext) },
        "cuCtxSetCurrent",
    )?;
    Ok(info)
}

/// Puts the calling thread's current context back when dropped. `bind` makes the operands'
/// device current, and a caller whose current device is another one (torch.cuda.set_device)
/// must find it unchanged after the call; every Python entry point that binds holds one.
pub struct KeepCurrent(Option<sys::CUcontext>);

impl KeepCurrent {
    pub fn new() -> Self {
        if ensure_driver().is_err() {
            return Self(None);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer; a null context (none current) is a valid answer.
        let ok = unsafe { sys::cuCtxGetCurrent(&mut ctx) } == sys::CUresult::CUDA_SUCCESS;
        Self(ok.then_some(ctx))
    }
}

impl Default for KeepCurrent {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepCurrent {
    fn drop(&mut self) {
        let Some(prev) = self.0 else { return };
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `prev` was current on this thread when saved; torch keeps primary contexts
        // alive, and restoring null (no context) is allowed.
        unsafe {
            if sys::cuCtxGetCurrent(&mut now) == sys::CUresult::CUDA_SUCCESS && now != prev {
                sys::cuCtxSetCurrent(prev);
            }
        }
    }
}
