//! The signaling GEMM on its own (no communication): launches used by the
//! overlapped ops and exposed for measuring the kernel alone.

use crate::cuda::driver::{self, DeviceInfo};
use crate::cuda::kernels::{self, GemmKernel, Kernel};
use crate::cuda::stream::RawStream;
use crate::cuda::tensor_map;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::TileShape;
use std::ffi::c_void;

/// out[M, N] = x[M, K] @ weight[N, K]^T; pointers are device addresses.
#[derive(Debug, Clone, Copy)]
pub struct GemmArgs {
    pub x: u64,
    pub weight: u64,
    pub out: u64,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub dtype: Dtype,
}

pub fn tile_shape(kernel: GemmKernel) -> TileShape {
    let (bm, bn, bk) = kernel.tile();
    TileShape { bm, bn, bk }
}

impl GemmArgs {
    /// What the kernel requires of the shape (Python checks first; this
    /// guards the Rust API too).
    pub fn validate(&self) -> Result<()> {
        if self.m == 0 || self.n == 0 || self.k == 0 {
            return Err(Error::Invalid(format!(
                "shape: M, N and K must be >= 1, got {}x{}x{}",
                self.m, self.n, self.k
            )));
        }
        if self.n % 8 != 0 || self.k % 8 != 0 {
            return Err(Error::Invalid(format!(
                "shape: N and K must be multiples of 8, got N={} K={}",
                self.n, self.k
            )));
        }
        if self.x == 0 || self.weight == 0 || self.out == 0 {
            return Err(Error::Invalid("pointers: null device pointer".into()));
        }
        Ok(())
    }

    pub fn tiles(&self, kernel: GemmKernel) -> u32 {
        let t = tile_shape(kernel);
        self.m.div_ceil(t.bm) * self.n.div_ceil(t.bn)
    }
}

/// Tables and counters of a signaling launch; all null for a plain GEMM.
#[derive(Debug, Clone, Copy, Default)]
pub struct Signals {
    pub tile_order: u64,
    pub tile_group: u64,
    pub counters: u64,
}

/// A GEMM kernel loaded for one device and dtype.
#[derive(Debug, Clone, Copy)]
pub struct LoadedGemm {
    pub which: GemmKernel,
    kernel: Kernel,
}

/// Loads `which` (or the device's default) for `dtype`; a kernel the device
/// cannot run is a clear error.
pub fn load(device: &DeviceInfo, dtype: Dtype, which: Option<GemmKernel>) -> Result<LoadedGemm> {
    let which = which.unwrap_or_else(|| GemmKernel::default_for(device.major));
    if !which.runs_on(&device.arch()) {
        return Err(Error::Invalid(format!(
            "kernel: {} does not run on {} (device {})",
            which.name(),
            device.arch(),
            device.ordinal
        )));
    }
    let kernel = kernels::load(device, &which.spec(dtype))?;
    Ok(LoadedGemm { which, kernel })
}

/// Enqueues the persistent GEMM with `ctas` CTAs on `stream`.
pub fn launch(
    gemm: &LoadedGemm,
    args: &GemmArgs,
    signals: &Signals,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    let (mut c, mut m, mut n, mut k) = (args.out, args.m as i32, args.n as i32, args.k as i32);
    let (mut order, mut group, mut counters) =
        (signals.tile_order, signals.tile_group, signals.counters);
    let tiles = args.tiles(gemm.which);
    let mut count = tiles as i32;
    let grid = ctas.min(tiles).max(1);
    let tail: [*mut c_void; 8] = [
        (&mut c as *mut u64).cast(),
        (&mut m as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut k as *mut i32).cast(),
        (&mut order as *mut u64).cast(),
        (&mut group as *mut u64).cast(),
        (&mut counters as *mut u64).cast(),
        (&mut count as *mut i32).cast(),
    ];
    match gemm.which {
        GemmKernel::Sm80 => {
            let (mut a, mut b) = (args.x, args.weight);
            let mut params: Vec<*mut c_void> =
                vec![(&mut a as *mut u64).cast(), (&mut b as *mut u64).cast()];
            params.extend(tail);
            gemm.kernel
                .launch(grid, gemm.which.threads(), stream, &mut params)
        }
        GemmKernel::Sm90 { bn } => {
            let (bm, _, bk) = gemm.which.tile();
            let mut a = tensor_map::row_major_2d(args.x, args.m, args.k, bm, bk, args.dtype)?;
            let mut b = tensor_map::row_major_2d(args.weight, args.n, args.k, bn, bk, args.dtype)?;
            let mut params: Vec<*mut c_void> = vec![
                (&mut a as *mut _ as *mut c_void),
                (&mut b as *mut _ as *mut c_void),
            ];
            params.extend(tail);
            gemm.kernel
                .launch(grid, gemm.which.threads(), stream, &mut params)
        }
    }
}

/// The GEMM alone on all SMs of `ordinal`, on the caller's stream.
pub fn gemm(
    args: &GemmArgs,
    ordinal: i32,
    which: Option<GemmKernel>,
    stream: RawStream,
) -> Result<()> {
    args.validate()?;
    let device = driver::bind(ordinal)?;
    let kernel = load(&device, args.dtype, which)?;
    launch(&kernel, args, &Signals::default(), device.sms, stream)
}
