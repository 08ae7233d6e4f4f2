//! Run-time compilation of csrc kernels to cubin with NVRTC.
//!
//! NVRTC is found by Python (nvidia-* wheels that torch installs, or
//! CUDA_HOME) and opened here by path, together with its builtins library,
//! before cudarc resolves it by soname, so the one the user has is used.

use crate::error::{Error, Result};
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

/// A source file: its name (as `#include` sees it) and its text.
#[derive(Debug, Clone, Copy)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
}

static LOADED: OnceLock<Vec<libloading::os::unix::Library>> = OnceLock::new();

fn open_global(path: &Path) -> Result<libloading::os::unix::Library> {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading NVRTC runs no user-visible initialisers with preconditions.
    unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| Error::Missing(format!("could not load {}: {e}", path.display())))
}

/// Opens NVRTC (and the libnvrtc-builtins beside it, which NVRTC itself only
/// finds on the loader path) from `path`. Later calls are no-ops.
pub fn load_from(path: &Path) -> Result<()> {
    if LOADED.get().is_some() {
        return Ok(());
    }
    let mut libs = Vec::new();
    if let Some(dir) = path.parent() {
        let mut builtins: Vec<_> = std::fs::read_dir(dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        builtins.retain(|p| {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            name.starts_with("libnvrtc-builtins.so") && !name.contains(".alt.")
        });
        builtins.sort();
        if let Some(b) = builtins.last() {
            libs.push(open_global(b)?);
        }
    }
    libs.push(open_global(path)?);
    let _ = LOADED.set(libs);
    Ok(())
}

fn ensure_loaded() -> Result<()> {
    // SAFETY: only probes whether the library can be opened.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Missing(
            "NVRTC (libnvrtc.so) was not found: install the nvidia-cuda-nvrtc wheel (pip install nvidia-cuda-nvrtc) \
             or set CUDA_HOME to a CUDA toolkit"
                .into(),
        ))
    }
}

fn check(code: sys::nvrtcResult, what: &str) -> Result<()> {
    if code == sys::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string.
    let msg = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(code)) }
        .to_string_lossy()
        .into_owned();
    Err(Error::Nvrtc {
        what: format!("{what}: {msg}"),
        log: String::new(),
    })
}

/// (major, minor) of the NVRTC in use; part of every cache key.
pub fn version() -> Result<(i32, i32)> {
    ensure_loaded()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: valid out pointers.
    check(
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) },
        "nvrtcVersion",
    )?;
    Ok((major, minor))
}

fn cstring(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::Invalid(format!("NUL byte in compiler input {s:?}")))
}

/// Compiles `main` (with in-memory `headers`) to a cubin for the arch named
/// in `options`. A failure carries the compiler log.
pub fn compile(main: &Source, headers: &[Source], options: &[String]) -> Result<Vec<u8>> {
    ensure_loaded()?;
    let src = cstring(main.text)?;
    let name = cstring(main.name)?;
    let header_texts = headers
        .iter()
        .map(|h| cstring(h.text))
        .collect::<Result<Vec<_>>>()?;
    let header_names = headers
        .iter()
        .map(|h| cstring(h.name))
        .collect::<Result<Vec<_>>>()?;
    let text_ptrs: Vec<_> = header_texts.iter().map(|c| c.as_ptr()).collect();
    let name_ptrs: Vec<_> = header_names.iter().map(|c| c.as_ptr()).collect();
    let opts = options
        .iter()
        .map(|o| cstring(o))
        .collect::<Result<Vec<_>>>()?;
    let opt_ptrs: Vec<_> = opts.iter().map(|c| c.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer outlives the program, which is destroyed below.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                headers.len() as i32,
                text_ptrs.as_ptr(),
                name_ptrs.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let compiled = sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr());
        let result = if compiled == sys::nvrtcResult::NVRTC_SUCCESS {
            cubin_of(prog)
        } else {
            Err(Error::Nvrtc {
                what: format!("compiling {} with {options:?} failed", main.name),
                log: log_of(prog),
            })
        };
        sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}

unsafe fn log_of(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    if sys::nvrtcGetProgramLogSize(prog, &mut size) != sys::nvrtcResult::NVRTC_SUCCESS || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast());
    String::from_utf8_lossy(&buf)
        .trim_end_matches('\0')
        .trim()
        .to_string()
}

unsafe fn cubin_of(prog: sys::nvrtcProgram) -> Result<Vec<u8>> {
    let mut size = 0usize;
    check(sys::nvrtcGetCUBINSize(prog, &mut size), "nvrtcGetCUBINSize")?;
    let mut buf = vec![0u8; size];
    check(
        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()),
        "nvrtcGetCUBIN",
    )?;
    Ok(buf)
}
