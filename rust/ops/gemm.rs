//! The signaling GEMM on its own (no communication): launches used by the
//! overlapped ops and exposed for measuring the kernel alone.

use crate::cuda::driver::{self, DeviceInfo};
use crate::cuda::kernels::{self, GemmKernel, Kernel};
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::{self, RawStream};
use crate::cuda::tensor_map;
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::plan::{self, GroupPartition, OutputTiles, TileOrder, TileShape};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

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
    /// A bf16 shape with no operands, for planning tests.
    #[cfg(test)]
    pub(crate) fn shape(m: u32, n: u32, k: u32) -> Self {
        Self {
            x: 0,
            weight: 0,
            out: 0,
            m,
            n,
            k,
            dtype: Dtype::Bf16,
        }
    }

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
    /// A staging buffer of [tiles * BM, BN] that takes the tile of position
    /// p at rows p*BM.. instead of `out` (0: store into `out`).
    pub staging: u64,
    /// Per position, (row of x read, row of `store` written) as i32 pairs,
    /// with `store` a [store_rows, N] buffer in place of `out` (0: none).
    pub row_table: u64,
    pub store: u64,
    pub store_rows: u32,
    /// Positions the row table lists.
    pub tile_count: u32,
    /// The push backend: every tile is also stored at this address (a
    /// peer's staging slot, laid out like the buffer the tile goes to:
    /// `out`, `staging` or `store`), and each group's ready flag in that
    /// peer's buffer (`push_flags` + group * PEER_FLAG_STRIDE words) counts
    /// its tiles once they are there. 0: no push (sm_90 kernel only).
    pub push: u64,
    pub push_flags: u64,
    /// With a row table: rows of the peer's slot (the tiles whose store row
    /// r is negative go to its row -r - 1 and not to `store`); 0 otherwise.
    pub push_rows: u32,
    /// Combined stores (with a row table and a push): the tiles stored
    /// locally first add the peer's partial of their rows from `recv` (this
    /// rank's slot, laid out like `store`), once group g's ready flag
    /// (`ready_flags` + g * PEER_FLAG_STRIDE words) reaches `ready_counts[g]`
    /// (u32 per group). A wait longer than `timeout_ns` (0: none) sets the
    /// word at `timed_out` and goes on. 0: no combining.
    pub recv: u64,
    pub ready_flags: u64,
    pub ready_counts: u64,
    pub timeout_ns: u64,
    pub timed_out: u64,
    /// Gathered sums (combined stores only): each combined tile, once
    /// summed, is also pushed to row `gather_row` + its output row of the
    /// peer's slot (`push`, which then has `push_rows` >= gather_row + the
    /// output's rows), counted in `gather_flags` + group * PEER_FLAG_STRIDE
    /// words there. None: no gather.
    pub gather_row: Option<u32>,
    pub gather_flags: u64,
}

/// Words between two groups' ready flags in a peer buffer, as the sm_90
/// kernel strides its pushed flags (csrc/gemm_signal_sm90.cu).
pub const PEER_FLAG_STRIDE: u64 = 8;
const _: () = assert!(PEER_FLAG_STRIDE as usize == crate::comm::peer::MAX_PEER_WORLD);

impl Signals {
    /// The counter of group `g` (4-byte words from `counters`).
    pub fn counter(&self, g: usize) -> u64 {
        self.counters + (g * 4) as u64
    }
}

/// Counter slots per shape: consecutive calls use different slots, so a call
/// never sees counts left by the call before it, even if the caller
/// enqueues on several streams.
const COUNTER_SLOTS: usize = 4;

/// The group counters of one shape's overlapped op, in COUNTER_SLOTS slots
/// taken in turn by consecutive calls.
pub struct CounterSlots {
    buffer: DeviceBuffer,
    groups: usize,
    next: std::sync::atomic::AtomicUsize,
}

impl CounterSlots {
    pub fn new(groups: usize) -> Result<Self> {
        Ok(Self {
            buffer: DeviceBuffer::zeroed_u32(groups * COUNTER_SLOTS)?,
            groups,
            next: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The first counter of the next call's slot.
    pub fn next(&self) -> u64 {
        let slot = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % COUNTER_SLOTS;
        self.buffer.ptr + (slot * self.groups * 4) as u64
    }
}

/// A GEMM kernel loaded for one device and dtype.
#[derive(Debug, Clone, Copy)]
pub struct LoadedGemm {
    pub which: GemmKernel,
    kernel: Kernel,
}

/// Loads `which` for `dtype`; a kernel the device cannot run is a clear error.
pub fn load(device: &DeviceInfo, dtype: Dtype, which: GemmKernel) -> Result<LoadedGemm> {
    load_spec(device, which, which.spec(dtype))
}

/// [`load`] with combined stores compiled in (`Signals::recv`).
pub fn load_combined(device: &DeviceInfo, dtype: Dtype, which: GemmKernel) -> Result<LoadedGemm> {
    load_spec(device, which, which.spec_combined(dtype))
}

fn load_spec(
    device: &DeviceInfo,
    which: GemmKernel,
    spec: kernels::KernelSpec,
) -> Result<LoadedGemm> {
    if !which.runs_on(&device.arch()) {
        return Err(Error::Invalid(format!(
            "kernel: {} does not run on {} (device {})",
            which.name(),
            device.arch(),
            device.ordinal
        )));
    }
    let kernel = kernels::load(device, &spec)?;
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
    prepare(gemm, args, signals, ctas)?.enqueue(stream)
}

/// The scalar and pointer parameters both kernels take after their operands.
struct Tail {
    c: u64,
    m: i32,
    n: i32,
    k: i32,
    order: u64,
    group: u64,
    counters: u64,
    count: i32,
    staged: i32,
    row_table: u64,
}

// One per launch and short-lived: the maps stay inline rather than boxed.
#[allow(clippy::large_enum_variant)]
enum Operands {
    Sm80 {
        a: u64,
        b: u64,
    },
    Sm90 {
        a: sys::CUtensorMap,
        b: sys::CUtensorMap,
        out: sys::CUtensorMap,
        peer: sys::CUtensorMap,
        push_flags: u64,
        recv: sys::CUtensorMap,
        ready_flags: u64,
        ready_counts: u64,
        timeout_ns: u64,
        timed_out: u64,
        gather_row: i32,
        gather_flags: u64,
    },
}

/// A GEMM launch with every parameter made and checked (tensor maps
/// encoded), so that what can fail has failed before anything is enqueued:
/// the push backend prepares it before its cross-GPU handshake.
pub struct Prepared<'a> {
    gemm: &'a LoadedGemm,
    grid: u32,
    tail: Tail,
    operands: Operands,
}

impl Prepared<'_> {
    /// Enqueues the launch on `stream`.
    pub fn enqueue(mut self, stream: RawStream) -> Result<()> {
        let t = &mut self.tail;
        let tail: [*mut c_void; 10] = [
            (&mut t.c as *mut u64).cast(),
            (&mut t.m as *mut i32).cast(),
            (&mut t.n as *mut i32).cast(),
            (&mut t.k as *mut i32).cast(),
            (&mut t.order as *mut u64).cast(),
            (&mut t.group as *mut u64).cast(),
            (&mut t.counters as *mut u64).cast(),
            (&mut t.count as *mut i32).cast(),
            (&mut t.staged as *mut i32).cast(),
            (&mut t.row_table as *mut u64).cast(),
        ];
        let mut params: Vec<*mut c_void> = match &mut self.operands {
            Operands::Sm80 { a, b } => {
                let mut p = vec![(a as *mut u64).cast(), (b as *mut u64).cast()];
                p.extend(tail);
                p
            }
            Operands::Sm90 {
                a,
                b,
                out,
                peer,
                push_flags,
                recv,
                ready_flags,
                ready_counts,
                timeout_ns,
                timed_out,
                gather_row,
                gather_flags,
            } => {
                // The sm_90 kernel takes the store map in place of C's pointer.
                let mut p: Vec<*mut c_void> = vec![
                    (a as *mut sys::CUtensorMap).cast(),
                    (b as *mut sys::CUtensorMap).cast(),
                    (out as *mut sys::CUtensorMap).cast(),
                ];
                p.extend(&tail[1..]);
                p.push((peer as *mut sys::CUtensorMap).cast());
                p.push((push_flags as *mut u64).cast());
                p.push((recv as *mut sys::CUtensorMap).cast());
                p.push((ready_flags as *mut u64).cast());
                p.push((ready_counts as *mut u64).cast());
                p.push((timeout_ns as *mut u64).cast());
                p.push((timed_out as *mut u64).cast());
                p.push((gather_row as *mut i32).cast());
                p.push((gather_flags as *mut u64).cast());
                p
            }
        };
        let gemm = self.gemm;
        gemm.kernel
            .launch(self.grid, gemm.which.threads(), stream, &mut params)
    }
}

/// Makes and checks every parameter of a launch with `ctas` CTAs (at most
/// one per position), enqueueing nothing.
pub fn prepare<'a>(
    gemm: &'a LoadedGemm,
    args: &GemmArgs,
    signals: &Signals,
    ctas: u32,
) -> Result<Prepared<'a>> {
    let mut c = args.out;
    // Positions the kernel walks: the row table's grid where there is one,
    // else the output's tiles.
    let tiles = if signals.row_table != 0 {
        c = signals.store;
        signals.tile_count
    } else {
        if signals.staging != 0 {
            c = signals.staging;
        }
        args.tiles(gemm.which)
    };
    let combined = signals.recv != 0;
    if (signals.push != 0) != (signals.push_flags != 0)
        || (signals.push != 0 && signals.counters == 0 && !combined)
        || (signals.push != 0 && signals.row_table != 0 && signals.push_rows == 0)
    {
        return Err(Error::Invalid(
            "internal: a pushed launch needs its slot, its flags and the group counters".into(),
        ));
    }
    if combined
        && (signals.push == 0
            || signals.row_table == 0
            || signals.ready_flags == 0
            || signals.ready_counts == 0
            || signals.timed_out == 0)
    {
        return Err(Error::Invalid(
            "internal: combined stores need a push, a row table, the ready flags and their counts"
                .into(),
        ));
    }
    let gather_row = match signals.gather_row {
        None => -1,
        Some(row)
            if combined
                && signals.gather_flags != 0
                && u64::from(row) + u64::from(signals.store_rows)
                    <= u64::from(signals.push_rows)
                && row <= i32::MAX as u32 =>
        {
            row as i32
        }
        Some(_) => {
            return Err(Error::Invalid(
                "internal: gathered sums need combined stores, their flags and a slot with room for them"
                    .into(),
            ))
        }
    };
    let tail = Tail {
        c,
        m: args.m as i32,
        n: args.n as i32,
        k: args.k as i32,
        order: signals.tile_order,
        group: signals.tile_group,
        counters: signals.counters,
        count: tiles as i32,
        staged: i32::from(signals.staging != 0),
        row_table: signals.row_table,
    };
    let operands = match gemm.which {
        GemmKernel::Sm80 if signals.push != 0 => return Err(Error::Invalid(
            "backend: 'push' stores from the sm_90 GEMM's epilogue; this call runs the sm80 kernel"
                .into(),
        )),
        GemmKernel::Sm80 => Operands::Sm80 {
            a: args.x,
            b: args.weight,
        },
        GemmKernel::Sm90 { bn } => {
            let (bm, _, bk) = gemm.which.tile();
            // The epilogue stores 128 x 64 boxes (one 128-byte swizzle row
            // each), into `base` laid out as the call's store buffer.
            let store_map = |base: u64| {
                if signals.staging != 0 {
                    tensor_map::row_major_2d(base, tiles * bm, bn, bm, 64, args.dtype)
                } else if signals.row_table != 0 {
                    tensor_map::row_major_2d(base, signals.store_rows, args.n, bm, 64, args.dtype)
                } else {
                    tensor_map::row_major_2d(base, args.m, args.n, bm, 64, args.dtype)
                }
            };
            Operands::Sm90 {
                a: tensor_map::row_major_2d(args.x, args.m, args.k, bm, bk, args.dtype)?,
                b: tensor_map::row_major_2d(args.weight, args.n, args.k, bn, bk, args.dtype)?,
                out: store_map(c)?,
                // Without a push the kernel never reads the peer map: any valid one does.
                peer: match (signals.push, signals.row_table) {
                    (0, _) => store_map(c)?,
                    (push, 0) => store_map(push)?,
                    (push, _) => tensor_map::row_major_2d(
                        push,
                        signals.push_rows,
                        args.n,
                        bm,
                        64,
                        args.dtype,
                    )?,
                },
                push_flags: signals.push_flags,
                // Read only when combining; any valid map otherwise.
                recv: store_map(if combined { signals.recv } else { c })?,
                ready_flags: signals.ready_flags,
                ready_counts: signals.ready_counts,
                timeout_ns: signals.timeout_ns,
                timed_out: signals.timed_out,
                gather_row,
                gather_flags: signals.gather_flags,
            }
        }
    };
    Ok(Prepared {
        gemm,
        grid: ctas.min(tiles).max(1),
        tail,
        operands,
    })
}

/// The kernel's row table: (row of x read, row written) per position, as
/// the interleaved pairs it reads.
pub fn row_table(load_rows: &[u32], store_rows: &[u32]) -> Vec<u32> {
    load_rows
        .iter()
        .zip(store_rows)
        .flat_map(|(&l, &s)| [l, s])
        .collect()
}

/// The per-shape state an overlapped op keeps on `comm`, keyed by the op's
/// name, shape and options, made by `make` on first use (refused under
/// CUDA graph capture, naming the call).
pub fn prepared<T: std::any::Any + Send + Sync>(
    comm: &crate::comm::communicator::Communicator,
    op: &str,
    args: &GemmArgs,
    opts: &impl std::fmt::Debug,
    caller: RawStream,
    make: impl FnOnce() -> Result<T>,
) -> Result<Arc<T>> {
    let key = format!(
        "{op}/{}x{}x{}/{:?}/{opts:?}",
        args.m, args.n, args.k, args.dtype
    );
    let what = || {
        format!(
            "{op}: shape {}x{}x{} ({})",
            args.m,
            args.n,
            args.k,
            args.dtype.name()
        )
    };
    comm.prepared(key, caller, what, make)
}

/// How the GEMM alone runs; every field None is the default launch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Launch {
    pub kernel: Option<GemmKernel>,
    /// Row bands per raster block (1: row-band order); None: plan's default.
    pub raster_bands: Option<u32>,
    /// CTAs (one per SM); None: every SM of the device.
    pub sms: Option<u32>,
    /// Signal a counter per group of this many row bands, as the overlapped
    /// ops do (nobody waits): measures what the signaling epilogue costs.
    pub signal_bands: Option<u32>,
    /// Store staged (see [`Signals::staging`]) into this buffer instead of
    /// `out`; [`unreorder`] then moves the tiles into `out`. 0: into `out`.
    pub staging: u64,
}

/// The device copy of a tile order the kernel reads; None for the identity,
/// which the kernel walks without a table.
pub fn order_table(order: &TileOrder) -> Result<Option<DeviceBuffer>> {
    (!order.is_identity())
        .then(|| DeviceBuffer::from_u32(&order.positions))
        .transpose()
}

/// Device tables of one (device, shape, launch): order, group per position, counters.
struct Tables {
    order: Option<DeviceBuffer>,
    group: Option<DeviceBuffer>,
    counters: Option<DeviceBuffer>,
}

type TableKey = (i32, u32, u32, u32, u32, Option<u32>);
static TABLES: Mutex<Option<HashMap<TableKey, Arc<Tables>>>> = Mutex::new(None);

fn tables(
    device: &DeviceInfo,
    tiles: &OutputTiles,
    raster: u32,
    signal: Option<u32>,
    stream: RawStream,
) -> Result<Arc<Tables>> {
    let key = (
        device.ordinal,
        tiles.tiles_m,
        tiles.tiles_n,
        tiles.tile.bn,
        raster,
        signal,
    );
    let mut guard = TABLES.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    if let Some(t) = map.get(&key) {
        return Ok(t.clone());
    }
    if stream::is_capturing(stream)? {
        return Err(Error::Invalid(format!(
            "gemm: a {}x{} output with raster_bands={raster} is first launched during CUDA graph capture; run it \
             once before capturing so that its tile tables exist",
            tiles.m, tiles.n
        )));
    }
    let partition = match signal {
        Some(bands) => GroupPartition::uniform(tiles, bands)?,
        None => GroupPartition::whole(tiles),
    };
    let order = TileOrder::rastered(tiles, &partition.band_counts(), raster)?;
    let t = Arc::new(Tables {
        order: order_table(&order)?,
        group: signal
            .map(|_| DeviceBuffer::from_u32(&order.by_position(&partition.tile_group_table(tiles))))
            .transpose()?,
        counters: signal
            .map(|_| DeviceBuffer::zeroed_u32(partition.len()))
            .transpose()?,
    });
    map.insert(key, t.clone());
    Ok(t)
}

/// What a launch of the GEMM alone resolves to.
struct Resolved {
    kernel: LoadedGemm,
    tiles: OutputTiles,
    sms: u32,
    signals: Signals,
}

fn resolve(args: &GemmArgs, ordinal: i32, how: &Launch, stream: RawStream) -> Result<Resolved> {
    args.validate()?;
    let device = driver::bind(ordinal)?;
    let sms = how.sms.unwrap_or(device.sms);
    if sms == 0 || sms > device.sms {
        return Err(Error::Invalid(format!(
            "sms: must be in 1..={} (the device's SMs), got {sms}",
            device.sms
        )));
    }
    if how.staging % 16 != 0 {
        return Err(Error::Invalid(format!(
            "staging: must be 16-byte aligned, got {:#x}",
            how.staging
        )));
    }
    // No kernel named: on Hopper the tile width that keeps the SMs busy.
    let which = how
        .kernel
        .unwrap_or_else(|| match GemmKernel::default_for(device.major) {
            GemmKernel::Sm90 { .. } => GemmKernel::Sm90 {
                bn: plan::hopper_tile_n(args.m, args.n, sms),
            },
            other => other,
        });
    let kernel = load(&device, args.dtype, which)?;
    let tiles = OutputTiles::new(args.m, args.n, tile_shape(kernel.which))?;
    let raster = how
        .raster_bands
        .unwrap_or_else(|| plan::default_raster_bands(&tiles, sms));
    if raster == 0 || how.signal_bands == Some(0) {
        return Err(Error::Invalid(
            "raster_bands and signal_bands must be >= 1".into(),
        ));
    }
    let t = tables(&device, &tiles, raster, how.signal_bands, stream)?;
    let ptr = |b: &Option<DeviceBuffer>| b.as_ref().map_or(0, |b| b.ptr);
    let signals = Signals {
        tile_order: ptr(&t.order),
        tile_group: ptr(&t.group),
        counters: ptr(&t.counters),
        staging: how.staging,
        ..Signals::default()
    };
    Ok(Resolved {
        kernel,
        tiles,
        sms,
        signals,
    })
}

/// The GEMM alone on `ordinal`, on the caller's stream.
pub fn gemm(args: &GemmArgs, ordinal: i32, how: &Launch, stream: RawStream) -> Result<()> {
    let r = resolve(args, ordinal, how, stream)?;
    launch(&r.kernel, args, &r.signals, r.sms, stream)
}

/// Moves every tile a staged launch of `how` stored in `how.staging` into
/// `args.out`, with `ctas` CTAs (what the staged schedule adds per call).
pub fn unreorder(
    args: &GemmArgs,
    ordinal: i32,
    how: &Launch,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    let r = resolve(args, ordinal, how, stream)?;
    if how.staging == 0 || ctas == 0 {
        return Err(Error::Invalid(
            "unreorder: needs a staging buffer and ctas >= 1".into(),
        ));
    }
    let device = driver::bind(ordinal)?;
    let t = r.tiles.tile;
    let kernel = kernels::load(&device, &kernels::unreorder_spec(t.bm, t.bn))?;
    launch_unreorder(
        &kernel,
        args,
        &r.signals,
        &r.tiles,
        0..r.tiles.count(),
        ctas,
        stream,
    )
}

/// Enqueues the copy of the staged tiles at `positions` into `args.out`
/// on at most `ctas` CTAs.
pub fn launch_unreorder(
    kernel: &Kernel,
    args: &GemmArgs,
    signals: &Signals,
    tiles: &OutputTiles,
    positions: std::ops::Range<u32>,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    let t = tiles.tile;
    let count = u64::from(positions.end - positions.start);
    let vectors = count * u64::from(t.bm) * u64::from(t.bn) / 8;
    let blocks = vectors
        .div_ceil(u64::from(kernels::UNREORDER_THREADS))
        .max(1);
    let grid = u64::from(ctas.max(1)).min(blocks) as u32;
    let (mut out, mut staging, mut order) = (args.out, signals.staging, signals.tile_order);
    let (mut m, mut n) = (args.m as i32, args.n as i32);
    let (mut first, mut last) = (positions.start as i32, positions.end as i32);
    let mut params: [*mut c_void; 7] = [
        (&mut out as *mut u64).cast(),
        (&mut staging as *mut u64).cast(),
        (&mut order as *mut u64).cast(),
        (&mut m as *mut i32).cast(),
        (&mut n as *mut i32).cast(),
        (&mut first as *mut i32).cast(),
        (&mut last as *mut i32).cast(),
    ];
    kernel.launch(grid, kernels::UNREORDER_THREADS, stream, &mut params)
}
