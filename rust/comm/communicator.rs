//! A communicator: one NCCL communicator (or none, for the copy-engine
//! backend alone) plus the communication streams and the per-shape state the
//! overlapped ops keep, registered by name.

use super::nccl::{self, Comm, UniqueId};
use super::peer::{PeerBuffers, PeerLayout, PendingPeer};
use crate::cuda::driver::{self, DeviceInfo};
use crate::cuda::memory::DeviceBuffer;
use crate::cuda::stream::{self, Event, OwnedStream};
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub struct Communicator {
    pub name: String,
    pub rank: i32,
    pub world: i32,
    pub device: DeviceInfo,
    pub max_ctas: Option<i32>,
    /// None: made without NCCL (copy-engine backend only; its ranks may
    /// even share a GPU, which NCCL refuses).
    comm: Option<Comm>,
    /// High-priority stream on which every collective of this communicator runs.
    pub stream: OwnedStream,
    /// Orders the caller's stream before the comm stream (fork)...
    pub fork: Event,
    /// ...and the comm stream before the caller's stream (join).
    pub join: Event,
    /// Second stream of the copy-engine backend: the reductions run here
    /// while the comm stream issues the next group's copies.
    pub reduce_stream: OwnedStream,
    pub reduce_join: Event,
    /// One event per wave group, ordering a group's copies before its reduction.
    pub group_events: Mutex<Vec<Event>>,
    /// Further copy streams of the copy-engine backend, one per peer beyond
    /// the first (world - 2), so that the copies to different peers run on
    /// several copy engines at once and every link is busy; `link_go`
    /// starts them on a group once the comm stream saw it finish, and
    /// `link_done[i]` orders link i's copies before the group's reduction.
    pub link_streams: Vec<OwnedStream>,
    pub link_go: Event,
    pub link_done: Vec<Event>,
    /// AllReduce as ReduceScatter + AllGather on the copy engines (world >=
    /// 3): after each group's sum, `gather_go` starts one copy stream per
    /// peer (this rank's summed share into that peer's slot) and the landing
    /// stream, which waits for the peers' shares and copies them from the
    /// slots into the output, then runs what follows the group (norm,
    /// un-reorder); `land_join` joins them all into the caller's stream.
    pub gather_streams: Vec<OwnedStream>,
    pub land_stream: OwnedStream,
    pub gather_go: Event,
    pub land_join: Event,
    /// The copy-engine backend's buffers, once attached.
    peer: Mutex<Option<Arc<PeerBuffers>>>,
    pending_peer: Mutex<Option<PendingPeer>>,
    /// Held while an op enqueues, so that calls from several threads never
    /// interleave their waits and collectives (NCCL needs one order on all ranks).
    pub enqueue: Mutex<()>,
    /// Per-shape state of the ops (plans, tables, counters), keyed by the op.
    pub prepared: Mutex<HashMap<String, Arc<dyn Any + Send + Sync>>>,
}

// SAFETY: the NCCL communicator is only used under `enqueue` or at teardown.
unsafe impl Send for Communicator {}
unsafe impl Sync for Communicator {}

impl Communicator {
    /// The per-shape state an op keeps under `key`, made by `make` on first
    /// use. A first use under CUDA graph capture is refused (`what` names the
    /// call in the error): making the state allocates and uploads, which must
    /// happen before capture.
    pub fn prepared<T: Any + Send + Sync>(
        &self,
        key: String,
        caller: stream::RawStream,
        what: impl FnOnce() -> String,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        if let Some(p) = self
            .prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return p
                .clone()
                .downcast::<T>()
                .map_err(|_| Error::Invalid("internal: prepared state type".into()));
        }
        if stream::is_capturing(caller)? {
            return Err(Error::Invalid(format!(
                "{} is first called during CUDA graph capture; run it once before capturing so that its plan, \
                 tables and kernel are ready",
                what()
            )));
        }
        let made = Arc::new(make()?);
        self.prepared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, made.clone());
        Ok(made)
    }

    /// Runs `enqueue` (a plain collective) on the communicator's stream,
    /// ordered after the caller's prior work and before its later work:
    /// the collective half of the sequential schedules.
    pub fn on_comm_stream(
        &self,
        caller: stream::RawStream,
        enqueue: impl FnOnce(&nccl::Nccl, Comm, stream::RawStream) -> Result<()>,
    ) -> Result<()> {
        driver::bind(self.device.ordinal)?;
        let (nccl, comm) = self.nccl()?;
        let _order = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        self.fork.order(caller, self.stream.0)?;
        enqueue(nccl, comm, self.stream.0)?;
        self.join.order(self.stream.0, caller)
    }

    /// The NCCL library and this communicator's NCCL communicator, or an
    /// error naming the communicator where it was made without NCCL.
    pub fn nccl(&self) -> Result<(&'static nccl::Nccl, Comm)> {
        let comm = self.comm.ok_or_else(|| {
            Error::Invalid(format!(
                "backend: communicator {:?} was made without NCCL (copy-engine backend only); \
                 use backend='copy_engine' or a communicator made with NCCL",
                self.name
            ))
        })?;
        Ok((nccl::get()?, comm))
    }

    /// The attached peer buffers, if any.
    pub fn peer(&self) -> Option<Arc<PeerBuffers>> {
        self.peer.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Bytes each staging slot holds (0 before any attach).
    pub fn peer_slot_bytes(&self) -> u64 {
        self.peer().map_or(0, |p| p.layout.slot_bytes)
    }

    /// First half of (re)making the peer buffers, collective over the ranks:
    /// waits until this rank's copies and reductions are done, allocates a
    /// buffer with `slot_bytes` per slot and returns its IPC handle. Every
    /// rank then exchanges the handles and calls `peer_attach`.
    pub fn peer_prepare(&self, slot_bytes: u64) -> Result<Vec<u8>> {
        driver::bind(self.device.ordinal)?;
        let _order = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        self.synchronize()?;
        let layout = PeerLayout::new(self.world as usize, slot_bytes)?;
        let (pending, handle) = PendingPeer::allocate(layout)?;
        *self.pending_peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(pending);
        Ok(handle)
    }

    /// Second half: maps every rank's new buffer. The old buffers go now:
    /// the exchange between the halves ordered every rank's last use of them
    /// (each had synchronized its streams) before this.
    pub fn peer_attach(&self, handles: &[Vec<u8>]) -> Result<()> {
        driver::bind(self.device.ordinal)?;
        let _order = self.enqueue.lock().unwrap_or_else(|p| p.into_inner());
        let pending = self
            .pending_peer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| Error::Invalid("peer_attach: no peer_prepare before it".into()))?;
        let buffers = pending.attach(self.rank as usize, handles)?;
        *self.peer.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(buffers));
        Ok(())
    }

    /// Waits until everything enqueued on this communicator's streams is done.
    pub fn synchronize(&self) -> Result<()> {
        driver::bind(self.device.ordinal)?;
        stream::synchronize(self.stream.0)?;
        for link in self.link_streams.iter().chain(&self.gather_streams) {
            stream::synchronize(link.0)?;
        }
        stream::synchronize(self.reduce_stream.0)?;
        stream::synchronize(self.land_stream.0)
    }

    /// Events for `groups` wave groups (made outside capture, on first use of a shape).
    pub fn ensure_group_events(&self, groups: usize) -> Result<()> {
        let mut events = self.group_events.lock().unwrap_or_else(|p| p.into_inner());
        while events.len() < groups {
            events.push(Event::new()?);
        }
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Teardown: let pending work finish, then free NCCL's resources.
        if driver::bind(self.device.ordinal).is_ok() {
            let _ = self.synchronize();
            if let (Some(comm), Ok(n)) = (self.comm, nccl::get()) {
                let _ = n.destroy(comm);
            }
        }
    }
}

static REGISTRY: Mutex<Option<HashMap<String, Arc<Communicator>>>> = Mutex::new(None);

fn with_registry<T>(f: impl FnOnce(&mut HashMap<String, Arc<Communicator>>) -> T) -> T {
    let mut guard = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(HashMap::new))
}

/// A new NCCL unique id (on the first rank; broadcast by the caller).
pub fn new_unique_id() -> Result<Vec<u8>> {
    let id = nccl::get()?.unique_id()?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Creates and registers a communicator; collective over the `world` ranks.
/// Every NCCL kernel the ops use is launched once here, so that none is first
/// loaded while a stream waits on a GEMM counter. `id`: the NCCL unique id
/// (broadcast by the caller), or None for a communicator without NCCL.
pub fn create(
    name: &str,
    world: i32,
    rank: i32,
    id: Option<&[u8]>,
    ordinal: i32,
    max_ctas: Option<i32>,
) -> Result<()> {
    if with_registry(|r| r.contains_key(name)) {
        return Err(Error::Invalid(format!(
            "name: a communicator named {name:?} already exists"
        )));
    }
    if let Some(id) = id.filter(|id| id.len() != nccl::UNIQUE_ID_BYTES) {
        return Err(Error::Invalid(format!(
            "unique_id: expected {} bytes, got {}",
            nccl::UNIQUE_ID_BYTES,
            id.len()
        )));
    }
    if !(0..world).contains(&rank) {
        return Err(Error::Invalid(format!(
            "rank: expected 0 <= rank < {world}, got {rank}"
        )));
    }
    let device = driver::bind(ordinal)?;
    let comm = match id {
        Some(id) => {
            let mut unique = UniqueId {
                internal: [0; nccl::UNIQUE_ID_BYTES],
            };
            for (d, s) in unique.internal.iter_mut().zip(id) {
                *d = *s as std::ffi::c_char;
            }
            Some(nccl::get()?.init_rank(world, unique, rank, max_ctas)?)
        }
        None => None,
    };
    let communicator = Communicator {
        name: name.to_string(),
        rank,
        world,
        device,
        max_ctas,
        comm,
        stream: OwnedStream::high_priority()?,
        fork: Event::new()?,
        join: Event::new()?,
        reduce_stream: OwnedStream::high_priority()?,
        reduce_join: Event::new()?,
        group_events: Mutex::new(Vec::new()),
        link_streams: (2..world)
            .map(|_| OwnedStream::high_priority())
            .collect::<Result<_>>()?,
        link_go: Event::new()?,
        link_done: (2..world).map(|_| Event::new()).collect::<Result<_>>()?,
        gather_streams: if crate::ops::copy_engine::gathers_all_reduce(world as usize) {
            (1..world)
                .map(|_| OwnedStream::high_priority())
                .collect::<Result<_>>()?
        } else {
            Vec::new()
        },
        land_stream: OwnedStream::high_priority()?,
        gather_go: Event::new()?,
        land_join: Event::new()?,
        peer: Mutex::new(None),
        pending_peer: Mutex::new(None),
        enqueue: Mutex::new(()),
        prepared: Mutex::new(HashMap::new()),
    };
    if let Some(comm) = comm {
        let nccl = nccl::get()?;
        let scratch = DeviceBuffer::zeroed_u32(256)?;
        for dtype in [Dtype::Bf16, Dtype::F16] {
            nccl.all_reduce_in_place(scratch.ptr, 256, dtype, comm, communicator.stream.0.cast())?;
        }
        stream::synchronize(communicator.stream.0)?;
        nccl.async_error(comm)?;
    }
    with_registry(|r| r.insert(name.to_string(), Arc::new(communicator)));
    Ok(())
}

pub fn get(name: &str) -> Result<Arc<Communicator>> {
    with_registry(|r| {
        r.get(name).cloned().ok_or_else(|| {
            let mut known: Vec<_> = r.keys().cloned().collect();
            known.sort();
            Error::Invalid(format!(
                "group_name: no communicator named {name:?} (registered: {known:?})"
            ))
        })
    })
}

/// Unregisters; NCCL resources go when the last op holding it is done.
pub fn destroy(name: &str) -> bool {
    with_registry(|r| r.remove(name)).is_some()
}

pub fn names() -> Vec<String> {
    with_registry(|r| r.keys().cloned().collect())
}
