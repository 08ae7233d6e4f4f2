//! The few NCCL entry points the ops use, bound by hand: cudarc resolves
//! NCCL by generic names, and there must never be a second NCCL beside
//! torch's, so the library is opened by the path found in /proc/self/maps.

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::OnceLock;

pub type Comm = *mut c_void;
pub const UNIQUE_ID_BYTES: usize = 128;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The 2.17 layout of ncclConfig_t. NCCL copies `size` bytes and, seeing
/// version 2.17, leaves every later field at its default, so this stays
/// valid for every newer NCCL.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

const CONFIG_MAGIC: u32 = 0xcafe_beef;
const CONFIG_VERSION: u32 = 21700;
const UNDEF_INT: c_int = c_int::MIN;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> c_int;
type CommDestroy = unsafe extern "C" fn(Comm) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(Comm, *mut c_int) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;

type ReduceScatter = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;

type SendRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, Comm, *mut c_void) -> c_int;
type GroupCall = unsafe extern "C" fn() -> c_int;

pub struct Nccl {
    pub path: PathBuf,
    _lib: libloading::Library,
    get_version: GetVersion,
    get_unique_id: GetUniqueId,
    comm_init_rank_config: CommInitRankConfig,
    comm_destroy: CommDestroy,
    comm_get_async_error: CommGetAsyncError,
    get_error_string: GetErrorString,
    all_reduce: AllReduce,
    reduce_scatter: ReduceScatter,
    send: SendRecv,
    recv: SendRecv,
    group_start: GroupCall,
    group_end: GroupCall,
}

/// The path of the libnccl mapped into this process, if any.
pub fn mapped_path() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            p.rsplit('/')
                .next()
                .is_some_and(|f| f.starts_with("libnccl.so"))
        })
        .map(PathBuf::from)
}

static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();

fn open() -> std::result::Result<Nccl, String> {
    let path = mapped_path().ok_or_else(|| {
        "NCCL is not loaded in this process: import torch (a CUDA build) and initialise the NCCL process group \
         before using flashoverlap's communicators"
            .to_string()
    })?;
    // SAFETY: this library is already mapped; opening it again only bumps its refcount.
    let lib = unsafe { libloading::Library::new(&path) }
        .map_err(|e| format!("could not open {}: {e}", path.display()))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol types match nccl.h.
            *unsafe { lib.get($name) }
                .map_err(|e| format!("{} lacks a symbol: {e}", path.display()))?
        };
    }
    Ok(Nccl {
        get_version: sym!(b"ncclGetVersion\0"),
        get_unique_id: sym!(b"ncclGetUniqueId\0"),
        comm_init_rank_config: sym!(b"ncclCommInitRankConfig\0"),
        comm_destroy: sym!(b"ncclCommDestroy\0"),
        comm_get_async_error: sym!(b"ncclCommGetAsyncError\0"),
        get_error_string: sym!(b"ncclGetErrorString\0"),
        all_reduce: sym!(b"ncclAllReduce\0"),
        reduce_scatter: sym!(b"ncclReduceScatter\0"),
        send: sym!(b"ncclSend\0"),
        recv: sym!(b"ncclRecv\0"),
        group_start: sym!(b"ncclGroupStart\0"),
        group_end: sym!(b"ncclGroupEnd\0"),
        path,
        _lib: lib,
    })
}

pub fn get() -> Result<&'static Nccl> {
    NCCL.get_or_init(open)
        .as_ref()
        .map_err(|e| Error::Missing(e.clone()))
}

fn nccl_dtype(d: Dtype) -> c_int {
    match d {
        Dtype::F16 => 6,
        Dtype::Bf16 => 9,
    }
}

const SUM: c_int = 0;

impl Nccl {
    fn check(&self, code: c_int, call: &'static str) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let message = unsafe { CStr::from_ptr((self.get_error_string)(code)) }
            .to_string_lossy()
            .into_owned();
        Err(Error::Nccl {
            call,
            code,
            message,
        })
    }

    /// e.g. 22809 for 2.28.9
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: valid out pointer.
        self.check(unsafe { (self.get_version)(&mut v) }, "ncclGetVersion")?;
        Ok(v)
    }

    pub fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: valid out pointer.
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        Ok(id)
    }

    /// Creates a blocking communicator whose collectives use at most
    /// `max_ctas` CTAs (None: NCCL's choice), each CTA its own cluster.
    /// Collective over all ranks.
    pub fn init_rank(
        &self,
        world: i32,
        id: UniqueId,
        rank: i32,
        max_ctas: Option<i32>,
    ) -> Result<Comm> {
        let mut config = Config {
            size: std::mem::size_of::<Config>(),
            magic: CONFIG_MAGIC,
            version: CONFIG_VERSION,
            blocking: 1,
            // NCCL's default on sm_90 launches its CTAs in clusters of 4,
            // which need 4 free SMs of one GPC. Beside a persistent GEMM the
            // free SMs are scattered over the GPCs, so clustered CTAs waited
            // for the GEMM to end (measured: with 16-24 SMs reserved, the
            // "overlap" ran slower than GEMM then AllReduce). Single-CTA
            // clusters run on any free SM.
            cga_cluster_size: 1,
            min_ctas: UNDEF_INT,
            max_ctas: max_ctas.unwrap_or(UNDEF_INT),
            net_name: std::ptr::null(),
        };
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: config outlives the call; comm is a valid out pointer.
        self.check(
            unsafe { (self.comm_init_rank_config)(&mut comm, world, id, rank, &mut config) },
            "ncclCommInitRankConfig",
        )?;
        Ok(comm)
    }

    pub fn destroy(&self, comm: Comm) -> Result<()> {
        // SAFETY: comm came from init_rank and is destroyed once.
        self.check(unsafe { (self.comm_destroy)(comm) }, "ncclCommDestroy")
    }

    /// An error NCCL hit asynchronously (e.g. a peer died), if any.
    pub fn async_error(&self, comm: Comm) -> Result<()> {
        let mut state = 0;
        // SAFETY: valid communicator and out pointer.
        self.check(
            unsafe { (self.comm_get_async_error)(comm, &mut state) },
            "ncclCommGetAsyncError",
        )?;
        self.check(state, "NCCL (asynchronous)")
    }

    /// In-place sum over `count` elements at `ptr`, enqueued on `stream`.
    pub fn all_reduce_in_place(
        &self,
        ptr: u64,
        count: usize,
        dtype: Dtype,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<()> {
        let p = ptr as *mut c_void;
        // SAFETY: ptr addresses count elements on the communicator's device.
        self.check(
            unsafe { (self.all_reduce)(p, p, count, nccl_dtype(dtype), SUM, comm, stream) },
            "ncclAllReduce",
        )
    }

    /// Sum over ranks of `recv_count * world` elements at `send`; rank r
    /// receives chunk r (`recv_count` elements) at `recv`, on `stream`.
    pub fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        recv_count: usize,
        dtype: Dtype,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: send holds world * recv_count and recv recv_count elements on the device.
        self.check(
            unsafe {
                (self.reduce_scatter)(
                    send as *const c_void,
                    recv as *mut c_void,
                    recv_count,
                    nccl_dtype(dtype),
                    SUM,
                    comm,
                    stream,
                )
            },
            "ncclReduceScatter",
        )
    }

    /// Point-to-point transfers fused into one NCCL group: each (send,
    /// count, peer) from this rank and each (recv, count, peer) into it, on
    /// `stream`. Zero-count entries are skipped (their counterparts are too).
    pub fn exchange(
        &self,
        sends: &[(u64, usize, i32)],
        recvs: &[(u64, usize, i32)],
        dtype: Dtype,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<()> {
        // SAFETY: plain group markers.
        self.check(unsafe { (self.group_start)() }, "ncclGroupStart")?;
        let mut result = Ok(());
        for &(ptr, count, peer) in sends.iter().filter(|s| s.1 > 0) {
            // SAFETY: ptr addresses count elements on the communicator's device.
            let code = unsafe {
                (self.send)(
                    ptr as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    peer,
                    comm,
                    stream,
                )
            };
            result = result.and(self.check(code, "ncclSend"));
        }
        for &(ptr, count, peer) in recvs.iter().filter(|r| r.1 > 0) {
            // SAFETY: as above, for the receive buffer.
            let code = unsafe {
                (self.recv)(
                    ptr as *mut c_void,
                    count,
                    nccl_dtype(dtype),
                    peer,
                    comm,
                    stream,
                )
            };
            result = result.and(self.check(code, "ncclRecv"));
        }
        // The group is closed whatever happened inside it.
        // SAFETY: matches the ncclGroupStart above.
        let end = self.check(unsafe { (self.group_end)() }, "ncclGroupEnd");
        result.and(end)
    }
}
