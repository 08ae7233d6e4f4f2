//! What the predictor knows about a machine: a few calibratable numbers,
//! and measured collective curves where `flashoverlap tune` made them.

use crate::plan::error::{require_positive, PlanError};

use super::curve::Curve;

/// Which collective a [`CollectiveModel`] times; `bytes` is always the
/// collective's input on one rank (for ReduceScatter: all `world` shards).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    AllReduce,
    ReduceScatter,
    /// Uniform splits: each rank sends bytes/world to every rank (itself
    /// included, which costs no link time).
    AllToAll,
}

/// A collective's cost: a measured curve at this world size where there is
/// one, else as nccl-tests reports it: a fixed latency plus the bytes each
/// rank moves over the bus bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CollectiveModel {
    pub latency_us: f64,
    /// Bus bandwidth in GB/s (1e9 bytes/s), nccl-tests' "busbw".
    pub bus_gbps: f64,
    pub kind: CollectiveKind,
    /// Measured time vs input bytes, for `kind` at the world size planned for.
    pub curve: Option<Curve>,
}

impl CollectiveModel {
    pub const fn analytic(latency_us: f64, bus_gbps: f64) -> Self {
        Self {
            latency_us,
            bus_gbps,
            kind: CollectiveKind::AllReduce,
            curve: None,
        }
    }

    /// The same link timing another collective: the analytic constants
    /// carry over (busbw is per collective-independent bus traffic), a
    /// measured curve only to its own kind.
    pub fn with_kind(self, kind: CollectiveKind) -> Self {
        if kind == self.kind {
            return self;
        }
        Self {
            kind,
            curve: None,
            ..self
        }
    }

    /// The collective over `bytes` of input per rank (world 1 -> 0). Ring
    /// traffic per rank: AllReduce 2*(world-1)/world * bytes, ReduceScatter
    /// and AllToAll (world-1)/world * bytes.
    pub fn time_us(&self, bytes: u64, world: u32) -> f64 {
        if world <= 1 {
            return 0.0;
        }
        if let Some(curve) = &self.curve {
            return curve.at(bytes);
        }
        let world = f64::from(world);
        let passes = match self.kind {
            CollectiveKind::AllReduce => 2.0,
            CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => 1.0,
        };
        let moved = passes * (world - 1.0) / world * bytes as f64;
        // 1 GB/s moves 1e3 bytes per microsecond.
        self.latency_us + moved / (self.bus_gbps * 1e3)
    }
}

// NCCL AllReduce on 2x H200 over NVLink: 64 MB in ~260 us, 256 MB in
// 900-1030 us, small messages 60-80 us (the bandwidth is set a little low:
// with 300 GB/s the model under-rated overlap at M = 2048).
const H200_NCCL: CollectiveModel = CollectiveModel::analytic(45.0, 270.0);

/// The un-reorder copy on H200: output bytes per microsecond per CTA (one
/// per SM), measured over the 17 kernel shapes alone on the GPU: 42 K on 4
/// CTAs, 38 K on 8, 29 K on 16, 28 K on 24 (evaluation/results/gemm_kernel_h200.txt).
const H200_UNREORDER_PER_SM: f64 = 30_000.0;

const GENERIC_LINK: CollectiveModel = CollectiveModel::analytic(60.0, 100.0);

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HardwareModel {
    pub sms: u32,
    /// Effective TFLOP/s of the signaling GEMM kernel on all SMs.
    pub gemm_tflops: f64,
    /// TFLOP/s of the GEMM the sequential schedule runs instead (the
    /// framework's library GEMM, cuBLAS), which may be faster than ours.
    pub sequential_gemm_tflops: f64,
    /// The collective when it has its full CTA budget (the sequential schedule's).
    pub comm: CollectiveModel,
    /// Each wave group's collective while overlapping: `comm` for NCCL, or
    /// another backend's (copy engines) whose cost per byte differs.
    pub overlap_comm: CollectiveModel,
    /// Multiplicative slowdown of the GEMM while collectives run concurrently (>= 1).
    pub overlap_gemm_slowdown: f64,
    /// Multiplicative slowdown of the collective under the CTA cap used during overlap (>= 1).
    pub overlap_comm_slowdown: f64,
    /// Multiplicative slowdown of a group's collective while the GEMM still
    /// runs beside it (>= 1): the part of it left when the GEMM ends runs at
    /// its own speed, so the last group's, which starts after, is not slowed.
    pub comm_beside_gemm: f64,
    /// A per-call cost of the overlapped schedule that no group's timing
    /// shows (stream forks and joins, flag waits, pipeline fill), charged
    /// when Auto decides whether overlapping pays.
    pub overlap_fixed_us: f64,
    /// A cost each wave group adds to the overlapped schedule that the
    /// pipeline does not hide (a collective call's own work per group:
    /// measured times grew linearly with the group count where the pipeline
    /// predicted them flat), added to the timeline's end per group.
    pub overlap_group_us: f64,
    /// Output bytes per microsecond that one SM of the communication's
    /// share un-reorders from the staging buffer into `out` (the staged
    /// schedule's extra copy: a read and a write of each byte).
    pub unreorder_bytes_per_us_per_sm: f64,
    /// Output bytes per microsecond per SM of the fused add + RMSNorm that
    /// follows each group's collective in gemm_all_reduce_rmsnorm (0: no
    /// norm follows). Capped at `FUSED_NORM_CAP` over the whole GPU.
    pub fused_norm_bytes_per_us_per_sm: f64,
    /// A combined-stores ReduceScatter (`predict_combined`) whose partials
    /// the GEMM pushes from its epilogue: Some(f), each pushed tile stalls its
    /// CTA for f times the tile's time on the link (its stores drain before
    /// the next fill), and a group's partial streams as its tiles finish.
    /// None: partials are copied (copy engines) once their group is done.
    pub push_drain_stall: Option<f64>,
    /// An All-to-All whose GEMM pushes its rows from the epilogue: Some(r),
    /// a group's bytes cross the links at r GB/s while its tiles compute
    /// (from the previous group's end), and what follows the group
    /// (`overlap_comm`) is the landing copies on the receiver. None: the
    /// exchange starts once the group is done.
    pub pushed_link_gbps: Option<f64>,
}

/// The fused add + RMSNorm on H200 (evaluation/results/bench_add_rmsnorm_h200.txt):
/// alone ~20 K output bytes per us per CTA on 4 to 16 CTAs and ~800 K on all
/// 132 (HBM-bound); beside the GEMM (an 8192^3 GEMM on the other SMs) 14 K per
/// CTA on 16 CTAs and 12 K on 24, which is what a group's norm gets.
pub const H200_FUSED_NORM_PER_SM: f64 = 12_000.0;
pub const FUSED_NORM_CAP: f64 = 800_000.0;
/// The fused norm takes a warp per row and 16 warps per CTA: a group of
/// fewer than 16 rows per SM leaves SMs idle (128 rows run on 8 CTAs,
/// whatever is reserved: measured ~22 us per group of 128 x 8192 on H200
/// where 24 SMs at the per-SM rate would take 7).
pub const FUSED_NORM_ROWS_PER_CTA: u32 = 16;
/// Each fused norm's launch behind its group's collective on the
/// communication stream: fitted to the world-1 E2 measurements on H200
/// (evaluation/e2_replay.py: the norm op's mean error 4.0% without, 2.9%
/// with 4 us, and the search's worst pick 0.944 -> 0.980 of the best;
/// 2-8 us all fit better than none).
pub const FUSED_NORM_LAUNCH_US: f64 = 4.0;

impl HardwareModel {
    /// Time of the fused add + RMSNorm over `rows` rows (`bytes` of output)
    /// on at most `sms` SMs, its launch included (0 when no norm follows the
    /// collectives).
    pub fn fused_norm_us(&self, bytes: u64, rows: u32, sms: u32) -> f64 {
        if self.fused_norm_bytes_per_us_per_sm <= 0.0 {
            return 0.0;
        }
        let ctas = sms.min(rows.div_ceil(FUSED_NORM_ROWS_PER_CTA)).max(1);
        let rate = (self.fused_norm_bytes_per_us_per_sm * f64::from(ctas)).min(FUSED_NORM_CAP);
        FUSED_NORM_LAUNCH_US + bytes as f64 / rate
    }

    /// An H200 node with NVLink, BF16 GEMM, with the sm80 kernel's rate;
    /// callers that run another kernel override `gemm_tflops`.
    pub fn h200() -> Self {
        Self {
            sms: 132,
            // Measured on H200: the sm80 mma.sync kernel 282-287 TFLOP/s
            // (BK 64, 3 stages); cuBLAS 525-694 on the 16 benchmark shapes
            // (evaluation/results/gemm_kernel_h200.txt), 666-694 where K >=
            // 3584: 720 made the sequential schedule 3-10% optimistic at
            // K = 14336 (bench_gemm_rs_h200x2, 2026-11-26).
            gemm_tflops: 285.0,
            sequential_gemm_tflops: 690.0,
            comm: H200_NCCL,
            overlap_comm: H200_NCCL,
            // Fitted to forced overlap with the TMA-store sm90 kernel on 2x
            // H200 (24 SMs reserved, 16 shapes, evaluation/results): no
            // slowdown beyond the reserved SMs is visible, and with none the
            // model picks overlap on every shape where it measured >= 1.02x
            // faster than cuBLAS + NCCL (still 5-10% pessimistic there).
            overlap_gemm_slowdown: 1.0,
            overlap_comm_slowdown: 1.0,
            comm_beside_gemm: 1.0,
            overlap_fixed_us: 0.0,
            overlap_group_us: 0.0,
            unreorder_bytes_per_us_per_sm: H200_UNREORDER_PER_SM,
            fused_norm_bytes_per_us_per_sm: 0.0,
            push_drain_stall: None,
            pushed_link_gbps: None,
        }
    }

    /// A pessimistic model for unknown GPUs: it makes overlap look worse than
    /// it likely is, so Auto only overlaps where the gain is clear.
    pub fn generic(sms: u32) -> Self {
        Self {
            sms,
            gemm_tflops: 100.0,
            sequential_gemm_tflops: 150.0,
            comm: GENERIC_LINK,
            overlap_comm: GENERIC_LINK,
            overlap_gemm_slowdown: 1.2,
            overlap_comm_slowdown: 1.1,
            comm_beside_gemm: 1.0,
            overlap_fixed_us: 0.0,
            overlap_group_us: 0.0,
            unreorder_bytes_per_us_per_sm: H200_UNREORDER_PER_SM / 2.0,
            fused_norm_bytes_per_us_per_sm: 0.0,
            push_drain_stall: None,
            pushed_link_gbps: None,
        }
    }

    /// The same machine timing `kind` (see [`CollectiveModel::with_kind`]).
    pub fn with_collective(self, kind: CollectiveKind) -> Self {
        Self {
            comm: self.comm.with_kind(kind),
            overlap_comm: self.overlap_comm.with_kind(kind),
            ..self
        }
    }

    pub fn validate(&self) -> Result<(), PlanError> {
        require_positive("sms", self.sms, PlanError::InvalidHardware)?;
        let checks = [
            (
                "gemm_tflops",
                self.gemm_tflops,
                "> 0",
                self.gemm_tflops > 0.0,
            ),
            (
                "sequential_gemm_tflops",
                self.sequential_gemm_tflops,
                "> 0",
                self.sequential_gemm_tflops > 0.0,
            ),
            (
                "comm.latency_us",
                self.comm.latency_us,
                ">= 0",
                self.comm.latency_us >= 0.0,
            ),
            (
                "comm.bus_gbps",
                self.comm.bus_gbps,
                "> 0",
                self.comm.bus_gbps > 0.0,
            ),
            (
                "overlap_comm.latency_us",
                self.overlap_comm.latency_us,
                ">= 0",
                self.overlap_comm.latency_us >= 0.0,
            ),
            (
                "overlap_comm.bus_gbps",
                self.overlap_comm.bus_gbps,
                "> 0",
                self.overlap_comm.bus_gbps > 0.0,
            ),
            (
                "overlap_fixed_us",
                self.overlap_fixed_us,
                ">= 0",
                self.overlap_fixed_us >= 0.0,
            ),
            (
                "overlap_group_us",
                self.overlap_group_us,
                ">= 0",
                self.overlap_group_us >= 0.0,
            ),
            (
                "unreorder_bytes_per_us_per_sm",
                self.unreorder_bytes_per_us_per_sm,
                "> 0",
                self.unreorder_bytes_per_us_per_sm > 0.0,
            ),
            (
                "fused_norm_bytes_per_us_per_sm",
                self.fused_norm_bytes_per_us_per_sm,
                ">= 0",
                self.fused_norm_bytes_per_us_per_sm >= 0.0,
            ),
            (
                "overlap_gemm_slowdown",
                self.overlap_gemm_slowdown,
                ">= 1",
                self.overlap_gemm_slowdown >= 1.0,
            ),
            (
                "overlap_comm_slowdown",
                self.overlap_comm_slowdown,
                ">= 1",
                self.overlap_comm_slowdown >= 1.0,
            ),
            (
                "comm_beside_gemm",
                self.comm_beside_gemm,
                ">= 1",
                self.comm_beside_gemm >= 1.0,
            ),
        ];
        match checks
            .into_iter()
            .find(|&(_, value, _, ok)| !(ok && value.is_finite()))
        {
            Some((field, value, bound, _)) => Err(PlanError::InvalidHardware(format!(
                "{field} must be finite and {bound}, got {value}"
            ))),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const LINK: CollectiveModel = CollectiveModel::analytic(10.0, 100.0);

    #[test]
    fn ring_all_reduce_moves_twice_the_shard_complement() {
        assert_eq!(LINK.time_us(100_000_000, 1), 0.0);
        assert!((LINK.time_us(100_000_000, 2) - 1010.0).abs() < 1e-9);
        assert!((LINK.time_us(100_000_000, 4) - 1510.0).abs() < 1e-9);
        assert_eq!(LINK.time_us(0, 8), 10.0);
        let rs = LINK.with_kind(CollectiveKind::ReduceScatter);
        assert!((rs.time_us(100_000_000, 4) - 760.0).abs() < 1e-9);
    }

    #[test]
    fn a_curve_times_its_own_kind_only() {
        let curve = Curve::new(&[(1000, 5.0), (2000, 7.0)]).unwrap();
        let measured = CollectiveModel {
            curve: Some(curve),
            ..LINK
        };
        assert_eq!(measured.time_us(1500, 2), 6.0);
        assert_eq!(measured.time_us(1500, 1), 0.0);
        assert_eq!(measured.with_kind(CollectiveKind::AllReduce), measured);
        let rs = measured.with_kind(CollectiveKind::ReduceScatter);
        assert_eq!(rs.curve, None);
        assert_eq!(rs.time_us(0, 2), 10.0);
    }

    #[test]
    fn presets_are_valid() {
        assert!(HardwareModel::h200().validate().is_ok());
        assert!(HardwareModel::generic(108).validate().is_ok());
    }

    #[test]
    fn invalid_constants_are_named() {
        let h200 = HardwareModel::h200();
        let cases = [
            (HardwareModel { sms: 0, ..h200 }, "sms"),
            (
                HardwareModel {
                    gemm_tflops: 0.0,
                    ..h200
                },
                "gemm_tflops",
            ),
            (
                HardwareModel {
                    gemm_tflops: f64::NAN,
                    ..h200
                },
                "gemm_tflops",
            ),
            (
                HardwareModel {
                    comm: CollectiveModel {
                        latency_us: -1.0,
                        ..h200.comm
                    },
                    ..h200
                },
                "comm.latency_us",
            ),
            (
                HardwareModel {
                    comm: CollectiveModel {
                        bus_gbps: f64::INFINITY,
                        ..h200.comm
                    },
                    ..h200
                },
                "comm.bus_gbps",
            ),
            (
                HardwareModel {
                    overlap_gemm_slowdown: 0.9,
                    ..h200
                },
                "overlap_gemm_slowdown",
            ),
            (
                HardwareModel {
                    overlap_comm_slowdown: 0.5,
                    ..h200
                },
                "overlap_comm_slowdown",
            ),
            (
                HardwareModel {
                    comm_beside_gemm: f64::NAN,
                    ..h200
                },
                "comm_beside_gemm",
            ),
        ];
        for (hw, field) in cases {
            match hw.validate() {
                Err(PlanError::InvalidHardware(why)) => assert!(why.starts_with(field), "{why}"),
                other => panic!("expected InvalidHardware for {field}, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_fused_norm_runs_on_one_cta_per_16_rows_at_most() {
        let hw = HardwareModel {
            fused_norm_bytes_per_us_per_sm: 10_000.0,
            ..HardwareModel::h200()
        };
        // Each call: its launch, then the bytes at the rate of the CTAs it runs on.
        let one_us = 1.0 + FUSED_NORM_LAUNCH_US;
        // 128 rows: 8 CTAs, however many SMs are free.
        assert_eq!(hw.fused_norm_us(80_000, 128, 24), one_us);
        assert_eq!(hw.fused_norm_us(80_000, 128, 132), one_us);
        // Enough rows: the SMs given, up to the cap over the GPU.
        assert_eq!(hw.fused_norm_us(240_000, 4096, 24), one_us);
        assert_eq!(hw.fused_norm_us(800_000, 1 << 20, 132), one_us);
        // A single row still takes a CTA; no norm, no time.
        assert_eq!(hw.fused_norm_us(10_000, 1, 24), one_us);
        assert_eq!(HardwareModel::h200().fused_norm_us(1 << 20, 1024, 24), 0.0);
    }

    proptest! {
        #[test]
        fn all_reduce_cost_grows_with_bytes(
            bytes in 0u64..1 << 34,
            extra in 1u64..1 << 30,
            world in 2u32..=8,
        ) {
            let comm = HardwareModel::h200().comm;
            prop_assert!(comm.time_us(bytes + extra, world) > comm.time_us(bytes, world));
        }
    }
}
