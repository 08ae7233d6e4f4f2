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
//! Where the plan says overlap does not pay, nothing is enqueued here: the
//! caller runs its library GEMM (cuBLAS, faster than ours today) and then
//! `all_reduce::all_reduce`.

use super::gemm::{self, GemmArgs, Signals};
use crate::comm::communicator::Communicator;
use crate::cuda::driver;
use crate::cuda::kernels::GemmKernel;
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::{self, RawStream};
use crate::error::{Error, Result};
use crate::plan::{self, GemmAllReducePlan, HardwareModel, ModeRequest, PlanRequest, Schedule};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counter slots per shape: consecutive calls use different slots, so a call
/// never sees counts left by the call before it, even if the caller
/// enqueues on several streams.
const COUNTER_SLOTS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The GEMM kernel; None: the device's default.
    pub kernel: Option<GemmKernel>,
    pub mode: ModeRequest,
    pub bands_per_group: Option<u32>,
    pub reserved_sms: u32,
    pub max_groups: u32,
    /// Row bands per raster block inside each group; None: the plan's default.
    pub raster_bands: Option<u32>,
}

/// What a shape needs on the device, made on its first call.
pub struct Prepared {
    pub plan: GemmAllReducePlan,
    /// The kernel the plan tiled for; the launch must use this one.
    kernel: GemmKernel,
    /// The tile order, when it is not the identity.
    tile_order: Option<DeviceBuffer>,
    tile_group: DeviceBuffer,
    counters: DeviceBuffer,
    next_slot: AtomicUsize,
}

/// The predictor's machine: measured constants on H200 (with the rate of
/// the kernel that will run), a pessimistic model elsewhere.
fn hardware_for(sms: u32, major: i32, kernel: GemmKernel) -> HardwareModel {
    if major == 9 && sms == 132 {
        // bf16 on H200, random data, all SMs (evaluation/results/gemm_kernel_h200.txt):
        // sm80 244-285 TFLOP/s; the sm90 kernel 510-770, 1.01x cuBLAS in the same run.
        let gemm_tflops = match kernel {
            GemmKernel::Sm80 => 285.0,
            GemmKernel::Sm90 { .. } => 690.0,
        };
        HardwareModel {
            gemm_tflops,
            ..HardwareModel::h200()
        }
    } else {
        HardwareModel::generic(sms)
    }
}

fn request(args: &GemmArgs, world: u32, opts: &Options, kernel: GemmKernel) -> PlanRequest {
    PlanRequest {
        m: args.m,
        n: args.n,
        k: args.k,
        world,
        elem_bytes: args.dtype.bytes(),
        tile: gemm::tile_shape(kernel),
        reserved_sms: opts.reserved_sms,
        bands_per_group: opts.bands_per_group,
        max_groups: opts.max_groups,
        mode: opts.mode,
        raster_bands: opts.raster_bands,
    }
}

/// The kernel and plan of a call on a device with `sms` SMs of compute
/// capability `major` (no GPU needed): the kernel is the caller's or the
/// device's default for the CTAs the overlap leaves the GEMM.
pub fn plan_for(
    args: &GemmArgs,
    world: u32,
    opts: &Options,
    sms: u32,
    major: i32,
) -> Result<(GemmKernel, GemmAllReducePlan)> {
    let kernel = opts.kernel.unwrap_or_else(|| {
        GemmKernel::default_for(major, args.m, args.n, sms.saturating_sub(opts.reserved_sms))
    });
    let hw = hardware_for(sms, major, kernel);
    let plan = plan::plan_gemm_all_reduce(&request(args, world, opts, kernel), &hw)?;
    Ok((kernel, plan))
}

fn prepare(
    comm: &Communicator,
    args: &GemmArgs,
    opts: &Options,
    caller: RawStream,
) -> Result<Arc<Prepared>> {
    let key = format!(
        "gemm_all_reduce/{}x{}x{}/{:?}/{:?}",
        args.m, args.n, args.k, args.dtype, opts
    );
    if let Some(p) = comm
        .prepared
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
    {
        return p
            .clone()
            .downcast::<Prepared>()
            .map_err(|_| Error::Invalid("internal: prepared state type".into()));
    }
    if stream::is_capturing(caller)? {
        return Err(Error::Invalid(format!(
            "gemm_all_reduce: shape {}x{}x{} ({}) is first called during CUDA graph capture; run it once before \
             capturing so that its plan, tables and kernel are ready",
            args.m,
            args.n,
            args.k,
            args.dtype.name()
        )));
    }
    let (kernel, plan) = plan_for(
        args,
        comm.world as u32,
        opts,
        comm.device.sms,
        comm.device.major,
    )?;
    let groups = plan.partition.len().max(1);
    let prepared = Arc::new(Prepared {
        kernel,
        tile_order: gemm::order_table(&plan.order)?,
        tile_group: DeviceBuffer::from_u32(&plan.tile_group)?,
        counters: DeviceBuffer::zeroed_u32(groups * COUNTER_SLOTS)?,
        next_slot: AtomicUsize::new(0),
        plan,
    });
    comm.prepared
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, prepared.clone());
    Ok(prepared)
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

/// Enqueues the overlapped op and returns `Schedule::Overlap`, or enqueues
/// nothing and returns `Schedule::Sequential` when the plan falls back.
pub fn gemm_all_reduce(
    comm: &Communicator,
    args: &GemmArgs,
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
    let kernel = gemm::load(&comm.device, args.dtype, prepared.kernel)?;
    let nccl = comm.nccl()?;
    let comm_stream = comm.stream.0;
    let elem = args.dtype.bytes() as u64;
    let groups = plan.partition.groups.len();
    let slot = prepared.next_slot.fetch_add(1, Ordering::Relaxed) % COUNTER_SLOTS;
    let counters = prepared.counters.ptr + (slot * groups * 4) as u64;
    let signals = Signals {
        tile_order: prepared.tile_order.as_ref().map_or(0, |b| b.ptr),
        tile_group: prepared.tile_group.ptr,
        counters,
    };

    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    // The comm stream starts after everything the caller enqueued before this
    // op (and, under graph capture, joins the capture here).
    comm.fork.order(caller, comm_stream)?;
    gemm::launch(&kernel, args, &signals, plan.ctas, caller)?;
    for (g, group) in plan.partition.groups.iter().enumerate() {
        let counter = counters + (g * 4) as u64;
        stream::wait_geq(comm_stream, counter, group.tiles)?;
        // Every tile of the group has counted, so the reset races with nothing.
        stream::write(comm_stream, counter, 0)?;
        nccl.all_reduce_in_place(
            args.out + group.slice.offset * elem,
            group.slice.count as usize,
            args.dtype,
            comm.comm(),
            comm_stream.cast(),
        )?;
    }
    comm.join.order(comm_stream, caller)?;
    Ok(Schedule::Overlap)
}
