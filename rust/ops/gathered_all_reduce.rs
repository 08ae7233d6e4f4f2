//! GEMM + AllReduce on 2 Hopper ranks as a combined ReduceScatter and a
//! gather, with no reduction pass and no SM reserved for one:
//!
//! Each rank owns half of the output rows (a shard). Its GEMM first computes
//! the tiles of the peer's shard and sends them (push: from the epilogue
//! into the peer's slot; copy engines: stored locally, copied per group),
//! then its own shard's tiles, adding the peer's partial in the epilogue
//! (ops/gemm_reduce_scatter.rs's combined stores). Each finished sum goes to
//! the output and to the peer (pushed from the same epilogue, or copied per
//! group), and each rank copies the peer's sums from its slot into its
//! output (the landing, on the copy engines); where a fused norm follows,
//! the group's norm reads them from the slot instead and writes the output
//! rows itself (no landing: a read and a write of half the output saved):
//!
//! Caller S:  GEMM (peer's tiles -> peer, own tiles + peer's partial -> out, -> peer)
//! Land L:    wait(gathered g0) copy(slot -> out) [own g0 stored] after(g0) ...
//! (norm:)    wait(gathered g0) [own g0 stored] norm(own rows, peer's rows from the slot) ...
//!
//! The links carry what a ReduceScatter + AllGather would; the sums cost
//! nothing beside the GEMM's epilogue.

use super::copy_engine::{self, GatherSteps, Land, SlotCopy};
use super::gemm::{self, CounterSlots, GemmArgs, Signals, PEER_FLAG_STRIDE};
use super::gemm_all_reduce::{self as gar, Backend, Norm};
use super::gemm_reduce_scatter as grs;
use crate::comm::communicator::Communicator;
use crate::cuda::kernels::{self, GemmKernel, Kernel};
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::RawStream;
use crate::error::{Error, Result};
use crate::plan::{OrderRequest, ReduceScatterPlan, Schedule};
use std::sync::Arc;

/// FLASHOVERLAP_GATHERED_ALLREDUCE: "0" never runs the gathered AllReduce
/// (each group is then summed on reserved SMs after the GEMM, as on other
/// GPUs and world sizes); otherwise it runs wherever it applies and its
/// plan overlaps. It is not weighed against the other plan's prediction:
/// with every call gathered, forced overlap ran faster on 14 of the 16
/// shapes with push (2x H200, up to 1.19x; 3% slower at 16384 x 8192 x
/// 14336), while the other plan's model ran up to 15% optimistic there.
/// Read once per process; every rank must set it alike.
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("FLASHOVERLAP_GATHERED_ALLREDUCE")
            .unwrap_or_default()
            .trim()
            != "0"
    })
}

/// Whether a call may run gathered: push or copy engines on 2 ranks (with
/// a fused norm push only), the sm_90 kernel, an even row count (two equal
/// shards), whole-row groups, and no forced `bands_per_group` (it names row
/// bands of the whole output, the other plan's groups: E2 times those
/// partitions against that plan's predictions). The copy engines' gathered norm op ran 1.03x
/// of sequential at 8192 x 8192 x 4096 on 2x H200 (16 groups; push 1.33x)
/// and only up to 4% faster than push on the others.
fn applies(args: &GemmArgs, world: u32, opts: &gar::Options, major: i32) -> bool {
    let backend_gathers = match opts.backend {
        Backend::Push => true,
        Backend::CopyEngine => !opts.fused_norm,
        _ => false,
    };
    backend_gathers
        && world == 2
        && major == 9
        && opts.kernel != Some(GemmKernel::Sm80)
        && args.m % 2 == 0
        && opts.order != OrderRequest::Swizzled
        && opts.raster_bands.is_none()
        && opts.bands_per_group.is_none()
        && opts.mode != crate::plan::ModeRequest::Sequential
        && enabled()
}

fn rs_options(opts: &gar::Options) -> grs::Options {
    grs::Options {
        kernel: opts.kernel,
        mode: opts.mode,
        bands_per_group: opts.bands_per_group,
        reserved_sms: opts.reserved_sms,
        max_groups: opts.max_groups,
        backend: opts.backend,
    }
}

/// The gathered plan of a call where it applies and overlaps; else None.
pub fn plan_for(
    args: &GemmArgs,
    world: u32,
    opts: &gar::Options,
    sms: u32,
    major: i32,
) -> Result<Option<(GemmKernel, ReduceScatterPlan)>> {
    if !applies(args, world, opts, major) {
        return Ok(None);
    }
    let (kernel, plan) = grs::plan_gathered(args, &rs_options(opts), opts.fused_norm, sms, major)?;
    Ok((plan.schedule == Schedule::Overlap).then_some((kernel, plan)))
}

/// What a gathered shape needs on the device, made on its first call.
pub struct Prepared {
    pub plan: ReduceScatterPlan,
    kernel: GemmKernel,
    tile_order: DeviceBuffer,
    tile_group: DeviceBuffer,
    row_table: DeviceBuffer,
    /// Copy engines: each group's tiles of the peer's shard, stored
    /// locally (PEER_FLAG_STRIDE words apart, as the kernel counts pushes).
    partials: CounterSlots,
    /// Every tile of each group (copy engines, or pushed with a norm).
    counters: CounterSlots,
    /// What each group's ready flag reaches once the peer's partial is here.
    ready_counts: DeviceBuffer,
    /// The groups' partials and sums in the order the GEMM finishes them.
    finish_order: Vec<(usize, bool)>,
}

/// The prepared gathered call, or None where the call runs otherwise
/// (planned and cached on the first call of a shape, like every op).
pub fn prepare(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &gar::Options,
    caller: RawStream,
) -> Result<Option<Arc<Prepared>>> {
    let world = comm.world as u32;
    if !applies(args, world, opts, comm.device.major) {
        return Ok(None);
    }
    let prepared = gemm::prepared(comm, "gemm_all_reduce_gathered", args, opts, caller, || {
        let (sms, major) = (comm.device.sms, comm.device.major);
        let Some((kernel, plan)) = plan_for(args, world, opts, sms, major)? else {
            return Ok(None);
        };
        comm.ensure_group_events(plan.groups.len())?;
        let tables = grs::combined_tables(&plan, comm.rank as u32);
        let counts: Vec<u32> = plan
            .groups
            .iter()
            .map(|g| match opts.backend {
                Backend::Push => g.tiles / 2,
                _ => 1,
            })
            .collect();
        Ok(Some(Arc::new(Prepared {
            kernel,
            tile_order: DeviceBuffer::from_u32(&tables.tile_order)?,
            tile_group: DeviceBuffer::from_u32(&tables.tile_group)?,
            row_table: DeviceBuffer::from_u32(&tables.row_table)?,
            partials: CounterSlots::new(plan.groups.len() * PEER_FLAG_STRIDE as usize)?,
            counters: CounterSlots::new(plan.groups.len())?,
            ready_counts: DeviceBuffer::from_u32(&counts)?,
            finish_order: plan.combined_finish_order(comm.rank as u32),
            plan,
        })))
    })?;
    Ok((*prepared).clone())
}

/// Bytes of the peer slot a gathered call uses: the peer's partials, then
/// its sums, each laid out like a shard of whole bands.
pub fn slot_bytes(plan: &ReduceScatterPlan, args: &GemmArgs) -> u64 {
    2 * plan.out_rows() * u64::from(args.n) * args.dtype.bytes() as u64
}

/// Enqueues the gathered call (`args.out`: the whole [m, n] output), with
/// `norm` (loaded) after each group where given.
pub fn enqueue(
    comm: &Communicator,
    prepared: &Prepared,
    args: &GemmArgs,
    backend: Backend,
    norm: Option<(&Norm, &Kernel)>,
    caller: RawStream,
) -> Result<()> {
    let plan = &prepared.plan;
    let peer = copy_engine::peer_buffers_holding(comm, slot_bytes(plan, args))?;
    let kernel = gemm::load_combined(&comm.device, args.dtype, prepared.kernel)?;
    let (rank, other) = (comm.rank as u64, 1 - comm.rank as u64);
    let shard_rows = u64::from(plan.shard_rows);
    let out_rows = plan.out_rows();
    let row_bytes = u64::from(args.n) * args.dtype.bytes() as u64;
    let (own, theirs) = (
        args.out + rank * shard_rows * row_bytes,
        args.out + other * shard_rows * row_bytes,
    );
    let bm = u64::from(plan.request.tile.bm);
    // Each group's first row in a shard and its rows there (the last band clipped).
    let spans: Vec<(u64, u64)> = plan
        .groups
        .iter()
        .map(|g| {
            let first = u64::from(g.bands.start) * bm;
            (first, (u64::from(g.bands.end) * bm).min(shard_rows) - first)
        })
        .collect();
    let pushed = backend == Backend::Push;
    let partials = prepared.partials.next();
    let counters = if pushed && norm.is_none() {
        0
    } else {
        prepared.counters.next()
    };
    let partial_copies: Vec<SlotCopy> = spans
        .iter()
        .enumerate()
        .map(|(g, &(first, rows))| SlotCopy {
            counter: partials + g as u64 * PEER_FLAG_STRIDE * 4,
            tiles: plan.groups[g].tiles / 2,
            src: theirs + first * row_bytes,
            slot_offset: first * row_bytes,
            bytes: rows * row_bytes,
        })
        .collect();
    let sends: Vec<SlotCopy> = spans
        .iter()
        .enumerate()
        .map(|(g, &(first, rows))| SlotCopy {
            counter: counters + 4 * g as u64,
            tiles: plan.groups[g].tiles,
            src: own + first * row_bytes,
            slot_offset: (out_rows + first) * row_bytes,
            bytes: rows * row_bytes,
        })
        .collect();
    // With a norm, it reads the peer's sums from the slot and writes the
    // output rows itself: nothing lands first.
    let lands: Vec<Land> = spans
        .iter()
        .enumerate()
        .map(|(g, &(first, rows))| Land {
            count: if pushed { plan.groups[g].tiles / 2 } else { 1 },
            slot_offset: (out_rows + first) * row_bytes,
            out: theirs + first * row_bytes,
            bytes: if norm.is_some() { 0 } else { rows * row_bytes },
        })
        .collect();
    let recv = peer.slot_from(other as usize);
    let own_tiles: Vec<u32> = plan.groups.iter().map(|g| g.tiles).collect();
    let last = plan.groups.len().saturating_sub(1);
    let mut after = |g: usize, stream: RawStream| -> Result<()> {
        let Some((norm, kernel)) = norm else {
            return Ok(());
        };
        // After the last group the GEMM is done: its norm gets every SM (as
        // do all where none is reserved: they run once the GEMM's CTAs leave).
        let ctas = if g == last || plan.request.reserved_sms == 0 {
            comm.device.sms
        } else {
            plan.request.reserved_sms.max(1)
        };
        let (first, rows) = spans[g];
        for shard in 0..2 {
            let start = (shard * shard_rows + first) as u32;
            let src = (shard == other).then_some(recv + (out_rows + first) * row_bytes);
            gar::launch_add_rmsnorm(
                kernel,
                args.out,
                src,
                norm,
                start..start + rows as u32,
                args.n,
                ctas,
                stream,
            )?;
        }
        Ok(())
    };
    let signals = Signals {
        tile_order: prepared.tile_order.ptr,
        tile_group: prepared.tile_group.ptr,
        counters,
        row_table: prepared.row_table.ptr,
        store: own,
        store_rows: plan.shard_rows,
        tile_count: plan.tile_order.len() as u32,
        ready_counts: prepared.ready_counts.ptr,
        ..Signals::default()
    };
    let gather = GatherSteps {
        sends: (!pushed).then_some(&sends[..]),
        lands: &lands,
        own_counters: counters,
        own_tiles: &own_tiles,
        after: &mut after,
        finish_order: &prepared.finish_order,
    };
    let rows = |r: u64| -> Result<u32> {
        u32::try_from(r)
            .map_err(|_| Error::Invalid(format!("shape: {r} rows exceed the kernel's 32-bit rows")))
    };
    let (slot_rows, shard) = (rows(2 * out_rows)?, plan.shard_rows);
    copy_engine::enqueue_combined(
        comm,
        &peer,
        plan.groups.len(),
        (!pushed).then_some(&partial_copies[..]),
        Some(gather),
        caller,
        |t| {
            let launch = Signals {
                // Own tiles to their output rows; the peer's to its slot
                // (push) or to their own output rows (copy engines), whence
                // each group's copy takes them.
                push: if pushed { t.peer_slot } else { theirs },
                push_flags: if pushed { t.peer_ready } else { partials },
                push_rows: if pushed { slot_rows } else { shard },
                recv: t.recv,
                ready_flags: t.ready,
                timeout_ns: t.timeout_ns,
                timed_out: t.timed_out,
                gather_row: pushed.then_some(out_rows as u32),
                gather_flags: if pushed { t.peer_gathered } else { 0 },
                ..signals
            };
            gemm::prepare(&kernel, args, &launch, plan.ctas)
        },
    )
}

/// Loads the fused norm's kernel (before anything is enqueued).
pub fn load_norm(comm: &Communicator, args: &GemmArgs) -> Result<Kernel> {
    kernels::load(&comm.device, &kernels::add_rmsnorm_spec(args.dtype))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(m: u32, n: u32, k: u32) -> GemmArgs {
        GemmArgs::shape(m, n, k)
    }

    fn opts(backend: Backend, fused_norm: bool) -> gar::Options {
        gar::Options {
            fused_norm,
            ..gar::Options::defaults(backend)
        }
    }

    #[test]
    fn gathered_only_on_two_hopper_ranks_with_even_rows() {
        let a = args(16384, 8192, 4096);
        for backend in [Backend::Push, Backend::CopyEngine] {
            let o = opts(backend, false);
            let (_, g) = plan_for(&a, 2, &o, 132, 9).unwrap().expect("gathered");
            assert_eq!(g.request.reserved_sms, 0, "no SM sums anything");
            assert_eq!(g.shard_rows, 8192);
            assert!(g.request.gather.is_some() && g.request.combined);
            for (args, world, major) in [(args(16383, 8192, 4096), 2, 9), (a, 4, 9), (a, 2, 8)] {
                assert!(plan_for(&args, world, &o, 132, major).unwrap().is_none());
            }
        }
        assert!(plan_for(&a, 2, &opts(Backend::Nccl, false), 132, 9)
            .unwrap()
            .is_none());
        // Forced groups are the other plan's.
        let forced = gar::Options {
            bands_per_group: Some(2),
            ..opts(Backend::Push, false)
        };
        assert!(plan_for(&a, 2, &forced, 132, 9).unwrap().is_none());
        // With a fused norm, push only.
        assert!(plan_for(&a, 2, &opts(Backend::Push, true), 132, 9)
            .unwrap()
            .is_some());
        assert!(plan_for(&a, 2, &opts(Backend::CopyEngine, true), 132, 9)
            .unwrap()
            .is_none());
        let sm80 = gar::Options {
            kernel: Some(GemmKernel::Sm80),
            ..opts(Backend::Push, false)
        };
        assert!(plan_for(&a, 2, &sm80, 132, 9).unwrap().is_none());
    }
}
