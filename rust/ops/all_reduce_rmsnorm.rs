//! AllReduce + residual add + RMSNorm over peer memory (csrc/allreduce_rmsnorm.cu):
//! each rank pushes the other owners' slices of its partial into their
//! buffers, reduces and normalizes its own slice, and pushes the normalized
//! rows back, on a few CTAs, with no NCCL and no multicast.
//!
//! Rank R's buffer (mapped into every rank of the node), push mode:
//!   [0, 64 KiB)              header: epoch, count of a launch's CTAs,
//!                            error, ready[part][source], done[part][source] (u32;
//!                            FLAG_SLOTS parts: CTAs x stages), then the
//!                            copy-engine mode's flags (ops::norm_copy_engines)
//!   slot area                world slots of ceil(tokens / world) rows: what
//!                            each source pushed of R's slice
//!   out area                 [tokens, hidden]: rows other owners normalized
//!   residual area            [tokens, hidden]: their residual rows (full mode)
//!   watch area (2 ranks)     [tokens, hidden]: the peer's x, landed by its
//!                            copy engine, the sentinel elsewhere and between
//!                            calls (ops::norm_copy_engines::enqueue_watch)
//!   store halves (2 ranks)   two of up to STORE_HALF_MAX bytes: the peer's x
//!                            of a one-shot call by peer stores, alternating
//!                            by the call's epoch ([`runs_store_entry`])
//!   watch halves (2 ranks)   two as large as a store half: the watch area of
//!                            a watched call outside graph capture that fits
//!                            one, alternating by its watch epoch
//!                            (ops::norm_copy_engines::enqueue_watch)
//! The areas are each a third of the buffer (2 ranks: a quarter of what the
//! halves leave) whatever the call's size:
//! a push writes into the peers' slot areas before it waits for anything,
//! and must not land on rows a peer still gathers from its out or residual
//! area for the previous call (of another size). One-shot calls copy R's
//! own x into the slot area or the out area, alternating by the call's
//! epoch, for the peers to load: a half is written again two calls later,
//! once the peers' kernels that read it have ended. One-shot calls by peer
//! stores write into the peer's store half before they wait for anything:
//! no other mode writes the halves, and the peer read that half last two
//! calls before (every call waits for some word of the peer's of that
//! call, so the peer's kernel of the call in between had begun).
//! The header starts zeroed and is never reset: flags carry epochs.
//!
//! Pull mode (gemm_all_reduce_rmsnorm with `backend="peer"`): the GEMM stores
//! its partial straight into an x area of its own buffer, no slots; one call
//! per wave group covers that group's rows, every owner reading its slice of
//! them from each peer's x area (a sharded call: the normalized rows go to
//! the out area, as in push mode):
//!   [0, 64 KiB) header | out area [rows, hidden] | residual area | x area

use std::ffi::c_void;

use crate::cuda::kernels::{self, Kernel, KernelSpec, NormConfig, NormEntry, NORM_RING_BYTES};
use crate::cuda::stream::RawStream;
use crate::dtype::Dtype;
use crate::error::{Error, Result};

pub const HEADER_BYTES: u64 = 64 * 1024;
/// Header word where a timed-out wait records itself (non-zero).
pub const ERROR_WORD: u64 = 2;
pub const MAX_WORLD: usize = 8;
pub const MAX_CTAS: u32 = 256;
/// Flag slots of each kind in the header (the kernel's FLAG_SLOTS): one per
/// (stage, CTA) of a call. The header's last 128 words are the copy-engine
/// mode's ([`CE_ARRIVED_WORD`]).
pub const FLAG_SLOTS: u32 = 1015;
pub const MAX_HIDDEN: u32 = 16384;

/// Where the areas of one call lie in every rank's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub slot_bytes: u64,
    pub out_offset: u64,
    pub res_offset: u64,
    /// Pull mode: where each rank's partial lies; 0 in push mode.
    pub x_offset: u64,
    /// Push mode on 2 ranks: the watch area ([`watch_offset`]); else 0.
    pub watch_offset: u64,
    /// Push mode on 2 ranks: the store halves of one-shot by peer stores
    /// ([`runs_store_entry`]), two of `store_half` bytes from here; else 0.
    pub store_offset: u64,
    pub store_half: u64,
    /// Push mode on 2 ranks: the two watch halves, `store_half` bytes each,
    /// from here; else 0.
    pub watch_halves: u64,
    /// Bytes a buffer needs for this call.
    pub bytes: u64,
}

impl Layout {
    /// Push mode: a call of `tokens` rows in buffers of `capacity` bytes
    /// (`bytes` is what the call needs: a smaller capacity only sizes the
    /// areas, for [`Layout::needed`]). `oneshot`: a slot of every row (what
    /// each half of a one-shot call holds; the kernel places the halves at
    /// the slot and out areas, so the row count only sizes them).
    pub fn new(
        world: usize,
        tokens: u64,
        hidden: u32,
        dtype: Dtype,
        capacity: u64,
        oneshot: bool,
    ) -> Result<Self> {
        check_world(world)?;
        let row = u64::from(hidden) * u64::from(dtype.bytes());
        let slot_bytes = if oneshot {
            tokens * row
        } else {
            tokens.div_ceil(world as u64) * row
        };
        let slots = if oneshot { world - 1 } else { world } as u64;
        // Each area holds the largest of the three (whole 16-byte vectors).
        let need = (slots * slot_bytes).max(tokens * row);
        let area = area_bytes(world, capacity).max(need);
        let watch = watched(world);
        let store_half = store_half(world, area);
        Ok(Self {
            slot_bytes,
            out_offset: HEADER_BYTES + area,
            res_offset: HEADER_BYTES + 2 * area,
            x_offset: 0,
            watch_offset: if watch { HEADER_BYTES + 3 * area } else { 0 },
            store_offset: if watch { HEADER_BYTES + 4 * area } else { 0 },
            store_half,
            watch_halves: if watch {
                HEADER_BYTES + 4 * area + 2 * store_half
            } else {
                0
            },
            bytes: HEADER_BYTES
                + if watch {
                    4 * area + HALVES * store_half
                } else {
                    2 * area + need
                },
        })
    }

    /// Bytes a push-mode buffer needs for calls of up to `tokens` rows,
    /// one-shot (2 ranks: [`Call::oneshot`]) or not.
    pub fn needed(world: usize, tokens: u64, hidden: u32, dtype: Dtype) -> Result<u64> {
        let two = Self::new(world, tokens, hidden, dtype, 0, false)?;
        // Whether a one-shot config could run one-shot here at all.
        let config = NormConfig {
            oneshot: true,
            ..NormConfig::PLAIN
        };
        let oneshot = runs_oneshot(config, world, true, false);
        let one = Self::new(world, tokens, hidden, dtype, 0, oneshot)?;
        let area = (two.out_offset - HEADER_BYTES).max(one.out_offset - HEADER_BYTES);
        Ok(HEADER_BYTES + areas(world) * area + HALVES * store_half(world, area))
    }

    /// Pull mode: calls over row ranges of an output of `rows` rows.
    pub fn pull(world: usize, rows: u64, hidden: u32, dtype: Dtype) -> Result<Self> {
        check_world(world)?;
        let area = rows * u64::from(hidden) * u64::from(dtype.bytes());
        Ok(Self {
            slot_bytes: 0,
            out_offset: HEADER_BYTES,
            res_offset: HEADER_BYTES + area,
            x_offset: HEADER_BYTES + 2 * area,
            watch_offset: 0,
            store_offset: 0,
            store_half: 0,
            watch_halves: 0,
            bytes: HEADER_BYTES + 3 * area,
        })
    }
}

/// Whether push-mode buffers of `world` ranks have a watch area (2 ranks),
/// which only the copy engines' watched one-shot calls write (its rows hold
/// the sentinel between calls: a row of another mode's there would pass
/// for landed).
fn watched(world: usize) -> bool {
    world == 2
}

/// Areas of a push-mode buffer: slots, out, residual, and the watch area
/// where [`watched`].
fn areas(world: usize) -> u64 {
    3 + u64::from(watched(world))
}

/// Bytes of each area of a push-mode buffer of `capacity` bytes (whole
/// 16-byte vectors), whatever the call's size: on 2 ranks the four areas
/// and [`HALVES`] halves of [`store_half`] bytes each fill it.
fn area_bytes(world: usize, capacity: u64) -> u64 {
    let avail = capacity.saturating_sub(HEADER_BYTES);
    let area = if !watched(world) {
        avail / areas(world)
    } else if avail <= (areas(world) + HALVES) * STORE_HALF_MAX {
        avail / (areas(world) + HALVES)
    } else {
        (avail - HALVES * STORE_HALF_MAX) / areas(world)
    };
    area / 16 * 16
}

/// Halves after the areas of a 2-rank push-mode buffer: two store halves,
/// two watch halves.
const HALVES: u64 = 4;

/// Each store (and watch) half of a push-mode buffer whose areas are `area`
/// bytes (2 ranks; else none): as large as an area up to [`STORE_HALF_MAX`],
/// which holds the most rows a one-shot call has at the widest rows.
fn store_half(world: usize, area: u64) -> u64 {
    if watched(world) {
        area.min(STORE_HALF_MAX)
    } else {
        0
    }
}
pub const STORE_HALF_MAX: u64 = ONESHOT_MAX_TOKENS * MAX_HIDDEN as u64 * 2;

/// Where the watch area of a push-mode buffer of `capacity` bytes on
/// `world` ranks starts (it runs to the end), or None (not [`watched`]):
/// the bytes to fill with the sentinel before the buffer is shared.
pub fn watch_offset(world: usize, capacity: u64) -> Option<u64> {
    watched(world).then(|| HEADER_BYTES + 3 * area_bytes(world, capacity))
}
/// The byte every watch-area byte holds between calls (the kernel's
/// WATCH_SENTINEL: 0xffff, a NaN in bf16 and fp16, in each 16-bit value).
pub const WATCH_SENTINEL_BYTE: u8 = 0xff;

fn check_world(world: usize) -> Result<()> {
    if (1..=MAX_WORLD).contains(&world) {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "group: the peer-memory AllReduce + RMSNorm serves 1 to {MAX_WORLD} ranks of one node, got {world}"
        )))
    }
}

/// A pull-mode call: rows [first, first + tokens) of an output of `rows`
/// rows whose partials the GEMM stored in each rank's x area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pull {
    pub first: u64,
    pub rows: u64,
}

/// Parts each CTA cuts its chunk of a slice into, whose push, reduce and
/// gather steps the kernel pipelines: at most `config.stages`, at least a
/// row per warp in each part (fewer leave warps idle for a step's whole
/// barrier), and CTAs x stages within the header's flag slots. The same on
/// every rank, as the kernel needs: a function of the call's shape alone.
/// `oneshot`: the call runs one-shot ([`runs_oneshot`]), its slice every row.
/// The default config pipelines only where it paid on 2x H200
/// (bench_all_reduce_rmsnorm, hidden 8192): a push-mode call on at least
/// [`DEFAULT_MIN_CTAS`] CTAs cut into at least [`DEFAULT_MIN_PARTS`] parts.
/// On 32 CTAs 8 parts took 0.91-0.94x the one-part time at 8K-16K tokens
/// and 4 parts 0.97-1.03x at 4K, 2 parts 1.03-1.06x at 2K; on 64 CTAs 4
/// parts 0.93x at 8K; on 8 and 16 CTAs, whose pushes do not fill NVLink,
/// 8 parts 1.11x and 1.04x at 8K. Pull-mode calls (gemm_all_reduce_rmsnorm's
/// groups, pipelined with the GEMM already) ran slower in parts (1.144x
/// over the baseline against 1.183x in one) and keep one.
pub fn stages(
    tokens: u64,
    world: usize,
    ctas: u32,
    config: NormConfig,
    oneshot: bool,
    pull: bool,
) -> u32 {
    let slices = if oneshot { 1 } else { world as u64 };
    let chunk_rows = tokens.div_ceil(slices).div_ceil(u64::from(ctas.max(1)));
    let warps = u64::from(config.threads / 32);
    let by_rows = (chunk_rows / warps).clamp(1, u64::from(config.stages));
    let parts = (by_rows as u32).min(FLAG_SLOTS / ctas.max(1)).max(1);
    if config.is_default() && (pull || parts < DEFAULT_MIN_PARTS || ctas < DEFAULT_MIN_CTAS) {
        return 1;
    }
    parts
}

/// The fewest parts, and CTAs, the default config pipelines a call with
/// (see [`stages`]).
pub const DEFAULT_MIN_PARTS: u32 = 4;
pub const DEFAULT_MIN_CTAS: u32 = 32;

/// The config a call of `world` ranks and `hidden` columns runs with on a
/// device of compute capability `major`: the ring's only on Hopper or later
/// (bulk copies) where two slots fit in its shared memory, and for the
/// default only where `default_ring` ([`default_takes_ring`]); else the
/// same shape on plain loads and stores.
pub fn effective(
    config: NormConfig,
    world: usize,
    hidden: u32,
    dtype: Dtype,
    major: i32,
    default_ring: bool,
) -> NormConfig {
    let row = u64::from(hidden) * u64::from(dtype.bytes());
    let fits = 2 * (world as u64 + 1) * row <= u64::from(NORM_RING_BYTES);
    NormConfig {
        ring: config.ring && major >= 9 && fits && (default_ring || !config.is_default()),
        ..config
    }
}

/// Whether the default config takes the ring for a call of `tokens` rows on
/// `ctas` CTAs: push mode (the standalone calls; gemm_all_reduce_rmsnorm's
/// pull calls keep what their bars were measured with) where each CTA's
/// chunk of a slice has at least [`RING_MIN_ROWS`] rows. On 2x H200 (hidden
/// 8192, 32 CTAs) the ring took 0.94x the plain kernel's time at 1K tokens
/// (16 rows a chunk) and 0.86x at 8K-16K, but 1.02x at 512 and 1.08x at 128.
pub fn default_takes_ring(tokens: u64, world: usize, ctas: u32, pull: bool) -> bool {
    !pull && tokens.div_ceil(world.max(1) as u64) >= RING_MIN_ROWS * u64::from(ctas.max(1))
}
pub const RING_MIN_ROWS: u64 = 16;

/// Whether a call runs one-shot: asked for by its config, and a push of two
/// ranks keeping the full residual (elsewhere one-shot would move more bytes,
/// or has no rows to skip).
pub fn runs_oneshot(config: NormConfig, world: usize, residual_full: bool, pull: bool) -> bool {
    config.oneshot && world == 2 && residual_full && !pull
}

/// The config a call of `tokens` rows on `ctas` CTAs runs with when asked
/// for `config`: the default one-shot ([`NormConfig::ONESHOT`]) where it
/// applies ([`runs_oneshot`]) on at most [`ONESHOT_MAX_TOKENS`] rows and
/// [`ONESHOT_MAX_ROWS_PER_CTA`] rows a CTA, else `config`. One-shot needs
/// one flag exchange instead of two and no peer stores, but every rank sums
/// and normalizes every row. On 2x H200 (hidden 8192, against the two-shot
/// default, evaluation/results/norm_oneshot_pull_h200x2.txt) it took 0.90x
/// the time at 128 tokens on 32 CTAs, 0.92x on 16, 0.93x at 256 on 32 and
/// 0.96x on 16, 1.00x at 512 on 32; with more rows a CTA it lost (1.04x at
/// 256 tokens on 8 CTAs, 1.10x at 512 on 8).
pub fn resolved(
    config: NormConfig,
    tokens: u64,
    world: usize,
    ctas: u32,
    residual_full: bool,
    pull: bool,
) -> NormConfig {
    let oneshot = NormConfig::ONESHOT;
    if config.is_default()
        && tokens <= ONESHOT_MAX_TOKENS
        && tokens <= ONESHOT_MAX_ROWS_PER_CTA * u64::from(ctas)
        && runs_oneshot(oneshot, world, residual_full, pull)
    {
        oneshot
    } else {
        config
    }
}
pub const ONESHOT_MAX_TOKENS: u64 = 512;
pub const ONESHOT_MAX_ROWS_PER_CTA: u64 = 16;

/// Whether a call launches fo_arn_oneshot, the plain build's one-shot by
/// peer loads with every other mode's code left out (47 KB of machine code
/// against fo_allreduce_rmsnorm's 194 KB, hidden 8192 bf16): every one-shot
/// call of that build. A short call runs each instruction about once, so
/// fetching the code is part of its latency.
pub fn runs_oneshot_entry(call: &Call) -> bool {
    !call.config.ring && call.oneshot()
}

/// Whether a one-shot call of fo_arn_oneshot's ([`runs_oneshot_entry`])
/// moves x by peer stores (fo_arn_oneshot_st): each rank stores its rows
/// into the peer's store half (a pair of halves that no other mode writes,
/// [`Layout::store_offset`]) and every load of the reduce is local, instead
/// of copying x into its own buffer for the peer to load. On 2x H200
/// (hidden 8192, 32 CTAs, evaluation/results/norm_oneshot_stores_h200x2.txt)
/// stores took 0.96x the time at 128 tokens (21.2-21.4 us against
/// 22.1-22.3), tied at 256 and were slower at 384 (1.05x) and 512 (1.08x):
/// the pushes cross NVLink before the reduce starts, with nothing beside them.
pub fn runs_store_entry(call: &Call) -> bool {
    runs_oneshot_entry(call) && call.tokens <= STORE_MAX_TOKENS
}
pub const STORE_MAX_TOKENS: u64 = 256;

/// The kernel a flag-mode call (not the copy engines': their
/// ops::norm_copy_engines::kernel_spec) on `ctas` CTAs launches, built for
/// its config (and its hidden size: [`runs_hidden_entry`], unless
/// kernels::hidden_kernels says not to).
pub fn kernel_spec(dtype: Dtype, call: &Call, ctas: u32) -> KernelSpec {
    let hidden = runs_hidden_entry(call, ctas) && kernels::hidden_kernels();
    let entry = match (runs_store_entry(call), runs_oneshot_entry(call), hidden) {
        (true, _, false) => NormEntry::OneshotStore,
        (true, _, true) => NormEntry::OneshotStoreHidden,
        (false, true, false) => NormEntry::Oneshot,
        (false, true, true) => NormEntry::OneshotHidden,
        (false, false, _) => return kernels::allreduce_rmsnorm_spec(dtype, call.config),
    };
    let spec = kernels::allreduce_rmsnorm_entry_spec(dtype, call.config, entry);
    if hidden {
        kernels::for_hidden(spec, call.hidden)
    } else {
        spec
    }
}

/// Whether a call of fo_arn_oneshot[_st] ([`runs_oneshot_entry`]) on `ctas`
/// CTAs launches its entry compiled for the call's hidden size
/// (fo_arn_oneshot[_st]_h, FO_HIDDEN): each row on the fewest warps that
/// hold it, every offset and bound a constant. Taken where the kernel's
/// row_group gives every part of a CTA that size anyway (at least 3 rows a
/// part at hidden 8192 on 512 threads), so each row is computed by the same
/// threads in the same order as on the general path, bit for bit. On 2x
/// H200 (hidden 8192) a 128-token call took 0.95x the general entry's time
/// on 32 CTAs (20.2 us against 21.2-21.4), 0.93x on 16 and 8, and 256
/// tokens 0.95x on 32.
pub fn runs_hidden_entry(call: &Call, ctas: u32) -> bool {
    if !runs_oneshot_entry(call) || ctas == 0 {
        return false;
    }
    let world = call.bases.len();
    let parts =
        u64::from(ctas) * u64::from(stages(call.tokens, world, ctas, call.config, true, false));
    let vecs = u64::from(call.hidden / 8);
    let threads = call.config.threads;
    let fewest = fewest_warps(vecs, threads);
    // Parts differ by one row at most: the shortest decides.
    let rows = call.tokens / parts;
    rows > 0 && fewest <= u64::from(threads / 32) && row_group_warps(rows, vecs, threads) == fewest
}

/// The kernel's REG_VECS: 16-byte vectors of a row one thread holds at most.
fn reg_vecs(threads: u32) -> u64 {
    2048 / u64::from(threads.min(256))
}

/// The fewest warps (a power of two) whose threads hold a row of `vecs`
/// vectors on blocks of `threads`.
fn warps_holding(vecs: u64, threads: u32) -> u64 {
    let mut size = 1;
    while size * 32 * reg_vecs(threads) < vecs {
        size *= 2;
    }
    size
}

/// Row groups of `size` warps grown until there are at most 15 of them where
/// a group has more than one warp (each takes a named barrier, 1..15).
fn within_barriers(mut size: u64, threads: u32) -> u64 {
    let warps = u64::from(threads / 32);
    while size > 1 && warps / size > 15 {
        size *= 2;
    }
    size
}

/// The kernel's fewest_warps: the warps of the smallest row group that holds
/// a row of `vecs` vectors on blocks of `threads`.
fn fewest_warps(vecs: u64, threads: u32) -> u64 {
    within_barriers(warps_holding(vecs, threads), threads)
}

/// The warps the kernel's row_group gives each row of a part of `rows` rows
/// of `vecs` vectors on blocks of `threads`: the fewest that hold one, more
/// (a power of two) while the part has too few rows to occupy every warp.
fn row_group_warps(rows: u64, vecs: u64, threads: u32) -> u64 {
    let warps = u64::from(threads / 32);
    let mut size = warps_holding(vecs, threads);
    let mut c = 2 * size;
    while c <= warps && rows * c <= warps {
        if warps / c <= 15 {
            size = c;
        }
        c *= 2;
    }
    within_barriers(size, threads)
}

/// The config a call that the copy engines serve (ops::norm_copy_engines)
/// runs with when asked for `config`: one-shot where `config` (or the
/// default) asks for it and the call allows it ([`runs_oneshot`]); else
/// two-shot. One-shot sends all of x to the peer and each rank sums and
/// normalizes every row: the same bytes cross NVLink, but one copy-engine
/// latency is in the chain instead of two and nothing comes back. On 2x
/// H200 (hidden 8192, 32 CTAs, evaluation/results/norm_ce_one_launch_h200x2.txt),
/// in one launch that waits for flagged ranges itself, it took 0.87x the
/// two-shot time at 4K tokens and 0.93x at 8K and 16K; watching one copy
/// (norm_ce_watch_h200x2.txt) 0.74-0.87x that at 2K-16K.
pub fn resolved_copy_engines(config: NormConfig, world: usize, residual_full: bool) -> NormConfig {
    let oneshot = NormConfig {
        oneshot: true,
        ..config
    };
    let asked = config.oneshot || config.is_default();
    NormConfig {
        oneshot: asked && runs_oneshot(oneshot, world, residual_full, false),
        ..config
    }
}

/// Rows [start, end) of `tokens` that `rank` owns (the kernel's split).
pub fn slice(tokens: u64, world: usize, rank: usize) -> (u64, u64) {
    let at = |r: usize| tokens * r as u64 / world as u64;
    (at(rank), at(rank + 1))
}

/// The kernel's parameters, laid out as its `Params` struct.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Params {
    x: u64,
    residual: u64,
    weight: u64,
    out: u64,
    residual_out: u64,
    bases: [u64; MAX_WORLD],
    slot_bytes: u64,
    out_offset: u64,
    res_offset: u64,
    timeout_ns: u64,
    x_offset: u64,
    watch_offset: u64,
    store_offset: u64,
    store_half: u64,
    rank: i32,
    world: i32,
    tokens: i32,
    hidden: i32,
    eps: f32,
    residual_full: i32,
    row0: i32,
    stages: i32,
    oneshot: i32,
    residual_sliced: i32,
    copy_engines: i32,
    watch_epoch: u32,
}

/// One call: device pointers of this rank's tensors, every rank's buffer
/// base as mapped in this process (own at `rank`).
#[derive(Debug, Clone)]
pub struct Call {
    /// This rank's partial (push mode; ignored in pull mode).
    pub x: u64,
    pub residual: u64,
    pub weight: u64,
    pub out: u64,
    pub residual_out: u64,
    pub bases: Vec<u64>,
    pub rank: usize,
    pub tokens: u64,
    pub hidden: u32,
    pub eps: f32,
    pub residual_full: bool,
    /// `residual` holds this rank's slice rows only (sharded residual mode).
    pub residual_sliced: bool,
    pub timeout_ns: u64,
    pub dtype: Dtype,
    /// Bytes of each rank's buffer (the same on every rank).
    pub buffer_bytes: u64,
    /// Pull mode (`tokens` rows from `first`; either residual mode).
    pub pull: Option<Pull>,
    /// The compiled shape of the kernel the call is launched with.
    pub config: NormConfig,
}

impl Call {
    pub fn layout(&self) -> Result<Layout> {
        match self.pull {
            None => Layout::new(
                self.bases.len(),
                self.tokens,
                self.hidden,
                self.dtype,
                self.buffer_bytes,
                self.oneshot(),
            ),
            Some(p) => Layout::pull(self.bases.len(), p.rows, self.hidden, self.dtype),
        }
    }

    /// Whether the call runs one-shot ([`runs_oneshot`]).
    pub fn oneshot(&self) -> bool {
        runs_oneshot(
            self.config,
            self.bases.len(),
            self.residual_full,
            self.pull.is_some(),
        )
    }
}

/// Enqueues the kernel on `ctas` CTAs. Every rank enqueues it with the same
/// tokens, hidden size, CTA count and residual mode.
pub fn launch(kernel: &Kernel, call: &Call, ctas: u32, stream: RawStream) -> Result<()> {
    checked(call, ctas)?.launch(kernel, stream)
}

/// A call whose arguments passed every check, ready to launch (nothing
/// to launch when it has no rows).
pub struct Checked {
    params: Option<Params>,
    ctas: u32,
    threads: u32,
}

impl Checked {
    pub fn launch(self, kernel: &Kernel, stream: RawStream) -> Result<()> {
        let Some(mut params) = self.params else {
            return Ok(());
        };
        let mut args: [*mut c_void; 1] = [(&mut params as *mut Params).cast()];
        kernel.launch(self.ctas, self.threads, stream, &mut args)
    }

    /// The copy-engine mode's kernel (`fo_arn_ce`) over rows [first, last)
    /// (`kind` [`CE_REDUCE`]: of this rank's slice; [`CE_GATHER`]: of the
    /// peer's), on at most `ctas` CTAs (one per row at least): the rows the
    /// copy engines moved, no peer access.
    pub fn launch_rows(
        &self,
        kernel: &Kernel,
        first: u64,
        last: u64,
        kind: i32,
        stream: RawStream,
    ) -> Result<()> {
        let Some(mut params) = self.copy_engines(CE_FLAGS) else {
            return Ok(());
        };
        if last <= first {
            return Ok(());
        }
        let (mut first, mut last, mut kind) = (first as i32, last as i32, kind);
        let grid = self.ctas.min((last - first) as u32);
        let mut args: [*mut c_void; 4] = [
            (&mut params as *mut Params).cast(),
            (&mut first as *mut i32).cast(),
            (&mut last as *mut i32).cast(),
            (&mut kind as *mut i32).cast(),
        ];
        kernel.launch(grid, self.threads, stream, &mut args)
    }

    /// One-shot's copy-engine kernel (`fo_arn_ce_chunks`) over every row,
    /// landed in the ranges [bounds[c], bounds[c + 1]) whose flags it waits
    /// for, on at most `ctas` CTAs (one per row at least).
    pub fn launch_chunks(&self, kernel: &Kernel, bounds: &[u64], stream: RawStream) -> Result<()> {
        let Some(mut params) = self.copy_engines(CE_FLAGS) else {
            return Ok(());
        };
        let count = bounds.len().saturating_sub(1);
        if !(1..=CE_LAUNCH_CHUNKS).contains(&count) {
            return Err(Error::Invalid(format!(
                "internal: one launch waits for 1 to {CE_LAUNCH_CHUNKS} ranges, got {count}"
            )));
        }
        let mut chunks = Chunks {
            count: count as i32,
            bounds: [0; CE_LAUNCH_CHUNKS + 1],
        };
        for (to, &b) in chunks.bounds.iter_mut().zip(bounds) {
            *to = b as i32;
        }
        let grid = self.ctas.min(params.tokens as u32);
        let mut args: [*mut c_void; 2] = [
            (&mut params as *mut Params).cast(),
            (&mut chunks as *mut Chunks).cast(),
        ];
        kernel.launch(grid, self.threads, stream, &mut args)
    }

    /// One-shot's watching copy-engine kernel (`fo_arn_ce_watch`) over every
    /// row, landed in one copy into the watch area at `area` (the layout's
    /// watch area or one of its watch halves), on at most `ctas` CTAs.
    /// `epoch`: the call's number, which the peer's copy lane writes into
    /// this rank's [`CE_WATCH_EPOCH_WORD`] after its copy (0: x arrived 0
    /// instead, which the close waits for and resets before it exchanges
    /// consumed with the peer).
    pub fn launch_watch(
        &self,
        kernel: &Kernel,
        stream: RawStream,
        area: u64,
        epoch: u32,
    ) -> Result<()> {
        let Some(mut params) = self.copy_engines(CE_WATCH) else {
            return Ok(());
        };
        if params.watch_offset == 0 || area < params.watch_offset {
            return Err(Error::Invalid(
                "internal: a watched call needs the watch area of a 2-rank push buffer".into(),
            ));
        }
        params.watch_offset = area;
        params.watch_epoch = epoch;
        let grid = self.ctas.min(params.tokens as u32);
        let mut args: [*mut c_void; 1] = [(&mut params as *mut Params).cast()];
        kernel.launch(grid, self.threads, stream, &mut args)
    }

    /// The call's parameters for a copy-engine kernel of mode `mode`
    /// ([`CE_FLAGS`], [`CE_WATCH`]); None when it has no rows.
    fn copy_engines(&self, mode: i32) -> Option<Params> {
        self.params.map(|params| Params {
            copy_engines: mode,
            ..params
        })
    }
}

/// Params::copy_engines of the copy-engine kernels (the kernel's CE_FLAGS,
/// CE_WATCH): a flag per landed range, or one copy into the watch area.
pub const CE_FLAGS: i32 = 1;
pub const CE_WATCH: i32 = 2;
/// Header word (u32 index) of a watched call's epoch outside graph capture
/// (the kernel's CE_WATCH_EPOCH).
pub const CE_WATCH_EPOCH_WORD: u64 = 4;

/// Ranges one `fo_arn_ce_chunks` launch waits for at most (the kernel's
/// CE_LAUNCH_CHUNKS), and their bounds as it takes them.
pub const CE_LAUNCH_CHUNKS: usize = 16;
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Chunks {
    count: i32,
    bounds: [i32; CE_LAUNCH_CHUNKS + 1],
}

/// `fo_arn_ce`'s kinds of rows (the kernel's CE_REDUCE and CE_GATHER).
pub const CE_REDUCE: i32 = 1;
pub const CE_GATHER: i32 = 2;

/// Whether the kernels take rows of `hidden` values: whole 16-byte vectors,
/// at most MAX_HIDDEN.
pub fn hidden_supported(hidden: u64) -> bool {
    hidden > 0 && hidden % 8 == 0 && hidden <= u64::from(MAX_HIDDEN)
}

/// Checks a call on `ctas` CTAs before anything is enqueued.
pub fn checked(call: &Call, ctas: u32) -> Result<Checked> {
    let world = call.bases.len();
    let layout = call.layout()?;
    if !(1..=MAX_CTAS).contains(&ctas) {
        return Err(Error::Invalid(format!(
            "ctas: expected 1 to {MAX_CTAS}, got {ctas}"
        )));
    }
    if !hidden_supported(u64::from(call.hidden)) {
        return Err(Error::Invalid(format!(
            "hidden size must be a multiple of 8 in 8..={MAX_HIDDEN}, got {}",
            call.hidden
        )));
    }
    let (row0, end) = match call.pull {
        None => (0, call.tokens),
        Some(p) => (p.first, p.first + call.tokens),
    };
    let pull_ok = call.pull.map_or(true, |p| end <= p.rows);
    // A slice of the residual is all a rank reads only where it normalizes its slice alone.
    let sliced_ok = !call.residual_sliced || !call.residual_full;
    if end > i32::MAX as u64 || call.rank >= world || !pull_ok || !sliced_ok {
        return Err(Error::Invalid(format!(
            "internal: tokens {} from {row0} / rank {} of {world} / {:?}",
            call.tokens, call.rank, call.pull
        )));
    }
    let stored = call.tokens * u64::from(call.hidden) * u64::from(call.dtype.bytes());
    let store_short = runs_store_entry(call) && stored > layout.store_half;
    if layout.bytes > call.buffer_bytes || call.bases.contains(&0) || store_short {
        return Err(Error::Invalid(format!(
            "internal: peer buffers of {} bytes (store halves of {}), the call needs {} ({stored} stored)",
            call.buffer_bytes, layout.store_half, layout.bytes
        )));
    }
    if call.tokens == 0 {
        return Ok(Checked {
            params: None,
            ctas,
            threads: call.config.block_threads(),
        });
    }
    let mut bases = [0u64; MAX_WORLD];
    bases[..world].copy_from_slice(&call.bases);
    let params = Params {
        x: call.x,
        residual: call.residual,
        weight: call.weight,
        out: call.out,
        residual_out: call.residual_out,
        bases,
        slot_bytes: layout.slot_bytes,
        out_offset: layout.out_offset,
        res_offset: layout.res_offset,
        timeout_ns: call.timeout_ns,
        x_offset: layout.x_offset,
        watch_offset: layout.watch_offset,
        store_offset: layout.store_offset,
        store_half: layout.store_half,
        rank: call.rank as i32,
        world: world as i32,
        tokens: call.tokens as i32,
        hidden: call.hidden as i32,
        eps: call.eps,
        residual_full: i32::from(call.residual_full),
        row0: row0 as i32,
        stages: stages(
            call.tokens,
            world,
            ctas,
            call.config,
            call.oneshot(),
            call.pull.is_some(),
        ) as i32,
        oneshot: i32::from(call.oneshot()),
        residual_sliced: i32::from(call.residual_sliced),
        copy_engines: 0,
        watch_epoch: 0,
    };
    Ok(Checked {
        params: Some(params),
        ctas,
        threads: call.config.block_threads(),
    })
}

/// A push call of `world` ranks keeping the full residual, `tokens` rows of
/// `hidden` bf16 values with `config`, on buffers large enough (pointers
/// never dereferenced): the unit tests' call, each changing what it probes.
#[cfg(test)]
pub(crate) fn sample_call(world: usize, tokens: u64, hidden: u32, config: NormConfig) -> Call {
    Call {
        x: 16,
        residual: 16,
        weight: 16,
        out: 16,
        residual_out: 16,
        bases: vec![1 << 20; world],
        rank: 0,
        tokens,
        hidden,
        eps: 1e-6,
        residual_full: true,
        residual_sliced: false,
        timeout_ns: 0,
        dtype: Dtype::Bf16,
        buffer_bytes: 1 << 30,
        pull: None,
        config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_tokens_once() {
        for world in 1..=MAX_WORLD {
            for tokens in [0u64, 1, 7, 128, 1001] {
                let mut next = 0;
                for r in 0..world {
                    let (a, b) = slice(tokens, world, r);
                    assert_eq!(a, next);
                    assert!(b - a <= tokens.div_ceil(world as u64));
                    next = b;
                }
                assert_eq!(next, tokens);
            }
        }
    }

    #[test]
    fn stages_leave_a_row_per_warp_and_fit_the_flags() {
        let config = |stages| NormConfig::new(512, 4, stages).unwrap();
        let push = |tokens, ctas, config| stages(tokens, 2, ctas, config, false, false);
        // 8K tokens on 2 ranks, 32 CTAs: 128 rows a chunk, 16 warps: up to 8 parts.
        assert_eq!(push(8192, 32, config(4)), 4);
        assert_eq!(push(8192, 32, config(8)), 8);
        assert_eq!(push(4096, 32, config(8)), 4);
        assert_eq!(push(2048, 32, config(4)), 2);
        // Too few rows for two parts, or one part asked for: the unpipelined kernel.
        assert_eq!(push(1024, 32, config(4)), 1);
        assert_eq!(push(8192, 32, config(1)), 1);
        assert_eq!(stages(1, 8, 256, config(8), false, false), 1);
        assert_eq!(push(0, 16, config(4)), 1);
        // The default: 4 parts or more where the rows allow, else one; pull mode one.
        let default = NormConfig::DEFAULT;
        assert_eq!(push(16384, 32, default), 8);
        assert_eq!(push(4096, 32, default), DEFAULT_MIN_PARTS);
        assert_eq!(push(2048, 32, default), 1);
        assert_eq!(push(8192, 128, default), 1);
        assert_eq!(push(8192, 64, default), 4);
        assert_eq!(push(16384, 16, default), 1);
        assert_eq!(stages(16384, 2, 32, default, false, true), 1);
        // Explicit configs keep their parts in pull mode.
        assert_eq!(stages(8192, 2, 32, config(4), false, true), 4);
        for ctas in 1..=MAX_CTAS {
            for tokens in [1u64, 1000, 1 << 20] {
                let s = push(tokens, ctas, config(NormConfig::MAX_STAGES));
                assert!((1..=NormConfig::MAX_STAGES).contains(&s));
                assert!(
                    s * ctas <= FLAG_SLOTS,
                    "{tokens} tokens on {ctas} CTAs: {s} stages"
                );
            }
        }
    }

    #[test]
    fn the_ring_runs_on_hopper_where_two_slots_fit() {
        let ring = NormConfig::DEFAULT;
        let runs =
            |world, hidden, dtype, major| effective(ring, world, hidden, dtype, major, true).ring;
        assert!(runs(2, 8192, Dtype::Bf16, 9));
        assert!(runs(2, 16384, Dtype::Bf16, 9)); // 2 slots of 3 rows of 32 KiB
        assert!(runs(4, 8192, Dtype::F16, 9));
        assert!(!runs(2, 8192, Dtype::Bf16, 8));
        assert!(!runs(4, 16384, Dtype::Bf16, 9));
        assert!(!runs(8, 8192, Dtype::Bf16, 9));
        // Elsewhere the same shape on plain loads; a plain config stays plain.
        assert_eq!(
            effective(ring, 2, 8192, Dtype::Bf16, 8, true),
            NormConfig::PLAIN
        );
        assert!(!effective(NormConfig::PLAIN, 2, 8192, Dtype::Bf16, 9, true).ring);
        // The default takes it only where it pays; a ring asked for runs anyway.
        assert!(!effective(ring, 2, 8192, Dtype::Bf16, 9, false).ring);
        let asked = NormConfig::new(512, 4, 4).unwrap().ringed(true).unwrap();
        assert!(effective(asked, 2, 8192, Dtype::Bf16, 9, false).ring);
        assert!(default_takes_ring(1024, 2, 32, false));
        assert!(!default_takes_ring(1022, 2, 32, false));
        assert!(!default_takes_ring(512, 2, 32, false));
        assert!(default_takes_ring(512, 2, 8, false));
        assert!(!default_takes_ring(16384, 2, 32, true));
        // The default's stage rule holds ring or not.
        for tokens in [1024, 4096, 8192] {
            assert_eq!(
                stages(tokens, 2, 32, NormConfig::DEFAULT, false, false),
                stages(tokens, 2, 32, NormConfig::PLAIN, false, false)
            );
        }
    }

    #[test]
    fn the_default_runs_small_full_pushes_of_two_ranks_one_shot() {
        let default = NormConfig::DEFAULT;
        let max = ONESHOT_MAX_TOKENS;
        assert_eq!(
            resolved(default, max, 2, 32, true, false),
            NormConfig::ONESHOT
        );
        assert_eq!(
            resolved(NormConfig::PLAIN, 1, 2, 1, true, false),
            NormConfig::ONESHOT
        );
        assert_eq!(
            resolved(default, 128, 2, 8, true, false),
            NormConfig::ONESHOT
        );
        // Larger calls, more rows a CTA, other worlds, the sharded residual, pull mode and
        // asked-for configs keep theirs.
        assert_eq!(resolved(default, max + 1, 2, 132, true, false), default);
        assert_eq!(resolved(default, 129, 2, 8, true, false), default);
        assert_eq!(resolved(default, 128, 3, 32, true, false), default);
        assert_eq!(resolved(default, 128, 2, 32, false, false), default);
        assert_eq!(resolved(default, 128, 2, 32, true, true), default);
        let asked = NormConfig::new(512, 4, 4).unwrap();
        assert_eq!(resolved(asked, 128, 2, 32, true, false), asked);
        // One part, plain loads: the build the two-shot default uses off the ring.
        let one = NormConfig::ONESHOT;
        assert!(one.oneshot && !one.ring && one.stages == 1 && !one.is_default());
        assert_eq!(
            crate::cuda::kernels::allreduce_rmsnorm_spec(Dtype::Bf16, one),
            crate::cuda::kernels::allreduce_rmsnorm_spec(Dtype::Bf16, NormConfig::PLAIN)
        );
    }

    #[test]
    fn the_copy_engines_run_the_default_one_shot() {
        let default = NormConfig::DEFAULT;
        let resolved = resolved_copy_engines;
        let one = resolved(default, 2, true);
        // The default's shape otherwise, ring included (the copy-engine kernel's build).
        assert!(one.oneshot && one.ring && one.threads == default.threads);
        assert!(!resolved(default, 2, false).oneshot, "sharded: two-shot");
        assert!(!resolved(default, 3, true).oneshot, "3 ranks: two-shot");
        // A one-shot config asks for it; another shape never gets it unasked.
        let asked = NormConfig::with(512, 4, 1, true).unwrap();
        assert!(resolved(asked, 2, true).oneshot);
        let other = NormConfig::new(512, 2, 4).unwrap();
        assert!(!resolved(other, 2, true).oneshot);
    }

    #[test]
    fn oneshot_runs_only_two_ranks_pushing_the_full_residual() {
        let config = NormConfig::with(512, 4, 4, true).unwrap();
        let call = |world: usize, full: bool, pull: Option<Pull>| Call {
            residual_full: full,
            pull,
            ..sample_call(world, 1000, 1024, config)
        };
        assert!(call(2, true, None).oneshot());
        assert!(!call(3, true, None).oneshot());
        assert!(!call(2, false, None).oneshot());
        let pull = Some(Pull {
            first: 0,
            rows: 1000,
        });
        assert!(!call(2, true, pull).oneshot());
        // fo_arn_oneshot: the plain build's one-shot calls only.
        assert!(runs_oneshot_entry(&call(2, true, None)));
        assert!(!runs_oneshot_entry(&call(3, true, None)));
        assert!(!runs_oneshot_entry(&call(2, false, None)));
        assert!(!runs_oneshot_entry(&call(2, true, pull)));
        let mut ring = call(2, true, None);
        ring.config.ring = true;
        assert!(!runs_oneshot_entry(&ring));
        // On 132 CTAs no part has enough rows for the hidden-size entries.
        let general = |c: &Call| kernel_spec(Dtype::Bf16, c, 132).entry;
        assert_eq!(general(&call(2, true, None)), NormEntry::Oneshot.name());
        assert_eq!(
            kernel_spec(Dtype::Bf16, &ring, 8).entry,
            "fo_allreduce_rmsnorm"
        );
        // fo_arn_oneshot_st: those of them with at most STORE_MAX_TOKENS rows.
        assert!(!runs_store_entry(&call(2, true, None)));
        let mut short = call(2, true, None);
        short.tokens = STORE_MAX_TOKENS;
        assert!(runs_store_entry(&short));
        assert_eq!(general(&short), NormEntry::OneshotStore.name());
        short.tokens += 1;
        assert!(!runs_store_entry(&short));
        short.tokens = 1;
        short.config.ring = true;
        assert!(!runs_store_entry(&short));
        // One-shot parts cut every row: 1000 rows on 8 CTAs of 16 warps allow 4 parts (2 ranks' slices: 3).
        let oneshot = checked(&call(2, true, None), 8).unwrap().params.unwrap();
        assert_eq!((oneshot.oneshot, oneshot.stages), (1, 4));
        assert_eq!(oneshot.slot_bytes, 1000 * 2048);
        let mut two = call(2, true, None);
        two.config = NormConfig::new(512, 4, 4).unwrap();
        let two = checked(&two, 8).unwrap().params.unwrap();
        assert_eq!(
            (two.oneshot, two.stages, two.slot_bytes),
            (0, 3, 500 * 2048)
        );
        // A buffer too small for the call is refused before launch.
        let mut small = call(2, true, None);
        small.buffer_bytes = Layout::needed(2, 990, 1024, Dtype::Bf16).unwrap();
        assert!(checked(&small, 8).is_err());
        // A residual slice is read only where each rank normalizes its own slice alone.
        let mut sliced = call(2, false, None);
        sliced.residual_sliced = true;
        assert_eq!(
            checked(&sliced, 8).unwrap().params.unwrap().residual_sliced,
            1
        );
        for (full, pull) in [
            (true, None),
            (
                true,
                Some(Pull {
                    first: 0,
                    rows: 1000,
                }),
            ),
        ] {
            let mut bad = call(2, full, pull);
            bad.residual_sliced = true;
            assert!(checked(&bad, 8).is_err());
        }
        // A pull call keeps either residual, a sharded one read from a slice too.
        let mut pulled = call(2, false, pull);
        pulled.residual_sliced = true;
        let params = checked(&pulled, 8).unwrap().params.unwrap();
        assert_eq!((params.residual_full, params.residual_sliced), (0, 1));
        assert!(params.x_offset > 0);
    }

    #[test]
    fn params_are_declared_in_the_kernels_order() {
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        let body = source.split("struct Params {").nth(1).unwrap();
        let body = body.split("};").next().unwrap();
        // Each declarator's name: the last word of each comma-separated part
        // before the ';', without a pointer or array.
        let names: Vec<&str> = body
            .lines()
            .filter_map(|l| l.split_once(';').map(|(decl, _)| decl))
            .flat_map(|decl| decl.split(','))
            .filter_map(|part| part.split_whitespace().last())
            .map(|n| n.trim_start_matches('*').split('[').next().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "x",
                "residual",
                "weight",
                "out",
                "residual_out",
                "bases",
                "slot_bytes",
                "out_offset",
                "res_offset",
                "timeout_ns",
                "x_offset",
                "watch_offset",
                "store_offset",
                "store_half",
                "rank",
                "world",
                "tokens",
                "hidden",
                "eps",
                "residual_full",
                "row0",
                "stages",
                "oneshot",
                "residual_sliced",
                "copy_engines",
                "watch_epoch"
            ]
        );
    }

    #[test]
    fn the_watch_mode_matches_the_kernel() {
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        assert!(source.contains(&format!("constexpr int CE_WATCH = {CE_WATCH};")));
        assert!(source.contains(&format!(
            "constexpr int CE_WATCH_EPOCH = {CE_WATCH_EPOCH_WORD};"
        )));
        let word = u32::from_ne_bytes([WATCH_SENTINEL_BYTE; 4]);
        assert!(source.contains(&format!(
            "constexpr unsigned WATCH_SENTINEL = {word:#010x}u;"
        )));
        let watch = format!("{}(Params p)", NormEntry::CopyEngineWatch.name());
        assert_eq!(
            source.matches(&watch).count(),
            2,
            "the ring's and the plain build's"
        );
    }

    #[test]
    fn the_one_shot_entries_are_the_plain_builds() {
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        for entry in [
            NormEntry::Oneshot,
            NormEntry::OneshotStore,
            NormEntry::OneshotHidden,
            NormEntry::OneshotStoreHidden,
        ] {
            let signature = format!("{}(Params p)", entry.name());
            let at = source
                .find(&signature)
                .unwrap_or_else(|| panic!("{}", entry.name()));
            assert_eq!(source.matches(&signature).count(), 1);
            // After the ring build's #else: runs_oneshot_entry never asks the ring's module for it.
            let before = &source[..at];
            assert!(before.rfind("#if FO_RING") < before.rfind("#else"));
        }
    }

    #[test]
    fn the_hidden_size_entries_run_where_row_group_gives_each_row_the_fewest_warps() {
        // The kernel's rule, mirrored: 16-byte vectors a thread holds, warps a row of 8192 needs,
        // and the part sizes past which row_group spreads a row over more warps.
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        assert!(source.contains("constexpr int REG_VECS = 2048 / (THREADS < 256 ? THREADS : 256);"));
        assert!(
            source.contains("for (int c = 2 * size; c <= WARPS && rows * c <= WARPS; c *= 2) {")
        );
        assert!(source.contains("    if (WARPS / c <= 15) size = c;"));
        assert_eq!(fewest_warps(1024, 512), 4);
        assert_eq!(fewest_warps(2048, 512), 8);
        assert_eq!(fewest_warps(256, 512), 1);
        assert_eq!(fewest_warps(1024, 128), 2); // 16 vectors a thread on small blocks
        let groups: Vec<u64> = (0..6)
            .map(|rows| row_group_warps(rows, 1024, 512))
            .collect();
        assert_eq!(groups, [16, 16, 8, 4, 4, 4]);
        // 32 warps: at most 15 groups where a row's warps grow (never 32 groups of 1), and
        // rows of 2 warps (hidden 4096) in 8 groups of 4, not 16 of 2.
        assert_eq!(row_group_warps(1, 128, 1024), 32);
        assert_eq!(row_group_warps(100, 128, 1024), 1);
        assert_eq!(row_group_warps(100, 512, 1024), 4);
        assert_eq!(fewest_warps(512, 1024), 4);
        assert!(source.contains("    while (size > 1 && WARPS / size > 15) size *= 2;"));

        let oneshot = NormConfig::DEFAULT.ringed(false).unwrap();
        let oneshot = NormConfig {
            oneshot: true,
            ..oneshot
        };
        let mut call = sample_call(2, 128, 8192, oneshot);
        assert!(runs_hidden_entry(&call, 32), "4 rows a CTA");
        assert!(runs_hidden_entry(&call, 8), "16 rows a CTA, one part");
        assert!(!runs_hidden_entry(&call, 64), "2 rows a CTA: 8 warps a row");
        call.tokens = 95; // parts of 2 and 3 rows on 32 CTAs
        assert!(!runs_hidden_entry(&call, 32));
        call.tokens = 96;
        assert!(runs_hidden_entry(&call, 32));
        let hidden_of = |spec: &KernelSpec| spec.define("FO_HIDDEN").map(str::to_owned);
        if kernels::hidden_kernels() {
            let spec = kernel_spec(Dtype::Bf16, &call, 32);
            assert_eq!(spec.entry, NormEntry::OneshotStoreHidden.name());
            assert_eq!(hidden_of(&spec).as_deref(), Some("8192"));
            call.tokens = 384; // past the stores' reach: one-shot by peer loads
            let spec = kernel_spec(Dtype::Bf16, &call, 32);
            assert_eq!(spec.entry, NormEntry::OneshotHidden.name());
            assert_eq!(hidden_of(&spec).as_deref(), Some("8192"));
        }
        call.tokens = 64;
        let spec = kernel_spec(Dtype::Bf16, &call, 32);
        assert_eq!(spec.entry, NormEntry::OneshotStore.name());
        assert_eq!(hidden_of(&spec), None);
        // Two-shot, three ranks and the ring never take them.
        let mut other = sample_call(3, 128, 8192, oneshot);
        assert!(!runs_hidden_entry(&other, 32));
        other = sample_call(2, 128, 8192, NormConfig::DEFAULT);
        assert!(!runs_hidden_entry(&other, 32));
        assert!(!runs_hidden_entry(
            &sample_call(2, 128, 8192, NormConfig::PLAIN),
            32
        ));
    }

    #[test]
    fn flags_fill_the_header_as_the_kernel_lays_them_out() {
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        assert!(source.contains(&format!("constexpr int FLAG_SLOTS = {FLAG_SLOTS};")));
        assert!(source.contains(&format!("#define FO_MAX_WORLD {MAX_WORLD}")));
        // 16 header words, then ready and done: a u32 per (slot, source) each.
        assert!((16 + 2 * u64::from(FLAG_SLOTS) * MAX_WORLD as u64) * 4 <= HEADER_BYTES);
        assert!(source.contains(&format!("area(p, owner, {HEADER_BYTES}ull")));
    }

    #[test]
    fn areas_split_the_buffer_and_fit_the_params_struct() {
        let row = 16384;
        let needed = Layout::needed(4, 1001, 8192, Dtype::Bf16).unwrap();
        assert_eq!(needed, HEADER_BYTES + 3 * 4 * 251 * row);
        for capacity in [needed, needed + 4096, 1 << 30] {
            let l = Layout::new(4, 1001, 8192, Dtype::Bf16, capacity, false).unwrap();
            assert_eq!(l.slot_bytes, 251 * row);
            let area = (capacity - HEADER_BYTES) / 3 / 16 * 16;
            assert_eq!(l.out_offset, HEADER_BYTES + area);
            assert_eq!(l.res_offset, HEADER_BYTES + 2 * area);
            assert!(l.bytes <= capacity);
            // The areas do not depend on the call's size: a smaller call keeps them.
            let small = Layout::new(4, 7, 8192, Dtype::Bf16, capacity, false).unwrap();
            assert_eq!(
                (small.out_offset, small.res_offset),
                (l.out_offset, l.res_offset)
            );
        }
        // Too small a buffer: the call needs more than it has.
        let short = Layout::new(4, 1001, 8192, Dtype::Bf16, needed - 16, false).unwrap();
        assert!(short.bytes > needed - 16);
        // One-shot on 2 ranks: one slot of every row, within the same areas: the watch
        // area after the residual area, then two store halves and two watch halves as
        // large as an area (up to STORE_HALF_MAX), to the buffer's end.
        let needed2 = Layout::needed(2, 1001, 8192, Dtype::Bf16).unwrap();
        assert_eq!(needed2, HEADER_BYTES + 8 * 2 * 501 * row);
        let one = Layout::new(2, 1001, 8192, Dtype::Bf16, needed2, true).unwrap();
        assert_eq!(one.slot_bytes, 1001 * row);
        assert!(one.slot_bytes <= one.out_offset - HEADER_BYTES && one.bytes <= needed2);
        for capacity in [needed2, 128 << 20, (128 << 20) + (1 << 20), 1 << 30] {
            let area = area_bytes(2, capacity);
            let half = area.min(STORE_HALF_MAX);
            assert!(HEADER_BYTES + 4 * area + 4 * half <= capacity);
            assert!(capacity - (HEADER_BYTES + 4 * area + 4 * half) < 8 * 16);
            for (tokens, oneshot) in [(1001, true), (1001, false), (5, true), (512, true)] {
                let l = Layout::new(2, tokens, 8192, Dtype::Bf16, capacity, oneshot).unwrap();
                assert_eq!(l.res_offset, HEADER_BYTES + 2 * area);
                assert_eq!(Some(l.watch_offset), watch_offset(2, capacity));
                assert_eq!(l.watch_offset, HEADER_BYTES + 3 * area);
                assert_eq!(
                    (l.store_offset, l.store_half),
                    (HEADER_BYTES + 4 * area, half)
                );
                assert_eq!(l.watch_halves, l.store_offset + 2 * half);
                assert!(l.watch_halves + 2 * half <= capacity);
                assert!(l.watch_offset + tokens * row <= l.store_offset && l.bytes <= capacity);
                // A one-shot call's rows fit a store half.
                assert!(!oneshot || tokens * row <= l.store_half);
            }
        }
        // Every one-shot call (at most ONESHOT_MAX_TOKENS rows of at most MAX_HIDDEN
        // 16-bit values) fits a store half of the buffer sized for it.
        for (tokens, hidden) in [(1, 8), (ONESHOT_MAX_TOKENS, MAX_HIDDEN), (300, 4104)] {
            let capacity = Layout::needed(2, tokens, hidden, Dtype::F16).unwrap();
            let l = Layout::new(2, tokens, hidden, Dtype::F16, capacity, true).unwrap();
            assert!(tokens * u64::from(hidden) * 2 <= l.store_half && l.bytes <= capacity);
        }
        // Areas grow with the buffer: none shrinks past the store halves' cap.
        let mut last = 0;
        for mib in [1u64, 16, 95, 96, 97, 127, 128, 129, 1024] {
            let area = area_bytes(2, mib << 20);
            assert!(area >= last);
            last = area;
        }
        assert_eq!(watch_offset(4, 1 << 30), None);
        assert_eq!(
            Layout::new(4, 7, 8192, Dtype::Bf16, 1 << 30, false)
                .unwrap()
                .watch_offset,
            0
        );
        assert!(Layout::new(0, 1, 8, Dtype::Bf16, 0, false).is_err());
        assert!(Layout::new(9, 1, 8, Dtype::Bf16, 0, false).is_err());
        // The CUDA struct: 5 pointers, 8 bases, 8 u64, 4 ints, a float, 7 ints (6 and the
        // watch epoch's u32: no padding left).
        assert_eq!(std::mem::size_of::<Params>(), 216);
        let l = Layout::new(2, 8, 8, Dtype::Bf16, 0, false).unwrap();
        // 8 rows of 16 bytes: areas of 128 bytes, store halves of as many.
        assert_eq!(
            (l.store_offset, l.store_half),
            (HEADER_BYTES + 4 * 128, 128)
        );
        let p = Layout::pull(2, 100, 8192, Dtype::Bf16).unwrap();
        let area = 100 * 16384;
        assert_eq!(
            (p.out_offset, p.res_offset),
            (HEADER_BYTES, HEADER_BYTES + area)
        );
        assert_eq!(
            (p.x_offset, p.bytes),
            (HEADER_BYTES + 2 * area, HEADER_BYTES + 3 * area)
        );
        assert_eq!(l.x_offset, 0);
    }
}
