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
//! AllReduce: every peer gets the whole group (its part is the same bytes)
//! and the sum is written in place. ReduceScatter: peer p gets the group's
//! chunk p of the send buffer, and the sum of chunk `rank` goes to this
//! rank's output rows.

use super::gemm::Signals;
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

/// Checks what the backend needs of the groups before a plan is kept:
/// few enough for the ready flags, and 16-byte aligned for the reduction.
pub fn check_groups(exchanges: &[Exchange]) -> Result<()> {
    if exchanges.len() > MAX_PEER_GROUPS {
        return Err(Error::Invalid(format!(
            "bands_per_group: the copy-engine backend signals at most {MAX_PEER_GROUPS} groups, the plan has {}",
            exchanges.len()
        )));
    }
    let aligned = |e: &Exchange| {
        [e.src, e.src_stride, e.bytes, e.slot_offset, e.out]
            .iter()
            .all(|v| v % 16 == 0)
    };
    match exchanges.iter().find(|e| !aligned(e)) {
        Some(e) => Err(Error::Invalid(format!(
            "internal: copy-engine group {e:?} is not 16-byte aligned"
        ))),
        None => Ok(()),
    }
}

/// The attached peer buffers, checked to hold every group's parts.
pub fn peer_buffers(comm: &Communicator, exchanges: &[Exchange]) -> Result<Arc<PeerBuffers>> {
    let bytes = exchanges
        .iter()
        .map(|e| e.slot_offset + e.bytes)
        .max()
        .unwrap_or(0);
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
        sources[i] = peer.layout.slot(peer.bases[me], me, source) + e.slot_offset;
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

/// What one overlapped call enqueues on the copy-engine backend.
pub struct Call<'a> {
    pub peer: &'a PeerBuffers,
    /// Loaded before anything is enqueued (None for one rank).
    pub reducer: Option<&'a Kernel>,
    pub signals: &'a Signals,
    pub exchanges: &'a [Exchange],
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
    let _order = comm.enqueue.lock().unwrap_or_else(|p| p.into_inner());
    let events = comm.group_events.lock().unwrap_or_else(|p| p.into_inner());
    if events.len() < call.exchanges.len() {
        return Err(Error::Invalid("internal: group events not made".into()));
    }
    comm.fork.order_all(caller, &[copies, reduces])?;
    launch_gemm()?;
    // This rank's slot in each peer may be written once that peer summed
    // the previous call (the flag starts set).
    for p in peer.peers() {
        let free = layout.free_flag(peer.bases[me], p);
        stream::wait_geq(copies, free, 1)?;
        stream::write(copies, free, 0)?;
    }
    for (g, e) in call.exchanges.iter().enumerate() {
        let counter = call.signals.counter(g);
        stream::wait_geq(copies, counter, e.tiles)?;
        // Every tile of the group has counted, so the reset races with nothing.
        stream::write(copies, counter, 0)?;
        for p in peer.peers() {
            let dst = layout.slot(peer.bases[p], p, me) + e.slot_offset;
            stream::copy(copies, dst, e.part(p), e.bytes as usize)?;
            // A stream write is fenced after the copy before it: the peer
            // sees the flag only once the bytes are there.
            stream::write(copies, layout.ready_flag(peer.bases[p], g, me), 1)?;
        }
        // The sum may rewrite the group's parts in place (AllReduce), so it
        // also waits for this rank's own copies of them.
        events[g].order(copies, reduces)?;
        for p in peer.peers() {
            let ready = layout.ready_flag(peer.bases[me], g, p);
            stream::wait_geq(reduces, ready, 1)?;
            stream::write(reduces, ready, 0)?;
        }
        match call.reducer {
            Some(reducer) => reduce(reducer, peer, e, call.reduce_ctas, reduces)?,
            // One rank: the sum is its own part.
            None if e.out != e.part(me) => stream::copy(reduces, e.out, e.part(me), e.bytes as usize)?,
            None => {}
        }
        after(g, reduces)?;
    }
    // Every staged part of this call is summed: the peers may write again.
    for p in peer.peers() {
        stream::write(reduces, layout.free_flag(peer.bases[p], me), 1)?;
    }
    comm.join.order(copies, caller)?;
    comm.reduce_join.order(reduces, caller)
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
        assert!(check_groups(&[exchange(0), exchange(1024)]).is_ok());
        assert!(check_groups(&[exchange(8)]).is_err());
        let stride = Exchange {
            src_stride: 24,
            ..exchange(0)
        };
        assert!(check_groups(&[stride]).is_err());
        assert!(check_groups(&vec![exchange(0); MAX_PEER_GROUPS]).is_ok());
        assert!(check_groups(&vec![exchange(0); MAX_PEER_GROUPS + 1]).is_err());
    }

    #[test]
    fn parts_follow_the_stride() {
        let e = exchange(0);
        assert_eq!(e.part(0), 4096);
        assert_eq!(e.part(3), 4096 + 3 * 1024);
        let all_reduce = Exchange {
            src_stride: 0,
            ..e
        };
        assert_eq!(all_reduce.part(5), all_reduce.src);
    }
}
