"""Plain collectives (no GEMM) on either backend: the copy engines (copies into peers' staging
slots, sums on a few CTAs) or flashoverlap's NCCL communicator. What the overlapped ops run per
wave group, callable alone: to measure the backends against each other, or to use the copy
engines where a collective should leave the SMs to concurrent compute."""

from __future__ import annotations

from typing import Optional

import torch

from . import _core, _nvrtc
from ._validation import check_device, check_tensor, dtype_name
from .communicator import Communicator, GroupLike, communicator_by_name
from .ops import _LIB, _check_backend, _communicator_of, _register, _resolve_backend, _stream_handle

# The sums' CTAs by default: few, so that concurrent compute keeps the SMs.
DEFAULT_CTAS = 8
KINDS = ("all_reduce", "reduce_scatter")

_LIB.define("all_reduce(Tensor x, str group_name, str? backend=None, int? ctas=None) -> Tensor")
_LIB.define("reduce_scatter(Tensor x, str group_name, str? backend=None, int? ctas=None) -> Tensor")


def _check_ctas(ctas: Optional[int]) -> None:
    if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or not 1 <= ctas <= 1024):
        raise ValueError(f"ctas: expected an int in 1..1024 or None, got {ctas!r}")


def _unit(kind: str, world: int) -> int:
    """Bytes the copy engines' input must be a multiple of: 16-byte vectors (per block for
    ReduceScatter)."""
    return 16 if kind == "all_reduce" else 16 * world


def _backend_for(comm: Communicator, kind: str, x: torch.Tensor, backend: Optional[str], ctas: int,
                 sms: int) -> str:
    """The caller's backend, else FLASHOVERLAP_BACKEND. "auto" (where the communicator runs both):
    NCCL where x is not whole 16-byte vectors (per rank block), else the backend `flashoverlap
    tune` measured faster at this size (its sums on `ctas` CTAs) where the profile of this GPU (`sms`) has both
    curves, else the copy engines. The same on every rank: same size, same profiles."""
    explicit = backend is not None and backend != "auto"
    chosen = _resolve_backend(comm, backend)
    nbytes = x.numel() * x.element_size()
    fits = nbytes % _unit(kind, comm.world_size) == 0
    if chosen == "copy_engine" and not fits:
        if explicit or not comm.nccl:
            raise ValueError(f"x: the copy-engine {kind} moves 16-byte vectors"
                             f"{' per rank block' if kind == 'reduce_scatter' else ''}: {x.numel()} elements of "
                             f"{x.dtype} over {comm.world_size} ranks do not divide; use backend='nccl'")
        return "nccl"
    if chosen == "auto":
        if not fits:
            return "nccl"
        return measured_faster(kind, nbytes, comm.world_size, sms, ctas) or "copy_engine"
    return chosen


def measured_faster(kind: str, nbytes: int, world: int, sms: int, ctas: int) -> Optional[str]:
    """Of NCCL and the copy engines (their sums on `ctas` CTAs), the one whose tuned curve times a
    plain `kind` of `nbytes` per rank faster on this device and world size; None unless the
    registered profile measured both."""
    times = {b: _core.measured_collective_us(kind, b, world, sms, ctas, nbytes) for b in ("nccl", "copy_engine")}
    if None in times.values():
        return None
    return "nccl" if times["nccl"] < times["copy_engine"] else "copy_engine"


def _run(kind: str, x: torch.Tensor, group_name: str, backend: Optional[str], ctas: Optional[int]) -> torch.Tensor:
    comm = communicator_by_name(group_name)
    check_tensor("x", x)
    check_device("x", x, comm.device)
    _check_ctas(ctas)
    world = comm.world_size
    _check_rows(kind, x, world)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    ctas = min(ctas or DEFAULT_CTAS, sms)  # the copy engines' sums
    backend = _backend_for(comm, kind, x, backend, ctas, sms)
    shape = x.shape if kind == "all_reduce" else (x.shape[0] // world, *x.shape[1:])
    dtype, stream = dtype_name(x.dtype), _stream_handle(x.device)
    if x.numel() == 0:
        return x.new_empty(shape)
    if backend == "nccl":
        if kind == "all_reduce":
            out = x.clone()
            _core.all_reduce(comm.name, out.data_ptr(), out.numel(), dtype, stream)
        else:
            out = x.new_empty(shape)
            _core.reduce_scatter(comm.name, x.data_ptr(), out.data_ptr(), out.numel(), dtype, stream)
        return out
    _nvrtc.ensure_loaded()
    nbytes = x.numel() * x.element_size()
    comm.ensure_peer_buffers(nbytes if kind == "all_reduce" else nbytes // world)
    out = x.new_empty(shape)
    _core.copy_engine_collective(comm.name, kind, x.data_ptr(), out.data_ptr(), nbytes, dtype, ctas, stream)
    return out


def _all_reduce_impl(x, group_name: str, backend: Optional[str] = None, ctas: Optional[int] = None):
    return _run("all_reduce", x, group_name, backend, ctas)


def _reduce_scatter_impl(x, group_name: str, backend: Optional[str] = None, ctas: Optional[int] = None):
    return _run("reduce_scatter", x, group_name, backend, ctas)


def _all_reduce_fake(x, group_name: str, backend: Optional[str] = None, ctas: Optional[int] = None):
    return x.new_empty(x.shape)


def _reduce_scatter_fake(x, group_name: str, backend: Optional[str] = None, ctas: Optional[int] = None):
    world = communicator_by_name(group_name).world_size
    return x.new_empty((x.shape[0] // world, *x.shape[1:]))


_register("all_reduce", _all_reduce_impl, _all_reduce_fake)
_register("reduce_scatter", _reduce_scatter_impl, _reduce_scatter_fake)


def _check_rows(kind: str, x: torch.Tensor, world: int) -> None:
    if kind == "reduce_scatter" and (x.dim() < 1 or x.shape[0] % world):
        raise ValueError(f"x: the first dimension must be divisible by the world size {world}, "
                         f"got shape {tuple(x.shape)}")


def _checked(kind: str, x, group, communicator, backend, ctas) -> Communicator:
    check_tensor("x", x)
    _check_backend(backend)
    _check_ctas(ctas)
    comm = _communicator_of(x, group, communicator)
    _check_rows(kind, x, comm.world_size)
    return comm


def all_reduce(x: torch.Tensor, group: GroupLike = None, *, communicator=None, backend: Optional[str] = None,
               ctas: Optional[int] = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``, as a new tensor (``x`` is left as it was).

    backend: "copy_engine" (every rank copies its x into each peer's staging slot on the copy
    engines; each rank sums the world's copies on ``ctas`` CTAs, default 8), "nccl" (flashoverlap's
    NCCL communicator, capped to its max_ctas), or "auto" (where every rank is on one node and x is
    whole 16-byte vectors: the backend ``flashoverlap tune`` measured faster at this size where
    this GPU's profile has both curves, else the copy engines; otherwise NCCL); default:
    FLASHOVERLAP_BACKEND, else "auto".
    x: bfloat16 or float16, contiguous, the same shape on every rank. The first call of a larger
    size on the copy engines grows the staging slots (collective, not during graph capture)."""
    comm = _checked("all_reduce", x, group, communicator, backend, ctas)
    return torch.ops.flashoverlap.all_reduce(x, comm.name, backend, ctas)


def reduce_scatter(x: torch.Tensor, group: GroupLike = None, *, communicator=None, backend: Optional[str] = None,
                   ctas: Optional[int] = None) -> torch.Tensor:
    """``torch.distributed.reduce_scatter_tensor`` (sum) as a new tensor: x [R, ...] with R divisible
    by the world size; rank r gets the sum of every rank's rows r*R/world .. (r+1)*R/world - 1.
    backend, ctas: as for :func:`all_reduce` (the copy engines move each block straight to its
    owner's slot; the owner sums them)."""
    comm = _checked("reduce_scatter", x, group, communicator, backend, ctas)
    return torch.ops.flashoverlap.reduce_scatter(x, comm.name, backend, ctas)
