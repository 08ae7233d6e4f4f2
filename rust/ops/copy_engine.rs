//! The copy-engine backend's per-group exchange, shared by GEMM +
//! AllReduce and GEMM + ReduceScatter: no SM moves a byte between GPUs.
//!
//! Per wave group, the comm stream waits for the GEMM's counter, copies
//! each peer's part of the group into that peer's staging slot for this
//! rank (copy engines) and flags it there with a stream memory write; a
//! second stream waits for the peers' flags and sums this rank's own part
//! and the staged ones into the output with a small kernel on the SMs the
//! GEMM leaves free:
//!
//! Comm stream C:   wait(free) wait(c0) copy(g0 -> peers) flag(peers) [e0] wait(c1) copy(g1) ...
//! Reduce stream R: [wait e0] wait(ready g0 from peers) reduce(g0) [wait e1] ... set(free at peers)
//!
//! AllReduce on 2 ranks: the peer gets the whole group and both ranks sum
//! all of it in place (one exchange; the links carry as much as a
//! ReduceScatter + AllGather would). On 3 or more (`Group::Gather`), as a
//! ReduceScatter + AllGather: peer p gets share p of the group, each rank
//! sums its own share, copies the sum into every peer's slot, and a landing
//! stream copies the peers' sums from its slots into the output, so that
//! each rank moves 2 (world - 1) / world of the group instead of
//! (world - 1) times it, and sums 1 / world of it:
//!
//! Reduce stream R: ... reduce(share of g) [go] ...
//! Gather streams:        [wait go] copy(sum -> peer p's slot) flag(p) ...
//! Land stream L:         [wait go] wait(gathered g from peers) copy(slots -> out) after(g) ...
//!
//! ReduceScatter: peer p gets the group's
//! chunk p of the send buffer, and the sum of chunk `rank` goes to this
//! rank's output rows. All-to-All: peer p gets the group's rows for p, and
//! the reduce stream copies what each peer staged into the output rows
//! where it belongs (copy engines again: no sum, no SM).

use super::gemm::{Prepared, Signals};
use crate::comm::communicator::Communicator;
use crate::comm::peer::{PeerBuffers, MAX_PEER_GROUPS};
use crate::cuda::kernels::{self, Kernel, PEER_REDUCE_THREADS};
use crate::cuda::stream::{self, RawStream};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// One wave group's exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exchange {
    /// Tiles the group's GEMM counter reaches when its output is stored.
    pub tiles: u32,
    /// This rank's part for rank p starts at `src + p * src_stride` (stride
    /// 0: every rank gets the same bytes, as in an AllReduce).
    pub src: u64,
    pub src_stride: u64,
    /// Bytes of each part.
    pub bytes: u64,
    /// Where the parts land in each receiver's staging slot.
    pub slot_offset: u64,
    /// Where this rank's sum goes (may equal its own part: in place).
    pub out: u64,
}

impl Exchange {
    fn part(&self, rank: usize) -> u64 {
        self.src + rank as u64 * self.src_stride
    }
}

/// `bytes` at `addr` of one rank's memory, and where they lie in a staging slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The receiver (in a send) or the source (in a landing).
    pub rank: usize,
    pub addr: u64,
    pub bytes: u64,
    pub slot_offset: u64,
}

/// One wave group's All-to-All: pieces sent into peers' slots, pieces that
/// land from this rank's slots into the output, and this rank's own rows
/// (send buffer to output, never leaving the GPU).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moves {
    pub tiles: u32,
    pub sends: Vec<Piece>,
    pub lands: Vec<Piece>,
    /// (from, to, bytes).
    pub own: (u64, u64, u64),
    /// The push backend: tiles the peer's GEMM stores into this rank's slot
    /// in this group (its ready flag counts them); 0 on the copy engines.
    pub pushed: u32,
}

/// One wave group's exchange on the copy engines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Group {
    /// Every peer's part summed into this rank's output.
    Sum(Exchange),
    /// An AllReduce (stride 0) as ReduceScatter + AllGather: rank p sums
    /// share p of the bytes ([`share`]) and gives every rank its sum.
    Gather(Exchange),
    Move(Moves),
}

impl Group {
    fn tiles(&self) -> u32 {
        match self {
            Group::Sum(e) | Group::Gather(e) => e.tiles,
            Group::Move(m) => m.tiles,
        }
    }

    /// The tiles of this group the peer's GEMM pushes to this rank (2
    /// ranks): all of an AllReduce's (stride 0: every rank gets the whole
    /// group), a ReduceScatter's of this rank's shard (1 / world of them,
    /// every shard having as many tiles in the group), an All-to-All's of
    /// the rows it sends this rank.
    pub fn pushed_tiles(&self, world: usize) -> u32 {
        match self {
            Group::Sum(e) | Group::Gather(e) if e.src_stride == 0 => e.tiles,
            Group::Sum(e) | Group::Gather(e) => e.tiles / world as u32,
            Group::Move(m) => m.pushed,
        }
    }

    /// Bytes of the slots this group writes into (and, on the receivers,
    /// reads from).
    fn slot_end(&self) -> u64 {
        match self {
            Group::Sum(e) | Group::Gather(e) => e.slot_offset + e.bytes,
            Group::Move(m) => m
                .sends
                .iter()
                .chain(&m.lands)
                .map(|p| p.slot_offset + p.bytes)
                .max()
                .unwrap_or(0),
        }
    }
}

/// Sums for every group (AllReduce, ReduceScatter).
pub fn sums(exchanges: Vec<Exchange>) -> Vec<Group> {
    exchanges.into_iter().map(Group::Sum).collect()
}

/// Whether the copy engines' ReduceScatter on 2 Hopper ranks sums in the
/// GEMM's epilogue (combined stores): yes unless FLASHOVERLAP_CE_REDUCE_SCATTER
/// is "sum" (the reduction kernel after each group's copies, as on other
/// GPUs and world sizes). Read once per process; every rank must set it alike.
pub fn combines_reduce_scatter() -> bool {
    static MODE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        !std::env::var("FLASHOVERLAP_CE_REDUCE_SCATTER")
            .unwrap_or_default()
            .trim()
            .eq_ignore_ascii_case("sum")
    })
}

/// Where the gathered AllReduce's sums are copied (FLASHOVERLAP_CE_SUMS_QUEUE,
/// read once per process; every rank must set it alike). On 2x H200 "order"
/// ran the 16 shapes 1.224x over cuBLAS then NCCL (geometric mean) against
/// "own"'s 1.196x (1.23x vs 1.11x at 16384 x 8192 x 1024), and the sums
/// behind every partial on one queue 1.146x (the sums came late).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SumsQueue {
    /// "own": a stream of their own, whose copies the copy engines
    /// interleave with the partials' as both become ready.
    Own,
    /// "order" (default): one queue with the partials, each copy where the
    /// GEMM's tile order finishes its group's part, so the link carries
    /// them in the order they become ready and a copy waits only for what
    /// the GEMM produces before what the copies behind it wait for.
    Order,
}

pub fn sums_queue() -> SumsQueue {
    static MODE: std::sync::OnceLock<SumsQueue> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| {
        match std::env::var("FLASHOVERLAP_CE_SUMS_QUEUE")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .as_str()
        {
            "own" => SumsQueue::Own,
            _ => SumsQueue::Order,
        }
    })
}

/// Whether an AllReduce over `world` ranks runs as ReduceScatter +
/// AllGather. On 2 ranks both move the same bytes over the link and one
/// exchange is what was measured (2x H200); beyond, sending the whole group
/// to every peer moves world / 2 times the bytes and sums world times them.
/// FLASHOVERLAP_CE_ALLREDUCE (read once per process; every rank must set it
/// alike) overrides: "gather" on 2 ranks too (each sums half: the one-exchange
/// AllReduce was sum-bound on 8 CTAs there, tune_h200x2.txt), "full" never,
/// "auto" or unset as above; the Python surface refuses other values.
pub fn gathers_all_reduce(world: usize) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *MODE.get_or_init(|| {
        match std::env::var("FLASHOVERLAP_CE_ALLREDUCE")
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase()
            .as_str()
        {
            "gather" => Some(true),
            "full" => Some(false),
            _ => None,
        }
    });
    world >= 2 && forced.unwrap_or(world >= 3)
}

/// AllReduce groups (stride-0 exchanges) for `world` ranks.
pub fn all_reduces(exchanges: Vec<Exchange>, world: usize) -> Vec<Group> {
    if gathers_all_reduce(world) {
        exchanges.into_iter().map(Group::Gather).collect()
    } else {
        sums(exchanges)
    }
}

/// Share `p` of `bytes` split among `world` ranks in whole 16-byte vectors:
/// (offset, bytes). Shares may be empty (fewer vectors than ranks).
pub fn share(bytes: u64, p: usize, world: usize) -> (u64, u64) {
    let vectors = bytes / 16;
    let (w, p) = (world as u64, p as u64);
    let (first, last) = (vectors * p / w, vectors * (p + 1) / w);
    (first * 16, (last - first) * 16)
}

/// Share `p` of an AllReduce exchange, as an exchange of its own.
fn share_of(e: &Exchange, p: usize, world: usize) -> Exchange {
    let (offset, bytes) = share(e.bytes, p, world);
    Exchange {
        tiles: e.tiles,
        src: e.src + offset,
        src_stride: 0,
        bytes,
        slot_offset: e.slot_offset + offset,
        out: e.out + offset,
    }
}

/// Checks what the backend needs of the groups before a plan is kept:
/// few enough for the ready flags, and 16-byte aligned sums.
pub fn check_groups(groups: &[Group]) -> Result<()> {
    if groups.len() > MAX_PEER_GROUPS {
        return Err(Error::Invalid(format!(
            "bands_per_group: the copy-engine backend signals at most {MAX_PEER_GROUPS} groups, the plan has {}",
            groups.len()
        )));
    }
    let aligned = |e: &&Exchange| {
        [e.src, e.src_stride, e.bytes, e.slot_offset, e.out]
            .iter()
            .all(|v| v % 16 == 0)
    };
    if groups
        .iter()
        .any(|g| matches!(g, Group::Gather(e) if e.src_stride != 0))
    {
        return Err(Error::Invalid(
            "internal: an AllReduce group has a stride".into(),
        ));
    }
    let mut sums = groups.iter().filter_map(|g| match g {
        Group::Sum(e) | Group::Gather(e) => Some(e),
        Group::Move(_) => None,
    });
    match sums.find(|e| !aligned(e)) {
        Some(e) => Err(Error::Invalid(format!(
            "internal: copy-engine group {e:?} is not 16-byte aligned"
        ))),
        None => Ok(()),
    }
}

/// The attached peer buffers, checked to hold every group's parts.
pub fn peer_buffers(comm: &Communicator, groups: &[Group]) -> Result<Arc<PeerBuffers>> {
    peer_buffers_holding(comm, groups.iter().map(Group::slot_end).max().unwrap_or(0))
}

/// The communicator's peer buffers, with slots of at least `bytes`.
pub fn peer_buffers_holding(comm: &Communicator, bytes: u64) -> Result<Arc<PeerBuffers>> {
    match comm.peer() {
        Some(p) if p.layout.slot_bytes >= bytes => Ok(p),
        _ => Err(Error::Invalid(format!(
            "backend: the copy-engine buffers of communicator {:?} hold {} bytes per rank, this call needs {bytes}; \
             the flashoverlap ops grow them (collectively) before the call",
            comm.name,
            comm.peer_slot_bytes()
        ))),
    }
}

/// Loads the reduction kernel for `world` ranks (None for one rank: its sum
/// is its own part, already in place or copied).
pub fn load_reducer(comm: &Communicator, dtype: Dtype, world: usize) -> Result<Option<Kernel>> {
    (world > 1)
        .then(|| {
            kernels::load(
                &comm.device,
                &kernels::peer_reduce_spec(dtype, world as u32, comm.device.major),
            )
        })
        .transpose()
}

/// Launches the sum of `e`'s parts: this rank's own and those staged by
/// every peer, in rank order (every rank adds in the same order).
fn reduce(
    reducer: &Kernel,
    peer: &PeerBuffers,
    e: &Exchange,
    ctas: u32,
    stream: RawStream,
) -> Result<()> {
    let me = peer.rank;
    let mut sources = [0u64; 7];
    for (i, source) in (0..peer.layout.world).filter(|&s| s != me).enumerate() {
        sources[i] = peer.slot_from(source) + e.slot_offset;
    }
    let (mut out, mut mine) = (e.out, e.part(me));
    let mut own = me as i32;
    let mut vectors = (e.bytes / 16) as i64;
    let blocks = (vectors as u64)
        .div_ceil(u64::from(PEER_REDUCE_THREADS))
        .max(1);
    let grid = u64::from(ctas.max(1)).min(blocks) as u32;
    let mut params: [*mut c_void; 5] = [
        (&mut out as *mut u64).cast(),
        (&mut mine as *mut u64).cast(),
        (&mut sources as *mut [u64; 7]).cast(),
        (&mut own as *mut i32).cast(),
        (&mut vectors as *mut i64).cast(),
    ];
    reducer.launch(grid, PEER_REDUCE_THREADS, stream, &mut params)
}

/// Copies the rows each peer staged for group `m` from this rank's slots
/// into the output (an All-to-All's landing: no sum, the copy engines).
fn land_rows(peer: &PeerBuffers, m: &Moves, stream: RawStream) -> Result<()> {
    for l in m.lands.iter().filter(|l| l.bytes > 0) {
        let from = peer.slot_from(l.rank) + l.slot_offset;
        stream::copy(stream, l.addr, from, l.bytes as usize)?;
    }
    Ok(())
}

/// The most CTAs an overlapped op's sums run on: beside a GEMM, 8 CTAs sum
/// ~232 GB/s of output at world 2 (evaluation/results/peer_reduce_h200.txt),
/// as fast as the copies deliver a ReduceScatter's and twice an AllReduce's.
pub const MAX_REDUCE_CTAS: u32 = 8;

/// The most CTAs the push backend's sums run on: no copy feeds them, the
/// GEMM pushed the bytes already, so more CTAs keep paying (16 sum ~456 GB/s
/// of output beside a GEMM, linear from 4 to 24: peer_reduce_h200.txt).
pub const MAX_PUSH_REDUCE_CTAS: u32 = 16;

/// The most CTAs a backend's sums run on (the rest of the reserved SMs, if
/// any, run what follows a group: the fused norm).
pub fn reduce_cta_cap(pushed: bool) -> u32 {
    if pushed {
        MAX_PUSH_REDUCE_CTAS
    } else {
        MAX_REDUCE_CTAS
    }
}

/// What one call enqueues on the copy-engine backend.
pub struct Call<'a> {
    pub peer: &'a PeerBuffers,
    /// Loaded before anything is enqueued (None for one rank).
    pub reducer: Option<&'a Kernel>,
    /// The GEMM's group counters each exchange waits for; None: the data is
    /// ready when the caller's stream reaches the call (a plain collective).
    pub signals: Option<&'a Signals>,
    pub groups: &'a [Group],
    /// CTAs of each reduction (the SMs the GEMM leaves free).
    pub reduce_ctas: u32,
}

/// Enqueues the GEMM (`launch_gemm` on the caller's stream, after the fork
/// so that the comm streams do not wait for it) and every group's exchange;
/// `after(g, stream)` enqueues what follows group g's sum on the reduce
/// stream (un-reorder, fused norm). The caller's stream joins both streams.
pub fn enqueue(
    comm: &Communicator,
    call: &Call,
    caller: RawStream,
    launch_gemm: impl FnOnce() -> Result<()>,
    mut after: impl FnMut(usize, RawStream) -> Result<()>,
) -> Result<()> {
    let peer = call.peer;
    let layout = peer.layout;
    let me = peer.rank;
    let (copies, reduces) = (comm.stream.0, comm.reduce_stream.0);
    // The copies to the i-th peer run on links[i]: the comm stream for the
    // first, a stream of their own for the others.
    let extra: Vec<RawStream> = comm.link_streams.iter().map(|s| s.0).collect();
    let links: Vec<RawStream> = std::iter::once(copies)
        .chain(extra.iter().copied())
        .collect();
    if links.len() < peer.peers().count() || comm.link_done.len() < extra.len() {
        return Err(Error::Invalid("internal: copy streams not made".into()));
    }
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    let events = comm.group_events.lock().unwrap_or_else(|p| p.into_inner());
    if events.len() < call.groups.len() {
        return Err(Error::Invalid("internal: group events not made".into()));
    }
    // AllReduce as ReduceScatter + AllGather: a gather stream per peer, and
    // the landing stream (which then also frees the slots: it reads them last).
    let gathering = layout.world > 1 && call.groups.iter().any(|g| matches!(g, Group::Gather(_)));
    let land = comm.land_stream.0;
    // The gather streams (one per peer), then the landing stream; none
    // where no group gathers.
    let gather_and_land: Vec<RawStream> = if gathering {
        comm.gather_streams
            .iter()
            .map(|s| s.0)
            .chain([land])
            .collect()
    } else {
        Vec::new()
    };
    let gathers = &gather_and_land[..gather_and_land.len().saturating_sub(1)];
    if gathering && gathers.len() < peer.peers().count() {
        return Err(Error::Invalid("internal: gather streams not made".into()));
    }
    let forked: Vec<RawStream> = [copies, reduces]
        .into_iter()
        .chain(extra.iter().copied())
        .chain(gather_and_land.iter().copied())
        .collect();
    // The groups' counters start at zero: one memset here rather than a
    // reset after each wait on the copy queue, where each stream memory
    // operation idles the links between copies.
    if let Some(signals) = call.signals {
        let counters: Vec<u64> = (0..call.groups.len()).map(|g| signals.counter(g)).collect();
        stream::zero_words(caller, &counters)?;
    }
    comm.fork.order_all(caller, &forked)?;
    launch_gemm()?;
    // This rank's slot in each peer may be written once that peer summed
    // the previous call (the flag starts set).
    for p in peer.peers() {
        let free = layout.free_flag(peer.bases[me], p);
        stream::take(copies, free, 1)?;
    }
    for (g, group) in call.groups.iter().enumerate() {
        if let Some(signals) = call.signals {
            stream::wait_geq(copies, signals.counter(g), group.tiles())?;
        }
        if !extra.is_empty() {
            comm.link_go.order_all(copies, &extra)?;
        }
        let send =
            |link: RawStream, p: usize, src: u64, bytes: u64, slot_offset: u64| -> Result<()> {
                if bytes > 0 {
                    let dst = peer.slot_at(p) + slot_offset;
                    stream::copy(link, dst, src, bytes as usize)?;
                }
                // A stream write is fenced after the copy before it: the peer
                // sees the flag only once the bytes are there. Every peer gets
                // one per group, bytes or not.
                stream::write(link, layout.ready_flag(peer.bases[p], g, me), 1)
            };
        match group {
            Group::Sum(e) => {
                for (link, p) in links.iter().zip(peer.peers()) {
                    send(*link, p, e.part(p), e.bytes, e.slot_offset)?;
                }
            }
            Group::Gather(e) => {
                for (link, p) in links.iter().zip(peer.peers()) {
                    let s = share_of(e, p, layout.world);
                    send(*link, p, s.src, s.bytes, s.slot_offset)?;
                }
            }
            Group::Move(m) => {
                for (link, p) in links.iter().zip(peer.peers()) {
                    match m.sends.iter().find(|s| s.rank == p) {
                        Some(s) => send(*link, p, s.addr, s.bytes, s.slot_offset)?,
                        None => send(*link, p, 0, 0, 0)?,
                    }
                }
                let (from, to, bytes) = m.own;
                if bytes > 0 {
                    stream::copy(copies, to, from, bytes as usize)?;
                }
            }
        }
        // The sum may rewrite the group's parts in place (AllReduce), so it
        // also waits for this rank's own copies of them, on every link (which
        // also joins the links into the caller's stream through this one).
        events[g].order(copies, reduces)?;
        for (done, link) in comm.link_done.iter().zip(&extra) {
            done.order(*link, reduces)?;
        }
        for p in peer.peers() {
            let ready = layout.ready_flag(peer.bases[me], g, p);
            stream::take(reduces, ready, 1)?;
        }
        match (group, call.reducer) {
            (Group::Sum(e), Some(reducer)) => reduce(reducer, peer, e, call.reduce_ctas, reduces)?,
            (Group::Gather(e), Some(reducer)) => {
                let mine = share_of(e, me, layout.world);
                reduce(reducer, peer, &mine, call.reduce_ctas, reduces)?;
                // The sum of this rank's share goes to every peer's slot for
                // it, where the peers' shares came from: the slots' bytes of
                // other shares, so nothing a reduction still reads.
                comm.gather_go.order_all(reduces, &gather_and_land)?;
                for (&link, p) in gathers.iter().zip(peer.peers()) {
                    if mine.bytes > 0 {
                        let dst = peer.slot_at(p) + mine.slot_offset;
                        stream::copy(link, dst, mine.out, mine.bytes as usize)?;
                    }
                    stream::write(link, layout.gathered_flag(peer.bases[p], g, me), 1)?;
                }
                // Each peer's summed share lands in the output; the output's
                // bytes of that share were this rank's part, sent to that
                // peer before it could sum (and so gather) it.
                for q in peer.peers() {
                    let flag = layout.gathered_flag(peer.bases[me], g, q);
                    stream::take(land, flag, 1)?;
                    let theirs = share_of(e, q, layout.world);
                    if theirs.bytes > 0 {
                        let from = peer.slot_from(q) + theirs.slot_offset;
                        stream::copy(land, theirs.out, from, theirs.bytes as usize)?;
                    }
                }
                after(g, land)?;
                continue;
            }
            (Group::Gather(_), None) => {
                return Err(Error::Invalid(
                    "internal: an AllReduce group without a reduction kernel".into(),
                ))
            }
            // One rank: the sum is its own part.
            (Group::Sum(e), None) if e.out != e.part(me) => {
                stream::copy(reduces, e.out, e.part(me), e.bytes as usize)?
            }
            (Group::Sum(_), None) => {}
            (Group::Move(m), _) => land_rows(peer, m, reduces)?,
        }
        after(g, reduces)?;
    }
    // Every staged part of this call is summed (and landed): the peers may
    // write again.
    let last_reader = if gathering {
        comm.land_join.order(reduces, land)?;
        land
    } else {
        reduces
    };
    for p in peer.peers() {
        stream::write(last_reader, layout.free_flag(peer.bases[p], me), 1)?;
    }
    comm.join.order(copies, caller)?;
    comm.reduce_join.order(reduces, caller)?;
    for &stream in &gather_and_land {
        comm.land_join.order(stream, caller)?;
    }
    Ok(())
}

/// The push backend's version of [`enqueue`] (2 ranks; every group a
/// [`Group::Sum`], an AllReduce's whole group or a ReduceScatter's chunks,
/// or a [`Group::Move`], an All-to-All's rows): no copy to the peer, no
/// copy stream. The GEMM (`prepare_gemm(push, push_flags)`, given where to
/// store the tiles it pushes and the peer's ready flags to count them in;
/// prepared before anything is enqueued, since a failure inside the
/// handshake would leave the peer waiting; None: no GEMM, no tile on this
/// rank) writes them into the peer's slot itself, so the caller's stream first
/// waits for that slot to be free (the peer consumed this rank's previous
/// call); per group the reduce stream waits for this rank's own tiles (the
/// GEMM's counter) and the peer's (its pushes, counted in this rank's ready
/// flag), sums (or, for an All-to-All, copies the rows that landed in the
/// slot and this rank's own into the output: local copies), and runs `after`:
///
/// Caller S:       wait(free) set(taken at peer) [fork] GEMM (stores, pushes, counts)       [join]
/// Reduce stream R:     wait(taken) wait(c0) wait(ready g0) reduce(g0) ... set(free at peer)
pub fn enqueue_pushed<'g>(
    comm: &Communicator,
    call: &Call,
    caller: RawStream,
    prepare_gemm: impl FnOnce(u64, u64) -> Result<Option<Prepared<'g>>>,
    mut after: impl FnMut(usize, RawStream) -> Result<()>,
) -> Result<()> {
    let peer = call.peer;
    let layout = peer.layout;
    let me = peer.rank;
    let sums = call.groups.iter().any(|g| matches!(g, Group::Sum(_)));
    let (Some(signals), true) = (call.signals, call.reducer.is_some() || !sums) else {
        return Err(Error::Invalid(
            "internal: the push backend needs the GEMM's counters (and a reduction to sum)".into(),
        ));
    };
    let other = only_peer(peer, "backend: 'push'")?;
    if call.groups.iter().any(|g| matches!(g, Group::Gather(_))) {
        return Err(Error::Invalid(
            "internal: the push backend sums an AllReduce's whole group on both ranks".into(),
        ));
    }
    let reduces = comm.reduce_stream.0;
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    // Offsets into the slot are those into the GEMM's store buffer
    // ([`Exchange::slot_offset`]), so the slot is laid out like it.
    let slot = peer.slot_at(other);
    let gemm = prepare_gemm(slot, layout.ready_flag(peer.bases[other], 0, me))?;
    // The GEMM writes into the peer's slot for this rank from its first tile.
    take_grant(peer, other, caller)?;
    comm.fork.order(caller, reduces)?;
    if let Some(gemm) = gemm {
        gemm.enqueue(caller)?;
    }
    // The peer's acknowledgement of the previous grant, waited for first
    // thing, leaves only the grant itself for the call's end.
    take_acknowledgement(peer, other, reduces)?;
    for (g, group) in call.groups.iter().enumerate() {
        let counter = signals.counter(g);
        stream::take(reduces, counter, group.tiles())?;
        let ready = layout.ready_flag(peer.bases[me], g, other);
        stream::take(reduces, ready, group.pushed_tiles(layout.world))?;
        match (group, call.reducer) {
            (Group::Sum(e), Some(reducer)) => reduce(reducer, peer, e, call.reduce_ctas, reduces)?,
            (Group::Move(m), _) => {
                land_rows(peer, m, reduces)?;
                let (from, to, bytes) = m.own;
                if bytes > 0 {
                    stream::copy(reduces, to, from, bytes as usize)?;
                }
            }
            _ => unreachable!("checked above"),
        }
        after(g, reduces)?;
    }
    // Every pushed tile of this call is consumed.
    grant(peer, other, reduces)?;
    comm.reduce_join.order(reduces, caller)
}

/// Waits on `stream` for the grant to write into `other`'s slot for this
/// rank (its free flag here) and acknowledges taking it. The peer hands the
/// next grant only after that acknowledgement, or a peer that waits for no
/// push from this rank could grant again before this reset and the two
/// grants would merge into one (a hang one call later).
fn take_grant(peer: &PeerBuffers, other: usize, stream: RawStream) -> Result<()> {
    let (layout, me) = (peer.layout, peer.rank);
    let free = layout.free_flag(peer.bases[me], other);
    stream::take(stream, free, 1)?;
    stream::write(stream, layout.taken_flag(peer.bases[other], me), 1)
}

/// Once this rank consumed everything `other` wrote into its slot this call
/// (enqueued on `stream` before) and `other` took its previous grant, hands
/// it the next one.
fn hand_back_grant(peer: &PeerBuffers, other: usize, stream: RawStream) -> Result<()> {
    take_acknowledgement(peer, other, stream)?;
    grant(peer, other, stream)
}

/// The first half of [`hand_back_grant`]: waits on `stream` until `other`
/// took this rank's previous grant (and resets its acknowledgement).
fn take_acknowledgement(peer: &PeerBuffers, other: usize, stream: RawStream) -> Result<()> {
    let taken = peer.layout.taken_flag(peer.bases[peer.rank], other);
    stream::take(stream, taken, 1)
}

/// The second half of [`hand_back_grant`], on a stream ordered after the
/// first: `other` may write into its slot here again.
fn grant(peer: &PeerBuffers, other: usize, stream: RawStream) -> Result<()> {
    stream::write(
        stream,
        peer.layout.free_flag(peer.bases[other], peer.rank),
        1,
    )
}

/// FLASHOVERLAP_PEER_TIMEOUT_S in ns (0: unset, waits are unbounded), as
/// the peer norm reads it (python/flashoverlap/peer_norm.py).
pub fn peer_timeout_ns() -> Result<u64> {
    let raw = std::env::var("FLASHOVERLAP_PEER_TIMEOUT_S").unwrap_or_default();
    let raw = raw.trim();
    if raw.is_empty() {
        return Ok(0);
    }
    match raw.parse::<f64>() {
        Ok(s) if s.is_finite() && s >= 0.0 => Ok(((s * 1e9) as u64).max(1)),
        _ => Err(Error::Invalid(format!(
            "FLASHOVERLAP_PEER_TIMEOUT_S: expected seconds, got {raw:?}"
        ))),
    }
}

/// The one other rank of a 2-rank communicator (`what` runs on no other).
fn only_peer(peer: &PeerBuffers, what: &str) -> Result<usize> {
    match peer.peers().collect::<Vec<_>>()[..] {
        [p] => Ok(p),
        _ => Err(Error::Invalid(format!(
            "{what} runs on exactly 2 ranks, this communicator has {}",
            peer.layout.world
        ))),
    }
}

/// Where a combined-stores GEMM sends and finds the partials (addresses
/// as mapped here): the peer's slot for this rank and its ready flags for
/// this rank (group 0's; PEER_FLAG_STRIDE words apart), this rank's slot for
/// the peer and its ready flags for the peer, the peer's gathered flags for
/// this rank (a gathered AllReduce's pushed sums), the timed-out word and
/// the wait's bound ([`peer_timeout_ns`]).
#[derive(Debug, Clone, Copy)]
pub struct Targets {
    pub peer_slot: u64,
    pub peer_ready: u64,
    pub recv: u64,
    pub ready: u64,
    pub peer_gathered: u64,
    pub timed_out: u64,
    pub timeout_ns: u64,
}

/// One group's copy into the peer's slot: once the GEMM's counter at
/// `counter` reaches `tiles`, `bytes` from `src` to `slot_offset` in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotCopy {
    pub counter: u64,
    pub tiles: u32,
    pub src: u64,
    pub slot_offset: u64,
    pub bytes: u64,
}

/// One group's landing in a gathered AllReduce: once this rank's gathered
/// flag of the group reaches `count` (the peer's sums are in this rank's
/// slot), `bytes` from `slot_offset` of the slot to `out` (0: none, what
/// follows reads the slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Land {
    pub count: u32,
    pub slot_offset: u64,
    pub out: u64,
    pub bytes: u64,
}

/// The second half of an AllReduce on 2 ranks with combined stores: each
/// rank's sums of its own shard go to the peer's slot, pushed by the GEMM
/// (`sends` None: the kernel counts them in the peer's gathered flags) or
/// copied per group by the copy engines (`sends`: from the output, once the
/// group's counter says its tiles are stored, then the peer's gathered flag
/// set to 1), and land in the peer's output (`lands`). `after(g, stream)`
/// follows group g's landing on the landing stream (its fused norm), once
/// this rank's own tiles of g are stored too: with pushed sums, once the
/// counter at `own_counters` + 4 g (every tile of the group counts; 0:
/// no wait) reaches `own_tiles[g]`; with copied ones, once the send's wait
/// is over.
pub struct GatherSteps<'a> {
    pub sends: Option<&'a [SlotCopy]>,
    pub lands: &'a [Land],
    pub own_counters: u64,
    pub own_tiles: &'a [u32],
    pub after: &'a mut dyn FnMut(usize, RawStream) -> Result<()>,
    /// (group, sums?) in the order the GEMM finishes each group's partials
    /// and sums: the copies' order on one queue ([`SumsQueue::Order`]).
    pub finish_order: &'a [(usize, bool)],
}

/// A ReduceScatter with combined stores on 2 ranks: the GEMM computes the
/// tiles of the peer's shard first and adds what the peer sent into its own
/// tiles before storing them (csrc/gemm_signal_sm90.cu), so no sum follows
/// it. The peer's tiles travel either from the GEMM's epilogue (push:
/// `copies` None; it stores them into the peer's slot and counts them in the
/// peer's ready flags) or by copy engine (`copies`: it stores them locally
/// and counts them in local counters; per group a second stream waits for
/// the count, copies the group into the peer's slot and sets the peer's
/// ready flag to 1):
///
/// Caller S:  zero(counters) [fork] GEMM (waits for ready, sums) zero(ready) wait(taken) set(free at peer) [join]
/// Comm C:                   wait(free) set(taken at peer) wait(c0) copy(g0 -> peer) set(ready g0 at peer) ...
///
/// (push: the caller takes the grant, wait(free) set(taken at peer), before
/// the GEMM, which writes into the peer's slot.)
///
/// With `gather` (an AllReduce, [`GatherSteps`]) the sums are copied too
/// (copy engines) and the landing stream lands the peer's. By default
/// ([`SumsQueue::Order`]) the sums' copies join the partials' on the comm
/// stream, each where the GEMM finishes its part (`finish_order`), and
/// the side (reduce) stream sets their gathered flags; with
/// [`SumsQueue::Own`] the side stream copies them too:
///
/// Comm C:    ... wait(c1) copy(g1 -> peer) set(ready g1) wait(own c0) copy(sums g0 -> peer) [e0] ...
/// Side R:    [wait e0] set(gathered g0 at peer) ...
/// Land L:    wait(taken) wait(gathered g0) reset(gathered g0) copy(slot -> out) [wait e0 or own c0] after(g0) ...
/// Caller S:  ... [join L] set(free at peer)
///
/// `prepare_gemm(targets)` makes the launch before anything is enqueued.
/// With a bounded wait ([`peer_timeout_ns`]) a wait that timed out in an
/// earlier call is reported here (outside graph capture).
pub fn enqueue_combined<'g>(
    comm: &Communicator,
    peer: &PeerBuffers,
    groups: usize,
    copies: Option<&[SlotCopy]>,
    gather: Option<GatherSteps>,
    caller: RawStream,
    prepare_gemm: impl FnOnce(Targets) -> Result<Prepared<'g>>,
) -> Result<()> {
    let layout = peer.layout;
    let me = peer.rank;
    let other = only_peer(peer, "internal: combined stores")?;
    let timed_out = layout.timed_out_flag(peer.bases[me]);
    let timeout_ns = peer_timeout_ns()?;
    if timeout_ns > 0
        && !stream::is_capturing(caller)?
        && crate::cuda::memory::read_u32(timed_out)? != 0
    {
        return Err(Error::Invalid(
            "combined stores: a GEMM's wait for the peer's tiles timed out (FLASHOVERLAP_PEER_TIMEOUT_S); \
             the ranks did not call the op together. The communicator's peer buffers are unusable."
                .into(),
        ));
    }
    let slot = peer.slot_at(other);
    let recv = peer.slot_from(other);
    let gemm = prepare_gemm(Targets {
        peer_slot: slot,
        peer_ready: layout.ready_flag(peer.bases[other], 0, me),
        recv,
        ready: layout.ready_flag(peer.bases[me], 0, other),
        peer_gathered: layout.gathered_flag(peer.bases[other], 0, me),
        timed_out,
        timeout_ns,
    })?;
    let sends = gather.as_ref().and_then(|g| g.sends);
    // The partials and the sums on one queue in the order the GEMM finishes
    // them ([`SumsQueue::Order`]), checked before anything is enqueued.
    let ordered = match (copies, sends) {
        (Some(c), Some(s)) if sums_queue() == SumsQueue::Order => {
            let order = gather.as_ref().map_or(&[][..], |g| g.finish_order);
            let groups = c.len().min(s.len());
            if order.len() != c.len() + s.len() || order.iter().any(|&(g, _)| g >= groups) {
                return Err(Error::Invalid(
                    "internal: the copies' order does not match the groups".into(),
                ));
            }
            Some(order)
        }
        _ => None,
    };
    let (copier, land, side) = (comm.stream.0, comm.land_stream.0, comm.reduce_stream.0);
    // The side stream copies the sums ([`SumsQueue::Own`]) or, where they
    // share the copier's queue, only sets their gathered flags: a stream
    // write after a copy holds its queue ~6 us (2x H200), and the peer's
    // landing, unlike its GEMM, can wait that long. The partials' ready
    // flags stay on the copier: the peer's GEMM waits for them.
    let sender = if ordered.is_some() { copier } else { side };
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    let events = comm.group_events.lock().unwrap_or_else(|p| p.into_inner());
    if sends.is_some() && events.len() < groups {
        return Err(Error::Invalid("internal: group events not made".into()));
    }
    // Where only the copy queue writes into the peer (its copies, and the
    // side stream's flags ordered after them), the copy queue takes the grant
    // and the GEMM starts without waiting on the peer: each stream memory
    // operation ahead of it costs the call ~2-5 us. A GEMM that pushes into
    // the peer's slot needs the grant before it starts.
    let gemm_writes_peer = copies.is_none() || (gather.is_some() && sends.is_none());
    let grant_on_copier = !gemm_writes_peer && (sends.is_none() || ordered.is_some());
    if !grant_on_copier {
        take_grant(peer, other, caller)?;
    }
    // The counters the copies wait for start each call at zero, zeroed here
    // (one memset each) rather than by a write after each wait: on the copy
    // queue each stream memory operation idles the link between copies.
    for list in [copies, sends].into_iter().flatten() {
        let words: Vec<u64> = list.iter().map(|c| c.counter).collect();
        stream::zero_words(caller, &words)?;
    }
    // The side streams start after the caller's earlier work and the zeroing
    // (and, under graph capture, join the capture here), before the GEMM.
    let mut forked = Vec::new();
    if copies.is_some() {
        forked.push(copier);
    }
    if sends.is_some() {
        forked.push(side);
    }
    if gather.is_some() {
        forked.push(land);
    }
    if !forked.is_empty() {
        comm.fork.order_all(caller, &forked)?;
    }
    if grant_on_copier {
        take_grant(peer, other, copier)?;
    }
    gemm.enqueue(caller)?;
    // The GEMM waited for every group's ready flag: they are consumed, and
    // zeroed here, while the last groups' copies still run, not at the end.
    let ready: Vec<u64> = (0..groups)
        .map(|g| layout.ready_flag(peer.bases[me], g, other))
        .collect();
    stream::zero_words(caller, &ready)?;
    // Without a gather the GEMM consumed everything the peer writes into
    // this rank's slot: the next grant goes now, before the last copies end.
    // With one, the landing stream reads the slot last; it waits for the
    // peer's acknowledgement of the previous grant first thing, so that
    // only the grant itself is left for the call's end.
    if gather.is_some() {
        take_acknowledgement(peer, other, land)?;
    } else {
        hand_back_grant(peer, other, caller)?;
    }
    let partial = |g: usize, c: &SlotCopy| -> Result<()> {
        stream::wait_geq(copier, c.counter, c.tiles)?;
        stream::copy(copier, slot + c.slot_offset, c.src, c.bytes as usize)?;
        stream::write(copier, layout.ready_flag(peer.bases[other], g, me), 1)
    };
    let send = |g: usize, c: &SlotCopy| -> Result<()> {
        stream::wait_geq(sender, c.counter, c.tiles)?;
        stream::copy(sender, slot + c.slot_offset, c.src, c.bytes as usize)?;
        // After the copy: what follows the landing (the fused norm)
        // may rewrite the rows it read; the flag follows it too.
        events[g].record(sender)?;
        if sender != side {
            events[g].wait(side)?;
        }
        stream::write(side, layout.gathered_flag(peer.bases[other], g, me), 1)
    };
    if let (Some(order), Some(copies), Some(sends)) = (ordered, copies, sends) {
        for &(g, sums) in order {
            if sums {
                send(g, &sends[g])?;
            } else {
                partial(g, &copies[g])?;
            }
        }
    } else {
        for (g, c) in copies.unwrap_or_default().iter().enumerate() {
            partial(g, c)?;
        }
        for (g, c) in sends.unwrap_or_default().iter().enumerate() {
            send(g, c)?;
        }
    }
    if copies.is_some() {
        comm.join.order(copier, caller)?;
    }
    if sends.is_some() {
        comm.reduce_join.order(side, caller)?;
    }
    if let Some(gather) = gather {
        for (g, l) in gather.lands.iter().enumerate() {
            let flag = layout.gathered_flag(peer.bases[me], g, other);
            stream::take(land, flag, l.count)?;
            if l.bytes > 0 {
                stream::copy(land, l.out, recv + l.slot_offset, l.bytes as usize)?;
            }
            // This rank's own tiles of g are stored once the send's wait is
            // over (copied sums) or the GEMM's counter says so (pushed ones).
            if gather.sends.is_some() {
                events[g].wait(land)?;
            } else if gather.own_counters != 0 {
                let counter = gather.own_counters + 4 * g as u64;
                stream::take(land, counter, gather.own_tiles[g])?;
            }
            (gather.after)(g, land)?;
        }
        comm.land_join.order(land, caller)?;
        grant(peer, other, caller)?;
    }
    Ok(())
}

/// Enqueues an overlapped op's GEMM (`prepare_gemm(signals)`, None where
/// this rank computes no tile) and its groups on one node: moved by the copy
/// engines ([`enqueue`]), or with `pushed = Some(push_rows)` by the GEMM
/// itself ([`enqueue_pushed`], its launch given `call.signals` plus where to
/// push: see [`Signals::push`]). The launch is prepared (and checked) before
/// anything is enqueued.
pub fn enqueue_gemm<'g>(
    comm: &Communicator,
    call: &Call,
    caller: RawStream,
    pushed: Option<u32>,
    prepare_gemm: impl FnOnce(&Signals) -> Result<Option<Prepared<'g>>>,
    after: impl FnMut(usize, RawStream) -> Result<()>,
) -> Result<()> {
    let signals = call.signals.ok_or_else(|| {
        Error::Invalid("internal: an overlapped op without the GEMM's counters".into())
    })?;
    match pushed {
        None => {
            let gemm = prepare_gemm(signals)?;
            let launch = || gemm.map_or(Ok(()), |g| g.enqueue(caller));
            enqueue(comm, call, caller, launch, after)
        }
        Some(push_rows) => enqueue_pushed(
            comm,
            call,
            caller,
            |push, push_flags| {
                prepare_gemm(&Signals {
                    push,
                    push_flags,
                    push_rows,
                    ..*signals
                })
            },
            after,
        ),
    }
}

/// A plain collective on the copy engines (no GEMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plain {
    /// `out` = the sum over ranks of `src` (`bytes` each; `out` may be `src`).
    AllReduce,
    /// `out` = the sum over ranks of block `rank` of `src` (`bytes` = the
    /// whole input, `world` blocks).
    ReduceScatter,
}

/// Chunks a plain collective is cut into, so that the copies of one chunk
/// overlap the sum of the previous: ~4 MiB each, at most 8.
pub const PLAIN_CHUNK_BYTES: u64 = 4 << 20;
pub const MAX_PLAIN_CHUNKS: u64 = 8;

/// The exchanges of a plain collective of `bytes` (a multiple of 16, and of
/// 16 * world for ReduceScatter) over `world` ranks: `chunks` of them (as
/// many as the data has vectors at most), else the default chunking.
pub fn plain_exchanges(
    kind: Plain,
    src: u64,
    out: u64,
    bytes: u64,
    world: usize,
    chunks: Option<u64>,
) -> Result<Vec<Exchange>> {
    let unit = match kind {
        Plain::AllReduce => 16,
        Plain::ReduceScatter => 16 * world as u64,
    };
    if bytes % unit != 0 {
        return Err(Error::Invalid(format!(
            "tensor: the copy-engine {kind:?} moves 16-byte vectors; {bytes} bytes are not a multiple of {unit}"
        )));
    }
    let part = match kind {
        Plain::AllReduce => bytes,
        Plain::ReduceScatter => bytes / world as u64,
    };
    let vectors = part / 16;
    let chunks = chunks
        .unwrap_or_else(|| part.div_ceil(PLAIN_CHUNK_BYTES).clamp(1, MAX_PLAIN_CHUNKS))
        .clamp(1, vectors.max(1));
    let stride = match kind {
        Plain::AllReduce => 0,
        Plain::ReduceScatter => part,
    };
    Ok((0..chunks)
        .map(|c| {
            let (first, last) = (vectors * c / chunks, vectors * (c + 1) / chunks);
            Exchange {
                tiles: 0,
                src: src + first * 16,
                src_stride: stride,
                bytes: (last - first) * 16,
                slot_offset: first * 16,
                out: out + first * 16,
            }
        })
        .filter(|e| e.bytes > 0)
        .collect())
}

/// Enqueues a plain collective on the copy engines, ordered after the
/// caller's prior work and before its later work; its sums run on `ctas`
/// CTAs, in `chunks` pipelined exchanges (None: ~4 MiB each; 1 is how one
/// wave group of an overlapped op moves, which is what `tune` times). The
/// peer buffers must hold `bytes` (AllReduce) or `bytes / world`
/// (ReduceScatter) per slot: the Python op grows them first.
#[allow(clippy::too_many_arguments)]
pub fn plain(
    comm: &Communicator,
    kind: Plain,
    src: u64,
    out: u64,
    bytes: u64,
    dtype: Dtype,
    ctas: u32,
    chunks: Option<u64>,
    caller: RawStream,
) -> Result<()> {
    if (src == 0 || out == 0) && bytes > 0 {
        return Err(Error::Invalid("tensor: null device pointer".into()));
    }
    if src % 16 != 0 || out % 16 != 0 {
        return Err(Error::Invalid(format!(
            "tensor: the copy engines need 16-byte aligned tensors, got {src:#x} and {out:#x}"
        )));
    }
    crate::cuda::driver::bind(comm.device.ordinal)?;
    let world = comm.world as usize;
    let exchanges = plain_exchanges(kind, src, out, bytes, world, chunks)?;
    if exchanges.is_empty() {
        return Ok(());
    }
    comm.ensure_group_events(exchanges.len())?;
    let groups = match kind {
        Plain::AllReduce => all_reduces(exchanges, world),
        Plain::ReduceScatter => sums(exchanges),
    };
    let peer = peer_buffers(comm, &groups)?;
    let reducer = load_reducer(comm, dtype, peer.layout.world)?;
    let call = Call {
        peer: &peer,
        reducer: reducer.as_ref(),
        signals: None,
        groups: &groups,
        reduce_ctas: ctas,
    };
    enqueue(comm, &call, caller, || Ok(()), |_, _| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(offset: u64) -> Exchange {
        Exchange {
            tiles: 1,
            src: 4096,
            src_stride: 1024,
            bytes: 1024,
            slot_offset: offset,
            out: 8192,
        }
    }

    #[test]
    fn groups_must_be_aligned_and_few_enough() {
        assert!(check_groups(&sums(vec![exchange(0), exchange(1024)])).is_ok());
        assert!(check_groups(&sums(vec![exchange(8)])).is_err());
        let stride = Exchange {
            src_stride: 24,
            ..exchange(0)
        };
        assert!(check_groups(&sums(vec![stride])).is_err());
        assert!(check_groups(&sums(vec![exchange(0); MAX_PEER_GROUPS])).is_ok());
        assert!(check_groups(&sums(vec![exchange(0); MAX_PEER_GROUPS + 1])).is_err());
    }

    #[test]
    fn plain_chunks_cover_the_data_in_order() {
        for world in [1usize, 2, 3, 8] {
            for bytes in [16 * 24u64, 1 << 20, 64 << 20, (100 << 20) + 16 * 24] {
                for (kind, chunks) in [
                    (Plain::AllReduce, None),
                    (Plain::ReduceScatter, None),
                    (Plain::AllReduce, Some(1)),
                    (Plain::ReduceScatter, Some(3)),
                ] {
                    let bytes = bytes - bytes % (16 * world as u64);
                    let ex = plain_exchanges(kind, 1 << 40, 1 << 41, bytes, world, chunks).unwrap();
                    if let Some(c) = chunks {
                        assert_eq!(ex.len() as u64, c);
                    }
                    let part = if kind == Plain::AllReduce {
                        bytes
                    } else {
                        bytes / world as u64
                    };
                    assert!(!ex.is_empty() && ex.len() as u64 <= MAX_PLAIN_CHUNKS);
                    assert!(check_groups(&sums(ex.clone())).is_ok());
                    let mut at = 0;
                    for e in &ex {
                        assert_eq!(e.slot_offset, at);
                        assert_eq!(e.src, (1 << 40) + at);
                        assert_eq!(e.out, (1 << 41) + at);
                        at += e.bytes;
                    }
                    assert_eq!(at, part, "{kind:?} world {world} bytes {bytes}");
                    // Rank r's ReduceScatter part is block r of the input.
                    if kind == Plain::ReduceScatter {
                        assert!(ex.iter().all(|e| e.src_stride == part));
                    }
                }
            }
        }
        assert!(plain_exchanges(Plain::AllReduce, 0, 0, 24, 2, None).is_err());
        assert!(plain_exchanges(Plain::ReduceScatter, 0, 0, 16 * 3, 2, None).is_err());
    }

    #[test]
    fn shares_split_an_all_reduce_in_whole_vectors() {
        for world in 1..=8usize {
            for bytes in [0u64, 16, 16 * 5, 4096, (3 << 20) + 16 * 7] {
                let mut at = 0;
                for p in 0..world {
                    let (offset, len) = share(bytes, p, world);
                    assert_eq!(offset, at, "world {world} bytes {bytes} share {p}");
                    assert_eq!(offset % 16, 0);
                    assert_eq!(len % 16, 0);
                    // Balanced: shares differ by at most one vector.
                    assert!(len / 16 >= bytes / 16 / world as u64);
                    assert!(len / 16 <= (bytes / 16).div_ceil(world as u64));
                    at += len;
                }
                assert_eq!(at, bytes);
            }
        }
        let e = Exchange {
            tiles: 3,
            src: 1 << 30,
            src_stride: 0,
            bytes: 16 * 10,
            slot_offset: 4096,
            out: 1 << 31,
        };
        let s = share_of(&e, 2, 3);
        assert_eq!(
            (s.src, s.out, s.slot_offset, s.bytes),
            ((1 << 30) + 96, (1 << 31) + 96, 4096 + 96, 64)
        );
        assert_eq!(s.tiles, 3);
    }

    #[test]
    fn all_reduces_gather_beyond_two_ranks() {
        let e = exchange(0);
        let stride0 = Exchange { src_stride: 0, ..e };
        assert!(matches!(all_reduces(vec![stride0], 2)[0], Group::Sum(_)));
        for world in 3..=8 {
            let groups = all_reduces(vec![stride0; 4], world);
            assert!(groups.iter().all(|g| matches!(g, Group::Gather(_))));
            assert!(check_groups(&groups).is_ok());
        }
        // A strided exchange is a ReduceScatter's, never an AllReduce's.
        assert!(check_groups(&[Group::Gather(e)]).is_err());
    }

    #[test]
    fn parts_follow_the_stride() {
        let e = exchange(0);
        assert_eq!(e.part(0), 4096);
        assert_eq!(e.part(3), 4096 + 3 * 1024);
        let all_reduce = Exchange { src_stride: 0, ..e };
        assert_eq!(all_reduce.part(5), all_reduce.src);
    }
}
