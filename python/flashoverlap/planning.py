"""Plans without a GPU: what an op would do for a shape on a given device."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _core, _env
from ._validation import check_split_matrix, dtype_name
from .communicator import MAX_PEER_WORLD


# Where backend "auto" may take "push": the GEMM ops on 2 Hopper ranks of one node. With its costs
# fitted to E2 on 2x H100, replaying that machine's benchmarks picked it at K = 1024, where it beat
# both other backends by 5-16%. On 2x H200 (2026-11-26, push asked for by name) it ran the
# All-to-All at 1.121x of sequential against auto's 1.019x and the fused norm at 1.130x against
# 1.066x; replaying auto's pick among the three over those runs gives the same (only the
# GEMM-bound shapes stay on NCCL or the copy engines), so there it joined auto too.
PUSH_AUTO_OPS = ("gemm_all_reduce", "gemm_reduce_scatter", "gemm_all_to_all")


def auto_backends(op: str, world_size: int, *, one_node: bool = True, nccl: bool = True, major: int = 9,
                  kernel: Optional[str] = None) -> list[str]:
    """The backends "auto" chooses among for `op` by predicted time: NCCL where the communicator has
    it, the copy engines where every rank is on one node (up to MAX_PEER_WORLD GPUs), and "push"
    where PUSH_AUTO_OPS says (never with the sm80 kernel, which cannot push)."""
    one_node = one_node and world_size <= MAX_PEER_WORLD
    allowed = [b for b, ok in (("nccl", nccl), ("copy_engine", one_node)) if ok]
    if op in PUSH_AUTO_OPS and world_size == 2 and one_node and major == 9 and kernel != "sm80":
        allowed.append("push")
    return allowed


def plan_gemm_all_reduce(m: int, n: int, k: int, world_size: int, *, dtype: torch.dtype = torch.bfloat16,
                         sms: int = 132, compute_capability: tuple[int, int] = (9, 0), mode: str = "auto",
                         bands_per_group: Optional[int] = None, reserved_sms: Optional[int] = None,
                         max_groups: Optional[int] = None, kernel: Optional[str] = None,
                         raster_bands: Optional[int] = None, backend: str = "nccl",
                         order: str = "auto", fused_norm: bool = False) -> "_core.Plan":
    """The GEMM + AllReduce plan for out[m, n] = x[m, k] @ w[n, k]^T over ``world_size`` GPUs with
    ``sms`` multiprocessors (default: an H200). raster_bands: row bands per L2 raster block of the
    tile order inside each group (default: the planner's choice). backend: "nccl", "copy_engine",
    "push" (2 GPUs, Hopper) or "auto" (whichever of ``auto_backends`` the predictor times fastest for the
    shape: the copy engines up to 8 GPUs, taken to be one node; push on 2 Hopper GPUs). order: "banded"
    (groups of whole row bands, reduced in place), "swizzled" (groups of whole waves in one raster
    over the output, reduced in a staging buffer and un-reordered) or "auto" (the faster
    prediction). fused_norm: the plan of gemm_all_reduce_rmsnorm instead (a fused add + RMSNorm
    of each group's rows after its collective: banded order only, and backend "peer" too). Needs
    no GPU."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if not isinstance(fused_norm, bool):
        raise TypeError(f"fused_norm: expected a bool, got {type(fused_norm).__name__}")
    backends = (*_env.GEMM_BACKENDS, "peer") if fused_norm else _env.GEMM_BACKENDS
    if backend not in backends:
        raise ValueError(f"backend: expected one of {backends}, got {backend!r}")
    if order not in _env.ORDERS:
        raise ValueError(f"order: expected one of {_env.ORDERS}, got {order!r}")
    if fused_norm and order == "swizzled":
        raise ValueError("order: the fused norm needs whole rows per group ('banded' or 'auto'), got 'swizzled'")
    order = "banded" if fused_norm else order
    reserved_sms = _env.reserved_sms() if reserved_sms is None else reserved_sms
    _env.ce_all_reduce()  # the core reads it for the copy engines' AllReduce model
    max_groups = _env.max_groups() if max_groups is None else max_groups
    _check_ints(m=m, n=n, k=k, world_size=world_size, sms=sms, bands_per_group=bands_per_group,
                reserved_sms=reserved_sms, max_groups=max_groups, raster_bands=raster_bands)
    if backend == "auto":
        allowed = auto_backends("gemm_all_reduce", world_size, major=compute_capability[0], kernel=kernel)
        options = (mode, bands_per_group, reserved_sms, max_groups, kernel, raster_bands, "auto", order, fused_norm)
        backend = _core.choose_backend("gemm_all_reduce", m, n, k, world_size, dtype_name(dtype), sms,
                                       compute_capability[0], options, allowed)
    return _core.plan_gemm_all_reduce(m, n, k, world_size, dtype_name(dtype), sms, compute_capability[0], mode,
                                      bands_per_group, reserved_sms, max_groups, kernel, raster_bands, backend,
                                      order, fused_norm)


def _check_ints(**values) -> None:
    """Planning arguments that must be ints in [1, 2**31) (reserved_sms from 0); the optional ones
    may be None."""
    for name, value in values.items():
        if value is None and name in ("bands_per_group", "raster_bands", "reserved_sms"):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        least = 0 if name == "reserved_sms" else 1
        if not least <= value < 2**31:
            raise ValueError(f"{name}: expected an integer in [{least}, 2**31), got {value}")


def plan_gemm_reduce_scatter(m: int, n: int, k: int, world_size: int, *, dtype: torch.dtype = torch.bfloat16,
                             sms: int = 132, compute_capability: tuple[int, int] = (9, 0), mode: str = "auto",
                             bands_per_group: Optional[int] = None, reserved_sms: Optional[int] = None,
                             max_groups: Optional[int] = None, kernel: Optional[str] = None,
                             backend: str = "nccl") -> dict:
    """The GEMM + ReduceScatter plan for out[m / world_size, n] on each of ``world_size`` GPUs with
    ``sms`` multiprocessors (default: an H200), as ``reduce_scatter_plan_of``'s dict (schedule,
    ctas, waves, buffers, tile, predicted times, one dict per wave group). backend: "nccl",
    "copy_engine", "push" (2 GPUs, Hopper) or "auto" (the fastest prediction among
    ``auto_backends``: the copy engines up to 8 GPUs, taken to be one node; push on 2 Hopper GPUs).
    Needs no GPU."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if backend not in _env.GEMM_BACKENDS:
        raise ValueError(f"backend: expected one of {_env.GEMM_BACKENDS}, got {backend!r}")
    reserved_sms = _env.reserved_sms() if reserved_sms is None else reserved_sms
    _env.ce_all_reduce()  # the core reads it for the copy engines' AllReduce model
    max_groups = _env.max_groups() if max_groups is None else max_groups
    _check_ints(m=m, n=n, k=k, world_size=world_size, sms=sms, bands_per_group=bands_per_group,
                reserved_sms=reserved_sms, max_groups=max_groups)
    if m % world_size:
        raise ValueError(f"m: {m} must be divisible by the world size {world_size}")
    if backend == "auto":
        allowed = auto_backends("gemm_reduce_scatter", world_size, major=compute_capability[0], kernel=kernel)
        backend = _core.choose_backend("gemm_reduce_scatter", m, n, k, world_size, dtype_name(dtype), sms,
                                       compute_capability[0], (mode, bands_per_group, reserved_sms, max_groups,
                                                               kernel, "auto"), allowed)
    options = (mode, bands_per_group, reserved_sms, max_groups, kernel, backend)
    return _core.plan_gemm_reduce_scatter(m, n, k, world_size, dtype_name(dtype), sms, compute_capability[0],
                                          options)


class AllToAllPrediction(NamedTuple):
    """What the predictor says of a GEMM + All-to-All routing: the schedule ("overlap", or
    "sequential": the library GEMM then one exchange, where no group count is predicted to beat
    it), the fastest group count, the predicted time of every candidate group count, of the
    sequential schedule, and what an overlapped call pays once beyond its candidate's time
    (fork, join; weighed for more than one group)."""
    schedule: str
    groups: int
    predicted_us: dict
    sequential_us: float
    overlap_fixed_us: float = 0.0


def plan_gemm_all_to_all(split_matrix, n: int, k: int, *, dtype: torch.dtype = torch.bfloat16, sms: int = 132,
                         compute_capability: tuple[int, int] = (9, 0), reserved_sms: Optional[int] = None,
                         kernel: Optional[str] = None, backend: str = "nccl",
                         _segment_rows: Optional[int] = None) -> AllToAllPrediction:
    """The group count gemm_all_to_all picks for ``split_matrix`` (matrix[p][q]: rows rank p sends
    rank q; the same on every rank, so that every rank picks the same count) with weights [n, k],
    on a device with ``sms`` multiprocessors (default: an H200). The model takes the slowest
    rank's GEMM and the busiest rank's links for each group. backend: "nccl", "copy_engine"
    (which leaves the GEMM every SM unless reserved_sms says otherwise) or "push" (2 ranks; its
    constants are estimates, not yet fitted on 2 GPUs). Needs no GPU. (_segment_rows: None models
    the op's layout when it has the matrix; n, each destination padded to parts of whole n-row
    bands, as the op runs without the matrix (128) or ran before 2026-11-25 (1): e2_replay.)"""
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    if backend not in ("nccl", "copy_engine", "push"):
        raise ValueError(f"backend: expected 'nccl', 'copy_engine' or 'push', got {backend!r}")
    matrix = check_split_matrix(split_matrix)
    if backend == "push" and len(matrix) != 2:
        raise ValueError(f"backend: 'push' runs on exactly 2 ranks, split_matrix has {len(matrix)}")
    reserved_sms = _env.reserved_sms() if reserved_sms is None else reserved_sms
    for name, value, least in (("n", n, 1), ("k", k, 1), ("sms", sms, 1), ("reserved_sms", reserved_sms, 0)):
        if value is None and name == "reserved_sms":
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if not least <= value < 2**31:
            raise ValueError(f"{name}: expected an integer in [{least}, 2**31), got {value}")
    schedule, best, predicted, sequential, fixed = _core.plan_all_to_all_groups(n, k, matrix, dtype_name(dtype), sms,
                                                                                compute_capability[0], reserved_sms,
                                                                                kernel, backend,
                                                                                _segment_rows)
    return AllToAllPrediction(schedule, best, dict(predicted), sequential, fixed)
