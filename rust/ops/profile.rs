//! The machine profiles the planner uses where they exist: measured
//! collective curves per world size (the overlapped groups' collectives on
//! this library's capped NCCL communicator; the sequential schedule's on the
//! ProcessGroup's own communicator) and
//! measured GEMM times (per kernel, CTA count and shape), registered by
//! Python (flashoverlap.profiles) from the cache dir or the bundled defaults
//! before a communicator's first op. Plans are cached per shape, so a
//! profile registered later applies to shapes planned after it.

use std::collections::HashMap;
use std::sync::Mutex;

use super::backend::Backend;
use crate::cuda::kernels::GemmKernel;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::{CollectiveKind, Curve, HardwareModel, OutputTiles, Waves};

/// Which collective a curve times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CurveOf {
    /// The sequential schedule's one collective (the ProcessGroup's own).
    Sequential,
    /// A wave group's collective on this library's capped NCCL communicator.
    NcclGroup,
    /// A wave group's exchange on the copy engines, its sums on `ctas` CTAs.
    CopyEngineGroup { ctas: u32 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct GemmSample {
    m: u32,
    n: u32,
    k: u32,
    us: f64,
}

impl GemmSample {
    fn tflops(&self) -> f64 {
        2.0 * f64::from(self.m) * f64::from(self.n) * f64::from(self.k) / (self.us * 1e6)
    }
}

/// Which GEMM a sample times: a kernel name ("sm90_n128", ..., or "cublas"
/// for the library GEMM the sequential schedule runs), dtype, device SMs, CTAs.
type GemmKey = (String, Dtype, u32, u32);

#[derive(Default)]
struct Registry {
    /// (device SMs, world size, collective, which) -> time vs input bytes.
    curves: HashMap<(u32, u32, CollectiveKind, CurveOf), Curve>,
    gemms: HashMap<GemmKey, Vec<GemmSample>>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Registry::default))
}

pub fn register_curve(
    sms: u32,
    world: u32,
    kind: CollectiveKind,
    of: CurveOf,
    samples: &[(u64, f64)],
) -> Result<()> {
    if of == (CurveOf::CopyEngineGroup { ctas: 0 }) {
        return Err(Error::Invalid(
            "curve: a copy-engine curve needs >= 1 reduction CTA".into(),
        ));
    }
    let curve = Curve::new(samples).map_err(|e| Error::Invalid(e.to_string()))?;
    with(|r| r.curves.insert((sms, world, kind, of), curve));
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub fn register_gemm(
    kernel: &str,
    dtype: Dtype,
    sms: u32,
    ctas: u32,
    (m, n, k): (u32, u32, u32),
    us: f64,
) -> Result<()> {
    if !(us.is_finite() && us > 0.0) || m == 0 || n == 0 || k == 0 || ctas == 0 || ctas > sms {
        return Err(Error::Invalid(format!(
            "profile: GEMM sample {kernel} {m}x{n}x{k} on {ctas}/{sms} CTAs: {us} us is not a time"
        )));
    }
    with(|r| {
        let samples = r
            .gemms
            .entry((kernel.to_string(), dtype, sms, ctas))
            .or_default();
        samples.retain(|s| (s.m, s.n, s.k) != (m, n, k));
        samples.push(GemmSample { m, n, k, us });
    });
    Ok(())
}

pub fn clear() {
    with(|r| *r = Registry::default());
}

/// (curves, GEMM samples) registered, for `flashoverlap show` and tests.
pub fn counts() -> (usize, usize) {
    with(|r| (r.curves.len(), r.gemms.values().map(Vec::len).sum()))
}

/// TFLOP/s of `kernel` on `ctas` CTAs for an m x n x k GEMM: the sample of
/// that shape (true), else the geometric mean of the kernel's samples there
/// (false) of the same n and k where there are some (the rate moves with
/// k far more than with m: cuBLAS on H200 ran 525 TFLOP/s at k = 1024 and
/// 666-694 at k >= 3584, so an All-to-All's m of 10923 rows priced at the
/// mean of every shape made its sequential schedule 5% too slow at
/// k = 14336), else of all of them.
fn gemm_tflops(
    kernel: &str,
    dtype: Dtype,
    sms: u32,
    ctas: u32,
    shape: (u32, u32, u32),
) -> Option<(f64, bool)> {
    with(|r| {
        let samples = r.gemms.get(&(kernel.to_string(), dtype, sms, ctas))?;
        if let Some(s) = samples.iter().find(|s| (s.m, s.n, s.k) == shape) {
            return Some((s.tflops(), true));
        }
        let same_nk: Vec<_> = samples
            .iter()
            .filter(|s| (s.n, s.k) == (shape.1, shape.2))
            .collect();
        let pool = if same_nk.is_empty() {
            samples.iter().collect()
        } else {
            same_nk
        };
        let logs: f64 = pool.iter().map(|s| s.tflops().ln()).sum();
        (!pool.is_empty()).then(|| ((logs / pool.len() as f64).exp(), false))
    })
}

/// Whether `tune` timed `kernel` on `ctas` CTAs for exactly this shape.
pub fn measured_gemm(
    kernel: &str,
    dtype: Dtype,
    sms: u32,
    ctas: u32,
    shape: (u32, u32, u32),
) -> bool {
    matches!(
        gemm_tflops(kernel, dtype, sms, ctas, shape),
        Some((_, true))
    )
}

/// The model's GEMM time over the true one for `kernel` on `ctas` CTAs: it
/// runs whole waves of whole tiles (ceil(tiles / ctas) waves of `ctas` full
/// tiles), where a measured time already holds the last wave's idle CTAs
/// and the edge tiles' padding. A measured rate times this makes the model
/// give back the measured time (1.055 for 2048 x 8192 on 108 CTAs of
/// 128 x 256 tiles: 512 tiles are 4.74 waves, and the model counted 5 on
/// top of the measurement).
fn wave_padding(kernel: &str, ctas: u32, (m, n, _): (u32, u32, u32)) -> f64 {
    // The same tiles and waves the cost model counts.
    let Some(tile) = GemmKernel::parse(kernel).map(super::gemm::tile_shape) else {
        return 1.0;
    };
    let Ok(tiles) = OutputTiles::new(m, n, tile) else {
        return 1.0;
    };
    let Ok(waves) = Waves::new(ctas, tiles.count()) else {
        return 1.0;
    };
    let modelled = f64::from(waves.count()) * f64::from(ctas) * f64::from(tile.bm * tile.bn);
    modelled / (f64::from(m) * f64::from(n))
}

/// What a call is planned for, to look its profile up.
pub struct Lookup<'a> {
    pub kernel: &'a str,
    pub dtype: Dtype,
    pub ctas: u32,
    pub shape: (u32, u32, u32),
    pub world: u32,
    pub kind: CollectiveKind,
    /// What runs the overlapped groups' collectives, and the SMs it has
    /// (the copy engines' sums run on that many CTAs).
    pub backend: Backend,
    pub reserved: u32,
}

/// The measured curve of one group's collective on `backend` (None where
/// `tune` measured none): NCCL's as this library's capped communicator runs
/// it; the copy engines' on the most CTAs `ctas` covers (fewer sum slower,
/// so a curve of more CTAs than the call has would flatter it).
fn group_curve(
    sms: u32,
    world: u32,
    kind: CollectiveKind,
    backend: Backend,
    ctas: u32,
) -> Option<Curve> {
    with(|r| match backend {
        Backend::Nccl => r
            .curves
            .get(&(sms, world, kind, CurveOf::NcclGroup))
            .copied(),
        // Not profiled yet: the constants stand.
        Backend::Peer | Backend::Push => None,
        Backend::CopyEngine => r
            .curves
            .iter()
            .filter_map(|(&(s, w, k, of), c)| match of {
                CurveOf::CopyEngineGroup { ctas: measured }
                    if (s, w, k) == (sms, world, kind) && measured <= ctas =>
                {
                    Some((measured, *c))
                }
                _ => None,
            })
            .max_by_key(|&(measured, _)| measured)
            .map(|(_, c)| c),
    })
}

/// What `tune` measured a plain collective of `bytes` per rank to take on
/// `backend` (its sums on `ctas` CTAs for the copy engines), or None where
/// it measured no curve for this device, world size and collective.
pub fn measured_collective_us(
    sms: u32,
    world: u32,
    kind: CollectiveKind,
    backend: Backend,
    ctas: u32,
    bytes: u64,
) -> Option<f64> {
    group_curve(sms, world, kind, backend, ctas).map(|c| c.at(bytes))
}

/// `hw` with what the profile measured in place of its constants.
pub fn apply(hw: HardwareModel, q: &Lookup) -> HardwareModel {
    let mut hw = hw.with_collective(q.kind);
    let (sms, world, kind) = (hw.sms, q.world, q.kind);
    let curve = |of| with(|r| r.curves.get(&(sms, world, kind, of)).copied());
    if let Some(c) = curve(CurveOf::Sequential) {
        hw.comm.curve = Some(c);
    }
    let group = group_curve(sms, world, kind, q.backend, q.reserved);
    // Not the copy engines' curve: `tune` times one exchange alone, ~35 us
    // each however small, where the pipeline's groups hide most of that
    // behind each other (2x H200 E2 with the curve: 55% mean error; the
    // analytic model, whose sum rates that curve fitted, 4.9%).
    if let Some(c) = group.filter(|_| q.backend != Backend::CopyEngine) {
        hw.overlap_comm.curve = Some(c);
    }
    // The model runs a wave of `ctas` tiles at gemm_tflops * ctas / sms. A
    // rate averaged over other shapes keeps their average padding as is.
    if let Some((t, exact)) = gemm_tflops(q.kernel, q.dtype, hw.sms, q.ctas, q.shape) {
        let padding = if exact {
            wave_padding(q.kernel, q.ctas, q.shape)
        } else {
            1.0
        };
        hw.gemm_tflops = t * padding * f64::from(hw.sms) / f64::from(q.ctas);
    }
    if let Some((t, _)) = gemm_tflops("cublas", q.dtype, hw.sms, hw.sms, q.shape) {
        hw.sequential_gemm_tflops = t;
    }
    hw
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: the registry is process-wide and tests run in parallel; a
    // 131-SM device keeps it away from every other test's plans.
    #[test]
    fn registered_measurements_replace_the_constants() {
        let base = HardwareModel {
            sms: 131,
            ..HardwareModel::h200()
        };
        let q = Lookup {
            kernel: "sm90_n256",
            dtype: Dtype::Bf16,
            ctas: 108,
            shape: (4096, 8192, 4096),
            world: 2,
            kind: CollectiveKind::AllReduce,
            backend: Backend::Nccl,
            reserved: 24,
        };
        assert_eq!(apply(base, &q), base);
        let (fast, slow) = (
            [(1 << 20, 15.0), (1 << 30, 2000.0)],
            [(1 << 20, 20.0), (1 << 30, 3000.0)],
        );
        register_curve(
            131,
            2,
            CollectiveKind::AllReduce,
            CurveOf::Sequential,
            &fast,
        )
        .unwrap();
        register_curve(131, 2, CollectiveKind::AllReduce, CurveOf::NcclGroup, &slow).unwrap();
        // 2 * 4096 * 8192 * 4096 flops in 500 us on 108 CTAs.
        register_gemm(
            "sm90_n256",
            Dtype::Bf16,
            131,
            108,
            (4096, 8192, 4096),
            500.0,
        )
        .unwrap();
        register_gemm(
            "sm90_n256",
            Dtype::Bf16,
            131,
            108,
            (2048, 8192, 4096),
            200.0,
        )
        .unwrap();
        register_gemm("cublas", Dtype::Bf16, 131, 131, (4096, 8192, 4096), 400.0).unwrap();
        let hw = apply(base, &q);
        assert_eq!(hw.comm.time_us(1 << 20, 2), 15.0);
        assert_eq!(hw.overlap_comm.time_us(1 << 20, 2), 20.0);
        let flops = 2.0 * 4096.0 * 8192.0 * 4096.0;
        // The measured shape: the model's 10 whole waves of 108 tiles of
        // 128 x 256 (1024 tiles) give back the measured 500 us.
        let padding = 10.0 * 108.0 / 1024.0;
        assert!((hw.gemm_tflops - flops / 500e6 * padding * 131.0 / 108.0).abs() < 1e-9);
        let tile_flops = 2.0 * 128.0 * 256.0 * 4096.0;
        let wave_us = tile_flops / (hw.gemm_tflops * 1e6 / 131.0);
        assert!((10.0 * wave_us - 500.0).abs() < 1e-6);
        assert!((hw.sequential_gemm_tflops - flops / 400e6).abs() < 1e-9);
        // Another shape: the geometric mean of the kernel's samples.
        let other = apply(
            base,
            &Lookup {
                shape: (1000, 1000, 1000),
                ..q
            },
        );
        let mean = ((flops / 500e6) * (flops / 2.0 / 200e6)).sqrt();
        assert!((other.gemm_tflops - mean * 131.0 / 108.0).abs() < 1e-9);
        // Another m of a timed n and k: the samples of that n and k only.
        register_gemm(
            "sm90_n256",
            Dtype::Bf16,
            131,
            108,
            (2048, 8192, 1024),
            100.0,
        )
        .unwrap();
        let rows = apply(
            base,
            &Lookup {
                shape: (3000, 8192, 4096),
                ..q
            },
        );
        assert!((rows.gemm_tflops - mean * 131.0 / 108.0).abs() < 1e-9);
        assert!((rows.sequential_gemm_tflops - flops / 400e6).abs() < 1e-9);
        // No curve for ReduceScatter, another world or another backend.
        let rs = apply(
            base,
            &Lookup {
                kind: CollectiveKind::ReduceScatter,
                ..q
            },
        );
        assert_eq!(rs.comm.curve, None);
        assert_eq!(apply(base, &Lookup { world: 4, ..q }).comm.curve, None);
        let ce = Lookup {
            backend: Backend::CopyEngine,
            reserved: 8,
            ..q
        };
        let ce_hw = apply(base, &ce);
        assert!(ce_hw.comm.curve.is_some() && ce_hw.overlap_comm.curve.is_none());
        // Copy-engine curves: the one of the most CTAs the reservation covers
        // is what a plain collective costs (below), but the overlapped model
        // keeps its analytic groups (the curve, timed alone, misled it).
        for (ctas, us) in [(4, 40.0), (8, 30.0), (16, 25.0)] {
            let samples = [(1 << 20, us), (1 << 30, 100.0 * us)];
            let of = CurveOf::CopyEngineGroup { ctas };
            register_curve(131, 2, CollectiveKind::AllReduce, of, &samples).unwrap();
        }
        let ce_hw = apply(base, &ce);
        assert!(ce_hw.comm.curve.is_some() && ce_hw.overlap_comm.curve.is_none());
        assert_eq!(ce_hw.overlap_comm_slowdown, base.overlap_comm_slowdown);
        assert_eq!(apply(base, &q).overlap_comm.time_us(1 << 20, 2), 20.0);
        // A plain collective's measured time on each backend (what "auto" compares).
        let (ar, mib) = (CollectiveKind::AllReduce, 1 << 20);
        let plain = |b, ctas| measured_collective_us(131, 2, ar, b, ctas, mib);
        assert_eq!(plain(Backend::Nccl, 8), Some(20.0));
        assert_eq!(plain(Backend::CopyEngine, 8), Some(30.0));
        assert_eq!(plain(Backend::CopyEngine, 100), Some(25.0));
        assert_eq!(plain(Backend::CopyEngine, 2), None);
        assert_eq!(plain(Backend::Peer, 8), None);
        let rs = CollectiveKind::ReduceScatter;
        assert_eq!(
            measured_collective_us(131, 2, rs, Backend::Nccl, 8, mib),
            None
        );
        let no_ctas = CurveOf::CopyEngineGroup { ctas: 0 };
        assert!(register_curve(131, 2, CollectiveKind::AllReduce, no_ctas, &slow).is_err());
        assert!(register_gemm("x", Dtype::Bf16, 132, 133, (1, 1, 1), 1.0).is_err());
        assert!(register_gemm("x", Dtype::Bf16, 132, 8, (1, 1, 1), f64::NAN).is_err());
        let one = [(1, 1.0)];
        assert!(
            register_curve(131, 2, CollectiveKind::AllReduce, CurveOf::NcclGroup, &one).is_err()
        );
        clear();
        assert_eq!(counts(), (0, 0));
    }
}
