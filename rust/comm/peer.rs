//! Peer buffers: one device allocation per rank, mapped into every other
//! rank of the node through CUDA IPC, holding the flags and the staging
//! slots of the copy-engine collectives.
//!
//! Layout of rank R's buffer (`PeerLayout`):
//!   word q (q < MAX_PEER_WORLD)        free[q]: rank q's slot for R's data is
//!                                      free (q reduced R's previous call)
//!   word 8 + q                         taken[q]: rank q took back (reset) the
//!                                      free[R] word in its buffer for its call:
//!                                      R may hand it back (push backend)
//!   word 16                            timed out: a GEMM's wait for pushed
//!                                      tiles gave up (FLASHOVERLAP_PEER_TIMEOUT_S)
//!   word 64 + g * 8 + q                ready[g][q]: rank q copied group g into
//!                                      R's slot for q
//!   word 64 + 8192 + g * 8 + q         gathered[g][q]: rank q copied its sum of
//!                                      its share of group g into R's slot for q
//!                                      (AllReduce as ReduceScatter + AllGather)
//!   FLAG_BYTES + i * slot_bytes        slot i: the partial of the i-th other
//!                                      rank, laid out like the output
//! Flags are set by the peer's stream (a stream memory write after its copy,
//! no kernel) and reset by the waiter right after its wait, so every call
//! leaves them as it found them (free = 1, ready = gathered = taken = 0) and CUDA-graph replays
//! see the same state each time.

use crate::cuda::driver::check;
use crate::cuda::memory::DeviceBuffer;
use crate::error::{Error, Result};
use cudarc::driver::sys;

/// Most ranks the copy-engine backend serves (one node).
pub const MAX_PEER_WORLD: usize = 8;
/// Most wave groups one op may signal through the ready flags.
pub const MAX_PEER_GROUPS: usize = 1024;
pub const IPC_HANDLE_BYTES: usize = 64;
const FREE_WORDS: usize = 64;
const FLAG_BYTES: u64 = 128 * 1024;
const _: () = assert!(
    2 * MAX_PEER_WORLD < FREE_WORDS,
    "free and taken flags and the timed-out word share the first words"
);
const _: () = assert!(
    ((FREE_WORDS + 2 * MAX_PEER_GROUPS * MAX_PEER_WORLD) * 4) as u64 <= FLAG_BYTES,
    "the flags must fit before the slots"
);

/// Addresses inside peer buffers; `base` is the buffer of the rank whose
/// flags or slots are meant, as mapped in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerLayout {
    pub world: usize,
    pub slot_bytes: u64,
}

impl PeerLayout {
    pub fn new(world: usize, slot_bytes: u64) -> Result<Self> {
        if !(1..=MAX_PEER_WORLD).contains(&world) {
            return Err(Error::Invalid(format!(
                "backend: the copy-engine backend serves 1 to {MAX_PEER_WORLD} ranks of one node, got {world}"
            )));
        }
        Ok(Self { world, slot_bytes })
    }

    /// Bytes of one rank's buffer: the flags, then a slot per other rank.
    pub fn bytes(&self) -> u64 {
        FLAG_BYTES + (self.world as u64 - 1) * self.slot_bytes
    }

    /// The word rank `from` sets in `base`'s buffer when its slot for
    /// `base`'s rank may be written again.
    pub fn free_flag(&self, base: u64, from: usize) -> u64 {
        debug_assert!(from < self.world);
        base + 4 * from as u64
    }

    /// The word rank `from` sets in `base`'s buffer once it reset its own
    /// free flag for `base`'s rank in a call: a free flag is handed back only
    /// after it was taken, so that two grants never merge into one (a rank
    /// that receives nothing in a call has no other sign that its peer's
    /// call began).
    pub fn taken_flag(&self, base: u64, from: usize) -> u64 {
        debug_assert!(from < self.world);
        base + 4 * (MAX_PEER_WORLD + from) as u64
    }

    /// The word a GEMM on `base`'s rank sets when its wait for pushed tiles
    /// timed out (never reset: the buffers are unusable after it).
    pub fn timed_out_flag(&self, base: u64) -> u64 {
        base + 4 * (2 * MAX_PEER_WORLD) as u64
    }

    /// The word rank `from` sets in `base`'s buffer once it copied group `group` there.
    pub fn ready_flag(&self, base: u64, group: usize, from: usize) -> u64 {
        debug_assert!(from < self.world && group < MAX_PEER_GROUPS);
        base + 4 * (FREE_WORDS + group * MAX_PEER_WORLD + from) as u64
    }

    /// The word rank `from` sets in `base`'s buffer once it copied its sum
    /// of its share of group `group` there.
    pub fn gathered_flag(&self, base: u64, group: usize, from: usize) -> u64 {
        debug_assert!(from < self.world && group < MAX_PEER_GROUPS);
        base + 4 * (FREE_WORDS + (MAX_PEER_GROUPS + group) * MAX_PEER_WORLD + from) as u64
    }

    /// The slot of `receiver`'s buffer (at `base`) that holds `source`'s partial.
    pub fn slot(&self, base: u64, receiver: usize, source: usize) -> u64 {
        debug_assert!(source != receiver && source < self.world && receiver < self.world);
        let index = if source < receiver {
            source
        } else {
            source - 1
        };
        base + FLAG_BYTES + index as u64 * self.slot_bytes
    }
}

/// This rank's buffer before the peers' handles are known.
pub struct PendingPeer {
    local: DeviceBuffer,
    layout: PeerLayout,
}

/// This rank's buffer and every rank's buffer mapped into this process.
pub struct PeerBuffers {
    pub layout: PeerLayout,
    pub rank: usize,
    /// Base address of each rank's buffer in this process (this rank's own at `rank`).
    pub bases: Vec<u64>,
    mapped: Vec<u64>,
    _local: DeviceBuffer,
}

// SAFETY: device addresses are plain data; the driver API is thread-safe.
unsafe impl Send for PeerBuffers {}
unsafe impl Sync for PeerBuffers {}
unsafe impl Send for PendingPeer {}

impl PendingPeer {
    /// Allocates this rank's buffer with every flag at rest (free = 1,
    /// ready = 0) and returns it with its IPC handle. The caller bound the
    /// device and made sure no copy into the old buffer is in flight.
    pub fn allocate(layout: PeerLayout) -> Result<(Self, Vec<u8>)> {
        let words = (layout.bytes() / 4) as usize;
        let local = DeviceBuffer::zeroed_u32(words)?;
        // SAFETY: the buffer holds FLAG_BYTES; export synchronizes the context
        // after this, so the flags are set before any peer can map the buffer.
        check(
            unsafe { sys::cuMemsetD32_v2(local.ptr, 1, MAX_PEER_WORLD) },
            "cuMemsetD32",
        )?;
        let bytes = export(&local)?;
        Ok((Self { local, layout }, bytes))
    }

    /// Maps every other rank's buffer from the handles of all ranks (in rank order).
    pub fn attach(self, rank: usize, handles: &[Vec<u8>]) -> Result<PeerBuffers> {
        if handles.len() != self.layout.world || rank >= self.layout.world {
            return Err(Error::Invalid(format!(
                "handles: expected one IPC handle per rank ({}), got {} (rank {rank})",
                self.layout.world,
                handles.len()
            )));
        }
        let (bases, mapped) = open_all(rank, self.local.ptr, handles)?;
        let peer = PeerBuffers {
            layout: self.layout,
            rank,
            bases,
            mapped,
            _local: self.local,
        };
        Ok(peer)
    }
}

/// The IPC handle of `local` (its contents settled: the context is
/// synchronized first, so a peer that maps it sees what was written).
pub fn export(local: &DeviceBuffer) -> Result<Vec<u8>> {
    let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
    // SAFETY: out pointer valid; local is a live cuMemAlloc allocation.
    unsafe {
        check(sys::cuCtxSynchronize(), "cuCtxSynchronize")?;
        check(
            sys::cuIpcGetMemHandle(&mut handle, local.ptr),
            "cuIpcGetMemHandle",
        )?;
    }
    Ok(handle.reserved.iter().map(|&c| c as u8).collect())
}

/// Maps every other rank's buffer from all ranks' handles (rank order):
/// the base of each rank's buffer in this process (`own` at `rank`), and
/// the mappings to close when done.
pub fn open_all(rank: usize, own: u64, handles: &[Vec<u8>]) -> Result<(Vec<u64>, Vec<u64>)> {
    let (mut bases, mut mapped) = (Vec::with_capacity(handles.len()), Vec::new());
    for (r, bytes) in handles.iter().enumerate() {
        if r == rank {
            bases.push(own);
            continue;
        }
        if bytes.len() != IPC_HANDLE_BYTES {
            close_all(&mapped);
            return Err(Error::Invalid(format!(
                "handles: rank {r}'s IPC handle has {} bytes, expected {IPC_HANDLE_BYTES}",
                bytes.len()
            )));
        }
        let mut handle = sys::CUipcMemHandle_st { reserved: [0; 64] };
        for (d, s) in handle.reserved.iter_mut().zip(bytes) {
            *d = *s as std::ffi::c_char;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; the handle came from a live allocation of rank r.
        let opened = check(
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    handle,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            },
            "cuIpcOpenMemHandle (are all ranks on one node, with peer access between their GPUs?)",
        );
        if let Err(e) = opened {
            close_all(&mapped);
            return Err(e);
        }
        mapped.push(ptr);
        bases.push(ptr);
    }
    Ok((bases, mapped))
}

/// Closes mappings made by [`open_all`].
pub fn close_all(mapped: &[u64]) {
    for &ptr in mapped {
        // SAFETY: opened by open_all; an error at teardown has no one to report to.
        unsafe {
            sys::cuIpcCloseMemHandle(ptr);
        }
    }
}

impl PeerBuffers {
    /// This rank's slot that `source` writes into.
    pub fn slot_from(&self, source: usize) -> u64 {
        self.layout.slot(self.bases[self.rank], self.rank, source)
    }

    /// `receiver`'s slot that this rank writes into (as mapped here).
    pub fn slot_at(&self, receiver: usize) -> u64 {
        self.layout.slot(self.bases[receiver], receiver, self.rank)
    }

    /// Ranks other than this one, starting after it, so that on more than
    /// two GPUs the ranks do not all copy to the same peer first.
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        let (rank, w) = (self.rank, self.layout.world);
        (1..w).map(move |i| (rank + i) % w)
    }
}

impl Drop for PeerBuffers {
    fn drop(&mut self) {
        close_all(&self.mapped);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_slots_never_overlap() {
        for world in 1..=MAX_PEER_WORLD {
            let layout = PeerLayout::new(world, 4096).unwrap();
            let mut words = std::collections::HashSet::new();
            for from in 0..world {
                assert!(words.insert(layout.free_flag(0, from)));
                for g in [0, 1, MAX_PEER_GROUPS - 1] {
                    assert!(words.insert(layout.ready_flag(0, g, from)));
                    assert!(words.insert(layout.gathered_flag(0, g, from)));
                }
            }
            assert!(words.iter().all(|&w| w + 4 <= FLAG_BYTES));
            for receiver in 0..world {
                let mut slots: Vec<u64> = (0..world)
                    .filter(|&s| s != receiver)
                    .map(|s| layout.slot(0, receiver, s))
                    .collect();
                assert_eq!(slots.len(), world - 1);
                slots.sort();
                for (i, s) in slots.iter().enumerate() {
                    assert_eq!(*s, FLAG_BYTES + i as u64 * 4096);
                }
                if let Some(last) = slots.last() {
                    assert_eq!(last + 4096, layout.bytes());
                }
            }
        }
    }

    #[test]
    fn world_sizes_outside_one_node_are_refused() {
        assert!(PeerLayout::new(0, 16).is_err());
        assert!(PeerLayout::new(MAX_PEER_WORLD + 1, 16).is_err());
    }
}
