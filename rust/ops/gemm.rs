//! The signaling GEMM on its own (no communication): launches used by the
//! overlapped ops and exposed for measuring the kernel alone.

use crate::cuda::driver::{self, DeviceInfo};
use crate::cuda::kernels::{self, Kernel, GEMM_SM80_THREADS, GEMM_SM80_TILE};
use crate::cuda::stream::RawStream;
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

pub fn tile_shape() -> TileShape {
    let (bm, bn, bk) = GEMM_SM80_TILE;
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

    pub fn tiles(&self) -> u32 {
        let t = tile_shape();
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

pub fn load(device: &DeviceInfo, dtype: Dtype) -> Result<Kernel> {
    kernels::load(device, &kernels::gemm_signal(dtype))
}

/// Enqueues the persistent GEMM with `ctas` CTAs on `stream`.
pub fn launch(
    kernel: &Kernel,
    args: &GemmArgs,
    signals: &Signals,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    let (mut a, mut b, mut c) = (args.x, args.weight, args.out);
    let (mut m, mut n, mut k) = (args.m as i32, args.n as i32, args.k as i32);
    let (mut order, mut group, mut counters) =
        (signals.tile_order, signals.tile_group, signals.counters);
    let mut tiles = args.tiles() as i32;
    let mut params: [*mut c_void; 10] = [
        (&mut a as *mut u64).cast(),
        (&mut b as *mut u64).cast(),
        (&mut c as *mut u64).cast(),
        (&mut m as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut k as *mut i32).cast(),
        (&mut order as *mut u64).cast(),
        (&mut group as *mut u64).cast(),
        (&mut counters as *mut u64).cast(),
        (&mut tiles as *mut i32).cast(),
    ];
    let grid = ctas.min(args.tiles()).max(1);
    kernel.launch(grid, GEMM_SM80_THREADS, stream, &mut params)
}

/// The GEMM alone on all SMs of `ordinal`, on the caller's stream.
pub fn gemm(args: &GemmArgs, ordinal: i32, stream: RawStream) -> Result<()> {
    args.validate()?;
    let device = driver::bind(ordinal)?;
    let kernel = load(&device, args.dtype)?;
    launch(&kernel, args, &Signals::default(), device.sms, stream)
}
