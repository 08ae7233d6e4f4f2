//! GEMM + ReduceScatter with the ReduceScatter of each finished wave group
//! running while the rest of the GEMM computes.
//!
//! Caller's stream S: [fork] GEMM (stores into the send buffer, signals)  [wait join]
//! Comm stream C:     [wait fork] wait(c0) c0=0 RS(g0 -> out rows of g0) wait(c1) ... [join]
//!
//! With the copy-engine backend each group's chunk p goes to rank p's
//! staging slot by copy engine and the chunks are summed into the output
//! rows on the SMs the GEMM leaves free (ops/copy_engine.rs). With the push
//! backend (2 ranks, sm_90) the GEMM stores the tiles of the peer's shard
//! straight into the peer's slot (over NVLink, as it computes them) instead
//! of the send buffer, and the same sums follow.
//!
//! The plan (plan/reduce_scatter.rs) tiles each rank's shard separately and
//! gives every position the row of x it reads and the row of the send
//! buffer it writes, so that group g's send block is the `world` chunks
//! ReduceScatter expects and rank r receives its rows straight into `out`.
//! Where overlap does not pay nothing is enqueued here: the caller runs its
//! library GEMM and then `reduce_scatter`.

use super::copy_engine::{self, Exchange};
use super::gemm::{self, CounterSlots, GemmArgs, Signals, PEER_FLAG_STRIDE};
use super::gemm_all_reduce::{
    check_push, fastest_kernel, fastest_of, fastest_reservation, kernel_candidates, Backend,
    Machine,
};
use crate::comm::communicator::Communicator;
use crate::cuda::driver;
use crate::cuda::kernels::GemmKernel;
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::{self, RawStream};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::{
    plan_gemm_reduce_scatter, pushed_row, CollectiveKind, Gather, ModeRequest, ReduceScatterPlan,
    ReduceScatterRequest, Schedule, MAX_TABLE_ROWS,
};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub kernel: Option<GemmKernel>,
    pub mode: ModeRequest,
    pub bands_per_group: Option<u32>,
    /// SMs left free of GEMM CTAs for the collectives; None: the
    /// backend's default (NCCL: 24; copy engines: chosen per shape).
    pub reserved_sms: Option<u32>,
    pub max_groups: u32,
    pub backend: Backend,
}

/// The kernel and plan of a call on a device with `sms` SMs of compute
/// capability `major` (no GPU needed): where the SMs to reserve are not
/// given, the copy-engine backend tries each candidate and keeps the plan
/// predicted fastest.
pub fn plan_for(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<(GemmKernel, ReduceScatterPlan)> {
    if opts.backend == Backend::Peer {
        return Err(Backend::peer_unsupported("gemm_reduce_scatter"));
    }
    if opts.backend == Backend::Push {
        check_push(world, major, opts.kernel)?;
    }
    // Combined stores: the sums happen in the GEMM's epilogue, so every SM computes.
    let reserved = if combines(opts, world, major) {
        Some(opts.reserved_sms.unwrap_or(0))
    } else {
        opts.reserved_sms
    };
    fastest_reservation(
        reserved,
        opts.backend,
        false,
        sms,
        |reserved| plan_reserving(args, world, opts, sms, major, reserved, None),
        |p: &ReduceScatterPlan| p.timeline.overlap_us,
    )
}

/// Whether a call sums in the GEMM's epilogue (combined stores: 2 ranks,
/// the sm_90 kernel): always with push, with the copy engines unless
/// [`copy_engine::combines_reduce_scatter`] says otherwise.
fn combines(opts: &Options, world: u32, major: i32) -> bool {
    match opts.backend {
        Backend::Push => true,
        Backend::CopyEngine => {
            world == 2
                && major == 9
                && opts.kernel != Some(GemmKernel::Sm80)
                && copy_engine::combines_reduce_scatter()
        }
        _ => false,
    }
}

/// The predicted time of the call [`plan_for`] plans (for "auto" backend choice).
pub fn predicted_us(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<f64> {
    Ok(plan_for(args, world, opts, sms, major)?.1.predicted_us())
}

/// SMs a gathered AllReduce with a fused norm may leave free: none (the
/// norms then run once the GEMM is done, on every SM) or a few for the
/// norms of the groups already gathered.
const GATHERED_NORM_RESERVED_SMS: [u32; 3] = [0, 8, 16];

/// The landing copies of a gathered AllReduce (slot -> output, local, on
/// the copy engines) beside the GEMM: 0.6-0.9 TB/s of landed bytes on
/// H200 (evaluation/results/bench_land_copy_h200.txt, 4-64 MiB).
const GATHER_LAND_GBPS: f64 = 700.0;

/// The push backend's gathered AllReduce: (each pushed partial's and each
/// pushed sum's stall of its CTA, in its share of the group's link time;
/// the link's GB/s, both directions busy), fitted to the 16 shapes with
/// every call gathered on 2x H200 (`GATHERED_H200` in the tests: mean
/// error 4.6%; the ReduceScatter's 0.5 stall and 360 GB/s gave 10.8%).
const PUSH_GATHER: (f64, f64, f64) = (0.2, 0.0, 330.0);

/// The copy engines' gathered AllReduce: (the GEMM's slowdown beside
/// the copies and landings, the copies' GB/s), fitted like PUSH_GATHER to
/// its column of `GATHERED_H200` (mean error 2.1%). Refitted after the
/// grant moved to the copy queue (2026-11-26), which took 15-20 us off
/// each call: the first fit, 1.06 and 300, was then 10% pessimistic (up
/// to 27% at K = 1024) and auto ran push where the copy engines were 2-7%
/// faster.
const CE_GATHER: (f64, f64) = (1.0, 390.0);

/// GEMM + AllReduce on 2 ranks (with its fused norm where `fused_norm`) as
/// a combined ReduceScatter whose sums each rank gives the peer
/// ([`crate::plan::Gather`]), for `opts.backend` push or copy engines:
/// the plan predicted fastest over the SMs it may leave free (0 without a
/// norm). `args.m` must be even (2 shards).
pub(crate) fn plan_gathered(
    args: &GemmArgs,
    opts: &Options,
    fused_norm: bool,
    sms: u32,
    major: i32,
) -> Result<(GemmKernel, ReduceScatterPlan)> {
    let candidates: Vec<u32> = match opts.reserved_sms {
        Some(r) => vec![r],
        None if fused_norm => GATHERED_NORM_RESERVED_SMS.to_vec(),
        None => vec![0],
    };
    fastest_of(
        candidates,
        sms,
        |reserved| plan_reserving(args, 2, opts, sms, major, reserved, Some(fused_norm)),
        ReduceScatterPlan::predicted_us,
    )
}

/// The plan with `reserved` SMs left free, of the kernel predicted
/// fastest; `gathered`: Some(fused_norm) for a gathered AllReduce.
fn plan_reserving(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
    reserved: u32,
    gathered: Option<bool>,
) -> Result<(GemmKernel, ReduceScatterPlan)> {
    let machine = Machine {
        sms,
        major,
        backend: opts.backend,
        reserved,
        fused_norm: gathered == Some(true),
        combined: gathered.is_some() || combines(opts, world, major),
    };
    fastest_kernel(
        kernel_candidates(opts.kernel, args, &machine),
        |kernel| plan_with(args, world, opts, &machine, kernel, gathered.is_some()),
        ReduceScatterPlan::predicted_us,
        |p| p.schedule == Schedule::Overlap,
    )
}

fn plan_with(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    machine: &Machine,
    kernel: GemmKernel,
    gathered: bool,
) -> Result<ReduceScatterPlan> {
    let reserved = machine.reserved;
    let mut hw = machine.model(args, world, kernel, CollectiveKind::ReduceScatter);
    let pushed = machine.backend == Backend::Push;
    if gathered && pushed {
        let (partial_stall, _, gbps) = PUSH_GATHER;
        hw.push_drain_stall = Some(partial_stall);
        hw.overlap_comm.bus_gbps = gbps;
    }
    if gathered && machine.backend == Backend::CopyEngine {
        let (slowdown, gbps) = CE_GATHER;
        hw.overlap_gemm_slowdown = slowdown;
        hw.overlap_comm.bus_gbps = gbps;
    }
    let gather = gathered.then(|| Gather {
        // With a norm nothing lands: it reads the peer's sums from the slot.
        land_gbps: if machine.fused_norm {
            f64::INFINITY
        } else {
            GATHER_LAND_GBPS
        },
        // The AllReduce the sequential schedule runs (its measured curve where there is one).
        all_reduce: machine
            .model(args, world, kernel, CollectiveKind::AllReduce)
            .comm,
        sums_stall: pushed.then_some(PUSH_GATHER.1),
        norm: machine.fused_norm,
    });
    let req = ReduceScatterRequest {
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
        combined: machine.combined,
        gather,
    };
    Ok(plan_gemm_reduce_scatter(&req, &hw)?)
}

struct Prepared {
    plan: ReduceScatterPlan,
    kernel: GemmKernel,
    tile_order: DeviceBuffer,
    tile_group: DeviceBuffer,
    /// (row of x read, row of the send buffer written) per position; with
    /// combined stores the row of the output or (pushed marking) of the
    /// buffer that takes the peer's tiles.
    row_table: DeviceBuffer,
    /// Per group; with combined stores on the copy engines, the count of
    /// the tiles of the peer's shard, PEER_FLAG_STRIDE words apart.
    counters: CounterSlots,
    /// Combined stores: what each group's ready flag reaches once the
    /// peer's partial of it is here (its pushed tiles, or 1: its copy).
    ready_counts: Option<DeviceBuffer>,
}

fn prepare(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &Options,
    caller: RawStream,
) -> Result<Arc<Prepared>> {
    gemm::prepared(comm, "gemm_reduce_scatter", args, opts, caller, || {
        let (kernel, plan) = plan_for(
            args,
            comm.world as u32,
            opts,
            comm.device.sms,
            comm.device.major,
        )?;
        if plan.send_rows() >= MAX_TABLE_ROWS {
            return Err(Error::Invalid(format!(
                "shape: {} rows of send buffer, the kernel's row tables name fewer than 2**30",
                plan.send_rows()
            )));
        }
        if matches!(opts.backend, Backend::CopyEngine | Backend::Push)
            && plan.schedule == Schedule::Overlap
        {
            // Offsets only (no buffers yet).
            copy_engine::check_groups(&copy_engine::sums(exchanges(&plan, args, 0, 0)))?;
            comm.ensure_group_events(plan.groups.len())?;
        }
        let combined = plan.request.combined;
        let tables = if combined {
            combined_tables(&plan, comm.rank as u32)
        } else {
            Tables {
                tile_order: plan.tile_order.clone(),
                tile_group: plan.tile_group.clone(),
                row_table: gemm::row_table(&plan.load_rows, &plan.store_rows),
            }
        };
        let world = plan.request.world;
        Ok(Prepared {
            kernel,
            tile_order: DeviceBuffer::from_u32(&tables.tile_order)?,
            tile_group: DeviceBuffer::from_u32(&tables.tile_group)?,
            row_table: DeviceBuffer::from_u32(&tables.row_table)?,
            counters: CounterSlots::new(plan.groups.len() * PEER_FLAG_STRIDE as usize)?,
            ready_counts: combined
                .then(|| {
                    let counts: Vec<u32> = plan
                        .groups
                        .iter()
                        .map(|g| match opts.backend {
                            Backend::Push => g.tiles / world,
                            _ => 1,
                        })
                        .collect();
                    DeviceBuffer::from_u32(&counts)
                })
                .transpose()?,
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
) -> Result<ReduceScatterPlan> {
    driver::bind(comm.device.ordinal)?;
    Ok(prepare(comm, args, opts, caller)?.plan.clone())
}

/// Enqueues the overlapped op and returns `Schedule::Overlap`, or enqueues
/// nothing and returns `Schedule::Sequential` when the plan falls back.
/// `args.out`: the output, `plan.out_rows()` x N (whole bands; the caller
/// keeps the first M / world rows); `send`: a `plan.send_rows()` x N buffer
/// the GEMM stores into (both from the caller, in stream order on `caller`).
pub fn gemm_reduce_scatter(
    comm: &Communicator,
    args: &GemmArgs,
    send: u64,
    opts: &Options,
    caller: RawStream,
) -> Result<Schedule> {
    args.validate()?;
    driver::bind(comm.device.ordinal)?;
    let prepared = prepare(comm, args, opts, caller)?;
    let plan = &prepared.plan;
    if plan.schedule == Schedule::Sequential {
        return Ok(Schedule::Sequential);
    }
    if send == 0 || send % 16 != 0 {
        return Err(Error::Invalid(format!(
            "send: needs a 16-byte aligned buffer of {} rows, got {send:#x}",
            plan.send_rows()
        )));
    }
    let kernel = if plan.request.combined {
        gemm::load_combined(&comm.device, args.dtype, prepared.kernel)?
    } else {
        gemm::load(&comm.device, args.dtype, prepared.kernel)?
    };
    let signals = Signals {
        tile_order: prepared.tile_order.ptr,
        tile_group: prepared.tile_group.ptr,
        counters: prepared.counters.next(),
        row_table: prepared.row_table.ptr,
        store: send,
        store_rows: plan.send_rows() as u32,
        tile_count: plan.tile_order.len() as u32,
        ..Signals::default()
    };
    let launch = || gemm::launch(&kernel, args, &signals, plan.ctas, caller);
    match opts.backend {
        Backend::Peer => return Err(Backend::peer_unsupported("gemm_reduce_scatter")),
        Backend::Nccl => enqueue_nccl(comm, plan, args, send, &signals, caller, launch)?,
        _ if plan.request.combined => enqueue_combined(
            comm,
            &prepared,
            &kernel,
            args,
            send,
            opts.backend,
            &signals,
            caller,
        )?,
        // Push always combines (`combines`): the arm above took it.
        Backend::Push => {
            return Err(Error::Invalid(
                "internal: a push ReduceScatter without combined stores".into(),
            ))
        }
        Backend::CopyEngine => {
            let groups = copy_engine::sums(exchanges(plan, args, send, args.out));
            let peer = copy_engine::peer_buffers(comm, &groups)?;
            let reducer = copy_engine::load_reducer(comm, args.dtype, peer.layout.world)?;
            let call = copy_engine::Call {
                peer: &peer,
                reducer: reducer.as_ref(),
                signals: Some(&signals),
                groups: &groups,
                reduce_ctas: plan
                    .request
                    .reserved_sms
                    .min(copy_engine::reduce_cta_cap(false)),
            };
            copy_engine::enqueue_gemm(
                comm,
                &call,
                caller,
                None,
                |signals| gemm::prepare(&kernel, args, signals, plan.ctas).map(Some),
                |_, _| Ok(()),
            )?;
        }
    }
    Ok(Schedule::Overlap)
}

/// A call with combined stores (2 ranks): the GEMM stores its own tiles,
/// summed with the peer's partial, into the output, and the peer's tiles
/// into the peer's slot (push) or into `send`, laid out like the output,
/// whence each group's copy takes them (copy engines).
#[allow(clippy::too_many_arguments)]
fn enqueue_combined(
    comm: &Communicator,
    prepared: &Prepared,
    kernel: &gemm::LoadedGemm,
    args: &GemmArgs,
    send: u64,
    backend: Backend,
    signals: &Signals,
    caller: RawStream,
) -> Result<()> {
    let plan = &prepared.plan;
    let groups = copy_engine::sums(exchanges(plan, args, send, args.out));
    let peer = copy_engine::peer_buffers(comm, &groups)?;
    let ready_counts = prepared.ready_counts.as_ref().ok_or_else(|| {
        Error::Invalid("internal: a combined plan without its ready counts".into())
    })?;
    let out_rows = plan.out_rows() as u32;
    let row_bytes = u64::from(args.n) * args.dtype.bytes() as u64;
    let world = plan.request.world;
    // The counter of group g's tiles of the peer's shard (copy engines).
    let counter = |g: usize| signals.counters + g as u64 * PEER_FLAG_STRIDE * 4;
    let copies: Vec<copy_engine::SlotCopy> = plan
        .groups
        .iter()
        .enumerate()
        .map(|(g, group)| copy_engine::SlotCopy {
            counter: counter(g),
            tiles: group.tiles / world,
            src: send + group.recv_row * row_bytes,
            slot_offset: group.recv_row * row_bytes,
            bytes: (group.bands.end - group.bands.start) as u64
                * u64::from(plan.request.tile.bm)
                * row_bytes,
        })
        .collect();
    let pushed = backend == Backend::Push;
    copy_engine::enqueue_combined(
        comm,
        &peer,
        plan.groups.len(),
        (!pushed).then_some(&copies[..]),
        None,
        caller,
        |t| {
            let combined = Signals {
                // Own tiles go to the output, the peer's to its slot (push)
                // or to `send` (copy engines), all laid out like the output.
                store: args.out,
                store_rows: out_rows,
                counters: 0,
                push: if pushed { t.peer_slot } else { send },
                push_flags: if pushed { t.peer_ready } else { counter(0) },
                push_rows: out_rows,
                recv: t.recv,
                ready_flags: t.ready,
                ready_counts: ready_counts.ptr,
                timeout_ns: t.timeout_ns,
                timed_out: t.timed_out,
                ..*signals
            };
            gemm::prepare(kernel, args, &combined, plan.ctas)
        },
    )
}

/// The kernel's tables of one call.
pub(crate) struct Tables {
    pub tile_order: Vec<u32>,
    pub tile_group: Vec<u32>,
    pub row_table: Vec<u32>,
}

/// The tables of a combined-stores call on `rank`: positions in
/// [`ReduceScatterPlan::combined_order`]; the tiles of this rank's shard
/// go to its output rows (band j at rows j * bm), those of another shard to
/// row -r - 1 (the kernel's "push" marking) for r the same row of that
/// shard's owner's slot, which is laid out like the output.
pub(crate) fn combined_tables(plan: &ReduceScatterPlan, rank: u32) -> Tables {
    let (bands, tiles_n, bm) = (plan.bands, plan.tiles_n, plan.request.tile.bm);
    let order = plan.combined_order(rank);
    let store = |p: usize| {
        let band = plan.tile_order[p] / tiles_n;
        let (shard, j) = (band / bands, band % bands);
        if shard == rank {
            j * bm
        } else {
            pushed_row(u64::from(j * bm))
        }
    };
    Tables {
        tile_order: order.iter().map(|&p| plan.tile_order[p]).collect(),
        tile_group: order.iter().map(|&p| plan.tile_group[p]).collect(),
        row_table: order
            .iter()
            .flat_map(|&p| [plan.load_rows[p], store(p)])
            .collect(),
    }
}

/// Each group's ReduceScatter as a copy-engine exchange: rank p's part is
/// the group's chunk p of the send buffer; the sum of this rank's chunk
/// goes to the group's output rows (`out`), the parts land at the same rows
/// of the receivers' slots.
fn exchanges(plan: &ReduceScatterPlan, args: &GemmArgs, send: u64, out: u64) -> Vec<Exchange> {
    let elem = args.dtype.bytes() as u64;
    let row_bytes = u64::from(args.n) * elem;
    plan.groups
        .iter()
        .map(|g| Exchange {
            tiles: g.tiles,
            src: send + g.send_row * row_bytes,
            src_stride: g.recv_count * elem,
            bytes: g.recv_count * elem,
            slot_offset: g.recv_row * row_bytes,
            out: out + g.recv_row * row_bytes,
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn enqueue_nccl(
    comm: &Communicator,
    plan: &ReduceScatterPlan,
    args: &GemmArgs,
    send: u64,
    signals: &Signals,
    caller: RawStream,
    launch_gemm: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (nccl, nccl_comm) = comm.nccl()?;
    let row_bytes = u64::from(args.n) * args.dtype.bytes() as u64;
    let comm_stream = comm.stream.0;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    comm.fork.order(caller, comm_stream)?;
    launch_gemm()?;
    for (g, group) in plan.groups.iter().enumerate() {
        let counter = signals.counter(g);
        stream::take(comm_stream, counter, group.tiles)?;
        nccl.reduce_scatter(
            send + group.send_row * row_bytes,
            args.out + group.recv_row * row_bytes,
            group.recv_count as usize,
            args.dtype,
            nccl_comm,
            comm_stream.cast(),
        )?;
    }
    comm.join.order(comm_stream, caller)
}

/// A plain ReduceScatter on the communicator's stream, ordered after the
/// caller's prior work and before its later work (the sequential schedule).
pub fn reduce_scatter(
    comm: &Communicator,
    send: u64,
    recv: u64,
    recv_count: usize,
    dtype: Dtype,
    caller: RawStream,
) -> Result<()> {
    if (send == 0 || recv == 0) && recv_count > 0 {
        return Err(Error::Invalid("tensor: null device pointer".into()));
    }
    comm.on_comm_stream(caller, |nccl, nccl_comm, stream| {
        nccl.reduce_scatter(send, recv, recv_count, dtype, nccl_comm, stream.cast())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::ops::profile;

    // A 129-SM device keeps these samples away from every other test's plans
    // (the profile registry is process-wide).
    const SMS: u32 = 129;

    fn opts(kernel: Option<GemmKernel>) -> Options {
        Options {
            kernel,
            mode: ModeRequest::Overlap,
            bands_per_group: None,
            reserved_sms: None,
            max_groups: 16,
            backend: Backend::Nccl,
        }
    }

    #[test]
    fn a_clearly_faster_measured_tile_width_is_taken() {
        let shape = (4096, 8192, 4096);
        let ctas = SMS - crate::ops::gemm_all_reduce::NCCL_RESERVED_SMS;
        for (kernel, us) in [("sm90_n128", 300.0), ("sm90_n256", 400.0)] {
            profile::register_gemm(kernel, Dtype::Bf16, SMS, ctas, shape, us).unwrap();
        }
        let args = GemmArgs {
            x: 0,
            weight: 0,
            out: 0,
            m: shape.0,
            n: shape.1,
            k: shape.2,
            dtype: Dtype::Bf16,
        };
        let (kernel, plan) = plan_for(&args, 2, &opts(None), SMS, 9).unwrap();
        assert_eq!(kernel, GemmKernel::Sm90 { bn: 128 });
        assert_eq!(plan.request.tile.bn, 128);
        // A named kernel is kept; on Ampere there is one kernel.
        let named = GemmKernel::Sm90 { bn: 256 };
        assert_eq!(
            plan_for(&args, 2, &opts(Some(named)), SMS, 9).unwrap().0,
            named
        );
        assert_eq!(
            plan_for(&args, 2, &opts(None), SMS, 8).unwrap().0,
            GemmKernel::Sm80
        );
    }

    /// Forced overlap of gemm_all_reduce on 2x H200 with every call
    /// gathered (bench_gemm_ar.py, 2026-11-26): (m, k, push us, copy
    /// engines us) at n = 8192. Push: FLASHOVERLAP_GATHERED_ALLREDUCE=1,
    /// one run; copy engines: the mean of two runs after the grant moved
    /// to the copy queue (5c151f2).
    const GATHERED_H200: [(u32, u32, f64, f64); 16] = [
        (2048, 4096, 294.0, 275.0),
        (2048, 14336, 785.0, 783.0),
        (2048, 1024, 181.0, 177.0),
        (2048, 3584, 272.0, 251.0),
        (4096, 4096, 502.0, 482.0),
        (4096, 14336, 1525.0, 1497.0),
        (4096, 1024, 274.0, 283.0),
        (4096, 3584, 453.0, 426.0),
        (8192, 4096, 967.0, 955.0),
        (8192, 14336, 3019.0, 2949.0),
        (8192, 1024, 521.0, 504.0),
        (8192, 3584, 824.0, 837.0),
        (16384, 4096, 1822.0, 1811.0),
        (16384, 14336, 5979.0, 5848.0),
        (16384, 1024, 949.0, 875.0),
        (16384, 3584, 1659.0, 1640.0),
    ];

    #[test]
    fn the_gathered_model_fits_its_measurements() {
        // As fitted (PUSH_GATHER, CE_GATHER).
        for (backend, bound) in [(Backend::Push, 0.05), (Backend::CopyEngine, 0.03)] {
            let mut errors = vec![];
            for &(m, k, push, ce) in &GATHERED_H200 {
                let a = GemmArgs {
                    x: 0,
                    weight: 0,
                    out: 0,
                    m,
                    n: 8192,
                    k,
                    dtype: Dtype::Bf16,
                };
                let o = Options {
                    backend,
                    mode: ModeRequest::Overlap,
                    ..opts(None)
                };
                let (_, p) = plan_gathered(&a, &o, false, 132, 9).unwrap();
                assert_eq!(p.schedule, Schedule::Overlap);
                let measured = if backend == Backend::Push { push } else { ce };
                errors.push((p.predicted_us() / measured - 1.0).abs());
            }
            let mean = errors.iter().sum::<f64>() / errors.len() as f64;
            println!("{backend:?}: mean error {:.1}%", 100.0 * mean);
            assert!(mean <= bound, "{backend:?}: mean error {mean}");
        }
    }

    #[test]
    fn combined_tiles_wait_only_for_earlier_pushes() {
        // A partial last band (M / world = 1000 rows: 8 bands of 128) and several groups.
        let args = GemmArgs {
            x: 0,
            weight: 0,
            out: 0,
            m: 2000,
            n: 1024,
            k: 512,
            dtype: Dtype::Bf16,
        };
        let push = Options {
            backend: Backend::Push,
            bands_per_group: Some(3),
            ..opts(None)
        };
        let (_, plan) = plan_for(&args, 2, &push, SMS, 9).unwrap();
        assert!(plan.groups.len() > 1);
        assert_eq!(plan.ctas, SMS, "the sums need no SM of their own");
        let bm = plan.request.tile.bm;
        let tables: Vec<Tables> = (0..2).map(|r| combined_tables(&plan, r)).collect();
        // Per rank and group: (last pushed position, first own position).
        let mut spans = vec![vec![(None, None); plan.groups.len()]; 2];
        for (rank, t) in tables.iter().enumerate() {
            let mut seen = t.tile_order.clone();
            seen.sort_unstable();
            let mut all = plan.tile_order.clone();
            all.sort_unstable();
            assert_eq!(seen, all, "every tile exactly once");
            let mut slot_tiles = std::collections::HashMap::new();
            for (p, &tile) in t.tile_order.iter().enumerate() {
                let band = tile / plan.tiles_n;
                let (shard, j) = (band / plan.bands, band % plan.bands);
                assert_eq!(t.row_table[2 * p], shard * plan.shard_rows + j * bm);
                let row = t.row_table[2 * p + 1] as i32;
                let g = t.tile_group[p] as usize;
                assert!(plan.groups[g].bands.contains(&j));
                let span = &mut spans[rank][g];
                if shard == rank as u32 {
                    assert_eq!(row as u32, j * bm, "own tiles go to their output rows");
                    span.1 = span.1.or(Some(p));
                } else {
                    // The peer's slot is laid out like its output: band j at rows j * bm.
                    assert_eq!(-row - 1, (j * bm) as i32);
                    *slot_tiles.entry(j).or_insert(0) += 1;
                    span.0 = Some(p);
                }
            }
            assert_eq!(slot_tiles.len() as u32, plan.bands);
            assert!(slot_tiles.values().all(|&c| c == plan.tiles_n));
        }
        for g in 0..plan.groups.len() {
            for rank in 0..2 {
                // This rank's own tiles of g come after every tile the peer
                // pushes for g (and the peer's own after this rank's).
                let (first_own, peer_last_push) = (spans[rank][g].1, spans[1 - rank][g].0);
                assert!(first_own.unwrap() > peer_last_push.unwrap(), "group {g}");
                // The plan's lead: a wave or more between the peer's last
                // tile of g and this rank's first.
                assert!(plan.combined_lead >= plan.ctas);
                assert!(
                    first_own.unwrap() >= peer_last_push.unwrap() + 1 + plan.combined_lead as usize
                        || spans[rank]
                            .iter()
                            .all(|s| s.0.unwrap() < first_own.unwrap()),
                    "group {g}"
                );
            }
            let pushed = tables[0]
                .tile_group
                .iter()
                .zip(&tables[0].row_table.chunks(2).collect::<Vec<_>>())
                .filter(|(&tg, r)| tg as usize == g && (r[1] as i32) < 0)
                .count();
            assert_eq!(
                pushed as u32,
                plan.groups[g].tiles / 2,
                "the peer's wait count of group {g}"
            );
        }
        // Only 2 ranks, only Hopper, only the sm_90 kernel.
        assert!(plan_for(&args, 4, &push, SMS, 9).is_err());
        assert!(plan_for(&args, 2, &push, SMS, 8).is_err());
        let sm80 = Options {
            kernel: Some(GemmKernel::Sm80),
            ..push
        };
        assert!(plan_for(&args, 2, &sm80, SMS, 9).is_err());
    }
}
