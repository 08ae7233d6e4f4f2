"""Type stubs of the Rust extension. Python validates tensors and passes plain
integers: device pointers, shapes, device ordinals and CUDA stream handles."""

from typing import Optional

class Plan:
    """A GEMM + collective plan: tiles, waves, wave groups and the predicted timeline."""

    @property
    def schedule(self) -> str: ...  # "overlap" | "sequential"
    @property
    def shape(self) -> tuple[int, int, int]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def tile(self) -> tuple[int, int, int]: ...
    @property
    def tiles(self) -> tuple[int, int]: ...
    @property
    def ctas(self) -> int: ...
    @property
    def waves(self) -> int: ...
    @property
    def predicted_us(self) -> float: ...  # the gathered AllReduce's where the call runs it
    @property
    def gathered(self) -> Optional[dict[str, object]]: ...  # groups, reserved_sms, predicted_us, predicted_sequential_us
    @property
    def predicted_overlap_us(self) -> float: ...
    @property
    def overlap_fixed_us(self) -> float: ...
    @property
    def overlap_groups_us(self) -> float: ...
    @property
    def predicted_sequential_us(self) -> float: ...
    @property
    def groups(self) -> list[dict[str, object]]: ...
    @property
    def tile_group(self) -> list[int]: ...
    @property
    def tile_order(self) -> list[int]: ...
    @property
    def raster_bands(self) -> int: ...
    @property
    def order(self) -> str: ...  # "banded" | "swizzled"
    @property
    def staging_elems(self) -> int: ...  # 0 for the banded order
    def describe(self) -> str: ...

NCCL_RESERVED_SMS: int
# gemm_all_to_all splits each destination's rows into groups in whole bands of this many rows.
A2A_SEGMENT_ROWS: int
COPY_ENGINE_RESERVED_SMS: list[int]
"""SMs the NCCL backend leaves free of GEMM CTAs when FLASHOVERLAP_RESERVED_SMS is unset."""
ADD_RMSNORM_MAX_N: int
"""The widest row (hidden size) the fused add + RMSNorm takes."""

def version() -> str: ...
def plan_gemm_all_reduce(
    m: int,
    n: int,
    k: int,
    world_size: int,
    dtype: str = "bfloat16",
    sms: int = 132,
    major: int = 9,
    mode: str = "auto",
    bands_per_group: Optional[int] = None,
    reserved_sms: Optional[int] = None,
    max_groups: int = 16,
    kernel: Optional[str] = None,
    raster_bands: Optional[int] = None,
    backend: str = "nccl",
    order: str = "auto",
    fused_norm: bool = False,
) -> Plan: ...
def load_nvrtc(path: str) -> None: ...
def nvrtc_version() -> tuple[int, int]: ...
def cache_dir() -> str: ...
def compile_kernels(arch: str) -> list[tuple[str, str, int]]: ...
def device_info(device: int) -> dict[str, object]: ...
def nccl_path() -> Optional[str]: ...
def nccl_version() -> int: ...
def new_unique_id() -> bytes: ...
def create_communicator(
    name: str, world_size: int, rank: int, unique_id: Optional[bytes], device: int, max_ctas: Optional[int] = None
) -> None: ...
def destroy_communicator(name: str) -> bool: ...
def communicator_names() -> list[str]: ...
def gemm(
    x: int,
    weight: int,
    out: int,
    m: int,
    n: int,
    k: int,
    dtype: str,
    device: int,
    stream: int,
    kernel: Optional[str] = None,
    raster_bands: Optional[int] = None,
    sms: Optional[int] = None,
    signal_bands: Optional[int] = None,
    staging: int = 0,
) -> None:
    """The GEMM alone. signal_bands (a measurement hook): signal one counter per group of this
    many row bands, as the overlapped ops do, with nobody waiting. staging (another): store the
    tile of position p at rows p*128.. of this [tiles * 128, BN] buffer instead of out."""
OpOptions = tuple[str, Optional[int], Optional[int], int, Optional[str], Optional[int], str, str, bool]
"""A collective op's options: (mode, bands_per_group, reserved_sms, max_groups, kernel, raster_bands,
backend, order, fused_norm); reserved_sms None is the backend's default."""

def gemm_all_reduce(
    group_name: str,
    x: int,
    weight: int,
    out: int,
    m: int,
    n: int,
    k: int,
    dtype: str,
    stream: int,
    options: OpOptions,
    staging: int = 0,
    norm: Optional[tuple[int, int, int, float]] = None,
) -> tuple[str, int]:
    """Enqueues the overlapped op and returns ("overlap", 0); or enqueues nothing and returns
    ("sequential", 0) (the caller then runs its GEMM and all_reduce) or ("staging", bytes) (the
    plan is swizzled: call again with a staging buffer of that many bytes). norm: (residual_in,
    residual_out, norm_weight pointers, eps) of the fused add + RMSNorm after each group."""
def unreorder(
    out: int,
    staging: int,
    m: int,
    n: int,
    dtype: str,
    device: int,
    stream: int,
    ctas: int,
    kernel: Optional[str] = None,
    raster_bands: Optional[int] = None,
    sms: Optional[int] = None,
) -> None:
    """Moves what gemm(..., staging=...) with the same launch options stored into out (a
    measurement hook for the swizzled schedule's copy)."""
def all_reduce(group_name: str, ptr: int, count: int, dtype: str, stream: int) -> None: ...
def peer_prepare(group_name: str, slot_bytes: int) -> bytes:
    """Collective, first half: waits for the communicator's streams, allocates this rank's
    copy-engine buffer and returns its IPC handle."""
def peer_attach(group_name: str, handles: list[bytes]) -> None:
    """Collective, second half: maps every rank's buffer (handles in rank order)."""
def peer_slot_bytes(group_name: str) -> int: ...
def synchronize_communicator(group_name: str) -> None: ...
def communicator_plan(
    group_name: str, m: int, n: int, k: int, dtype: str, stream: int, options: OpOptions
) -> Plan: ...

RsOptions = tuple[str, Optional[int], Optional[int], int, Optional[str], str]
"""GEMM + ReduceScatter options: (mode, bands_per_group, reserved_sms, max_groups, kernel)."""

def copy_engine_collective(
    group_name: str, kind: str, src: int, out: int, bytes: int, dtype: str, ctas: int, stream: int,
    chunks: Optional[int] = None
) -> None: ...
def choose_backend(
    op: str, m: int, n: int, k: int, world_size: int, dtype: str, sms: int, major: int, options: tuple,
    allowed: list[str], matrix: Optional[list[list[int]]] = None
) -> str:
    """Of `allowed`, the backend whose plan is predicted fastest for the call (needs no GPU)."""
def communicator_rs_plan(
    group_name: str, m: int, n: int, k: int, dtype: str, stream: int, options: RsOptions
) -> dict[str, object]: ...
def plan_gemm_reduce_scatter(
    m: int, n: int, k: int, world_size: int, dtype: str, sms: int, major: int, options: RsOptions
) -> dict[str, object]:
    """communicator_rs_plan's dict for a described device (needs no GPU)."""
def wave_aware_split(tokens: int, gemms: list[tuple[int, int]], tile: tuple[int, int], ctas: int,
                     skew: float) -> Optional[tuple[int, int, int, int]]:
    """(first, second, waves of the halves, waves unsplit); None below two row bands."""
def gemm_reduce_scatter(
    group_name: str,
    x: int,
    weight: int,
    out: int,
    send: int,
    m: int,
    n: int,
    k: int,
    dtype: str,
    stream: int,
    options: RsOptions,
) -> str: ...
def reduce_scatter(group_name: str, send: int, recv: int, recv_count: int, dtype: str, stream: int) -> None: ...
def register_collective_curve(sms: int, world_size: int, collective: str, overlapped: bool, bytes: list[int],
                              us: list[float], copy_engine_ctas: Optional[int] = None) -> None:
    """A measured curve (input bytes per rank -> us) of "all_reduce" or "reduce_scatter" for
    devices with `sms` SMs at `world_size` ranks: the overlapped groups' (flashoverlap's capped
    communicator) or the sequential schedule's; plans made afterwards use it."""
def register_gemm_sample(kernel: str, dtype: str, sms: int, ctas: int, m: int, n: int, k: int, us: float) -> None:
    """A measured GEMM time: `kernel` ("sm80", "sm90_n128", "sm90_n256" or "cublas") on `ctas` CTAs."""
def clear_profiles() -> None: ...
def profile_counts() -> tuple[int, int]: ...
def all_to_all_tables(m: int, n: int, k: int, dtype: str, device: int, rank: int, send_splits: list[int],
                      recv_splits: list[int], options: tuple[int, Optional[int], Optional[str], str],
                      split_matrix: Optional[list[list[int]]] = None) -> tuple[bytes, int]:
    """split_matrix: one band grid over x's rows, the receivers' parts laid out from the matrix
    (the push backend's only layout); None: each destination in whole bands of its own."""
def gemm_all_to_all(group_name: str, x: int, weight: int, out: int, m: int, n: int, k: int, dtype: str, stream: int,
                    send_splits: list[int], recv_splits: list[int], buffers: tuple[int, int, int, int, int],
                    options: tuple[int, Optional[int], Optional[str], str],
                    split_matrix: Optional[list[list[int]]] = None) -> None: ...
def plan_all_to_all_groups(n: int, k: int, matrix: list[list[int]], dtype: str = "bfloat16", sms: int = 132,
                           major: int = 9, reserved_sms: Optional[int] = None, kernel: Optional[str] = None,
                           backend: str = "nccl", segment_rows: Optional[int] = None
                           ) -> tuple[str, int, list[tuple[int, float]], float, float]:
    """(schedule, fastest group count, [(groups, predicted us)], predicted sequential us, an overlapped
    call's fixed us) for a routing; segment_rows: None models the op's layout (one band grid over
    each rank's rows), n: each destination padded to parts
    of whole n-row bands (1: near-equal rows, as runs before 2026-11-25 split them)."""
def all_to_all(group_name: str, send: int, recv: int, count: int, dtype: str, stream: int) -> None: ...
def measured_collective_us(collective: str, backend: str, world_size: int, sms: int, ctas: int,
                           bytes: int) -> Optional[float]:
    """What `tune` measured a plain collective of `bytes` per rank to take; None where unmeasured."""
def add_rmsnorm(x: int, residual_in: int, residual_out: int, weight: int, rows: int, n: int, eps: float, dtype: str,
                device: int, stream: int, ctas: int) -> None:
    """The fused add + RMSNorm alone on rows 0..rows of x [rows, n], on `ctas` CTAs."""

# The peer-memory AllReduce + residual add + RMSNorm (peer_norm.py drives these).
PeerBuffers = tuple[list[int], int, int, int, tuple[int, int, int, bool]]  # bases, bytes, rank, timeout_ns, config
ALLREDUCE_RMSNORM_ERROR_WORD: int

class PeerMemory:
    """A device buffer of this rank's, mapped into the other ranks through CUDA IPC handles."""

    def __init__(self, device: int, bytes: int) -> None: ...
    def handle(self) -> bytes: ...
    def attach(self, rank: int, handles: list[bytes]) -> None: ...
    @property
    def bases(self) -> list[int]: ...
    @property
    def bytes(self) -> int: ...
    def header_word(self, index: int) -> int: ...  # index < 16384 (the 64 KiB header), else ValueError
    def close(self) -> None: ...

def allreduce_rmsnorm_buffer_bytes(world: int, tokens: int, hidden: int, dtype: str, pull: bool = False) -> int: ...
def allreduce_rmsnorm_slice(tokens: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of `tokens` that `rank` owns."""
def allreduce_rmsnorm_partial(buffers: PeerBuffers, rows: int, hidden: int, dtype: str) -> int: ...
def allreduce_rmsnorm_stages(tokens: int, world: int, ctas: int,
                             config: Optional[tuple[int, int, int, bool]] = None) -> int: ...
def allreduce_rmsnorm_launch(device: int, tensors: tuple[int, int, int, int, int], bases: list[int],
                             buffer_bytes: int, rank: int, tokens: int, hidden: int, eps: float,
                             residual_full: bool, dtype: str, ctas: int, timeout_ns: int, stream: int,
                             pull: bool = False, config: Optional[tuple[int, int, int, bool]] = None,
                             residual_sliced: bool = False, lanes: Optional["NormLanes"] = None,
                             chunks: int = 4) -> None:
    """Enqueues the kernel: tensors = (x, residual, weight, out, residual_out) pointers; residual_sliced
    (sharded mode): `residual` holds this rank's slice rows only; lanes (2 ranks, push mode): the copy
    engines move the rows, in `chunks` per slice, and the kernel only sums and normalizes."""


class NormLanes:
    """The streams and events of the copy engines' AllReduce + RMSNorm on one device."""

    def __init__(self, device: int) -> None: ...
