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

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::{CollectiveKind, Curve, HardwareModel};

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
    /// (device SMs, world size, collective, overlapped) -> time vs input bytes.
    curves: HashMap<(u32, u32, CollectiveKind, bool), Curve>,
    gemms: HashMap<GemmKey, Vec<GemmSample>>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Registry) -> T) -> T {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(Registry::default))
}

/// `overlapped`: the curve of the groups' collectives while overlapping
/// (else of the sequential schedule's one collective).
pub fn register_curve(
    sms: u32,
    world: u32,
    kind: CollectiveKind,
    overlapped: bool,
    samples: &[(u64, f64)],
) -> Result<()> {
    let curve = Curve::new(samples).map_err(|e| Error::Invalid(e.to_string()))?;
    with(|r| r.curves.insert((sms, world, kind, overlapped), curve));
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
/// that shape, else the geometric mean of the kernel's samples there.
fn gemm_tflops(
    kernel: &str,
    dtype: Dtype,
    sms: u32,
    ctas: u32,
    shape: (u32, u32, u32),
) -> Option<f64> {
    with(|r| {
        let samples = r.gemms.get(&(kernel.to_string(), dtype, sms, ctas))?;
        if let Some(s) = samples.iter().find(|s| (s.m, s.n, s.k) == shape) {
            return Some(s.tflops());
        }
        let logs: f64 = samples.iter().map(|s| s.tflops().ln()).sum();
        (!samples.is_empty()).then(|| (logs / samples.len() as f64).exp())
    })
}

/// What a call is planned for, to look its profile up.
pub struct Lookup<'a> {
    pub kernel: &'a str,
    pub dtype: Dtype,
    pub ctas: u32,
    pub shape: (u32, u32, u32),
    pub world: u32,
    pub kind: CollectiveKind,
    /// The overlapped groups' collectives run on NCCL (else another
    /// backend, whose own curve the profile does not hold yet).
    pub nccl_overlap: bool,
}

/// `hw` with what the profile measured in place of its constants.
pub fn apply(hw: HardwareModel, q: &Lookup) -> HardwareModel {
    let mut hw = hw.with_collective(q.kind);
    let curve = |overlapped| {
        with(|r| {
            r.curves
                .get(&(hw.sms, q.world, q.kind, overlapped))
                .copied()
        })
    };
    if let Some(c) = curve(false) {
        hw.comm.curve = Some(c);
    }
    if let (Some(c), true) = (curve(true), q.nccl_overlap) {
        hw.overlap_comm.curve = Some(c);
    }
    // The model runs a wave of `ctas` tiles at gemm_tflops * ctas / sms.
    if let Some(t) = gemm_tflops(q.kernel, q.dtype, hw.sms, q.ctas, q.shape) {
        hw.gemm_tflops = t * f64::from(hw.sms) / f64::from(q.ctas);
    }
    if let Some(t) = gemm_tflops("cublas", q.dtype, hw.sms, hw.sms, q.shape) {
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
            nccl_overlap: true,
        };
        assert_eq!(apply(base, &q), base);
        let (fast, slow) = (
            [(1 << 20, 15.0), (1 << 30, 2000.0)],
            [(1 << 20, 20.0), (1 << 30, 3000.0)],
        );
        register_curve(131, 2, CollectiveKind::AllReduce, false, &fast).unwrap();
        register_curve(131, 2, CollectiveKind::AllReduce, true, &slow).unwrap();
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
        assert!((hw.gemm_tflops - flops / 500e6 * 131.0 / 108.0).abs() < 1e-9);
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
        let ce = apply(
            base,
            &Lookup {
                nccl_overlap: false,
                ..q
            },
        );
        assert!(ce.comm.curve.is_some() && ce.overlap_comm.curve.is_none());
        assert!(register_gemm("x", Dtype::Bf16, 132, 133, (1, 1, 1), 1.0).is_err());
        assert!(register_gemm("x", Dtype::Bf16, 132, 8, (1, 1, 1), f64::NAN).is_err());
        assert!(register_curve(131, 2, CollectiveKind::AllReduce, true, &[(1, 1.0)]).is_err());
        clear();
        assert_eq!(counts(), (0, 0));
    }
}
