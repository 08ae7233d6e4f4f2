//! GEMM + AllReduce with the AllReduce of each finished wave group running
//! while the rest of the GEMM computes.
//!
//! Caller's stream S: [fork] GEMM (signals group counters)            [wait join]
//! Comm stream C:     [wait fork] wait(c0>=n0) c0=0 AR(g0) wait(c1>=n1) ... [join]
//!
//! Groups are unions of whole row bands, so each AllReduce runs in place on
//! contiguous output rows and nothing is reordered afterwards; inside a
//! group the kernel walks tiles in the plan's L2-friendly raster order.
//!
//! With the copy-engine backend (`Backend::CopyEngine`, ranks of one node)
//! no SM moves a byte: each group goes to every peer by copy engine and is
//! summed on the few SMs the GEMM leaves free (ops/copy_engine.rs).
//!
//! With the peer backend (`Backend::Peer`, gemm_all_reduce_rmsnorm only)
//! the GEMM stores its partial into this rank's peer buffer and each group's
//! AllReduce, residual add and RMSNorm is one kernel on the reserved SMs
//! that reads every rank's partial over NVLink (ops/all_reduce_rmsnorm.rs).
//!
//! With the push backend (`Backend::Push`, 2 ranks of one node, sm_90)
//! the GEMM's epilogue stores each tile into the peer's staging slot too,
//! over NVLink while it computes, and the copy-engine backend's reduction
//! sums each group once both ranks' tiles are in (no copy at all).
//!
//! Where the plan says overlap does not pay, nothing is enqueued here: the
//! caller runs its library GEMM (cuBLAS, faster than ours today) and then
//! `all_reduce::all_reduce`.

use super::all_reduce_rmsnorm as arn;
use super::copy_engine::{self, Exchange};
use super::gemm::{self, CounterSlots, GemmArgs, Signals};
use super::profile;
use crate::comm::communicator::Communicator;
use crate::cuda::driver;
use crate::cuda::kernels::{self, GemmKernel, Kernel};
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::{self, RawStream};
use crate::error::{Error, Result};
use crate::plan::{
    self, Collective, CollectiveKind, CollectiveModel, GemmAllReducePlan, HardwareModel,
    ModeRequest, OrderRequest, PlanRequest, Schedule,
};
use std::ffi::c_void;
use std::sync::Arc;

pub use super::backend::Backend;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The GEMM kernel; None: the device's default.
    pub kernel: Option<GemmKernel>,
    pub mode: ModeRequest,
    pub bands_per_group: Option<u32>,
    /// SMs left free of GEMM CTAs; None: the backend's default (NCCL: 24;
    /// copy engines: chosen per shape by the predictor).
    pub reserved_sms: Option<u32>,
    pub max_groups: u32,
    /// Row bands per raster block inside each group; None: the plan's default.
    pub raster_bands: Option<u32>,
    pub backend: Backend,
    /// Banded (in place), swizzled (staged) or whichever the predictor prefers.
    pub order: OrderRequest,
    /// A fused add + RMSNorm follows each group (gemm_all_reduce_rmsnorm):
    /// the predictor charges it to the communication stream.
    pub fused_norm: bool,
}

#[cfg(test)]
impl Options {
    /// What a call with no option given plans with, on `backend`.
    pub(crate) fn defaults(backend: Backend) -> Self {
        Self {
            kernel: None,
            mode: ModeRequest::Auto,
            bands_per_group: None,
            reserved_sms: None,
            max_groups: 16,
            raster_bands: None,
            backend,
            order: OrderRequest::Auto,
            fused_norm: false,
        }
    }
}

/// What a shape needs on the device, made on its first call.
pub struct Prepared {
    pub plan: GemmAllReducePlan,
    /// The kernel the plan tiled for; the launch must use this one.
    kernel: GemmKernel,
    /// The tile order, when it is not the identity.
    tile_order: Option<DeviceBuffer>,
    /// The plan's groups: what each waits for and where its collective runs.
    collectives: Vec<Collective>,
    tile_group: DeviceBuffer,
    counters: CounterSlots,
}

/// What an overlapped call on the NCCL backend costs beyond its groups'
/// timeline (the GEMM's launch beside the communication stream's, the
/// final join): fitted to the world-1 E2 measurements on H200, where
/// measured times ran a median 3-9 us above the model on the shapes whose
/// GEMM takes 80-900 us (evaluation/results/e2_predictive_search_h200x1.txt);
/// with it the mean error there is 2.7% (3.3% without).
pub const NCCL_OVERLAP_FIXED_US: f64 = 5.0;

/// What each wave group's NCCL AllReduce or ReduceScatter adds at world >= 2
/// that the pipeline does not hide (a call per group on one stream: its
/// launch and NCCL's own setup): on 2x H200 the E2 partitions' measured time
/// grew with the group count faster than the model's (the search's worst
/// pick, RS 4096x8192x3584 at 10 groups, measured 0.909 of the best at 4).
/// Fitted by replaying that run (evaluation/e2_replay.py
/// evaluation/results/e2_predictive_search_h200x2.csv): 3, 6, 8, 9, 12 us
/// give mean errors of 3.3, 3.9, 4.8, 5.3, 6.9% and worst picks of 0.909,
/// 0.909, 0.961, 0.961, 0.971 (0 us: 3.6%, 0.909); 8 kept the error under
/// 5% with every pick within 4% of the best, at +4% of pessimism overall.
/// The next 2x H200 run (2026-11-26, after the A2A raster fix:
/// e2_predictive_search_h200x2_5c3c9ef.csv; that run is
/// ..._h200x2_20261124.csv) ran faster than that model: at 8 us 4.9% error
/// (+4.5% signed), picks 0.990 mean / 0.949 worst; 3, 4, 5, 6 us gave 3.6,
/// 3.7, 3.9, 4.2% and worst picks 0.929, 0.929, 0.929, 0.962 (mean
/// 0.991-0.993). 6 us: the least error whose worst pick holds 0.95 on both
/// runs. Measured after (e2_predictive_search_h200x2.csv): 4.30% over all
/// 308 partitions, picks 0.991 mean, 0.944 worst (RS 4096x8192x3584).
/// Refitted with [`NCCL_COMM_BESIDE_GEMM`] and [`NCCL_GEMM_BESIDE_TRAFFIC`]
/// (see there): 3 us.
pub const NCCL_GROUP_US: f64 = 3.0;

/// How much slower a wave group's NCCL collective runs while the GEMM runs
/// beside it (its SMs' memory traffic, power) than its curve says; the part
/// left when the GEMM ends, and so the last group's, runs at the curve's
/// speed. Without it the model charged a group its curve time wherever it
/// ran and the GEMM the whole 5% of [`GEMM_BESIDE_TRAFFIC`] even where no
/// collective ran beside it, so it found uniform 4-group layouts of RS
/// 4096x8192x3584 7-11% slower than measured (1-group: the GEMM, then one
/// ReduceScatter: 620 us predicted, 587 measured) and preferred layouts with
/// a long first collective beside the GEMM, which measured slower (9,4,3:
/// 509 us, 4 x 4: 483): the worst pick of every 2x H200 E2 run (0.944-0.962).
/// Fitted jointly with the GEMM's slowdown and the per-group cost by
/// replaying the three committed NCCL runs (evaluation/e2_replay.py over
/// e2_predictive_search_h200x2{,_20261124,_5c3c9ef}.csv; mean |error| /
/// mean pick / worst pick): before (1.0, 1.05, 6 us) 4.04 / 0.991 / 0.951,
/// 3.95 / 0.994 / 0.970, 4.17 / 0.993 / 0.962; with (1.15, 1.03, 3 us)
/// 3.87 / 0.995 / 0.969, 3.97 / 0.996 / 0.981, 3.81 / 0.994 / 0.973. 1.1 and
/// 1.2 fit about as well; 1.3 raises the error above 5%.
pub const NCCL_COMM_BESIDE_GEMM: f64 = 1.15;

/// [`NCCL_COMM_BESIDE_GEMM`] for the NCCL backend's All-to-All, whose
/// overlapped GEMM is then not slowed beyond its profile (its exchanges move
/// far fewer bytes per GEMM flop). Every 2x H200 E2 run on the natural
/// layout found 4 groups of 2048x8192x4096 20 us slower than 3 or 6 (its
/// exchanges, one wave apart, queue up behind each other when slowed
/// beside the GEMM), where the model had predicted 4 the fastest (the
/// predicted-best count at 0.938-0.955 of the best measured). Fitted with
/// the GEMM's slowdown and [`NCCL_ALL_TO_ALL_GROUP_US`] by replaying the
/// four NCCL runs (evaluation/e2_replay.py --all-to-all over
/// e2_predictive_search_h200x2{,_5c3c9ef,_20261124}.csv and the run of
/// 2026-11-26 06:26; mean |error|, predicted-best count mean / worst): before
/// (1.0, GEMM 1.05, 5 us) 7.05% 0.992 / 0.955, 7.13% 0.992 / 0.949, 7.16%
/// 0.990 / 0.938, and on the older layout 5.77% 0.993 / 0.960; with (1.35,
/// 1.0, 2 us) 6.80% 0.997 / 0.985, 5.86% 0.996 / 0.977, 6.59% 0.995 / 0.972,
/// 8.26% 0.992 / 0.962. 1.3 with 3-4 us and 1.4 with 1-3 us pick as well;
/// below 1.3 the 4-group pick stays.
pub const NCCL_A2A_COMM_BESIDE_GEMM: f64 = 1.35;

/// [`GEMM_BESIDE_TRAFFIC`] for the NCCL backend's AllReduce and
/// ReduceScatter, now that a collective's own slowdown beside the GEMM is
/// modelled apart ([`NCCL_COMM_BESIDE_GEMM`]).
pub const NCCL_GEMM_BESIDE_TRAFFIC: f64 = 1.03;

/// What each wave group of a copy-engine AllReduce (no fused norm) adds at
/// world >= 2 that the pipeline does not hide: fitted by replaying the 2x
/// H200 E2 copy-engine run (evaluation/e2_replay.py
/// evaluation/results/e2_predictive_search_ce_h200x2.csv): AllReduce error
/// 5.2% -> 4.4% (0, 3, 5 us: 5.2, 4.4, 5.0%), mean over the run 4.93% ->
/// 4.65%; the model had been 7-15% optimistic at M = 2048, where it picked 9
/// groups and now picks 5 (E2 measured 4 groups there at 0.94 of the
/// sequential time, 8 at 1.03). The fused-norm and ReduceScatter cases fit no
/// better with it.
pub const COPY_ENGINE_ALL_REDUCE_GROUP_US: f64 = 3.0;

/// What each wave group of an All-to-All on the copy engines adds that the
/// pipeline does not hide (its copies into the peers' slots, their flags, and
/// the landing copies from the slots into the output): on 2x H200 the
/// measured time grew by ~20-35 us per group on every shape where the
/// pipeline predicts it flat (evaluation/results/e2_predictive_search_ce_h200x2.csv,
/// 8 shapes x 1-16 groups; bench_gemm_a2a_h200x2_bfloat16.csv). Fitted there
/// by `python evaluation/e2_replay.py --all-to-all`.
pub const COPY_ENGINE_ALL_TO_ALL_GROUP_US: f64 = 20.0;

/// What each wave group of an All-to-All on NCCL (a grouped send/receive
/// per peer) adds that the pipeline does not hide: on 2x H200 (E2,
/// evaluation/results/e2_predictive_search_h200x2.csv) times grew again past
/// ~8 groups, and the wave-aligned counts the search liked (11, 43 groups)
/// ran 13-20% slower than predicted (picks 0.982 / 0.913 of the best). Fitted
/// by `python evaluation/e2_replay.py ... --all-to-all`: 3 us is the least
/// that moves the picks, 5 the least that fixes the worst (0.993 / 0.960),
/// at 5.2% -> 5.8% error; 8 us costs 7.5%. Not re-measured. Refitted with
/// [`NCCL_A2A_COMM_BESIDE_GEMM`] (see there): 2 us.
pub const NCCL_ALL_TO_ALL_GROUP_US: f64 = 2.0;

/// How much slower the overlapped GEMM runs beside cross-GPU traffic than
/// its profile (timed alone) says: on 2x H200 the E2 partitions of GEMM-bound
/// shapes ran 5-10% above the model with NCCL, and with the copy engines
/// (HBM and power shared with the transfers). Fitted by replaying those runs
/// (evaluation/e2_replay.py): NCCL mean error 5.4% -> 3.6%, copy engines
/// (with copy_engine_gbps's sum rates) 6.0% -> 4.9%. One rank alone has no such traffic.
/// The peer backend's fused kernel reads the peer's partials over NVLink
/// beside the GEMM too: with 1.0 its 2x H200 benchmark ran 1-8% above the
/// model even after its rate was fitted (see [`peer_gbps`]), with 1.05 within
/// about 4% either way, so it pays the same.
pub const GEMM_BESIDE_TRAFFIC: f64 = 1.05;

/// The predictor's machine: measured constants on H200 (with the rate of
/// the kernel that will run and the backend's per-group cost), a
/// pessimistic model elsewhere.
fn hardware_for(
    machine: &Machine,
    kernel: GemmKernel,
    kind: CollectiveKind,
    world: u32,
) -> HardwareModel {
    let Machine {
        sms,
        major,
        backend,
        reserved,
        fused_norm,
        combined,
    } = *machine;
    if major == 9 && sms == 132 {
        // bf16 on H200, random data, all SMs (evaluation/results/gemm_kernel_h200.txt):
        // sm80 244-285 TFLOP/s; the sm90 kernel 510-770, 1.01x cuBLAS in the same run.
        let gemm_tflops = match kernel {
            GemmKernel::Sm80 => 285.0,
            GemmKernel::Sm90 { .. } => 690.0,
        };
        let h200 = HardwareModel::h200();
        let (overlap_comm, overlap_fixed_us) = match backend {
            Backend::Nccl => (h200.comm, NCCL_OVERLAP_FIXED_US),
            // Its cost per group is small (memops and a copy per peer), but
            // each call pays ~40 us that no group shows: a 30 us latency per
            // group made the search pick 2-3 groups and lose up to 10% on
            // communication-bound shapes.
            // An AllReduce as ReduceScatter + AllGather pays a second
            // exchange's latency per group (estimated, not measured).
            // Sums in the GEMM's epilogue: a group costs its copy.
            Backend::CopyEngine if combined => (
                CollectiveModel::analytic(CE_COMBINED_LATENCY_US, CE_COMBINED_GBPS),
                CE_COMBINED_FIXED_US,
            ),
            Backend::CopyEngine => (
                CollectiveModel::analytic(
                    match kind {
                        CollectiveKind::AllReduce
                            if copy_engine::gathers_all_reduce(world as usize) =>
                        {
                            16.0
                        }
                        _ => 8.0,
                    },
                    copy_engine_gbps(kind, reserved, world),
                ),
                40.0,
            ),
            Backend::Peer => (CollectiveModel::analytic(12.0, peer_gbps(reserved)), 0.0),
            // A ReduceScatter sums in the GEMM's epilogue: what its groups
            // wait for is the links.
            Backend::Push if kind == CollectiveKind::ReduceScatter => (
                CollectiveModel::analytic(PUSH_GROUP_LATENCY_US, PUSH_LINK_GBPS),
                PUSH_COMBINED_FIXED_US,
            ),
            Backend::Push if kind == CollectiveKind::AllToAll => (
                CollectiveModel::analytic(PUSH_GROUP_LATENCY_US, PUSH_A2A_LAND_GBPS),
                PUSH_A2A_FIXED_US,
            ),
            Backend::Push => (
                CollectiveModel::analytic(PUSH_GROUP_LATENCY_US, push_gbps(kind, reserved)),
                PUSH_FIXED_US,
            ),
        };
        HardwareModel {
            gemm_tflops,
            overlap_comm,
            overlap_fixed_us,
            overlap_group_us: match (backend, kind) {
                (Backend::Push, CollectiveKind::AllReduce) if fused_norm => PUSH_NORM_GROUP_US,
                (Backend::Push, CollectiveKind::AllReduce) => PUSH_ALL_REDUCE_GROUP_US,
                (Backend::Push, CollectiveKind::ReduceScatter) => PUSH_COMBINED_GROUP_US,
                (Backend::CopyEngine, CollectiveKind::ReduceScatter) if combined => {
                    CE_COMBINED_GROUP_US
                }
                (Backend::Push, CollectiveKind::AllToAll) => PUSH_A2A_GROUP_US,
                (Backend::CopyEngine, CollectiveKind::AllToAll) => COPY_ENGINE_ALL_TO_ALL_GROUP_US,
                (Backend::Nccl, CollectiveKind::AllToAll) if world > 1 => NCCL_ALL_TO_ALL_GROUP_US,
                (Backend::CopyEngine, CollectiveKind::AllReduce) if world > 1 && !fused_norm => {
                    COPY_ENGINE_ALL_REDUCE_GROUP_US
                }
                (Backend::Nccl, CollectiveKind::AllReduce | CollectiveKind::ReduceScatter)
                    if world > 1 =>
                {
                    NCCL_GROUP_US
                }
                _ => 0.0,
            },
            overlap_gemm_slowdown: match (world, backend) {
                (1, _) => 1.0,
                (_, Backend::Nccl) if kind == CollectiveKind::AllToAll => 1.0,
                (_, Backend::Nccl) => NCCL_GEMM_BESIDE_TRAFFIC,
                // Only the copies' HBM traffic beside it: no SM moves a byte.
                (_, Backend::CopyEngine) if combined => CE_COMBINED_GEMM_SLOWDOWN,
                (_, Backend::Push) if kind == CollectiveKind::AllToAll => PUSH_A2A_GEMM_SLOWDOWN,
                _ => GEMM_BESIDE_TRAFFIC,
            },
            fused_norm_bytes_per_us_per_sm: if fused_norm {
                crate::plan::predictor::H200_FUSED_NORM_PER_SM
            } else {
                0.0
            },
            push_drain_stall: (backend == Backend::Push && kind == CollectiveKind::ReduceScatter)
                .then_some(PUSH_DRAIN_STALL),
            pushed_link_gbps: (backend == Backend::Push && kind == CollectiveKind::AllToAll)
                .then_some(PUSH_LINK_GBPS),
            comm_beside_gemm: match (backend, kind) {
                (Backend::Nccl, _) if world == 1 => 1.0,
                (Backend::Nccl, CollectiveKind::AllToAll) => NCCL_A2A_COMM_BESIDE_GEMM,
                (Backend::Nccl, _) => NCCL_COMM_BESIDE_GEMM,
                _ => 1.0,
            },
            ..h200
        }
    } else {
        HardwareModel {
            fused_norm_bytes_per_us_per_sm: if fused_norm {
                crate::plan::predictor::H200_FUSED_NORM_PER_SM / 2.0
            } else {
                0.0
            },
            ..HardwareModel::generic(sms)
        }
    }
}

/// The copy-engine backend's rate on H200 in GB/s of the collective's bus
/// traffic (as [`CollectiveModel`] counts it: 2 (world - 1) / world of the
/// bytes for an AllReduce, (world - 1) / world for a ReduceScatter): the
/// copies' ~240 GB/s beside the GEMM (376 alone: 256 MB in 714 us on 2x
/// H200; 240 fitted to forced overlap on the 16 shapes), unless the sum on
/// the reserved SMs (at most [`copy_engine::MAX_REDUCE_CTAS`]) is slower. A
/// CTA reading `world` partials and writing one sums ~SUM_RATE / (world + 1)
/// K output bytes per us, where SUM_RATE is what `tune` timed on 2x H200
/// (the exchange alone at 4 and 8 CTAs: AllReduce 90 and 145 GB/s of bus
/// traffic, ReduceScatter 90 and 140) and the E2 run on that backend
/// confirmed (replayed mean error 4.9%; the 87 assumed before put 4 CTAs on
/// par with 8, and plans that reserved 4 ran 0.75-0.92x of sequential). A
/// ReduceScatter sums 1 / (world - 1) output bytes per byte of bus traffic.
/// An AllReduce in one exchange (2 ranks, see
/// [`copy_engine::gathers_all_reduce`]) sums the whole group on each rank,
/// world / (2 (world - 1)) per bus byte, at the 80 fitted per CTA (the same
/// as 40 on half the bytes, which is how it was fitted), and moves world / 2
/// times the bus bytes; as ReduceScatter + AllGather (3 ranks or more) it
/// sums its 1 / world share, 1 / (2 (world - 1)) per bus byte, at the
/// ReduceScatter's rate (not measured: no machine of more than 2 GPUs yet).
/// An All-to-All sums nothing (its landing copies are copy-engine work too).
fn copy_engine_gbps(kind: CollectiveKind, reserved: u32, world: u32) -> f64 {
    const COPIES_GBPS: f64 = 240.0;
    let w = f64::from(world.max(2));
    // (sum rate, output bytes summed per byte of bus traffic, bytes moved per byte of bus traffic)
    let (sum_rate, summed_per_moved, moved) = match kind {
        CollectiveKind::AllReduce if copy_engine::gathers_all_reduce(world as usize) => {
            (70.0, 1.0 / (2.0 * (w - 1.0)), 1.0)
        }
        // One exchange: every rank gets and sums the whole group.
        CollectiveKind::AllReduce => (80.0, w / (2.0 * (w - 1.0)), w / 2.0),
        CollectiveKind::ReduceScatter => (70.0, 1.0 / (w - 1.0), 1.0),
        CollectiveKind::AllToAll => return COPIES_GBPS,
    };
    let ctas = f64::from(reserved.clamp(1, copy_engine::MAX_REDUCE_CTAS));
    // Thousands of output bytes per us = GB/s of output.
    let sums_gbps = ctas * sum_rate / (w + 1.0) / summed_per_moved;
    (COPIES_GBPS / moved).min(sums_gbps)
}

/// The peer backend's fused kernel on H200 in GB/s of AllReduce bus
/// traffic on `reserved` CTAs: a rate that saturates, cap * r / (r + half).
/// The first estimate (20 GB/s a CTA up to 360) was 5-22% optimistic on 2x
/// H200 wherever the planner gave the kernel 8 or 16 CTAs
/// (bench_gemm_ar_rmsnorm_h200x2_bfloat16.csv, 2026-11-26) and right at 32,
/// where the comm-bound K = 1024 shapes put it near 310 GB/s. The shape of the
/// curve is the stand-alone kernel's CTA sweep (bench_all_reduce_rmsnorm_h200x2:
/// 84 / 142 / 208 / 258 GB/s at 8 / 16 / 32 / 64 CTAs, its input copy
/// included), scaled to that 310 at 32: 129 / 212 / 310 / 406 GB/s. The 12 us
/// per group stands for its launch and two cross-GPU barriers.
const PEER_CAP_GBPS: f64 = 580.0;
const PEER_HALF_CTAS: f64 = 28.0;

fn peer_gbps(reserved: u32) -> f64 {
    let r = f64::from(reserved.max(1));
    PEER_CAP_GBPS * r / (r + PEER_HALF_CTAS)
}

/// The push backend's costs beyond its sums' rate, fitted to every
/// partition E2 measured on 2x H100 (`e2_predictive_search_push_h100x2.csv`,
/// 309 partitions of 32 cases; `evaluation/e2_replay.py` replays them): per
/// call 35 us (the wait for the peer's free flag, the join, and what the
/// GEMM loses storing half its tiles over NVLink), per group the latency of
/// two stream waits and the sum's launch plus what each group adds beyond
/// it: 11 us for an AllReduce, 9 for a ReduceScatter, 7 with the fused norm
/// (whose own launch is modelled apart), 20 for an All-to-All's landing
/// copies (as the copy engines'). The first estimates (10 us per call,
/// nothing per group) were 9-18% optimistic; these give 3.6% (AllReduce
/// 2.8%, ReduceScatter 3.1%, norm 4.7%) and 6.1% for the All-to-All.
/// Its first 2x H200 E2 run (`e2_predictive_search_push_h200x2.csv`) found
/// the 35 us per call pessimistic there (+2.4% signed; auto ran
/// AllReduce 2048 x 8192 x {3584, 4096} sequential where overlap measured
/// 1.13-1.17x faster): 25 us gives 3.8% on H200 (4.2% at 35) and 4.0% on
/// H100 (3.6%); replaying auto over both machines' benchmarks moves the
/// AllReduce from 1.161x to 1.168x on H200 and leaves H100's unchanged.
const PUSH_GROUP_LATENCY_US: f64 = 6.0;
const PUSH_FIXED_US: f64 = 25.0;
const PUSH_ALL_REDUCE_GROUP_US: f64 = 11.0;
const PUSH_NORM_GROUP_US: f64 = 7.0;
/// The ReduceScatter with combined stores (sums in the GEMM's epilogue):
/// per call the grant handshake and the flags' resets on the caller's
/// stream, per group one reset (estimates, not yet fitted).
const PUSH_COMBINED_FIXED_US: f64 = 10.0;
/// A pushed tile's CTA waits for its stores to drain before it refills the
/// epilogue buffer: on 2x H200 the combined ReduceScatter ran 0.4-0.6 of its
/// pushed bytes' link time above the GEMM alone (2048-16384 x 8192 x 4096,
/// 2048 x 8192 x 14336; a one-off probe of forced groupings on 2026-11-26).
const PUSH_DRAIN_STALL: f64 = 0.5;
const PUSH_COMBINED_GROUP_US: f64 = 1.0;
/// The push All-to-All (natural layout, 2026-11-26): its rows cross NVLink
/// inside the GEMM (at most PUSH_LINK_GBPS), and what follows each group is
/// the receiver's landing copies, from the slot and of its own rows, both
/// local (counted per byte the busiest rank receives: two copies). Fitted
/// by replaying its first 2x H200 E2 run (6 cases x 8 group counts, the
/// issue's N = 4096 x K = 14336 and N = 8192 x K = 4096 at T = 2048-8192;
/// `e2_replay.py --all-to-all`): the estimates it ran with (the copy
/// engines' 20 us per group, the exchange after each group at the links'
/// rate, the GEMM 1.05x slower, 25 us per call) were 17% pessimistic and
/// kept every K = 14336 case sequential, where 2-6 groups measured
/// 1.04-1.08x faster. These give 5.1% (land 500-1400 GB/s, 4-12 us per
/// group: 4.8-7.8%), and predicted-best counts at 0.996 of the best
/// measured (worst 0.986). One group runs the same machinery as many (the
/// grant, the flags, the landings), so no fixed cost sets it apart, and the
/// GEMM ran as fast as its profile (1.05 cost 0.5% of error).
const PUSH_A2A_LAND_GBPS: f64 = 700.0;
const PUSH_A2A_GROUP_US: f64 = 10.0;
const PUSH_A2A_FIXED_US: f64 = 0.0;
const PUSH_A2A_GEMM_SLOWDOWN: f64 = 1.0;
/// The copy engines' ReduceScatter with combined stores (2 ranks): per
/// group a stream wait, a copy into the peer's slot and a flag write, at
/// the copies' rate beside a GEMM. The rate was fitted to two
/// bench_gemm_rs.py runs on 2x H200 (2026-11-26, forced overlap, the 16
/// shapes; after the grant moved to the copy queue): mean error 2.2% (the
/// first estimate, 240 GB/s, was 7% pessimistic, 21-29% at K = 1024, where
/// the links bound the call). Those runs fix each shape's group count, so
/// they cannot tell the per-group cost: a fit with none, 0.2 points
/// better, planned 8-16 groups where 2-8 ran, and measured 1-6% slower
/// (2x H200, same day: the gathered AllReduce at 16384 x 8192 x 3584, 16
/// groups, 1.39x of sequential against 1.48x with 8).
const CE_COMBINED_LATENCY_US: f64 = 10.0;
const CE_COMBINED_GBPS: f64 = 330.0;
const CE_COMBINED_FIXED_US: f64 = 25.0;
const CE_COMBINED_GEMM_SLOWDOWN: f64 = 1.02;
const CE_COMBINED_GROUP_US: f64 = 2.0;

/// The push backend's rate on H200 in GB/s of bus traffic (on 2 ranks: an
/// AllReduce's group bytes, half a ReduceScatter's): its bytes cross NVLink
/// inside the GEMM, so what follows a group is the sum on the reserved SMs,
/// at the copy-engine sums' fitted rates (see [`copy_engine_gbps`]: an
/// AllReduce sums the whole group, one output byte per bus byte, at ~80 / 3
/// per CTA; a ReduceScatter its own chunk, also one per bus byte, at
/// ~70 / 3), capped by what the links gave NCCL (~360 GB/s), since the last
/// pushes trail the GEMM's last tiles. An All-to-All sums nothing (its
/// landing copies are local, 1.3-1.8 TB/s of copy traffic beside a GEMM:
/// evaluation/results/bench_land_copy_h200.txt): the links' rate.
fn push_gbps(kind: CollectiveKind, reserved: u32) -> f64 {
    let ctas = f64::from(reserved.clamp(1, copy_engine::MAX_PUSH_REDUCE_CTAS));
    let sums = match kind {
        CollectiveKind::ReduceScatter => ctas * 70.0 / 3.0,
        CollectiveKind::AllToAll => return PUSH_LINK_GBPS,
        CollectiveKind::AllReduce => ctas * 80.0 / 3.0,
    };
    sums.min(PUSH_LINK_GBPS)
}

/// What NVLink gave NCCL on 2x H200, the most any push group's bytes move at.
const PUSH_LINK_GBPS: f64 = 360.0;

/// Where a call is planned: the device, the backend and SMs left to it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Machine {
    pub sms: u32,
    pub major: i32,
    pub backend: Backend,
    pub reserved: u32,
    pub fused_norm: bool,
    /// A ReduceScatter whose sums happen in the GEMM's epilogue
    /// (plan/reduce_scatter.rs: combined stores).
    pub combined: bool,
}

impl Machine {
    /// The predictor's model for `args` on `world` ranks: [`hardware_for`]'s
    /// constants, with this GPU's profile (measured curves of `kind`, GEMM
    /// times of `kernel` on the CTAs left to it) where one is registered.
    pub(crate) fn model(
        &self,
        args: &GemmArgs,
        world: u32,
        kernel: GemmKernel,
        kind: CollectiveKind,
    ) -> HardwareModel {
        let (sms, reserved) = (self.sms, self.reserved);
        let constants = hardware_for(self, kernel, kind, world);
        profile::apply(
            constants,
            &profile::Lookup {
                kernel: &kernel.name(),
                dtype: args.dtype,
                ctas: sms.saturating_sub(reserved).max(1),
                shape: (args.m, args.n, args.k),
                world,
                kind,
                backend: self.backend,
                reserved,
            },
        )
    }
}

fn request(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    kernel: GemmKernel,
    reserved: u32,
) -> PlanRequest {
    PlanRequest {
        m: args.m,
        n: args.n,
        k: args.k,
        world,
        elem_bytes: args.dtype.bytes(),
        tile: gemm::tile_shape(kernel),
        reserved_sms: reserved,
        bands_per_group: opts.bands_per_group,
        max_groups: opts.max_groups,
        mode: opts.mode,
        raster_bands: opts.raster_bands,
        order: opts.order,
    }
}

/// NCCL's CTAs need 24 SMs beside the GEMM to run at full speed (8, 16,
/// 24, 32, 48 measured on 2x H200).
pub const NCCL_RESERVED_SMS: u32 = 24;
/// What the copy-engine backend may leave its reduction: 8 CTAs sum as fast
/// as the copies deliver (see `hardware_for`); 4 suit GEMM-bound shapes,
/// where one more wave of tiles costs more than a slower sum that stays hidden.
pub const COPY_ENGINE_RESERVED_SMS: [u32; 2] = [4, 8];
/// With a fused norm after each group, 16 is a candidate too: the norm runs
/// on every reserved SM (the sum still on at most 8).
const COPY_ENGINE_NORM_RESERVED_SMS: [u32; 3] = [4, 8, 16];
/// The push backend's sums have no copies to wait for, so 16 SMs (sums twice
/// as fast as on 8) are a candidate where the sums, not the GEMM, bound the
/// call (estimated, not yet timed on 2 GPUs).
pub const PUSH_RESERVED_SMS: [u32; 3] = [4, 8, 16];
/// The peer backend moves, sums and normalizes on the reserved SMs alone.
pub const PEER_RESERVED_SMS: [u32; 3] = [8, 16, 32];

/// The plan predicted fastest over the SM reservations a call may use: the
/// caller's, else the backend's candidates (all below `sms`, unless there is
/// only one). `plan_one(reserved)` plans with that many SMs left free.
pub(crate) fn fastest_reservation<P>(
    reserved: Option<u32>,
    backend: Backend,
    fused_norm: bool,
    sms: u32,
    plan_one: impl FnMut(u32) -> Result<(GemmKernel, P)>,
    overlap_us: impl Fn(&P) -> f64,
) -> Result<(GemmKernel, P)> {
    let candidates: Vec<u32> = match (reserved, backend) {
        (Some(r), _) => vec![r],
        (None, Backend::Nccl) => vec![NCCL_RESERVED_SMS],
        (None, Backend::CopyEngine | Backend::Push) if fused_norm => {
            COPY_ENGINE_NORM_RESERVED_SMS.to_vec()
        }
        (None, Backend::CopyEngine) => COPY_ENGINE_RESERVED_SMS.to_vec(),
        (None, Backend::Push) => PUSH_RESERVED_SMS.to_vec(),
        (None, Backend::Peer) => PEER_RESERVED_SMS.to_vec(),
    };
    fastest_of(candidates, sms, plan_one, overlap_us)
}

/// The plan `key` ranks fastest over the SM reservations `candidates` (all
/// below `sms`, unless there is only one); `plan_one(reserved)` plans with
/// that many SMs left free.
pub(crate) fn fastest_of<P>(
    candidates: Vec<u32>,
    sms: u32,
    mut plan_one: impl FnMut(u32) -> Result<(GemmKernel, P)>,
    key: impl Fn(&P) -> f64,
) -> Result<(GemmKernel, P)> {
    let single = candidates.len() == 1;
    let mut best: Option<(GemmKernel, P)> = None;
    for reserved in candidates.into_iter().filter(|&r| r < sms || single) {
        let plan = plan_one(reserved)?;
        if best.as_ref().map_or(true, |(_, b)| key(&plan.1) < key(b)) {
            best = Some(plan);
        }
    }
    best.ok_or_else(|| {
        Error::Invalid(format!(
            "reserved_sms: every candidate leaves no SM to the GEMM on a device with {sms} SMs"
        ))
    })
}

/// The kernels a call may run: the caller's; else plan/'s default, and on
/// Hopper the other tile width too where this GPU's profile timed both on
/// the CTAs left to the GEMM for exactly this shape. The choice between
/// them rests on those measurements, never on the model's constants alone:
/// with reserved SMs 128-wide tiles ran up to 13% faster at M = 2048 (finer
/// waves) on H200 and H100, but 0.59x cuBLAS at M >= 8192 on H100.
pub(crate) fn kernel_candidates(
    named: Option<GemmKernel>,
    args: &GemmArgs,
    machine: &Machine,
) -> Vec<GemmKernel> {
    if let Some(kernel) = named {
        return vec![kernel];
    }
    let default = GemmKernel::default_for(machine.major);
    let ctas = machine.sms.saturating_sub(machine.reserved).max(1);
    let shape = (args.m, args.n, args.k);
    let measured =
        |k: GemmKernel| profile::measured_gemm(&k.name(), args.dtype, machine.sms, ctas, shape);
    let mut out = vec![default];
    if machine.major == 9 && measured(default) {
        out.extend(
            [128, 256]
                .map(|bn| GemmKernel::Sm90 { bn })
                .into_iter()
                .filter(|&k| k != default && measured(k)),
        );
    }
    out
}

/// What another tile width must be predicted to save over the default's
/// plan to be taken: GEMM timings of one shape move 1-2% run to run.
pub const OTHER_KERNEL_MARGIN: f64 = 0.97;

/// The first of `kernels` (the default), unless its plan overlaps and
/// another's plan, overlapping too, is predicted at least 3% faster (`us`).
/// The width only refines an overlap the default would run: it never turns
/// a sequential call into an overlapped one (the model is most optimistic
/// where overlap barely pays, at small M with the fused norm).
pub(crate) fn fastest_kernel<P>(
    kernels: Vec<GemmKernel>,
    mut plan_one: impl FnMut(GemmKernel) -> Result<P>,
    us: impl Fn(&P) -> f64,
    overlaps: impl Fn(&P) -> bool,
) -> Result<(GemmKernel, P)> {
    let mut kernels = kernels.into_iter();
    let first = kernels
        .next()
        .ok_or_else(|| Error::Invalid("kernel: no kernel to plan with".into()))?;
    let mut best = (first, plan_one(first)?);
    if !overlaps(&best.1) {
        return Ok(best);
    }
    let bar = OTHER_KERNEL_MARGIN * us(&best.1);
    for kernel in kernels {
        let plan = plan_one(kernel)?;
        if overlaps(&plan) && us(&plan) < bar.min(us(&best.1)) {
            best = (kernel, plan);
        }
    }
    Ok(best)
}

/// The kernel and plan of a call on a device with `sms` SMs of compute
/// capability `major` (no GPU needed): the kernel is the caller's or the
/// device's default for the CTAs the overlap leaves the GEMM; where the SMs
/// to reserve are not given, the copy-engine backend tries each candidate
/// and keeps the plan predicted fastest.
pub fn plan_for(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<(GemmKernel, GemmAllReducePlan)> {
    if opts.backend == Backend::Peer && !opts.fused_norm {
        return Err(Backend::peer_unsupported("gemm_all_reduce"));
    }
    if opts.backend == Backend::Push {
        check_push(world, major, opts.kernel)?;
    }
    fastest_reservation(
        opts.reserved_sms,
        opts.backend,
        opts.fused_norm,
        sms,
        |reserved| {
            let machine = Machine {
                sms,
                major,
                backend: opts.backend,
                reserved,
                fused_norm: opts.fused_norm,
                combined: false,
            };
            fastest_kernel(
                kernel_candidates(opts.kernel, args, &machine),
                |kernel| {
                    let hw = machine.model(args, world, kernel, CollectiveKind::AllReduce);
                    plan::plan_gemm_all_reduce(&request(args, world, opts, kernel, reserved), &hw)
                        .map_err(Into::into)
                },
                GemmAllReducePlan::predicted_us,
                |p| p.schedule == Schedule::Overlap,
            )
        },
        |p: &GemmAllReducePlan| p.timeline.overlap_us,
    )
}

/// What the push backend needs of a call: 2 ranks (each GEMM stores its
/// tiles into the other's memory) and the sm_90 GEMM (its epilogue pushes).
pub(crate) fn check_push(world: u32, major: i32, kernel: Option<GemmKernel>) -> Result<()> {
    if world != 2 {
        return Err(Error::Invalid(format!(
            "backend: 'push' runs on exactly 2 ranks (each GEMM stores its tiles into the other's \
             memory); this group has {world}: use 'copy_engine', 'nccl' or 'auto'"
        )));
    }
    if major != 9 || matches!(kernel, Some(GemmKernel::Sm80)) {
        return Err(Error::Invalid(
            "backend: 'push' stores from the sm_90 GEMM's epilogue (Hopper only, kernel None or sm90)".into(),
        ));
    }
    Ok(())
}

/// The predicted time of the plan the call runs: the gathered AllReduce's
/// where it applies, else [`plan_for`]'s (for "auto" backend choice; the
/// other plan is not made where it would not run).
pub fn predicted_us(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<f64> {
    if let Some((_, gathered)) =
        super::gathered_all_reduce::plan_for(args, world, opts, sms, major)?
    {
        return Ok(gathered.predicted_us());
    }
    Ok(plan_for(args, world, opts, sms, major)?.1.predicted_us())
}

fn prepare(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &Options,
    caller: RawStream,
) -> Result<Arc<Prepared>> {
    gemm::prepared(comm, "gemm_all_reduce", args, opts, caller, || {
        let (kernel, plan) = plan_for(
            args,
            comm.world as u32,
            opts,
            comm.device.sms,
            comm.device.major,
        )?;
        let groups = plan.partition.len().max(1);
        let collectives = plan.partition.collectives();
        if matches!(opts.backend, Backend::CopyEngine | Backend::Push) {
            // Offsets only (no buffers yet): N % 8 == 0 keeps every group's
            // rows on 16-byte vectors.
            copy_engine::check_groups(&copy_engine::all_reduces(
                exchanges(&collectives, 0, args.dtype.bytes() as u64),
                comm.world as usize,
            ))?;
            comm.ensure_group_events(groups)?;
        }
        Ok(Prepared {
            kernel,
            tile_order: gemm::order_table(&plan.order)?,
            collectives,
            tile_group: DeviceBuffer::from_u32(&plan.tile_group)?,
            counters: CounterSlots::new(groups)?,
            plan,
        })
    })
}

/// The plan a call with these arguments runs (made on first use).
pub fn plan_of(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &Options,
    caller: RawStream,
) -> Result<GemmAllReducePlan> {
    driver::bind(comm.device.ordinal)?;
    Ok(prepare(comm, args, opts, caller)?.plan.clone())
}

/// The fused add + RMSNorm that follows each group's AllReduce in
/// `gemm_all_reduce_rmsnorm`: residual_out = out + residual_in, out =
/// rms_norm(residual_out) * weight, over the group's rows.
#[derive(Debug, Clone, Copy)]
pub struct Norm {
    pub residual_in: u64,
    pub residual_out: u64,
    pub weight: u64,
    pub eps: f32,
    /// The peer backend's buffers (its calls only).
    pub peer: Option<PeerNorm>,
}

/// The peer buffers `backend="peer"` runs on: every rank's, as mapped in
/// this process (this rank's at `rank`), each `buffer_bytes` long and laid
/// out as [`arn::Layout::pull`] for the whole output.
#[derive(Debug, Clone, Copy)]
pub struct PeerNorm {
    pub bases: [u64; arn::MAX_WORLD],
    pub world: usize,
    pub rank: usize,
    pub buffer_bytes: u64,
    /// A cross-GPU wait gives up after this long (0: never), recording the
    /// error in the buffer's header.
    pub timeout_ns: u64,
    /// The shape of the per-group kernel (the same on every rank).
    pub config: crate::cuda::kernels::NormConfig,
}

impl PeerNorm {
    /// The config the group's calls of hidden size `n` run with on a device
    /// of compute capability `major` ([`arn::effective`]: pull calls, so the
    /// default keeps plain loads).
    pub fn config_for(
        &self,
        n: u32,
        dtype: crate::dtype::Dtype,
        major: i32,
    ) -> crate::cuda::kernels::NormConfig {
        arn::effective(self.config, self.world, n, dtype, major, false)
    }

    /// The pull-mode call over rows `first..first + tokens` of an [m, n]
    /// output, on a device of compute capability `major`.
    #[allow(clippy::too_many_arguments)]
    pub fn call(
        &self,
        norm: &Norm,
        out: u64,
        first: u64,
        tokens: u64,
        m: u64,
        n: u32,
        dtype: crate::dtype::Dtype,
        major: i32,
    ) -> arn::Call {
        arn::Call {
            x: 0,
            residual: norm.residual_in,
            weight: norm.weight,
            out,
            residual_out: norm.residual_out,
            bases: self.bases[..self.world].to_vec(),
            rank: self.rank,
            tokens,
            hidden: n,
            eps: norm.eps,
            residual_full: true,
            residual_sliced: false,
            timeout_ns: self.timeout_ns,
            dtype,
            buffer_bytes: self.buffer_bytes,
            pull: Some(arn::Pull { first, rows: m }),
            config: self.config_for(n, dtype, major),
        }
    }

    /// Where the GEMM stores this rank's partial of an [m, n] output.
    pub fn partial(&self, m: u64, n: u32, dtype: crate::dtype::Dtype) -> Result<u64> {
        let layout = arn::Layout::pull(self.world, m, n, dtype)?;
        if layout.bytes > self.buffer_bytes || self.rank >= self.world {
            return Err(Error::Invalid(format!(
                "backend: the peer buffers hold {} bytes per rank, this call needs {}; \
                 the flashoverlap ops grow them (collectively) before the call",
                self.buffer_bytes, layout.bytes
            )));
        }
        Ok(self.bases[self.rank] + layout.x_offset)
    }
}

/// Enqueues the fused add + RMSNorm over `rows` of an [.., n] output on at
/// most `ctas` CTAs (one row per warp at a time).
/// `src`: where the rows' sums are read from (row rows.start first; None:
/// `out` itself, in place).
#[allow(clippy::too_many_arguments)]
pub fn launch_add_rmsnorm(
    kernel: &Kernel,
    out: u64,
    src: Option<u64>,
    norm: &Norm,
    rows: std::ops::Range<u32>,
    n: u32,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    // bf16 or fp16: 2 bytes an element.
    let row_bytes = u64::from(n) * 2;
    let mut src = src.unwrap_or(out + u64::from(rows.start) * row_bytes);
    // A warp per row: a block takes ADD_RMSNORM_THREADS / 32 rows at a time.
    let warps = kernels::ADD_RMSNORM_THREADS / 32;
    let grid = ctas.max(1).min((rows.end - rows.start).div_ceil(warps));
    let (mut x, mut res_in, mut res_out, mut weight) =
        (out, norm.residual_in, norm.residual_out, norm.weight);
    let (mut first, mut last, mut n, mut eps) =
        (rows.start as i32, rows.end as i32, n as i32, norm.eps);
    let mut params: [*mut c_void; 9] = [
        (&mut x as *mut u64).cast(),
        (&mut src as *mut u64).cast(),
        (&mut res_in as *mut u64).cast(),
        (&mut res_out as *mut u64).cast(),
        (&mut weight as *mut u64).cast(),
        (&mut first as *mut i32).cast(),
        (&mut last as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut eps as *mut f32).cast(),
    ];
    kernel.launch(grid, kernels::ADD_RMSNORM_THREADS, stream, &mut params)
}

/// What a call of [`gemm_all_reduce`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// The overlapped op is on the streams.
    Overlap,
    /// Nothing: the plan falls back; the caller runs its GEMM, then the AllReduce.
    Sequential,
    /// Nothing: the plan is swizzled and no staging buffer was given; call
    /// again with one of this many bytes.
    NeedsStaging(u64),
}

/// Enqueues the overlapped op, or nothing where the plan falls back or
/// needs a staging buffer the call did not bring (see [`Enqueued`]): the
/// default, banded plans need none, so they cost one call. `staging`: a
/// 16-byte aligned device buffer of the bytes `NeedsStaging` named (the
/// caller allocates it in stream order on `caller`; the op is done with it
/// when `caller` reaches the end of the op), or 0. `norm`: the fused add +
/// RMSNorm to run on each group's rows after its AllReduce (banded plans
/// only: their groups are whole rows).
pub fn gemm_all_reduce(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &Options,
    staging: u64,
    norm: Option<&Norm>,
    caller: RawStream,
) -> Result<Enqueued> {
    args.validate()?;
    driver::bind(comm.device.ordinal)?;
    let opts = &Options {
        fused_norm: norm.is_some(),
        ..*opts
    };
    let peer = match (opts.backend, norm.and_then(|n| n.peer)) {
        (Backend::Peer, Some(p)) => Some(p),
        (Backend::Peer, None) => return Err(Backend::peer_unsupported("gemm_all_reduce")),
        _ => None,
    };
    if peer.is_none() {
        if let Some(gathered) = super::gathered_all_reduce::prepare(comm, args, opts, caller)? {
            // Loaded before anything is enqueued: no wait may sit in front of a lazy load.
            let norm_kernel = norm
                .map(|_| super::gathered_all_reduce::load_norm(comm, args))
                .transpose()?;
            super::gathered_all_reduce::enqueue(
                comm,
                &gathered,
                args,
                opts.backend,
                norm.zip(norm_kernel.as_ref()),
                caller,
            )?;
            return Ok(Enqueued::Overlap);
        }
    }
    let prepared = prepare(comm, args, opts, caller)?;
    let plan = &prepared.plan;
    if plan.schedule == Schedule::Sequential {
        return Ok(Enqueued::Sequential);
    }
    let staged = plan.partition.is_staged();
    if staged && norm.is_some() {
        return Err(Error::Invalid(
            "order: the fused RMSNorm needs whole-row groups; use order='banded'".into(),
        ));
    }
    if staged && staging == 0 {
        return Ok(Enqueued::NeedsStaging(
            plan.staging_elems() * args.dtype.bytes() as u64,
        ));
    }
    if staged && staging % 16 != 0 {
        return Err(Error::Invalid(format!(
            "staging: the swizzled plan needs a 16-byte aligned buffer, got {staging:#x}"
        )));
    }
    let kernel = gemm::load(&comm.device, args.dtype, prepared.kernel)?;
    // Loaded before anything is enqueued: no wait may sit in front of a lazy load.
    let unreorder = staged
        .then(|| {
            let t = plan.tiles.tile;
            kernels::load(&comm.device, &kernels::unreorder_spec(t.bm, t.bn))
        })
        .transpose()?;
    let norm_kernel = norm
        .map(|_| {
            let spec = match peer {
                Some(p) => kernels::allreduce_rmsnorm_spec(
                    args.dtype,
                    p.config_for(args.n, args.dtype, comm.device.major),
                ),
                None => kernels::add_rmsnorm_spec(args.dtype),
            };
            kernels::load(&comm.device, &spec)
        })
        .transpose()?;
    // The peer backend's GEMM stores into this rank's peer buffer.
    let gemm_args = match peer {
        Some(p) => GemmArgs {
            out: p.partial(u64::from(args.m), args.n, args.dtype)?,
            ..*args
        },
        None => *args,
    };
    let counters = prepared.counters.next();
    let signals = Signals {
        tile_order: prepared.tile_order.as_ref().map_or(0, |b| b.ptr),
        tile_group: prepared.tile_group.ptr,
        counters,
        staging: if staged { staging } else { 0 },
        ..Signals::default()
    };
    let run = Run {
        args: &gemm_args,
        plan,
        collectives: &prepared.collectives,
        signals,
        unreorder,
        norm: norm.copied().zip(norm_kernel),
    };
    match opts.backend {
        Backend::Nccl => enqueue_nccl(comm, &run, &kernel, caller)?,
        Backend::CopyEngine => enqueue_copy_engine(comm, &run, &kernel, caller, false)?,
        Backend::Push => enqueue_copy_engine(comm, &run, &kernel, caller, true)?,
        Backend::Peer => enqueue_peer(comm, &run, &kernel, args.out, caller)?,
    }
    Ok(Enqueued::Overlap)
}

/// What one overlapped call enqueues.
struct Run<'a> {
    args: &'a GemmArgs,
    plan: &'a GemmAllReducePlan,
    collectives: &'a [Collective],
    signals: Signals,
    /// The un-reorder copy, loaded, where the plan is staged.
    unreorder: Option<Kernel>,
    /// The fused add + RMSNorm after each group, loaded, where asked for.
    norm: Option<(Norm, Kernel)>,
}

impl Run<'_> {
    /// Where the collectives run: the staging buffer, or `out` itself.
    fn base(&self) -> u64 {
        if self.signals.staging != 0 {
            self.signals.staging
        } else {
            self.args.out
        }
    }

    /// After group `c`'s collective, on the same stream: its staged tiles
    /// into `out` (nothing when the plan reduces in place).
    fn unreorder(&self, c: &Collective, stream: RawStream) -> Result<()> {
        match &self.unreorder {
            Some(kernel) => gemm::launch_unreorder(
                kernel,
                self.args,
                &self.signals,
                &self.plan.tiles,
                c.positions.clone(),
                self.plan.request.reserved_sms,
                stream,
            ),
            None => Ok(()),
        }
    }

    /// After group `c`'s collective (in place: whole rows), on the same
    /// stream: the fused add + RMSNorm of its rows, on the SMs the GEMM
    /// leaves free; after the last group every tile is stored (the groups'
    /// waits ran in order), so its norm gets every SM.
    fn norm(&self, c: &Collective, stream: RawStream, sms: u32) -> Result<()> {
        let Some((norm, kernel)) = &self.norm else {
            return Ok(());
        };
        let n = u64::from(self.args.n);
        let rows = (c.slice.offset / n) as u32..((c.slice.offset + c.slice.count) / n) as u32;
        let last = rows.end == self.args.m;
        let ctas = if last {
            sms
        } else {
            self.plan.request.reserved_sms
        };
        launch_add_rmsnorm(
            kernel,
            self.args.out,
            None,
            norm,
            rows,
            self.args.n,
            ctas,
            stream,
        )
    }
}

fn enqueue_nccl(
    comm: &Communicator,
    run: &Run,
    kernel: &gemm::LoadedGemm,
    caller: RawStream,
) -> Result<()> {
    let (nccl, nccl_comm) = comm.nccl()?;
    let comm_stream = comm.stream.0;
    let elem = run.args.dtype.bytes() as u64;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    // The comm stream starts after everything the caller enqueued before this
    // op (and, under graph capture, joins the capture here).
    comm.fork.order(caller, comm_stream)?;
    gemm::launch(kernel, run.args, &run.signals, run.plan.ctas, caller)?;
    for (g, group) in run.collectives.iter().enumerate() {
        let counter = run.signals.counter(g);
        stream::take(comm_stream, counter, group.tiles)?;
        nccl.all_reduce_in_place(
            run.base() + group.slice.offset * elem,
            group.slice.count as usize,
            run.args.dtype,
            nccl_comm,
            comm_stream.cast(),
        )?;
        run.unreorder(group, comm_stream)?;
        run.norm(group, comm_stream, comm.device.sms)?;
    }
    comm.join.order(comm_stream, caller)
}

/// The peer backend: per group, the comm stream waits for the GEMM's
/// counter and runs the fused AllReduce + add + RMSNorm of the group's rows
/// (pull mode) on the reserved SMs, every SM for the last group (the GEMM is
/// done by then). Every rank launches the same kernels on the same CTA
/// counts: the kernels' barriers pair CTA b of every rank.
fn enqueue_peer(
    comm: &Communicator,
    run: &Run,
    kernel: &gemm::LoadedGemm,
    out: u64,
    caller: RawStream,
) -> Result<()> {
    let (Some((norm, fused)), Some(peer)) =
        (&run.norm, run.norm.as_ref().and_then(|(n, _)| n.peer))
    else {
        return Err(Error::Invalid(
            "internal: the peer backend without its buffers".into(),
        ));
    };
    let (m, n) = (u64::from(run.args.m), u64::from(run.args.n));
    // Every group's call is checked before anything is enqueued.
    let calls = run
        .collectives
        .iter()
        .map(|group| {
            let (first, end) = (
                group.slice.offset / n,
                (group.slice.offset + group.slice.count) / n,
            );
            let ctas = if end == m {
                comm.device.sms.min(arn::MAX_CTAS)
            } else {
                run.plan.request.reserved_sms.clamp(1, arn::MAX_CTAS)
            };
            let call = peer.call(
                norm,
                out,
                first,
                end - first,
                m,
                run.args.n,
                run.args.dtype,
                comm.device.major,
            );
            arn::checked(&call, ctas)
        })
        .collect::<Result<Vec<_>>>()?;
    let comm_stream = comm.stream.0;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    comm.fork.order(caller, comm_stream)?;
    gemm::launch(kernel, run.args, &run.signals, run.plan.ctas, caller)?;
    for (g, (group, call)) in run.collectives.iter().zip(calls).enumerate() {
        let counter = run.signals.counter(g);
        stream::take(comm_stream, counter, group.tiles)?;
        call.launch(fused, comm_stream)?;
    }
    comm.join.order(comm_stream, caller)
}

/// Each group's AllReduce as a copy-engine exchange over `base` (the
/// output, or the staging buffer), summed in place ([`copy_engine::all_reduces`]
/// says how the ranks share the work).
fn exchanges(collectives: &[Collective], base: u64, elem: u64) -> Vec<Exchange> {
    collectives
        .iter()
        .map(|c| Exchange {
            tiles: c.tiles,
            src: base + c.slice.offset * elem,
            src_stride: 0,
            bytes: c.slice.count * elem,
            slot_offset: c.slice.offset * elem,
            out: base + c.slice.offset * elem,
        })
        .collect()
}

/// The copy-engine backend, or with `pushed` the push backend (the GEMM
/// moves the bytes itself; the sums are the same).
fn enqueue_copy_engine(
    comm: &Communicator,
    run: &Run,
    kernel: &gemm::LoadedGemm,
    caller: RawStream,
    pushed: bool,
) -> Result<()> {
    let args = run.args;
    let exchanges = exchanges(run.collectives, run.base(), args.dtype.bytes() as u64);
    // Pushed, both ranks get every tile and sum the whole group.
    let groups = if pushed {
        copy_engine::sums(exchanges)
    } else {
        copy_engine::all_reduces(exchanges, comm.world as usize)
    };
    let peer = copy_engine::peer_buffers(comm, &groups)?;
    let reducer = copy_engine::load_reducer(comm, args.dtype, peer.layout.world)?;
    let call = copy_engine::Call {
        peer: &peer,
        reducer: reducer.as_ref(),
        signals: Some(&run.signals),
        groups: &groups,
        reduce_ctas: run
            .plan
            .request
            .reserved_sms
            .min(copy_engine::reduce_cta_cap(pushed)),
    };
    let after = |g: usize, stream: RawStream| {
        let group = &run.collectives[g];
        run.unreorder(group, stream)?;
        run.norm(group, stream, comm.device.sms)
    };
    // Pushed without a row table: push_rows unused.
    copy_engine::enqueue_gemm(
        comm,
        &call,
        caller,
        pushed.then_some(0),
        |signals| gemm::prepare(kernel, args, signals, run.plan.ctas).map(Some),
        after,
    )
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::dtype::Dtype;

    fn args(m: u32, n: u32, k: u32) -> GemmArgs {
        GemmArgs::shape(m, n, k)
    }

    /// Push sums the same bytes with the same kernel as the copy-engine
    /// AllReduce on 2 ranks, so its rate cannot beat the copy engines' sums,
    /// nor the ~29 K output bytes per us one CTA sums beside a GEMM
    /// (evaluation/results/peer_reduce_h200.txt) by much; it only skips the copies.
    #[test]
    fn push_sums_no_faster_than_the_reduction_kernel() {
        let (ar, rs) = (CollectiveKind::AllReduce, CollectiveKind::ReduceScatter);
        for reserved in 1..=copy_engine::MAX_PUSH_REDUCE_CTAS {
            let ctas = f64::from(reserved);
            for kind in [ar, rs] {
                let push = push_gbps(kind, reserved);
                assert!(
                    push <= 30.0 * ctas + 1e-9,
                    "{kind:?} on {reserved} CTAs: {push}"
                );
                assert!(
                    push >= copy_engine_gbps(kind, reserved, 2) - 1e-9,
                    "{kind:?} on {reserved}"
                );
            }
        }
        assert_eq!(push_gbps(CollectiveKind::AllToAll, 4), PUSH_LINK_GBPS);
    }

    #[test]
    fn copy_engine_sums_bound_the_rate_below_many_ranks() {
        let (ar, rs) = (CollectiveKind::AllReduce, CollectiveKind::ReduceScatter);
        // World 2: the sums bound both kinds; 8 CTAs move twice what 4 do.
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(near(copy_engine_gbps(ar, 4, 2), 4.0 * 40.0 / 3.0 * 2.0));
        assert!(near(
            copy_engine_gbps(ar, 8, 2),
            2.0 * copy_engine_gbps(ar, 4, 2)
        ));
        assert!(near(copy_engine_gbps(rs, 4, 2), 4.0 * 70.0 / 3.0));
        assert!(near(
            copy_engine_gbps(rs, 8, 2),
            2.0 * copy_engine_gbps(rs, 4, 2)
        ));
        // The sum never runs on more than MAX_REDUCE_CTAS, however many are reserved.
        assert_eq!(copy_engine_gbps(rs, 16, 2), copy_engine_gbps(rs, 8, 2));
        // More ranks: more partials read per output byte, but fewer output bytes per moved one:
        // at world 8, 8 CTAs keep up with the copies.
        assert_eq!(copy_engine_gbps(rs, 8, 8), 240.0);
        // World 3 and more: the AllReduce sums its share (ReduceScatter + AllGather) at the
        // ReduceScatter's rate per CTA, on half the output bytes per bus byte.
        assert!(near(copy_engine_gbps(ar, 2, 3), 2.0 * 70.0 / 4.0 * 4.0));
        assert_eq!(copy_engine_gbps(ar, 8, 8), 240.0);
        assert_eq!(copy_engine_gbps(CollectiveKind::AllToAll, 0, 4), 240.0);
    }

    fn defaults(backend: Backend) -> Options {
        Options::defaults(backend)
    }

    #[test]
    fn the_predictor_knows_the_norm_kernels_rows_per_cta() {
        // launch_add_rmsnorm gives each warp a row: a CTA takes THREADS / 32 rows at a time.
        assert_eq!(
            kernels::ADD_RMSNORM_THREADS / 32,
            crate::plan::predictor::FUSED_NORM_ROWS_PER_CTA
        );
    }

    #[test]
    fn the_gemm_slows_beside_cross_gpu_traffic_only() {
        let kernel = GemmKernel::default_for(9);
        let kind = CollectiveKind::AllReduce;
        for backend in [Backend::Nccl, Backend::CopyEngine, Backend::Peer] {
            let machine = Machine {
                sms: 132,
                major: 9,
                backend,
                reserved: 8,
                fused_norm: backend == Backend::Peer,
                combined: false,
            };
            let slowdowns = |world| {
                let hw = hardware_for(&machine, kernel, kind, world);
                (hw.overlap_gemm_slowdown, hw.comm_beside_gemm)
            };
            // NCCL's collectives slow down beside the GEMM on their own.
            let beside = match backend {
                Backend::Nccl => (NCCL_GEMM_BESIDE_TRAFFIC, NCCL_COMM_BESIDE_GEMM),
                _ => (GEMM_BESIDE_TRAFFIC, 1.0),
            };
            assert_eq!(
                (slowdowns(1), slowdowns(2), slowdowns(8)),
                ((1.0, 1.0), beside, beside)
            );
        }
    }

    #[test]
    fn the_peer_backend_plans_the_fused_norm_alone() {
        let opts = Options {
            order: OrderRequest::Banded,
            ..defaults(Backend::Peer)
        };
        let a = args(8192, 8192, 4096);
        assert!(plan_for(&a, 2, &opts, 132, 9).is_err());
        let fused = Options {
            fused_norm: true,
            ..opts
        };
        let (_, plan) = plan_for(&a, 2, &fused, 132, 9).unwrap();
        assert!(PEER_RESERVED_SMS.contains(&plan.request.reserved_sms));
        // More CTAs move more, each less than the one before; 32 near the
        // ~310 GB/s measured there, never the 580 GB/s cap.
        assert!(peer_gbps(8) < peer_gbps(16) && peer_gbps(16) < peer_gbps(32));
        assert!(
            peer_gbps(8) / 8.0 > peer_gbps(16) / 16.0
                && peer_gbps(16) / 16.0 > peer_gbps(32) / 32.0
        );
        assert!((peer_gbps(32) - 310.0).abs() < 5.0 && peer_gbps(132) < PEER_CAP_GBPS);
    }

    /// Pushed, the sums may take 16 SMs where they bound the call (a short
    /// K: little GEMM to hide them behind), and fewer where the GEMM does.
    #[test]
    fn push_reserves_more_sms_where_its_sums_bound_the_call() {
        let opts = Options {
            order: OrderRequest::Banded,
            ..defaults(Backend::Push)
        };
        let reserved = |k: u32| {
            let (_, plan) = plan_for(&args(16384, 8192, k), 2, &opts, 132, 9).unwrap();
            assert!(PUSH_RESERVED_SMS.contains(&plan.request.reserved_sms));
            plan.request.reserved_sms
        };
        assert_eq!(reserved(1024), 16);
        assert!(reserved(14336) < 16);
        // The sums' rate: 16 CTAs twice 8, until the links cap it.
        let ar = CollectiveKind::AllReduce;
        assert!(push_gbps(ar, 16) > push_gbps(ar, 8) && push_gbps(ar, 16) <= PUSH_LINK_GBPS);
    }

    #[test]
    fn the_gemm_stores_its_partial_in_the_x_area_of_its_own_buffer() {
        let layout = arn::Layout::pull(2, 100, 64, Dtype::Bf16).unwrap();
        let mut bases = [0u64; arn::MAX_WORLD];
        bases[..2].copy_from_slice(&[1 << 40, 2 << 40]);
        let peer = PeerNorm {
            bases,
            world: 2,
            rank: 1,
            buffer_bytes: layout.bytes,
            timeout_ns: 0,
            config: crate::cuda::kernels::NormConfig::DEFAULT,
        };
        assert_eq!(
            peer.partial(100, 64, Dtype::Bf16).unwrap(),
            (2 << 40) + layout.x_offset
        );
        // A larger output than the buffers hold is refused, naming what it needs.
        let err = peer.partial(101, 64, Dtype::Bf16).unwrap_err().to_string();
        assert!(err.contains("peer buffers"), "{err}");
    }

    /// The whole per-shape decision a first call makes on an H200 (every SM
    /// reservation the backend tries, both orders, the Auto decision), over
    /// the 16 benchmark shapes and every backend of 2 ranks: well under 1 ms
    /// (measured 0.05 ms mean with NCCL, 0.17 ms with the copy engines, 0.6
    /// ms worst).
    #[test]
    fn planning_a_new_shape_takes_under_a_millisecond() {
        let shapes: Vec<(u32, u32, u32)> = [2048, 4096, 8192, 16384]
            .into_iter()
            .flat_map(|m| {
                [(8192, 4096), (8192, 14336), (8192, 1024), (8192, 3584)].map(|(n, k)| (m, n, k))
            })
            .collect();
        for backend in [Backend::Nccl, Backend::CopyEngine, Backend::Push] {
            let opts = defaults(backend);
            let started = Instant::now();
            let mut worst = 0.0f64;
            for &(m, n, k) in &shapes {
                let one = Instant::now();
                // What a first call plans: the plan, and on 2 Hopper ranks the gathered one.
                let a = args(m, n, k);
                let (_, plan) = plan_for(&a, 2, &opts, 132, 9).unwrap();
                let gathered =
                    super::super::gathered_all_reduce::plan_for(&a, 2, &opts, 132, 9).unwrap();
                worst = worst.max(one.elapsed().as_secs_f64() * 1e3);
                assert!(plan.timeline.overlap_us > 0.0);
                if backend == Backend::Nccl {
                    assert!(gathered.is_none());
                }
            }
            let mean = started.elapsed().as_secs_f64() * 1e3 / shapes.len() as f64;
            println!(
                "plan_for {backend:?} on H200, 16 shapes: mean {mean:.3} ms, worst {worst:.3} ms"
            );
            // The mean, not the worst: a loaded CI machine may stall one call.
            if !cfg!(debug_assertions) {
                assert!(mean < 1.0, "{mean} ms");
            }
        }
    }
}
