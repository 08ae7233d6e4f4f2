//! PyO3 bindings: argument conversion and exceptions only. Python has
//! already validated tensors and passes plain integers (pointers, shapes,
//! device ordinals, stream handles).

use crate::comm::{communicator, nccl};
use crate::cuda::kernels::GemmKernel;
use crate::cuda::{cache, driver, kernels, nvrtc, stream};
use crate::dtype::Dtype;
use crate::error::Error;
use crate::ops::gemm::GemmArgs;
use crate::ops::profile;
use crate::ops::{
    all_reduce as ar_op, all_reduce_rmsnorm as arn, backend as backend_choice, copy_engine,
    gemm as gemm_op, gemm_all_reduce as gar, gemm_all_to_all as ga2a, gemm_reduce_scatter as grs,
};
use crate::plan::all_to_all::SEGMENT_ROWS;
use crate::plan::{
    CollectiveKind, GemmAllReducePlan, ModeRequest, OrderRequest, Partition, Schedule,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) => PyValueError::new_err(m),
        Error::Plan(p) => PyValueError::new_err(p.to_string()),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

fn mode(name: &str) -> PyResult<ModeRequest> {
    match name {
        "auto" => Ok(ModeRequest::Auto),
        "overlap" => Ok(ModeRequest::Overlap),
        "sequential" => Ok(ModeRequest::Sequential),
        other => Err(PyValueError::new_err(format!(
            "mode: expected 'auto', 'overlap' or 'sequential', got {other:?}"
        ))),
    }
}

fn dtype(name: &str) -> PyResult<Dtype> {
    Dtype::parse(name).map_err(to_py)
}

fn operands(
    x: u64,
    weight: u64,
    out: u64,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
) -> PyResult<GemmArgs> {
    Ok(GemmArgs {
        x,
        weight,
        out,
        m,
        n,
        k,
        dtype: self::dtype(dtype)?,
    })
}

fn gemm_kernel(name: Option<&str>) -> PyResult<Option<GemmKernel>> {
    name.map(|n| {
        GemmKernel::parse(n).ok_or_else(|| {
            let known: Vec<String> = GemmKernel::ALL.iter().map(|k| k.name()).collect();
            PyValueError::new_err(format!(
                "kernel: expected one of {known:?} or None, got {n:?}"
            ))
        })
    })
    .transpose()
}

fn backend(name: &str) -> PyResult<gar::Backend> {
    gar::Backend::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "backend: expected 'nccl', 'copy_engine', 'push' or 'peer', got {name:?}"
        ))
    })
}

#[allow(clippy::too_many_arguments)]
fn options(
    mode: &str,
    bands_per_group: Option<u32>,
    reserved_sms: Option<u32>,
    max_groups: u32,
    kernel: Option<&str>,
    raster_bands: Option<u32>,
    backend: &str,
    order: &str,
) -> PyResult<gar::Options> {
    if raster_bands == Some(0) {
        return Err(PyValueError::new_err(
            "raster_bands: must be >= 1 or None, got 0",
        ));
    }
    Ok(gar::Options {
        kernel: gemm_kernel(kernel)?,
        mode: self::mode(mode)?,
        bands_per_group,
        reserved_sms,
        max_groups,
        raster_bands,
        backend: self::backend(backend)?,
        order: self::order(order)?,
        fused_norm: false,
    })
}

fn order(name: &str) -> PyResult<OrderRequest> {
    match name {
        "auto" => Ok(OrderRequest::Auto),
        "banded" => Ok(OrderRequest::Banded),
        "swizzled" => Ok(OrderRequest::Swizzled),
        _ => Err(PyValueError::new_err(format!(
            "order: expected 'auto', 'banded' or 'swizzled', got {name:?}"
        ))),
    }
}

/// A GEMM + collective plan: tiles, waves, wave groups and predicted timeline.
#[pyclass(name = "Plan", module = "flashoverlap._core", frozen)]
struct PyPlan(
    GemmAllReducePlan,
    /// The gathered AllReduce's plan, where the call runs that instead.
    Option<crate::plan::ReduceScatterPlan>,
);

#[pymethods]
impl PyPlan {
    /// None, or where the call runs the gathered AllReduce (2 Hopper ranks,
    /// push or copy engines: a combined ReduceScatter and a gather) instead
    /// of this plan: its groups, reserved SMs and predicted times.
    #[getter]
    fn gathered<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(g) = &self.1 else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("groups", g.groups.len())?;
        d.set_item("reserved_sms", g.request.reserved_sms)?;
        d.set_item("predicted_us", g.predicted_us())?;
        d.set_item("predicted_sequential_us", g.timeline.sequential_us)?;
        Ok(Some(d))
    }
    #[getter]
    fn schedule(&self) -> &'static str {
        schedule_name(self.0.schedule)
    }
    #[getter]
    fn shape(&self) -> (u32, u32, u32) {
        (self.0.request.m, self.0.request.n, self.0.request.k)
    }
    #[getter]
    fn world_size(&self) -> u32 {
        self.0.request.world
    }
    #[getter]
    fn tile(&self) -> (u32, u32, u32) {
        let t = self.0.tiles.tile;
        (t.bm, t.bn, t.bk)
    }
    #[getter]
    fn tiles(&self) -> (u32, u32) {
        (self.0.tiles.tiles_m, self.0.tiles.tiles_n)
    }
    #[getter]
    fn ctas(&self) -> u32 {
        self.0.ctas
    }
    #[getter]
    fn waves(&self) -> u32 {
        self.0.waves.count()
    }
    /// What the call is predicted to take on the schedule it runs (the
    /// gathered AllReduce's prediction where it runs that: see `gathered`).
    #[getter]
    fn predicted_us(&self) -> f64 {
        match &self.1 {
            Some(g) => g.predicted_us(),
            None => self.0.predicted_us(),
        }
    }
    /// The overlapped schedule's predicted time: its timeline's end plus the
    /// per-call cost no group shows (`overlap_fixed_us`).
    #[getter]
    fn predicted_overlap_us(&self) -> f64 {
        Schedule::Overlap.predicted_us(&self.0.timeline, self.0.overlap_fixed_us)
    }
    /// The backend's per-call cost of overlapping (the copy engines' ~40 us on H200; 0 for NCCL).
    #[getter]
    fn overlap_fixed_us(&self) -> f64 {
        self.0.overlap_fixed_us
    }
    /// What the overlapped schedule's groups cost beyond its pipeline (NCCL's
    /// per-call cost of each group at world >= 2), included in `predicted_overlap_us`.
    #[getter]
    fn overlap_groups_us(&self) -> f64 {
        self.0.timeline.groups_overhead_us()
    }
    #[getter]
    fn predicted_sequential_us(&self) -> f64 {
        self.0.timeline.sequential_us
    }
    /// One dict per wave group, in the order the collectives run.
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let timings = &self.0.timeline.groups;
        // Row bands and output rows exist for in-place groups only.
        type Span = (u32, u32);
        let extents: Vec<Option<(Span, Span)>> = match &self.0.partition {
            Partition::InPlace(p) => p
                .groups
                .iter()
                .map(|g| Some(((g.bands.start, g.bands.end), (g.rows.start, g.rows.end))))
                .collect(),
            Partition::Staged(p) => vec![None; p.len()],
        };
        self.0
            .partition
            .collectives()
            .iter()
            .zip(extents)
            .enumerate()
            .map(|(i, (g, extent))| {
                let d = PyDict::new(py);
                d.set_item("bands", extent.map(|e| e.0))?;
                d.set_item("rows", extent.map(|e| e.1))?;
                d.set_item("positions", (g.positions.start, g.positions.end))?;
                d.set_item("tiles", g.tiles)?;
                d.set_item("offset", g.slice.offset)?;
                d.set_item("count", g.slice.count)?;
                if let Some(t) = timings.get(i) {
                    d.set_item("gemm_done_us", t.gemm_done_us)?;
                    d.set_item("comm_start_us", t.comm_start_us)?;
                    d.set_item("comm_end_us", t.comm_end_us)?;
                }
                Ok(d)
            })
            .collect()
    }
    /// The group id of every position of the tile order (what the kernel reads).
    #[getter]
    fn tile_group(&self) -> Vec<u32> {
        self.0.tile_group.clone()
    }
    /// The tile id (row-major over the tile grid) the kernel computes at every position.
    #[getter]
    fn tile_order(&self) -> Vec<u32> {
        self.0.order.positions.clone()
    }
    /// Row bands per raster block of the tile order (1: row by row).
    #[getter]
    fn raster_bands(&self) -> u32 {
        self.0.raster_bands()
    }
    /// "banded" (groups of whole row bands reduced in place in the output)
    /// or "swizzled" (groups of whole waves reduced in a staging buffer,
    /// then un-reordered into the output).
    #[getter]
    fn order(&self) -> &'static str {
        if self.0.partition.is_staged() {
            "swizzled"
        } else {
            "banded"
        }
    }
    /// Elements of the staging buffer (0 for the banded order).
    #[getter]
    fn staging_elems(&self) -> u64 {
        self.0.staging_elems()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn __repr__(&self) -> String {
        let (m, n, k) = self.shape();
        format!(
            "Plan({m}x{n}x{k}, world={}, schedule={}, ctas={}, waves={}, groups={})",
            self.0.request.world,
            self.schedule(),
            self.0.ctas,
            self.0.waves.count(),
            self.0.partition.len()
        )
    }
}

#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Plans GEMM + AllReduce for a device described by `sms` and compute
/// capability `major`; needs no GPU.
#[pyfunction]
#[pyo3(signature = (m, n, k, world_size, dtype="bfloat16", sms=132, major=9, mode="auto", bands_per_group=None, reserved_sms=None, max_groups=16, kernel=None, raster_bands=None, backend="nccl", order="auto", fused_norm=false))]
#[allow(clippy::too_many_arguments)]
fn plan_gemm_all_reduce(
    m: u32,
    n: u32,
    k: u32,
    world_size: u32,
    dtype: &str,
    sms: u32,
    major: i32,
    mode: &str,
    bands_per_group: Option<u32>,
    reserved_sms: Option<u32>,
    max_groups: u32,
    kernel: Option<&str>,
    raster_bands: Option<u32>,
    backend: &str,
    order: &str,
    fused_norm: bool,
) -> PyResult<PyPlan> {
    // Planning needs the shape only; no pointer is ever read.
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let opts = gar::Options {
        fused_norm,
        ..options(
            mode,
            bands_per_group,
            reserved_sms,
            max_groups,
            kernel,
            raster_bands,
            backend,
            order,
        )?
    };
    let (_, plan) = gar::plan_for(&args, world_size, &opts, sms, major).map_err(to_py)?;
    let gathered = crate::ops::gathered_all_reduce::plan_for(&args, world_size, &opts, sms, major)
        .map_err(to_py)?
        .map(|(_, g)| g);
    Ok(PyPlan(plan, gathered))
}

#[pyfunction]
fn load_nvrtc(path: &str) -> PyResult<()> {
    nvrtc::load_from(std::path::Path::new(path)).map_err(to_py)
}

#[pyfunction]
fn nvrtc_version() -> PyResult<(i32, i32)> {
    nvrtc::version().map_err(to_py)
}

#[pyfunction]
fn cache_dir() -> String {
    cache::cache_dir().display().to_string()
}

/// Compiles every csrc kernel variant for `arch` (e.g. "sm_80", "sm_90a")
/// and returns (kernel, defines, cubin bytes) for each. Needs NVRTC, no GPU.
/// `hidden`: the hidden sizes to build the AllReduce + RMSNorm kernels
/// compiled for a hidden size for (default: the compile check's).
#[pyfunction]
#[pyo3(signature = (arch, hidden=None))]
fn compile_kernels(
    py: Python<'_>,
    arch: &str,
    hidden: Option<Vec<Bound<'_, PyAny>>>,
) -> PyResult<Vec<(String, String, usize)>> {
    let _keep = driver::KeepCurrent::new();
    let hidden = match hidden {
        None => kernels::CHECKED_HIDDEN.to_vec(),
        Some(sizes) => {
            // Any integer the op refuses (negative or huge ones too) is named in one ValueError.
            let supported = |h: &Bound<'_, PyAny>| {
                h.extract::<u32>()
                    .ok()
                    .filter(|&h| arn::hidden_supported(u64::from(h)))
            };
            let parsed: Vec<Option<u32>> = sizes.iter().map(supported).collect();
            let bad: Vec<String> = sizes
                .iter()
                .zip(&parsed)
                .filter(|(_, h)| h.is_none())
                .map(|(h, _)| h.to_string())
                .collect();
            if !bad.is_empty() {
                return Err(PyValueError::new_err(format!(
                    "hidden: expected multiples of 8 in 8..={}, got [{}]",
                    arn::MAX_HIDDEN,
                    bad.join(", ")
                )));
            }
            parsed.into_iter().flatten().collect()
        }
    };
    let specs = kernels::all_with_hidden(arch, &hidden);
    if specs.is_empty() {
        return Err(PyValueError::new_err(format!(
            "arch: no kernel targets {arch:?}; expected an NVRTC target of sm_80 or newer, e.g. \"sm_80\" or \"sm_90a\""
        )));
    }
    py.detach(|| -> Result<Vec<_>, Error> {
        specs
            .iter()
            .map(|spec| {
                let defines = spec
                    .defines
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                kernels::cubin(spec, arch)
                    .map(|c| (format!("{}:{}", spec.source, spec.entry), defines, c.len()))
            })
            .collect::<Result<Vec<_>, _>>()
    })
    .map_err(to_py)
}

#[pyfunction]
fn device_info<'py>(py: Python<'py>, device: i32) -> PyResult<Bound<'py, PyDict>> {
    let _keep = driver::KeepCurrent::new();
    let info = driver::bind(device).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("ordinal", info.ordinal)?;
    d.set_item("sms", info.sms)?;
    d.set_item("compute_capability", (info.major, info.minor))?;
    d.set_item("arch", info.arch())?;
    Ok(d)
}

#[pyfunction]
fn nccl_path() -> Option<String> {
    nccl::mapped_path().map(|p| p.display().to_string())
}

#[pyfunction]
fn nccl_version() -> PyResult<i32> {
    nccl::get().and_then(|n| n.version()).map_err(to_py)
}

#[pyfunction]
fn new_unique_id(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let id = communicator::new_unique_id().map_err(to_py)?;
    Ok(PyBytes::new(py, &id))
}

/// `unique_id`: the NCCL unique id rank 0 made (broadcast by the caller), or
/// None for a communicator without NCCL (copy-engine backend only).
#[pyfunction]
#[pyo3(signature = (name, world_size, rank, unique_id, device, max_ctas=None))]
fn create_communicator(
    py: Python<'_>,
    name: &str,
    world_size: i32,
    rank: i32,
    unique_id: Option<Vec<u8>>,
    device: i32,
    max_ctas: Option<i32>,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    py.detach(|| {
        communicator::create(
            name,
            world_size,
            rank,
            unique_id.as_deref(),
            device,
            max_ctas,
        )
    })
    .map_err(to_py)
}

#[pyfunction]
fn destroy_communicator(name: &str) -> bool {
    let _keep = driver::KeepCurrent::new();
    communicator::destroy(name)
}

#[pyfunction]
fn communicator_names() -> Vec<String> {
    let mut n = communicator::names();
    n.sort();
    n
}

#[pyfunction]
#[pyo3(signature = (x, weight, out, m, n, k, dtype, device, stream, kernel=None, raster_bands=None, sms=None, signal_bands=None, staging=0))]
#[allow(clippy::too_many_arguments)]
fn gemm(
    py: Python<'_>,
    x: u64,
    weight: u64,
    out: u64,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    device: i32,
    stream: usize,
    kernel: Option<&str>,
    raster_bands: Option<u32>,
    sms: Option<u32>,
    signal_bands: Option<u32>,
    staging: u64,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let args = operands(x, weight, out, m, n, k, dtype)?;
    let how = gemm_op::Launch {
        kernel: gemm_kernel(kernel)?,
        raster_bands,
        sms,
        signal_bands,
        staging,
    };
    py.detach(|| gemm_op::gemm(&args, device, &how, stream::from_handle(stream)))
        .map_err(to_py)
}

/// Moves what a `gemm(..., staging=...)` with the same launch options
/// stored in `staging` into `out`, on `ctas` CTAs (for measuring the swizzled
/// schedule's extra copy; `x` and `weight` are not read).
#[pyfunction]
#[pyo3(signature = (out, staging, m, n, dtype, device, stream, ctas, kernel=None, raster_bands=None, sms=None))]
#[allow(clippy::too_many_arguments)]
fn unreorder(
    py: Python<'_>,
    out: u64,
    staging: u64,
    m: u32,
    n: u32,
    dtype: &str,
    device: i32,
    stream: usize,
    ctas: u32,
    kernel: Option<&str>,
    raster_bands: Option<u32>,
    sms: Option<u32>,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    // The copy never reads the operands; K only has to be valid.
    let args = operands(out, out, out, m, n, 8, dtype)?;
    let how = gemm_op::Launch {
        kernel: gemm_kernel(kernel)?,
        raster_bands,
        sms,
        signal_bands: None,
        staging,
    };
    py.detach(|| gemm_op::unreorder(&args, device, &how, ctas, stream::from_handle(stream)))
        .map_err(to_py)
}

/// Enqueues GEMM + AllReduce: ("overlap", 0), ("sequential", 0) (nothing
/// enqueued: the caller runs the GEMM, then the AllReduce) or ("staging",
/// bytes) (nothing enqueued: call again with a staging buffer that large).
#[pyfunction]
#[pyo3(signature = (group_name, x, weight, out, m, n, k, dtype, stream, options, staging=0, norm=None))]
#[allow(clippy::too_many_arguments)]
fn gemm_all_reduce(
    py: Python<'_>,
    group_name: &str,
    x: u64,
    weight: u64,
    out: u64,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    stream: usize,
    options: OpOptions,
    staging: u64,
    norm: Option<NormArgs>,
) -> PyResult<(&'static str, u64)> {
    let _keep = driver::KeepCurrent::new();
    let (comm, _, opts) = call_of(group_name, m, n, k, dtype, &options)?;
    let args = operands(x, weight, out, m, n, k, dtype)?;
    let norm = norm
        .map(
            |(residual_in, residual_out, weight, eps, peer)| -> PyResult<gar::Norm> {
                Ok(gar::Norm {
                    residual_in,
                    residual_out,
                    weight,
                    eps,
                    peer: peer.map(peer_norm).transpose()?,
                })
            },
        )
        .transpose()?;
    py.detach(|| {
        let caller = stream::from_handle(stream);
        gar::gemm_all_reduce(&comm, &args, &opts, staging, norm.as_ref(), caller)
    })
    .map(|done| match done {
        gar::Enqueued::Overlap => ("overlap", 0),
        gar::Enqueued::Sequential => ("sequential", 0),
        gar::Enqueued::NeedsStaging(bytes) => ("staging", bytes),
    })
    .map_err(to_py)
}

/// Peer buffers as PeerGroup.core_buffers gives them: (every rank's base,
/// bytes each, this rank, wait timeout in ns, kernel config (threads,
/// unroll, stages, oneshot[, ring])).
type PeerBuffers = (Vec<u64>, u64, usize, u64, NormTuple);

/// The fused norm of gemm_all_reduce_rmsnorm: (residual_in, residual_out,
/// norm weight, eps, peer buffers for backend="peer").
type NormArgs = (u64, u64, u64, f32, Option<PeerBuffers>);

fn peer_norm(
    (bases, buffer_bytes, rank, timeout_ns, config): PeerBuffers,
) -> PyResult<gar::PeerNorm> {
    let world = bases.len();
    if !(1..=arn::MAX_WORLD).contains(&world) || rank >= world || bases.contains(&0) {
        return Err(PyValueError::new_err(format!(
            "peer: expected 1 to {} mapped buffers and a rank among them, got {world} (rank {rank})",
            arn::MAX_WORLD
        )));
    }
    let mut all = [0u64; arn::MAX_WORLD];
    all[..world].copy_from_slice(&bases);
    Ok(gar::PeerNorm {
        bases: all,
        world,
        rank,
        buffer_bytes,
        timeout_ns,
        config: norm_config(Some(config))?,
    })
}

/// A collective op's options as Python passes them: (mode, bands_per_group,
/// reserved_sms, max_groups, kernel, raster_bands, backend, order,
/// fused_norm).
type OpOptions = (
    String,
    Option<u32>,
    Option<u32>,
    u32,
    Option<String>,
    Option<u32>,
    String,
    String,
    bool,
);

/// The communicator, the shape (no pointers: planning reads none) and the
/// options of a call.
fn call_of(
    group_name: &str,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    o: &OpOptions,
) -> PyResult<(
    std::sync::Arc<communicator::Communicator>,
    GemmArgs,
    gar::Options,
)> {
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let opts = op_options(o)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    Ok((comm, args, opts))
}

fn op_options(o: &OpOptions) -> PyResult<gar::Options> {
    Ok(gar::Options {
        fused_norm: o.8,
        ..options(&o.0, o.1, o.2, o.3, o.4.as_deref(), o.5, &o.6, &o.7)?
    })
}

fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Overlap => "overlap",
        Schedule::Sequential => "sequential",
    }
}

/// Collective: this rank's half of (re)making the copy-engine buffers of a
/// communicator with `slot_bytes` per staging slot; returns the IPC handle
/// every rank must receive (in rank order) for `peer_attach`.
#[pyfunction]
fn peer_prepare<'py>(
    py: Python<'py>,
    group_name: &str,
    slot_bytes: u64,
) -> PyResult<Bound<'py, PyBytes>> {
    let _keep = driver::KeepCurrent::new();
    let comm = communicator::get(group_name).map_err(to_py)?;
    let handle = py.detach(|| comm.peer_prepare(slot_bytes)).map_err(to_py)?;
    Ok(PyBytes::new(py, &handle))
}

#[pyfunction]
fn peer_attach(py: Python<'_>, group_name: &str, handles: Vec<Vec<u8>>) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| comm.peer_attach(&handles)).map_err(to_py)
}

/// Bytes per staging slot of the communicator's copy-engine buffers (0: none yet).
#[pyfunction]
fn peer_slot_bytes(group_name: &str) -> PyResult<u64> {
    Ok(communicator::get(group_name)
        .map_err(to_py)?
        .peer_slot_bytes())
}

/// Waits until the communicator's streams are idle.
#[pyfunction]
fn synchronize_communicator(py: Python<'_>, group_name: &str) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| comm.synchronize()).map_err(to_py)
}

/// In-place sum AllReduce of `count` elements at `ptr` on the communicator's
/// stream, ordered with the caller's `stream`.
#[pyfunction]
fn all_reduce(
    py: Python<'_>,
    group_name: &str,
    ptr: u64,
    count: usize,
    dtype: &str,
    stream: usize,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let dtype = self::dtype(dtype)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| ar_op::all_reduce(&comm, ptr, count, dtype, stream::from_handle(stream)))
        .map_err(to_py)
}

/// The plan `gemm_all_reduce` runs for these arguments on this communicator.
#[pyfunction]
fn communicator_plan(
    group_name: &str,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    stream: usize,
    options: OpOptions,
) -> PyResult<PyPlan> {
    let (comm, args, opts) = call_of(group_name, m, n, k, dtype, &options)?;
    let caller = stream::from_handle(stream);
    let plan = gar::plan_of(&comm, &args, &opts, caller).map_err(to_py)?;
    let gathered = crate::ops::gathered_all_reduce::prepare(&comm, &args, &opts, caller)
        .map_err(to_py)?
        .map(|g| g.plan.clone());
    Ok(PyPlan(plan, gathered))
}

/// GEMM + ReduceScatter options as Python passes them: (mode,
/// bands_per_group, reserved_sms, max_groups, kernel, backend).
type RsOptions = (
    String,
    Option<u32>,
    Option<u32>,
    u32,
    Option<String>,
    String,
);

fn rs_call(
    group_name: &str,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    o: &RsOptions,
) -> PyResult<(
    std::sync::Arc<communicator::Communicator>,
    GemmArgs,
    grs::Options,
)> {
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let opts = rs_options(o)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    Ok((comm, args, opts))
}

fn rs_options(o: &RsOptions) -> PyResult<grs::Options> {
    Ok(grs::Options {
        mode: mode(&o.0)?,
        bands_per_group: o.1,
        reserved_sms: o.2,
        max_groups: o.3,
        kernel: gemm_kernel(o.4.as_deref())?,
        backend: backend(&o.5)?,
    })
}

/// The backend "auto" runs for a call: of `allowed` ("nccl", "copy_engine";
/// those the communicator can run), the one whose plan is predicted fastest
/// for this shape on `world_size` devices with `sms` SMs of compute
/// capability `major`. `options` is the op's options tuple (its backend
/// field is ignored); `matrix` the whole routing of gemm_all_to_all (whose
/// `m` is ignored). Needs no GPU.
#[pyfunction]
#[pyo3(signature = (op, m, n, k, world_size, dtype, sms, major, options, allowed, matrix=None))]
#[allow(clippy::too_many_arguments)]
fn choose_backend(
    op: &str,
    m: u32,
    n: u32,
    k: u32,
    world_size: u32,
    dtype: &str,
    sms: u32,
    major: i32,
    options: &Bound<'_, PyAny>,
    allowed: Vec<String>,
    matrix: Option<Vec<Vec<u64>>>,
) -> PyResult<&'static str> {
    let allowed = allowed
        .iter()
        .map(|b| backend(b))
        .collect::<PyResult<Vec<_>>>()?;
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let chosen = match op {
        "gemm_all_reduce" => {
            let o: OpOptions = options.extract()?;
            let base = op_options(&(o.0, o.1, o.2, o.3, o.4, o.5, "nccl".into(), o.7, o.8))?;
            backend_choice::cheapest(&allowed, |backend| {
                gar::predicted_us(&args, world_size, &gar::Options { backend, ..base }, sms, major)
            })
        }
        "gemm_reduce_scatter" => {
            let o: RsOptions = options.extract()?;
            let base = rs_options(&(o.0, o.1, o.2, o.3, o.4, "nccl".into()))?;
            backend_choice::cheapest(&allowed, |backend| {
                grs::predicted_us(&args, world_size, &grs::Options { backend, ..base }, sms, major)
            })
        }
        "gemm_all_to_all" => {
            let o: A2aOptions = options.extract()?;
            let base = a2a_options(&(o.0, o.1, o.2, "nccl".into()))?;
            let matrix = matrix.ok_or_else(|| {
                PyValueError::new_err("matrix: gemm_all_to_all chooses its backend from the whole routing")
            })?;
            let dtype = args.dtype;
            backend_choice::cheapest(&allowed, |backend| {
                let opts = ga2a::Options { backend, ..base };
                Ok(ga2a::choose_groups(n, k, dtype, &matrix, &opts, sms, major, None)?.predicted_us())
            })
        }
        other => {
            return Err(PyValueError::new_err(format!(
                "op: expected 'gemm_all_reduce', 'gemm_reduce_scatter' or 'gemm_all_to_all', got {other:?}"
            )))
        }
    };
    chosen.map(|b| b.name()).map_err(to_py)
}

/// The GEMM + ReduceScatter plan of a call, as a dict: schedule, ctas,
/// waves, out_rows and send_rows (the buffers the op needs), tile, bands
/// per shard, predicted times, and one dict per group.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn communicator_rs_plan<'py>(
    py: Python<'py>,
    group_name: &str,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    stream: usize,
    options: RsOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let (comm, args, opts) = rs_call(group_name, m, n, k, dtype, &options)?;
    let plan = grs::plan_of(&comm, &args, &opts, stream::from_handle(stream)).map_err(to_py)?;
    rs_plan_dict(py, &plan)
}

/// Plans GEMM + ReduceScatter for a device described by `sms` and compute
/// capability `major`, as [`communicator_rs_plan`]'s dict; needs no GPU.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn plan_gemm_reduce_scatter<'py>(
    py: Python<'py>,
    m: u32,
    n: u32,
    k: u32,
    world_size: u32,
    dtype: &str,
    sms: u32,
    major: i32,
    options: RsOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let (_, plan) =
        grs::plan_for(&args, world_size, &rs_options(&options)?, sms, major).map_err(to_py)?;
    rs_plan_dict(py, &plan)
}

fn rs_plan_dict<'py>(
    py: Python<'py>,
    plan: &crate::plan::ReduceScatterPlan,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("schedule", schedule_name(plan.schedule))?;
    d.set_item("ctas", plan.ctas)?;
    d.set_item("waves", plan.waves.count())?;
    d.set_item("out_rows", plan.out_rows())?;
    d.set_item("send_rows", plan.send_rows())?;
    let t = plan.request.tile;
    d.set_item("tile", (t.bm, t.bn, t.bk))?;
    d.set_item("bands", plan.bands)?;
    d.set_item(
        "predicted_overlap_us",
        Schedule::Overlap.predicted_us(&plan.timeline, plan.overlap_fixed_us),
    )?;
    d.set_item("predicted_sequential_us", plan.timeline.sequential_us)?;
    d.set_item("predicted_us", plan.predicted_us())?;
    d.set_item("overlap_fixed_us", plan.overlap_fixed_us)?;
    d.set_item("overlap_groups_us", plan.timeline.groups_overhead_us())?;
    let groups = plan
        .groups
        .iter()
        .map(|g| {
            let gd = PyDict::new(py);
            gd.set_item("bands", (g.bands.start, g.bands.end))?;
            gd.set_item("positions", (g.positions.start, g.positions.end))?;
            gd.set_item("tiles", g.tiles)?;
            gd.set_item("recv_row", g.recv_row)?;
            gd.set_item("recv_count", g.recv_count)?;
            Ok(gd)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("groups", groups)?;
    Ok(d)
}

/// Enqueues GEMM + ReduceScatter ("overlap") or nothing ("sequential").
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn gemm_reduce_scatter(
    py: Python<'_>,
    group_name: &str,
    x: u64,
    weight: u64,
    out: u64,
    send: u64,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    stream: usize,
    options: RsOptions,
) -> PyResult<&'static str> {
    let _keep = driver::KeepCurrent::new();
    let (comm, _, opts) = rs_call(group_name, m, n, k, dtype, &options)?;
    let args = operands(x, weight, out, m, n, k, dtype)?;
    py.detach(|| grs::gemm_reduce_scatter(&comm, &args, send, &opts, stream::from_handle(stream)))
        .map(schedule_name)
        .map_err(to_py)
}

/// The fused add + RMSNorm alone on rows 0..rows of x [rows, n] (the
/// sequential schedule's norm), on `ctas` CTAs.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn add_rmsnorm(
    py: Python<'_>,
    x: u64,
    residual_in: u64,
    residual_out: u64,
    weight: u64,
    rows: u32,
    n: u32,
    eps: f32,
    dtype: &str,
    device: i32,
    stream: usize,
    ctas: u32,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let dtype = self::dtype(dtype)?;
    if n % 8 != 0 || n > kernels::ADD_RMSNORM_MAX_N {
        return Err(PyValueError::new_err(format!(
            "weight: the hidden size must be a multiple of 8 and <= {}, got {n}",
            kernels::ADD_RMSNORM_MAX_N
        )));
    }
    let norm = gar::Norm {
        residual_in,
        residual_out,
        weight,
        eps,
        peer: None,
    };
    py.detach(|| {
        let dev = driver::bind(device)?;
        let kernel = kernels::load(&dev, &kernels::add_rmsnorm_spec(dtype))?;
        gar::launch_add_rmsnorm(
            &kernel,
            x,
            None,
            &norm,
            0..rows,
            n,
            ctas,
            stream::from_handle(stream),
        )
    })
    .map_err(to_py)
}

/// Bytes each rank's peer buffer needs for an AllReduce + RMSNorm of
/// `tokens` rows of `hidden` on `world` ranks (`pull`: laid out for
/// gemm_all_reduce_rmsnorm's backend="peer").
#[pyfunction]
#[pyo3(signature = (world, tokens, hidden, dtype, pull=false))]
fn allreduce_rmsnorm_buffer_bytes(
    world: usize,
    tokens: u64,
    hidden: u32,
    dtype: &str,
    pull: bool,
) -> PyResult<u64> {
    let dtype = self::dtype(dtype)?;
    if pull {
        Ok(arn::Layout::pull(world, tokens, hidden, dtype)
            .map_err(to_py)?
            .bytes)
    } else {
        arn::Layout::needed(world, tokens, hidden, dtype).map_err(to_py)
    }
}

/// Parts each CTA pipelines its rows in, for a push call keeping the full
/// residual of `tokens` rows on `world` ranks and `ctas` CTAs with kernel
/// Rows [start, end) of `tokens` that `rank` of `world` owns in the peer
/// AllReduce + RMSNorm (the kernel's near-equal split).
#[pyfunction]
fn allreduce_rmsnorm_slice(tokens: u64, world: usize, rank: usize) -> PyResult<(u64, u64)> {
    if world == 0 || rank >= world {
        return Err(PyValueError::new_err(format!(
            "rank: expected 0 <= rank < world, got rank {rank} of world {world}"
        )));
    }
    Ok(arn::slice(tokens, world, rank))
}

/// TokenWeave's wave-aware cut of `tokens` for a layer of GEMMs `(n, k)`
/// in `tile` (rows, columns) tiles on `ctas` CTAs, halves at most `skew` x
/// tokens apart: (first, second, waves of the halves, waves of the whole
/// batch), or None where the batch has fewer than two row bands.
#[pyfunction]
fn wave_aware_split(
    tokens: u32,
    gemms: Vec<(u32, u32)>,
    tile: (u32, u32),
    ctas: u32,
    skew: f64,
) -> PyResult<Option<(u32, u32, u32, u32)>> {
    let tile = crate::plan::TileShape {
        bm: tile.0,
        bn: tile.1,
        bk: 1,
    };
    let gemms: Vec<_> = gemms
        .into_iter()
        .map(|(n, k)| crate::plan::LayerGemm { n, k })
        .collect();
    let split = crate::plan::wave_aware_split(tokens, &gemms, tile, ctas, skew)
        .map_err(|e| to_py(e.into()))?;
    Ok(split.map(|s| (s.first, s.second, s.waves, s.unsplit_waves)))
}

/// `config` (threads, unroll, stages, oneshot; default the library's).
#[pyfunction]
#[pyo3(signature = (tokens, world, ctas, config=None))]
fn allreduce_rmsnorm_stages(
    tokens: u64,
    world: usize,
    ctas: u32,
    config: Option<NormTuple>,
) -> PyResult<u32> {
    let config = arn::resolved(norm_config(config)?, tokens, world, ctas, true, false);
    let oneshot = arn::runs_oneshot(config, world, true, false);
    Ok(arn::stages(tokens, world, ctas, config, oneshot, false))
}

/// A norm kernel config as Python gives it: (threads, unroll, stages,
/// oneshot[, ring]).
#[derive(FromPyObject)]
enum NormTuple {
    Ring((u32, u32, u32, bool, bool)),
    Plain((u32, u32, u32, bool)),
}

fn norm_config(config: Option<NormTuple>) -> PyResult<kernels::NormConfig> {
    let (threads, unroll, stages, oneshot, ring) = match config {
        Some(NormTuple::Ring(t)) => t,
        Some(NormTuple::Plain((a, b, c, d))) => (a, b, c, d, false),
        None => return Ok(kernels::NormConfig::DEFAULT),
    };
    kernels::NormConfig::with(threads, unroll, stages, oneshot)
        .and_then(|c| c.ringed(ring))
        .map_err(to_py)
}

/// Where this rank's partial (x area) lies in its peer buffer, laid out for
/// gemm_all_reduce_rmsnorm's backend="peer" over an output of `rows` rows
/// (`buffers` as PeerGroup.core_buffers gives them; refused where they are too
/// small): a producer that stores its partial there spares the launch's copy.
#[pyfunction]
fn allreduce_rmsnorm_partial(
    buffers: PeerBuffers,
    rows: u64,
    hidden: u32,
    dtype: &str,
) -> PyResult<u64> {
    peer_norm(buffers)?
        .partial(rows, hidden, self::dtype(dtype)?)
        .map_err(to_py)
}

/// Enqueues the peer-memory AllReduce + residual add + RMSNorm on `stream`:
/// tensors = (x, residual, weight, out, residual_out) device pointers,
/// bases = every rank's peer buffer as mapped in this process (zeroed
/// before first use, `buffer_bytes` each), this rank at `rank`. `pull`:
/// the buffers are laid out for gemm_all_reduce_rmsnorm's backend="peer";
/// x is first copied into this rank's x area unless it lies there already
/// (its sequential schedule).
/// `config`: (threads, unroll, stages, oneshot) of the kernel (default the library's;
/// other values for the benchmark's sweep). `residual_sliced` (sharded mode):
/// the residual tensor holds this rank's slice rows only. `lanes` (2 ranks,
/// push mode): the copy engines move the rows, in `chunks` row ranges (0:
/// the library's count, norm_copy_engines::auto_chunks), and the kernel on
/// `ctas` CTAs only sums and normalizes (ops::norm_copy_engines).
#[pyfunction]
#[pyo3(signature = (device, tensors, bases, buffer_bytes, rank, tokens, hidden, eps, residual_full, dtype, ctas, timeout_ns, stream, pull=false, config=None, residual_sliced=false, lanes=None, chunks=0))]
#[allow(clippy::too_many_arguments)]
fn allreduce_rmsnorm_launch(
    py: Python<'_>,
    device: i32,
    tensors: (u64, u64, u64, u64, u64),
    bases: Vec<u64>,
    buffer_bytes: u64,
    rank: usize,
    tokens: u64,
    hidden: u32,
    eps: f32,
    residual_full: bool,
    dtype: &str,
    ctas: u32,
    timeout_ns: u64,
    stream: usize,
    pull: bool,
    config: Option<NormTuple>,
    residual_sliced: bool,
    lanes: Option<PyRef<'_, PyNormLanes>>,
    chunks: u32,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let dtype = self::dtype(dtype)?;
    let config = norm_config(config)?;
    if let Some(lanes) = &lanes {
        if pull || lanes.device != device || bases.len() != 2 {
            return Err(PyValueError::new_err(
                "lanes: the copy engines serve push calls of 2 ranks, with lanes of the call's device",
            ));
        }
    }
    let call = arn::Call {
        x: tensors.0,
        residual: tensors.1,
        weight: tensors.2,
        out: tensors.3,
        residual_out: tensors.4,
        bases,
        rank,
        tokens,
        hidden,
        eps,
        residual_full,
        residual_sliced,
        timeout_ns,
        dtype,
        buffer_bytes,
        pull: pull.then_some(arn::Pull {
            first: 0,
            rows: tokens,
        }),
        config,
    };
    let lanes = lanes.as_ref().map(|l| &l.lanes);
    py.detach(|| {
        let dev = driver::bind(device)?;
        let mut call = call;
        let world = call.bases.len();
        if let Some(lanes) = lanes {
            // The ring's build where it runs (each CTA's rows through it in bulk copies);
            // one-shot where the config asks for it, or the default's rule, and the call allows it.
            let ce = arn::resolved_copy_engines(config, world, residual_full);
            call.config = arn::effective(ce, world, hidden, dtype, dev.major, true);
            // Checked before its kernel is compiled (for its hidden size, too).
            let checked = arn::checked(&call, ctas)?;
            let ce = &crate::ops::norm_copy_engines::kernel_spec(dtype, &call, chunks);
            let kernel = kernels::load(&dev, ce)?;
            let stream = stream::from_handle(stream);
            return crate::ops::norm_copy_engines::enqueue(
                &kernel, &call, &checked, chunks, stream, lanes,
            );
        }
        let config = arn::resolved(config, tokens, world, ctas, residual_full, pull);
        let ring = arn::default_takes_ring(tokens, world, ctas, pull);
        call.config = arn::effective(config, world, hidden, dtype, dev.major, ring);
        // Checked before its kernel is compiled (for its hidden size, too).
        let checked = arn::checked(&call, ctas)?;
        let kernel = kernels::load(&dev, &arn::kernel_spec(dtype, &call, ctas))?;
        let stream = stream::from_handle(stream);
        if pull && tokens > 0 {
            let partial = call.bases[rank] + call.layout()?.x_offset;
            // A partial already in place (the producer stored it there) needs no copy.
            if call.x != partial {
                let bytes = tokens * u64::from(hidden) * u64::from(dtype.bytes());
                stream::copy(stream, partial, call.x, bytes as usize)?;
            }
        }
        checked.launch(&kernel, stream)
    })
    .map_err(to_py)
}

/// The streams and events of the copy engines' AllReduce + RMSNorm on one
/// device (ops::norm_copy_engines::Lanes), made once per peer group.
#[pyclass(name = "NormLanes", module = "flashoverlap._core")]
struct PyNormLanes {
    device: i32,
    lanes: crate::ops::norm_copy_engines::Lanes,
}

#[pymethods]
impl PyNormLanes {
    #[new]
    fn new(device: i32) -> PyResult<Self> {
        let _keep = driver::KeepCurrent::new();
        driver::bind(device).map_err(to_py)?;
        let lanes = crate::ops::norm_copy_engines::Lanes::new().map_err(to_py)?;
        Ok(Self { device, lanes })
    }
}

/// A zeroed device buffer of this rank mapped into every rank of a node
/// through CUDA IPC (the peer-memory AllReduce + RMSNorm's): create it,
/// exchange `handle()`s, `attach` them; `bases` are then every rank's
/// buffer as seen from this process. Freed by `close()` or when collected.
#[pyclass(name = "PeerMemory", module = "flashoverlap._core")]
struct PyPeerMemory {
    device: i32,
    local: Option<crate::cuda::memory::DeviceBuffer>,
    bases: Vec<u64>,
    mapped: Vec<u64>,
}

#[pymethods]
impl PyPeerMemory {
    #[new]
    fn new(device: i32, bytes: u64) -> PyResult<Self> {
        let _keep = driver::KeepCurrent::new();
        driver::bind(device).map_err(to_py)?;
        let words = usize::try_from(bytes.div_ceil(4))
            .map_err(|_| PyValueError::new_err(format!("bytes: too large ({bytes})")))?;
        let local = crate::cuda::memory::DeviceBuffer::zeroed_u32(words).map_err(to_py)?;
        Ok(Self {
            device,
            local: Some(local),
            bases: Vec::new(),
            mapped: Vec::new(),
        })
    }

    /// This buffer's IPC handle (its zeroes settled first).
    fn handle<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let _keep = driver::KeepCurrent::new();
        let local = self.live()?;
        driver::bind(self.device).map_err(to_py)?;
        let bytes = crate::comm::peer::export(local).map_err(to_py)?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Maps the other ranks' buffers from every rank's handle (rank order).
    fn attach(&mut self, rank: usize, handles: Vec<Vec<u8>>) -> PyResult<()> {
        let _keep = driver::KeepCurrent::new();
        let local = self.live()?;
        let own = local.ptr;
        if rank >= handles.len() || !self.mapped.is_empty() {
            return Err(PyValueError::new_err(format!(
                "attach: rank {rank} of {} handles, or attached already",
                handles.len()
            )));
        }
        driver::bind(self.device).map_err(to_py)?;
        // 2 ranks: the watch area holds the sentinel before any peer can copy into it (every
        // rank attaches before any calls).
        if let Some(offset) = arn::watch_offset(handles.len(), local.bytes as u64) {
            crate::cuda::memory::fill_from(local, offset, arn::WATCH_SENTINEL_BYTE)
                .map_err(to_py)?;
        }
        let (bases, mapped) = crate::comm::peer::open_all(rank, own, &handles).map_err(to_py)?;
        self.bases = bases;
        self.mapped = mapped;
        Ok(())
    }

    #[getter]
    fn bases(&self) -> Vec<u64> {
        self.bases.clone()
    }

    #[getter]
    fn bytes(&self) -> u64 {
        self.local.as_ref().map_or(0, |l| l.bytes as u64)
    }

    /// Header word `index` of this rank's buffer (read synchronously).
    fn header_word(&self, index: u64) -> PyResult<u32> {
        const WORDS: u64 = arn::HEADER_BYTES / 4;
        if index >= WORDS {
            return Err(PyValueError::new_err(format!(
                "index: expected a header word below {WORDS}, got {index}"
            )));
        }
        let _keep = driver::KeepCurrent::new();
        let local = self.live()?;
        driver::bind(self.device).map_err(to_py)?;
        // The buffer is larger than its header, whose words `index` is checked to be among.
        crate::cuda::memory::read_u32(local.ptr + 4 * index).map_err(to_py)
    }

    /// Unmaps the peers' buffers and frees this one (every rank's kernels
    /// that use them must be done: the caller synchronizes first).
    fn close(&mut self) {
        let _keep = driver::KeepCurrent::new();
        if driver::bind(self.device).is_ok() {
            crate::comm::peer::close_all(&self.mapped);
            self.local = None;
        }
        self.mapped.clear();
        self.bases.clear();
    }
}

impl PyPeerMemory {
    fn live(&self) -> PyResult<&crate::cuda::memory::DeviceBuffer> {
        self.local
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("PeerMemory: closed"))
    }
}

impl Drop for PyPeerMemory {
    fn drop(&mut self) {
        let _keep = driver::KeepCurrent::new();
        self.close();
    }
}

/// GEMM + All-to-All options: (groups, reserved_sms, kernel, backend).
type A2aOptions = (u32, Option<u32>, Option<String>, String);
/// (schedule, chosen group count, (groups, predicted us) per candidate,
/// sequential us); schedule "sequential": the library GEMM, then one
/// exchange (the group count is then the best overlapped one's).
type A2aPrediction = (&'static str, u32, Vec<(u32, f64)>, f64, f64);

fn a2a_options(o: &A2aOptions) -> PyResult<ga2a::Options> {
    Ok(ga2a::Options {
        groups: o.0,
        reserved_sms: o.1,
        kernel: gemm_kernel(o.2.as_deref())?,
        backend: backend(&o.3)?,
    })
}

/// The tables (u32 words, little-endian bytes) and send-buffer rows of a
/// GEMM + All-to-All call on `device` by `rank` (whose tiles the push
/// backend stores into the peer), for the caller to upload. `split_matrix`:
/// the natural layout (see ga2a::plan_for); None: padded.
#[pyfunction]
#[pyo3(signature = (m, n, k, dtype, device, rank, send_splits, recv_splits, options, split_matrix=None))]
#[allow(clippy::too_many_arguments)]
fn all_to_all_tables<'py>(
    py: Python<'py>,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    device: i32,
    rank: u32,
    send_splits: Vec<u64>,
    recv_splits: Vec<u64>,
    options: A2aOptions,
    split_matrix: Option<Vec<Vec<u64>>>,
) -> PyResult<(Bound<'py, PyBytes>, u64)> {
    let _keep = driver::KeepCurrent::new();
    let args = operands(0, 0, 0, m, n, k, dtype)?;
    let opts = a2a_options(&options)?;
    let routing = split_matrix.as_deref().map(|matrix| ga2a::Routing {
        matrix,
        me: rank as usize,
    });
    let dev = driver::bind(device).map_err(to_py)?;
    let (kernel, plan) = ga2a::plan_for(
        &args,
        &send_splits,
        &recv_splits,
        routing,
        &opts,
        dev.sms,
        dev.major,
    )
    .map_err(to_py)?;
    let pushed_by = (opts.backend == gar::Backend::Push).then_some((rank, &send_splits[..]));
    let words = ga2a::tables(&plan, kernel, pushed_by);
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    Ok((PyBytes::new(py, &bytes), plan.send_buffer_rows))
}

/// The group count the predictor picks for GEMM + All-to-All over the whole
/// routing (`matrix[p][q]`: rows rank p sends rank q) on a device with
/// `sms` SMs of compute capability `major`, each candidate's predicted time
/// in microseconds, the predicted sequential time (library GEMM, then one
/// All-to-All), and what an overlapped call pays once beyond its candidate's
/// time (the choice weighs it for more than one group). `segment_rows`:
/// the op's split of each destination's rows (whole bands); 1 replays runs
/// measured before it (near-equal rows). Needs no GPU.
#[pyfunction]
#[pyo3(signature = (n, k, matrix, dtype="bfloat16", sms=132, major=9, reserved_sms=None, kernel=None, backend="nccl", segment_rows=None))]
#[allow(clippy::too_many_arguments)]
fn plan_all_to_all_groups(
    n: u32,
    k: u32,
    matrix: Vec<Vec<u64>>,
    dtype: &str,
    sms: u32,
    major: i32,
    reserved_sms: Option<u32>,
    kernel: Option<String>,
    backend: &str,
    segment_rows: Option<u64>,
) -> PyResult<A2aPrediction> {
    if segment_rows == Some(0) {
        return Err(PyValueError::new_err("segment_rows: expected >= 1, got 0"));
    }
    let segments = segment_rows.map(crate::plan::predictor::Segments::Padded);
    let dtype = self::dtype(dtype)?;
    let opts = a2a_options(&(1, reserved_sms, kernel, backend.to_string()))?;
    let choice =
        ga2a::choose_groups(n, k, dtype, &matrix, &opts, sms, major, segments).map_err(to_py)?;
    let timelines = &choice.timelines;
    let sequential = timelines.first().map_or(0.0, |(_, t)| t.sequential_us);
    let predicted = timelines.iter().map(|(g, t)| (*g, t.overlap_us)).collect();
    // The library GEMM then one exchange, where no group count beats it.
    let schedule = if choice.sequential {
        "sequential"
    } else {
        "overlap"
    };
    Ok((
        schedule,
        choice.groups,
        predicted,
        sequential,
        choice.fixed_us,
    ))
}

/// Enqueues GEMM + All-to-All; buffers = (send, send_rows, tables,
/// table_words, counters), all device memory in stream order on `stream`;
/// `split_matrix` as the tables were made with.
#[pyfunction]
#[pyo3(signature = (group_name, x, weight, out, m, n, k, dtype, stream, send_splits, recv_splits, buffers, options, split_matrix=None))]
#[allow(clippy::too_many_arguments)]
fn gemm_all_to_all(
    py: Python<'_>,
    group_name: &str,
    x: u64,
    weight: u64,
    out: u64,
    m: u32,
    n: u32,
    k: u32,
    dtype: &str,
    stream: usize,
    send_splits: Vec<u64>,
    recv_splits: Vec<u64>,
    buffers: (u64, u64, u64, u64, u64),
    options: A2aOptions,
    split_matrix: Option<Vec<Vec<u64>>>,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let args = operands(x, weight, out, m, n, k, dtype)?;
    let opts = a2a_options(&options)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    let b = ga2a::Buffers {
        send: buffers.0,
        send_rows: buffers.1,
        tables: buffers.2,
        table_words: buffers.3,
        counters: buffers.4,
    };
    py.detach(|| {
        let caller = stream::from_handle(stream);
        ga2a::gemm_all_to_all(
            &comm,
            &args,
            &send_splits,
            &recv_splits,
            split_matrix.as_deref(),
            &b,
            &opts,
            caller,
        )
    })
    .map_err(to_py)
}

/// A plain uniform All-to-All on a communicator: `count` elements from
/// every rank to every rank (send and recv hold world * count each).
#[pyfunction]
fn all_to_all(
    py: Python<'_>,
    group_name: &str,
    send: u64,
    recv: u64,
    count: usize,
    dtype: &str,
    stream: usize,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let dtype = self::dtype(dtype)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| ga2a::all_to_all(&comm, send, recv, count, dtype, stream::from_handle(stream)))
        .map_err(to_py)
}

/// A plain ReduceScatter on a communicator (the sequential schedule).
#[pyfunction]
fn reduce_scatter(
    py: Python<'_>,
    group_name: &str,
    send: u64,
    recv: u64,
    recv_count: usize,
    dtype: &str,
    stream: usize,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let dtype = self::dtype(dtype)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| {
        grs::reduce_scatter(
            &comm,
            send,
            recv,
            recv_count,
            dtype,
            stream::from_handle(stream),
        )
    })
    .map_err(to_py)
}

/// A plain AllReduce ("all_reduce": `out` = the sum of every rank's `src`,
/// `bytes` each) or ReduceScatter ("reduce_scatter": `out` = the sum of
/// every rank's block `rank` of `src`, `bytes` the whole input) on the copy
/// engines, its sums on `ctas` CTAs, ordered with the caller's `stream`;
/// `chunks`: pipelined exchanges (None: the default, ~4 MiB each).
#[pyfunction]
#[pyo3(signature = (group_name, kind, src, out, bytes, dtype, ctas, stream, chunks=None))]
#[allow(clippy::too_many_arguments)]
fn copy_engine_collective(
    py: Python<'_>,
    group_name: &str,
    kind: &str,
    src: u64,
    out: u64,
    bytes: u64,
    dtype: &str,
    ctas: u32,
    stream: usize,
    chunks: Option<u64>,
) -> PyResult<()> {
    let _keep = driver::KeepCurrent::new();
    let kind = match kind {
        "all_reduce" => copy_engine::Plain::AllReduce,
        "reduce_scatter" => copy_engine::Plain::ReduceScatter,
        other => {
            return Err(PyValueError::new_err(format!(
                "kind: expected 'all_reduce' or 'reduce_scatter', got {other:?}"
            )))
        }
    };
    let dtype = self::dtype(dtype)?;
    let comm = communicator::get(group_name).map_err(to_py)?;
    py.detach(|| {
        copy_engine::plain(
            &comm,
            kind,
            src,
            out,
            bytes,
            dtype,
            ctas,
            chunks,
            stream::from_handle(stream),
        )
    })
    .map_err(to_py)
}

fn collective_kind(name: &str) -> PyResult<CollectiveKind> {
    match name {
        "all_reduce" => Ok(CollectiveKind::AllReduce),
        "reduce_scatter" => Ok(CollectiveKind::ReduceScatter),
        "all_to_all" => Ok(CollectiveKind::AllToAll),
        other => Err(PyValueError::new_err(format!(
            "collective: expected 'all_reduce', 'reduce_scatter' or 'all_to_all', got {other:?}"
        ))),
    }
}

/// What `tune` measured a plain collective of `bytes` per rank to take on
/// `backend` ("nccl": this library's capped communicator; "copy_engine":
/// the exchange with its sums on at most `ctas` CTAs), on devices with `sms`
/// SMs at `world_size` ranks; None where no curve was measured.
#[pyfunction]
fn measured_collective_us(
    collective: &str,
    backend: &str,
    world_size: u32,
    sms: u32,
    ctas: u32,
    bytes: u64,
) -> PyResult<Option<f64>> {
    Ok(profile::measured_collective_us(
        sms,
        world_size,
        collective_kind(collective)?,
        self::backend(backend)?,
        ctas,
        bytes,
    ))
}

/// Registers a measured curve (input bytes per rank, microseconds) of
/// `collective` for devices with `sms` SMs at `world_size` ranks: the
/// overlapped groups' where `overlapped` (this library's capped NCCL
/// communicator, or with `copy_engine_ctas` the copy-engine exchange of one
/// group summed on that many CTAs), else the sequential schedule's; plans
/// made afterwards use it.
#[pyfunction]
#[pyo3(signature = (sms, world_size, collective, overlapped, bytes, us, copy_engine_ctas=None))]
fn register_collective_curve(
    sms: u32,
    world_size: u32,
    collective: &str,
    overlapped: bool,
    bytes: Vec<u64>,
    us: Vec<f64>,
    copy_engine_ctas: Option<u32>,
) -> PyResult<()> {
    if bytes.len() != us.len() {
        return Err(PyValueError::new_err(format!(
            "curve: {} sizes but {} times",
            bytes.len(),
            us.len()
        )));
    }
    let samples: Vec<(u64, f64)> = bytes.into_iter().zip(us).collect();
    let kind = collective_kind(collective)?;
    let of = match (overlapped, copy_engine_ctas) {
        (false, None) => profile::CurveOf::Sequential,
        (true, None) => profile::CurveOf::NcclGroup,
        (true, Some(ctas)) => profile::CurveOf::CopyEngineGroup { ctas },
        (false, Some(_)) => {
            return Err(PyValueError::new_err(
                "copy_engine_ctas: only the overlapped groups run on the copy engines",
            ))
        }
    };
    profile::register_curve(sms, world_size, kind, of, &samples).map_err(to_py)
}

/// Registers a measured GEMM time: `kernel` ("sm80", "sm90_n128",
/// "sm90_n256", or "cublas" for the sequential schedule's GEMM) on `ctas`
/// of a device's `sms` SMs.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn register_gemm_sample(
    kernel: &str,
    dtype: &str,
    sms: u32,
    ctas: u32,
    m: u32,
    n: u32,
    k: u32,
    us: f64,
) -> PyResult<()> {
    profile::register_gemm(kernel, self::dtype(dtype)?, sms, ctas, (m, n, k), us).map_err(to_py)
}

/// Forgets every registered profile (plans already made keep theirs).
#[pyfunction]
fn clear_profiles() {
    profile::clear()
}

/// (collective curves, GEMM samples) registered.
#[pyfunction]
fn profile_counts() -> (usize, usize) {
    profile::counts()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPlan>()?;
    m.add("NCCL_RESERVED_SMS", gar::NCCL_RESERVED_SMS)?;
    m.add("A2A_SEGMENT_ROWS", SEGMENT_ROWS)?;
    m.add(
        "COPY_ENGINE_RESERVED_SMS",
        gar::COPY_ENGINE_RESERVED_SMS.to_vec(),
    )?;
    m.add("ADD_RMSNORM_MAX_N", kernels::ADD_RMSNORM_MAX_N)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(unreorder, m)?)?;
    m.add_function(wrap_pyfunction!(communicator_rs_plan, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(copy_engine_collective, m)?)?;
    m.add_function(wrap_pyfunction!(choose_backend, m)?)?;
    m.add_function(wrap_pyfunction!(measured_collective_us, m)?)?;
    m.add_function(wrap_pyfunction!(add_rmsnorm, m)?)?;
    m.add_function(wrap_pyfunction!(register_collective_curve, m)?)?;
    m.add_function(wrap_pyfunction!(register_gemm_sample, m)?)?;
    m.add_function(wrap_pyfunction!(clear_profiles, m)?)?;
    m.add_function(wrap_pyfunction!(profile_counts, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all_tables, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_all_to_all, m)?)?;
    m.add_function(wrap_pyfunction!(plan_all_to_all_groups, m)?)?;
    m.add_function(wrap_pyfunction!(all_to_all, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_rmsnorm_buffer_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_rmsnorm_slice, m)?)?;
    m.add_function(wrap_pyfunction!(wave_aware_split, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_rmsnorm_partial, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_rmsnorm_stages, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_rmsnorm_launch, m)?)?;
    m.add_class::<PyNormLanes>()?;
    m.add_class::<PyPeerMemory>()?;
    m.add("ALLREDUCE_RMSNORM_ERROR_WORD", arn::ERROR_WORD)?;
    m.add_function(wrap_pyfunction!(plan_gemm_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(plan_gemm_reduce_scatter, m)?)?;
    m.add_function(wrap_pyfunction!(load_nvrtc, m)?)?;
    m.add_function(wrap_pyfunction!(nvrtc_version, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(compile_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_path, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add_function(wrap_pyfunction!(new_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(create_communicator, m)?)?;
    m.add_function(wrap_pyfunction!(destroy_communicator, m)?)?;
    m.add_function(wrap_pyfunction!(communicator_names, m)?)?;
    m.add_function(wrap_pyfunction!(gemm, m)?)?;
    m.add_function(wrap_pyfunction!(gemm_all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce, m)?)?;
    m.add_function(wrap_pyfunction!(communicator_plan, m)?)?;
    m.add_function(wrap_pyfunction!(peer_prepare, m)?)?;
    m.add_function(wrap_pyfunction!(peer_attach, m)?)?;
    m.add_function(wrap_pyfunction!(peer_slot_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(synchronize_communicator, m)?)?;
    Ok(())
}
