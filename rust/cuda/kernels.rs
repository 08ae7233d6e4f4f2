//! The csrc kernels: their sources (embedded in the binary, so the cache key
//! always matches what runs), compile options, and per-device loading.

use super::driver::{check, DeviceInfo};
use super::nvrtc::{self, Source};
use super::{cache, stream::RawStream};
use crate::dtype::Dtype;
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

const HEADERS: &[Source] = &[Source {
    name: "ptx.cuh",
    text: include_str!("../../csrc/ptx.cuh"),
}];

const GEMM_SIGNAL_SM80: Source = Source {
    name: "gemm_signal_sm80.cu",
    text: include_str!("../../csrc/gemm_signal_sm80.cu"),
};

/// The tile the sm80 GEMM computes per CTA iteration; plan/ needs it.
/// BK = 64 measured 1.25x faster than 32 on H200 (fewer barriers per K);
/// 3 stages (96 KiB) fit every sm_80+ part, and a 4th gained only ~2%.
pub const GEMM_SM80_TILE: (u32, u32, u32) = (128, 128, 64);
const GEMM_SM80_STAGES: u32 = 3;
pub const GEMM_SM80_THREADS: u32 = 256;
pub const GEMM_SM80_SMEM: u32 = GEMM_SM80_STAGES * (128 + 128) * GEMM_SM80_TILE.2 * 2;

/// One compiled variant of one kernel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    pub source: &'static str,
    pub entry: &'static str,
    pub defines: Vec<(&'static str, String)>,
    pub dynamic_smem: u32,
}

impl KernelSpec {
    fn main(&self) -> Source {
        match self.source {
            "gemm_signal_sm80.cu" => GEMM_SIGNAL_SM80,
            other => unreachable!("unknown kernel source {other}"),
        }
    }

    fn options(&self, arch: &str) -> Vec<String> {
        let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()];
        o.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        o
    }
}

pub fn gemm_signal(dtype: Dtype) -> KernelSpec {
    KernelSpec {
        source: GEMM_SIGNAL_SM80.name,
        entry: "fo_gemm_signal",
        defines: vec![
            (
                "FO_BF16",
                if dtype == Dtype::Bf16 { "1" } else { "0" }.to_string(),
            ),
            ("FO_BK", GEMM_SM80_TILE.2.to_string()),
            ("FO_STAGES", GEMM_SM80_STAGES.to_string()),
        ],
        dynamic_smem: GEMM_SM80_SMEM,
    }
}

/// Every variant the library can launch, for the compile check CI runs.
pub fn all() -> Vec<KernelSpec> {
    vec![gemm_signal(Dtype::Bf16), gemm_signal(Dtype::F16)]
}

/// The cubin of `spec` for `arch` (e.g. "sm_90a"), from the cache or NVRTC.
pub fn cubin(spec: &KernelSpec, arch: &str) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc::version()?;
    let options = spec.options(arch);
    let main = spec.main();
    let mut parts: Vec<&[u8]> = vec![main.text.as_bytes()];
    parts.extend(HEADERS.iter().map(|h| h.text.as_bytes()));
    let joined = options.join(" ");
    let version = format!("nvrtc {major}.{minor}");
    parts.push(joined.as_bytes());
    parts.push(version.as_bytes());
    parts.push(arch.as_bytes());
    let key = cache::key(&parts);
    cache::get_or_compile(&key, || nvrtc::compile(&main, HEADERS, &options))
}

/// A kernel loaded into a device's primary context. Modules stay loaded for
/// the life of the process (as torch's own kernels do).
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    function: usize,
    pub dynamic_smem: u32,
}

static LOADED: Mutex<Option<HashMap<(i32, KernelSpec), Kernel>>> = Mutex::new(None);

/// Loads (once per device) and returns the kernel. Getting the function
/// handle loads it eagerly, which must happen before any stream wait that
/// its launch could otherwise deadlock behind under lazy module loading.
pub fn load(device: &DeviceInfo, spec: &KernelSpec) -> Result<Kernel> {
    let key = (device.ordinal, spec.clone());
    if let Some(k) = LOADED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(*k);
    }
    let image = cubin(spec, &device.arch())?;
    let entry = CString::new(spec.entry).expect("entry names have no NUL");
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: image is a complete cubin; out pointers are valid.
    unsafe {
        check(
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast()),
            "cuModuleLoadData",
        )?;
        check(
            sys::cuModuleGetFunction(&mut function, module, entry.as_ptr()),
            "cuModuleGetFunction",
        )?;
        check(
            sys::cuFuncSetAttribute(
                function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                spec.dynamic_smem as i32,
            ),
            "cuFuncSetAttribute",
        )?;
    }
    let kernel = Kernel {
        function: function as usize,
        dynamic_smem: spec.dynamic_smem,
    };
    LOADED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, kernel);
    Ok(kernel)
}

impl Kernel {
    /// Enqueues the kernel; `params` point at each argument, in order.
    pub fn launch(
        &self,
        grid: u32,
        block: u32,
        stream: RawStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller passes one pointer per kernel parameter, live for this call.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    self.function as sys::CUfunction,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    self.dynamic_smem,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}
