//! AllReduce + residual add + RMSNorm on 2 ranks with the copy engines
//! moving every row over NVLink, so that the SMs only sum and normalize
//! (csrc/allreduce_rmsnorm.cu's fo_arn_ce):
//! the same buffers, slices and results as the peer-store kernel, which
//! needs its CTAs to drive the links as well.
//!
//! Each slice is cut into `chunks` row ranges; chunk c of rank o's slice
//! goes through the caller's stream S and three lanes of this rank's:
//!
//! Copy C:  copy(x rows of the peer's chunk c -> its slot for this rank) set(x arrived c at peer) ...
//! S:       wait(x arrived c) reduce(chunk c: sum, residual, norm) [reduced c] wait(r arrived c - 1) gather(c - 1) ...
//!          (after the last reduce: zero every x arrived; full residual, at the end: zero every r arrived)
//! Send G:  [reduced c] copy(r rows, or out rows if sharded, -> the peer's area) set(r arrived c at peer) ...
//! Land L:  (sharded) wait(r arrived c) copy(the peer's normalized rows of chunk c -> out) ... zero every r arrived
//!          [C done] [G done]; S waits for L's end
//!
//! One-shot (full residual; every default-config call of the full
//! residual here: all_reduce_rmsnorm::resolved_copy_engines) sends all of x
//! instead and has each rank normalize every row, with no r coming back:
//! by default in one copy whose landed values the kernel watches
//! ([`enqueue_watch`]), or in flagged ranges ([`enqueue_oneshot`]).
//!
//! With the full residual, gather(c) normalizes the peer's r of its chunk c
//! (bit for bit as the peer did) on the caller's stream, one chunk behind
//! the sums, so that one kernel of `ctas` CTAs runs at a time.
//!
//! The flags (1 = arrived) are reset on their waiter's side, all of a kind
//! by one memset once it waited for the last (x arrived: on S after the
//! last sum, before its r leaves, which the peer's next x flags follow;
//! r arrived: at the end of S or L), so CUDA-graph replays work. Nothing
//! else orders one call after the previous: every
//! write into the peer's buffer follows (through the flags) the peer's
//! reads of the previous call. The x copies follow this rank's previous
//! call, whose landings waited for every r the peer sent, sent once the
//! peer had read its slots; the r copies follow this call's x from the
//! peer, sent once the peer finished its previous call, landings included.
//! The same holds against the peer-store kernel's calls before and after.

use super::all_reduce_rmsnorm::{self as arn, Call, HEADER_BYTES};
use crate::cuda::kernels::{self, Kernel, KernelSpec, NormEntry};
use crate::cuda::stream::{self, Event, OwnedStream, RawStream};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};

/// Header words of the copy-engine mode's flags (u32 indices), after the
/// kernel's ready and done arrays ([`arn::FLAG_SLOTS`]): x arrived for
/// chunk c at `CE_ARRIVED_WORD + c`, r arrived at `+ MAX_CHUNKS + c`.
pub const CE_ARRIVED_WORD: u64 = 16 + 2 * arn::FLAG_SLOTS as u64 * arn::MAX_WORLD as u64;
pub const MAX_CHUNKS: u32 = 64;

/// The streams and events one rank's calls run on (made once per group).
pub struct Lanes {
    copy: OwnedStream,
    send: OwnedStream,
    land: OwnedStream,
    fork: Event,
    joins: [Event; 3],
    reduced: Vec<Event>,
    /// The number of this rank's last watched call outside graph capture
    /// (both ranks of a group count its calls alike; lanes are made anew
    /// with the group's buffers, whose epoch word starts at 0).
    watch_epoch: AtomicU32,
}

impl Lanes {
    /// On the current context's device.
    pub fn new() -> Result<Self> {
        Ok(Self {
            copy: OwnedStream::high_priority()?,
            send: OwnedStream::high_priority()?,
            land: OwnedStream::high_priority()?,
            fork: Event::new()?,
            joins: [Event::new()?, Event::new()?, Event::new()?],
            reduced: (0..MAX_CHUNKS)
                .map(|_| Event::new())
                .collect::<Result<_>>()?,
            watch_epoch: AtomicU32::new(0),
        })
    }
}

/// Chunks from which the first and the last of a slice are half the others'
/// size: the first x lands sooner and the last r leaves sooner, the two
/// ends of the pipeline where one side waits (on 2x H200, 6 chunks so cut
/// took 0.90-0.97x the time of 4 equal ones at 16K tokens; 4 so cut gained
/// nothing at 8K).
pub const TAPER_MIN_CHUNKS: u32 = 5;

/// Rows [first, last) of chunk `c` of `slice` cut into `chunks` ranges:
/// near-equal, but for half-size ends from [`TAPER_MIN_CHUNKS`] on.
pub fn chunk(slice: (u64, u64), chunks: u32, c: u32) -> (u64, u64) {
    let (a, b) = slice;
    let n = u64::from(chunks.max(1));
    let taper = chunks >= TAPER_MIN_CHUNKS;
    // Weight of the chunks before chunk i: 1 for each end, 2 for the others where tapered.
    let before = |i: u64| match (taper, i) {
        (false, i) => i,
        (true, 0) => 0,
        (true, i) if i >= n => 2 * n - 2,
        (true, i) => 2 * i - 1,
    };
    let total = before(n);
    let at = |i: u64| a + (b - a) * before(i) / total;
    (at(u64::from(c)), at(u64::from(c) + 1))
}

/// Row ranges of a two-shot call left to the library (`chunks` 0): one
/// per [`CHUNK_ROWS`] rows of a slice, at most [`MAX_AUTO_CHUNKS`]. (A
/// one-shot call left to it watches one copy: [`enqueue_watch`]; asked for
/// ranges, 4, 6 and 8 took 154 / 155 / 162 us at 2K tokens, 271 / 262 / 266
/// at 4K, 458 / 443 / 445 at 8K, 907 / 859 / 817 at 16K on 2x H200, hidden
/// 8192, 32 CTAs: evaluation/results/norm_ce_one_launch_h200x2.txt.)
pub fn auto_chunks(tokens: u64) -> u32 {
    let slice = tokens.div_ceil(2);
    (slice / CHUNK_ROWS).clamp(1, u64::from(MAX_AUTO_CHUNKS)) as u32
}
pub const CHUNK_ROWS: u64 = 1024;
pub const MAX_AUTO_CHUNKS: u32 = 6;

/// Each one-shot range after the first is this share of the one before
/// (the first is half the second): the kernel on 32 CTAs sums and
/// normalizes a range in ~0.83x the time its copy takes, so a range is
/// done before the next one lands and the one left after the last copy is
/// small (2x H200, 16K tokens: 8 ranges so cut in one launch took 817 us,
/// the launch per range of half-size-ended ranges 872;
/// evaluation/results/norm_ce_one_launch_h200x2.txt).
pub const ONESHOT_RATIO: f64 = 0.8;

/// Rows [first, last) of one-shot's range `c` of `rows` rows cut into
/// `chunks`, [`ONESHOT_RATIO`] apart (from 3 ranges; fewer: [`chunk`]).
pub fn oneshot_chunk(rows: u64, chunks: u32, c: u32) -> (u64, u64) {
    if chunks < 3 {
        return chunk((0, rows), chunks, c);
    }
    let weight = |i: u32| {
        if i == 0 {
            0.5
        } else {
            ONESHOT_RATIO.powi(i as i32 - 1)
        }
    };
    let before = |i: u32| (0..i).map(weight).sum::<f64>();
    let total = before(chunks);
    let at = |i: u32| {
        if i >= chunks {
            rows
        } else {
            ((rows as f64) * before(i) / total).round() as u64
        }
    };
    (at(c), at(c + 1))
}

fn word(base: u64, index: u64) -> u64 {
    base + 4 * index
}

/// The buffer at `base`'s flag for x of chunk `c` arrived, and for r (or
/// the normalized rows) of chunk `c` arrived.
fn x_arrived(base: u64, c: u32) -> u64 {
    word(base, CE_ARRIVED_WORD + u64::from(c))
}
fn r_arrived(base: u64, c: u32) -> u64 {
    word(base, CE_ARRIVED_WORD + u64::from(MAX_CHUNKS + c))
}

/// The kernel a call with `chunks` ranges asked for runs, from the build of
/// its config: one-shot's single launch (fo_arn_ce_watch with the library's
/// count, else fo_arn_ce_chunks), else the per-chunk kernel (fo_arn_ce).
/// The ring's fo_arn_ce_watch is compiled for the call's hidden size
/// (FO_HIDDEN: a reduce with constant offsets and no per-vector tests of the
/// mode; one compile per hidden size, kept in the kernel cache): its compute
/// threads' issue rate bounds a row, and on 2x H200 (hidden 8192, 32 CTAs)
/// the call took 0.95x the time at 1K tokens, 0.92x at 2K and on 8 CTAs, a
/// tie at 512 (evaluation/results/norm_row_cost_h200x2.txt, session 22).
pub fn kernel_spec(dtype: Dtype, call: &Call, chunks: u32) -> KernelSpec {
    let entry = if watches(call, chunks) {
        NormEntry::CopyEngineWatch
    } else if call.oneshot() {
        NormEntry::CopyEngineChunks
    } else {
        NormEntry::CopyEngines
    };
    let spec = kernels::allreduce_rmsnorm_entry_spec(dtype, call.config, entry);
    if entry == NormEntry::CopyEngineWatch && call.config.ring && kernels::hidden_kernels() {
        kernels::for_hidden(spec, call.hidden)
    } else {
        spec
    }
}

/// Whether a call with `chunks` ranges asked for watches one copy
/// ([`enqueue_watch`]): one-shot with the library's count.
fn watches(call: &Call, chunks: u32) -> bool {
    call.oneshot() && chunks == 0
}

/// Enqueues a call (push layout, 2 ranks; `checked`: arn::checked's of it,
/// taken before its kernel was compiled) on the caller's stream and
/// `lanes`, `kernel` ([`kernel_spec`]'s, loaded before anything is
/// enqueued) on the checked call's CTAs, one launch at a time. Both ranks
/// must enqueue it with the same tokens and `chunks`.
pub fn enqueue(
    kernel: &Kernel,
    call: &Call,
    checked: &arn::Checked,
    chunks: u32,
    caller: RawStream,
    lanes: &Lanes,
) -> Result<()> {
    if call.bases.len() != 2 || call.pull.is_some() {
        return Err(Error::Invalid(
            "internal: the copy engines' AllReduce + RMSNorm serves push calls of 2 ranks".into(),
        ));
    }
    if chunks > MAX_CHUNKS {
        return Err(Error::Invalid(format!(
            "chunks: expected 0 (by rows) or 1 to {MAX_CHUNKS}, got {chunks}"
        )));
    }
    if call.tokens == 0 {
        return Ok(());
    }
    if watches(call, chunks) {
        return enqueue_watch(kernel, call, checked, caller, lanes);
    }
    let chunks = match chunks {
        0 => auto_chunks(call.tokens),
        n => n,
    };
    if call.oneshot() {
        return enqueue_oneshot(kernel, call, checked, chunks, caller, lanes);
    }
    let layout = call.layout()?;
    let (me, peer) = (call.rank, 1 - call.rank);
    let (own, theirs) = (
        arn::slice(call.tokens, 2, me),
        arn::slice(call.tokens, 2, peer),
    );
    let row = u64::from(call.hidden) * u64::from(call.dtype.bytes());
    let (mine, other) = (call.bases[me], call.bases[peer]);
    // What this rank sends of its slice after the sum: r (full: the peer
    // normalizes it, bit for bit as here) or the normalized rows.
    let (sent, area) = if call.residual_full {
        (call.residual_out, layout.res_offset)
    } else {
        (call.out, layout.out_offset)
    };
    let (copy, send, land) = (lanes.copy.0, lanes.send.0, lanes.land.0);
    lanes.fork.order_all(caller, &[copy, send, land])?;
    // This rank's slot in the peer (the kernel's slot(peer, me)).
    let slot = other + HEADER_BYTES + me as u64 * layout.slot_bytes;
    for c in 0..chunks {
        let (f, l) = chunk(theirs, chunks, c);
        if l > f {
            stream::copy(
                copy,
                slot + (f - theirs.0) * row,
                call.x + f * row,
                ((l - f) * row) as usize,
            )?;
        }
        stream::write(copy, x_arrived(other, c), 1)?;
    }
    // With the full residual the peer's r is normalized here on the same
    // CTAs, each chunk's after the next one's sum: one kernel at a time.
    let gather_on = |c: u32| -> Result<()> {
        let (f, l) = chunk(theirs, chunks, c);
        stream::wait_geq(caller, r_arrived(mine, c), 1)?;
        checked.launch_rows(kernel, f, l, arn::CE_GATHER, caller)
    };
    // Each stream memory operation on a lane costs microseconds, so a flag's
    // one waiter only waits, and one memset per lane resets all of a call's
    // flags of a kind once it has waited for the last (see the module's notes).
    let x_flags: Vec<u64> = (0..chunks).map(|c| x_arrived(mine, c)).collect();
    let r_flags: Vec<u64> = (0..chunks).map(|c| r_arrived(mine, c)).collect();
    for c in 0..chunks {
        let (f, l) = chunk(own, chunks, c);
        stream::wait_geq(caller, x_arrived(mine, c), 1)?;
        checked.launch_rows(kernel, f, l, arn::CE_REDUCE, caller)?;
        if c + 1 == chunks {
            // Before the last r leaves: the peer's next x flags follow it.
            stream::zero_words(caller, &x_flags)?;
        }
        lanes.reduced[c as usize].record(caller)?;
        lanes.reduced[c as usize].wait(send)?;
        if l > f {
            stream::copy(
                send,
                other + area + f * row,
                sent + f * row,
                ((l - f) * row) as usize,
            )?;
        }
        stream::write(send, r_arrived(other, c), 1)?;
        if call.residual_full && c >= 1 {
            gather_on(c - 1)?;
        }
    }
    if call.residual_full {
        gather_on(chunks - 1)?;
        stream::zero_words(caller, &r_flags)?;
    } else {
        // Sharded: the peer's normalized rows land on the copy engines.
        for c in 0..chunks {
            let (f, l) = chunk(theirs, chunks, c);
            stream::wait_geq(land, r_arrived(mine, c), 1)?;
            if l > f {
                stream::copy(
                    land,
                    call.out + f * row,
                    mine + layout.out_offset + f * row,
                    ((l - f) * row) as usize,
                )?;
            }
        }
        stream::zero_words(land, &r_flags)?;
    }
    // The caller waits for one lane: the others' last work is ordered before
    // the land lane's end there, where it has long finished.
    let [copy_done, send_done, land_done] = &lanes.joins;
    copy_done.order(copy, land)?;
    send_done.order(send, land)?;
    land_done.order(land, caller)?;
    Ok(())
}

/// Header word of the one-shot mode's closing flag (1: the peer has summed
/// every row this rank sent), after the x flags.
pub const CE_CONSUMED_WORD: u64 = CE_ARRIVED_WORD + MAX_CHUNKS as u64;

/// One-shot (2 ranks, full residual, a one-shot config): the copy engines
/// move ALL of this rank's x into the peer's slot area, in `chunks` row
/// ranges of every row (at most [`arn::CE_LAUNCH_CHUNKS`]), and each rank
/// sums, adds its own residual and normalizes every row as the peer's land,
/// in one launch of `chunked` (fo_arn_ce_chunks) that waits for each range's
/// flag itself (no r comes back, one copy-engine latency in the chain
/// instead of two; the same bytes cross NVLink):
///
/// Copy C:  copy(x rows of chunk c -> the peer's slot area) set(x arrived c at peer) ...
/// S:       fo_arn_ce_chunks(wait x arrived c, reduce chunk c, ...; last CTA: zero every
///          x arrived, set consumed at peer, wait consumed, zero it) [C done]
///
/// The closing exchange ends a call only once both ranks have read every
/// row landed in their buffers, so the next call, of any mode, may write
/// into the peer's at once; the flags are zero again at the end. The x
/// copies follow the peer's previous call as a whole: two-shot calls end
/// after the peer's reads of its slots (their gathers wait for the peer's
/// r or rows, sent after its sums), one-shot calls by loads read nothing
/// of the slot area but the half the copying rank wrote itself.
fn enqueue_oneshot(
    chunked: &Kernel,
    call: &Call,
    checked: &arn::Checked,
    chunks: u32,
    caller: RawStream,
    lanes: &Lanes,
) -> Result<()> {
    let chunks = chunks.min(arn::CE_LAUNCH_CHUNKS as u32);
    let row = u64::from(call.hidden) * u64::from(call.dtype.bytes());
    let other = call.bases[1 - call.rank];
    let bounds: Vec<u64> = (0..chunks)
        .map(|c| oneshot_chunk(call.tokens, chunks, c).0)
        .chain(std::iter::once(call.tokens))
        .collect();
    let copy = lanes.copy.0;
    lanes.fork.order(caller, copy)?;
    // (Each flag written from a lane of its own, after an event of its copy, so that no memory
    // operation stands between the copies, took 1.4-1.6x the time on 2x H200.)
    for (c, w) in bounds.windows(2).enumerate() {
        let (f, l) = (w[0], w[1]);
        if l > f {
            stream::copy(
                copy,
                other + HEADER_BYTES + f * row,
                call.x + f * row,
                ((l - f) * row) as usize,
            )?;
        }
        stream::write(copy, x_arrived(other, c as u32), 1)?;
    }
    checked.launch_chunks(chunked, &bounds, caller)?;
    lanes.joins[0].order(copy, caller)
}

/// One-shot, watching (the default: `chunks` 0): the copy engine moves all
/// of this rank's x into the peer's watch area in one copy, then says so in
/// the peer's header. One launch of fo_arn_ce_watch (CTA b: rows b, b + ctas,
/// ...) sums and normalizes every row as its values land, known by their
/// value: the watch area holds the sentinel (0xffff in every 16-bit value,
/// filled when the buffer is attached) wherever nothing landed yet, and
/// the kernel puts it back over each row it has read (one bulk store from
/// shared memory in the ring build). A value that is the sentinel itself is
/// taken once the copy is known landed. No stream wait, flag or ~4-5 us gap
/// between copies stands between ranges: on 2x H200 (hidden 8192, 32 CTAs)
/// it took 0.74-0.87x the time of the flagged ranges at 2K-16K tokens (2K:
/// 118.9 against 158.8 us, 8K: 365.5 against 444.5), 0.76x the kernel's own
/// stores at 1K and 0.82x at 512 (evaluation/results/norm_ce_watch_h200x2.txt).
///
/// Outside graph capture, a call whose rows fit a watch half ([`Layout`]'s
/// `watch_halves`) lands them in the half of its epoch's parity (a host count
/// of such calls, alike on both ranks, skipping 0) and the copy lane then
/// writes the epoch into the peer's [`arn::CE_WATCH_EPOCH_WORD`], never
/// reset: the kernel ends when its rows are done, with no close (the caller
/// joins the copy). The peer's next copy into that half comes two such calls
/// later, after the peer's end of the call in between, which needed rows this
/// rank sent after this call had ended; no other call writes the halves or
/// the word. Otherwise (graph capture, whose replays would write the same
/// epochs and halves again after calls of any kind, or a larger call) the
/// rows land in the watch area, x arrived 0 follows them, and the last CTA
/// waits for that flag, zeroes it and exchanges consumed with the peer as
/// [`enqueue_oneshot`]'s does, so the area is the sentinel again, and no
/// copy lands in it, before either rank's next call.
fn enqueue_watch(
    watch: &Kernel,
    call: &Call,
    checked: &arn::Checked,
    caller: RawStream,
    lanes: &Lanes,
) -> Result<()> {
    let layout = call.layout()?;
    let row = u64::from(call.hidden) * u64::from(call.dtype.bytes());
    let bytes = call.tokens * row;
    let other = call.bases[1 - call.rank];
    let copy = lanes.copy.0;
    let halves = call.tokens > 0 && bytes <= layout.store_half && !stream::is_capturing(caller)?;
    // Epoch 0: the watch area, its flag and the close.
    let epoch = if halves {
        next_epoch(&lanes.watch_epoch)
    } else {
        0
    };
    let area = match epoch {
        0 => layout.watch_offset,
        e => layout.watch_halves + u64::from(e & 1) * layout.store_half,
    };
    lanes.fork.order(caller, copy)?;
    stream::copy(copy, other + area, call.x, bytes as usize)?;
    if epoch == 0 {
        stream::write(copy, x_arrived(other, 0), 1)?;
        checked.launch_watch(watch, caller, area, 0)?;
        return lanes.joins[0].order(copy, caller);
    }
    lanes.joins[0].record(copy)?;
    stream::write(copy, word(other, arn::CE_WATCH_EPOCH_WORD), epoch)?;
    checked.launch_watch(watch, caller, area, epoch)?;
    lanes.joins[0].wait(caller)
}

/// The next watched call's epoch: 1, 2, ..., skipping 0 (the kernel's "no
/// epoch") and 1 when the count wraps, so that parities still alternate.
fn next_epoch(last: &AtomicU32) -> u32 {
    let next = |e: u32| match e.wrapping_add(1) {
        0 => 2,
        n => n,
    };
    let prev = last
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |e| Some(next(e)))
        .unwrap_or_default();
    next(prev)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_epochs_count_from_one_and_alternate_parity_when_they_wrap() {
        let last = AtomicU32::new(0);
        assert_eq!([next_epoch(&last), next_epoch(&last)], [1, 2]);
        last.store(u32::MAX - 1, Ordering::Relaxed);
        let wrapped = [next_epoch(&last), next_epoch(&last), next_epoch(&last)];
        assert_eq!(wrapped, [u32::MAX, 2, 3]);
        // The kernel's test, a later epoch's word seen by an earlier call: landed.
        assert!(wrapped
            .windows(2)
            .all(|w| (w[1].wrapping_sub(w[0]) as i32) > 0));
    }

    #[test]
    fn chunks_cover_a_slice_in_order() {
        for (a, b) in [(0u64, 0u64), (0, 1), (500, 1001), (4096, 8192)] {
            for chunks in [1, 3, 4, 16, MAX_CHUNKS] {
                let mut next = a;
                for c in 0..chunks {
                    let (f, l) = chunk((a, b), chunks, c);
                    assert_eq!(f, next);
                    // Tapered: the inner chunks are 2 / (2n - 2) of the slice.
                    let share = if chunks >= TAPER_MIN_CHUNKS {
                        (2 * (b - a)).div_ceil(2 * u64::from(chunks) - 2)
                    } else {
                        (b - a).div_ceil(u64::from(chunks))
                    };
                    assert!(l >= f && l - f <= share);
                    next = l;
                }
                assert_eq!(next, b);
            }
        }
    }

    #[test]
    fn long_slices_have_half_size_ends() {
        let rows = |c| {
            let (f, l) = chunk((0, 6000), 6, c);
            l - f
        };
        assert_eq!(
            (0..6).map(rows).collect::<Vec<_>>(),
            [600, 1200, 1200, 1200, 1200, 600]
        );
        let (f, l) = chunk((0, 4000), 4, 0);
        assert_eq!((f, l), (0, 1000));
    }

    #[test]
    fn oneshot_ranges_cover_every_row_and_shrink() {
        for rows in [1u64, 7, 2048, 4096, 16384, 16383] {
            for chunks in 1..=16 {
                let ranges: Vec<_> = (0..chunks)
                    .map(|c| oneshot_chunk(rows, chunks, c))
                    .collect();
                assert_eq!(ranges[0].0, 0);
                assert_eq!(ranges[chunks as usize - 1].1, rows);
                assert!(ranges
                    .windows(2)
                    .all(|w| w[0].1 == w[1].0 && w[0].0 <= w[0].1));
            }
        }
        let sizes: Vec<u64> = (0..8)
            .map(|c| {
                let (f, l) = oneshot_chunk(16384, 8, c);
                l - f
            })
            .collect();
        // Half the second, then each 0.8 of the one before.
        assert!((sizes[0] * 2).abs_diff(sizes[1]) <= 2);
        assert!(sizes[1..]
            .windows(2)
            .all(|w| w[1] < w[0] && w[1] * 10 >= w[0] * 7));
        assert!(
            sizes[7] < 16384 / 12,
            "the range left after the last copy is small"
        );
    }

    #[test]
    fn automatic_ranges_follow_the_rows() {
        let two_shot: Vec<u32> = [1u64, 2047, 4096, 8192, 12288, 16384, 65536]
            .iter()
            .map(|&t| auto_chunks(t))
            .collect();
        assert_eq!(two_shot, [1, 1, 2, 4, 6, 6, 6]);
    }

    #[test]
    fn the_kernel_has_both_builds_and_kinds() {
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        let spec = crate::cuda::kernels::allreduce_rmsnorm_entry_spec(
            crate::dtype::Dtype::Bf16,
            crate::cuda::kernels::NormConfig::DEFAULT,
            NormEntry::CopyEngines,
        );
        let entry = format!("{}(Params p, int first, int last, int kind)", spec.entry);
        assert_eq!(
            source.matches(&entry).count(),
            2,
            "the ring's and the plain build's"
        );
        assert!(source.contains(&format!(
            "constexpr int CE_REDUCE = {}, CE_GATHER = {};",
            arn::CE_REDUCE,
            arn::CE_GATHER
        )));
        let chunked = crate::cuda::kernels::allreduce_rmsnorm_entry_spec(
            crate::dtype::Dtype::Bf16,
            crate::cuda::kernels::NormConfig::DEFAULT,
            NormEntry::CopyEngineChunks,
        );
        let entry = format!("{}(Params p, Chunks ch)", chunked.entry);
        assert_eq!(source.matches(&entry).count(), 2);
        // The one-launch kernel's header words and range count, as laid out here.
        assert!(source.contains("constexpr int CE_ARRIVED = DONE + FLAG_SLOTS * FO_MAX_WORLD;"));
        assert_eq!(
            CE_ARRIVED_WORD,
            16 + 2 * arn::FLAG_SLOTS as u64 * arn::MAX_WORLD as u64
        );
        assert!(source.contains(&format!(
            "constexpr int CE_CONSUMED = CE_ARRIVED + {MAX_CHUNKS};"
        )));
        assert!(source.contains(&format!(
            "constexpr int CE_LAUNCH_CHUNKS = {};",
            arn::CE_LAUNCH_CHUNKS
        )));
    }

    #[test]
    fn the_watched_ring_kernel_is_compiled_for_the_hidden_size() {
        let call = |hidden: u32, ring: bool| {
            let config = crate::cuda::kernels::NormConfig {
                oneshot: true,
                ring,
                ..crate::cuda::kernels::NormConfig::DEFAULT
            };
            arn::sample_call(2, 1000, hidden, config)
        };
        let hidden_of = |spec: &KernelSpec| spec.define("FO_HIDDEN").map(str::to_owned);
        let watched = kernel_spec(Dtype::Bf16, &call(4096, true), 0);
        assert_eq!(watched.entry, "fo_arn_ce_watch");
        assert_eq!(hidden_of(&watched).as_deref(), Some("4096"));
        // Another size is another kernel; the chunked launch and the plain build stay general.
        assert_ne!(watched, kernel_spec(Dtype::Bf16, &call(8192, true), 0));
        assert_eq!(
            hidden_of(&kernel_spec(Dtype::Bf16, &call(4096, true), 4)),
            None
        );
        assert_eq!(
            hidden_of(&kernel_spec(Dtype::Bf16, &call(4096, false), 0)),
            None
        );
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        assert!(source.contains("if (p.hidden == FO_HIDDEN) {"));
    }

    #[test]
    fn flags_lie_after_the_kernels_within_the_header() {
        let kernel_end = 16 + 2 * u64::from(arn::FLAG_SLOTS) * arn::MAX_WORLD as u64;
        assert!(CE_ARRIVED_WORD >= kernel_end);
        assert!((CE_ARRIVED_WORD + 2 * u64::from(MAX_CHUNKS)) * 4 <= HEADER_BYTES);
        // One-shot's closing flag takes the first r flag's word, which it leaves zero.
        assert!(CE_CONSUMED_WORD >= CE_ARRIVED_WORD + u64::from(MAX_CHUNKS));
        assert!(CE_CONSUMED_WORD < CE_ARRIVED_WORD + 2 * u64::from(MAX_CHUNKS));
    }
}
