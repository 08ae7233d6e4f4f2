"""The overlapped ops, as torch custom ops (with fake implementations for
torch.compile) and as plain Python functions with argument checking.

The ops are defined with torch.library.Library rather than the
torch.library.custom_op decorator: the decorator's Python wrapper costs
~100 us per call on the host, more than a small GEMM + AllReduce takes on the
GPU, while a plain dispatcher op costs a few microseconds."""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from . import _core, _env, _nvrtc
from ._validation import (check_device, check_eps, check_gemm_operands, check_groups, check_split_matrix,
                          check_splits, check_tensor, dtype_name)
from .communicator import Communicator, GroupLike, resolve_group, communicator_by_name, get_communicator
from .planning import PUSH_AUTO_OPS, auto_backends

_MODES = ("auto", "overlap", "sequential")


def _stream_handle(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


_LIB = torch.library.Library("flashoverlap", "DEF")
# The schemas name the GEMM kernel argument `gemm_kernel` (the Python functions' `kernel`): Inductor
# hands a custom op's arguments to FallbackKernel.create(kernel, ...) by name, so one named
# `kernel` made torch.compile fail ("got multiple values for argument 'kernel'").
_LIB.define("gemm(Tensor x, Tensor weight, str? gemm_kernel=None, int? raster_bands=None, int? sms=None) "
            "-> Tensor")
_LIB.define("gemm_all_reduce(Tensor x, Tensor weight, str group_name, str mode='auto', int? bands_per_group=None, "
            "str? gemm_kernel=None, str? backend=None, str? order=None) -> Tensor")

_LIB.define("gemm_all_reduce_rmsnorm(Tensor x, Tensor weight, Tensor residual, Tensor norm_weight, float eps, "
            "str group_name, str mode='auto', int? bands_per_group=None, str? gemm_kernel=None, str? backend=None) "
            "-> (Tensor, Tensor)")
_LIB.define("gemm_all_to_all(Tensor x, Tensor weight, int[] input_split_sizes, int[] output_split_sizes, "
            "str group_name, int? groups=None, str? gemm_kernel=None, int[]? split_matrix=None, str? backend=None) "
            "-> Tensor")
_LIB.define("gemm_reduce_scatter(Tensor x, Tensor weight, str group_name, str mode='auto', "
            "int? bands_per_group=None, str? gemm_kernel=None, str? backend=None) -> Tensor")


def _register(name: str, impl, fake) -> None:
    # CPU too, so that CPU tensors reach the argument checks and get their
    # clear error rather than the dispatcher's "no kernel" one.
    for key in ("CUDA", "CPU"):
        _LIB.impl(name, impl, key)
    torch.library.register_fake(f"flashoverlap::{name}", fake, lib=_LIB)


def _gemm_impl(x: torch.Tensor, weight: torch.Tensor, kernel: Optional[str] = None,
               raster_bands: Optional[int] = None, sms: Optional[int] = None) -> torch.Tensor:
    m, n, k = check_gemm_operands(x, weight)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _nvrtc.ensure_loaded()
    _core.gemm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, dtype_name(x.dtype),
               x.device.index, _stream_handle(x.device), kernel, raster_bands, sms)
    return out


def _gemm_fake(x: torch.Tensor, weight: torch.Tensor, kernel: Optional[str] = None,
               raster_bands: Optional[int] = None, sms: Optional[int] = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _allowed_backends(comm: Communicator, op: Optional[str] = None, options: Optional[tuple] = None) -> list[str]:
    """The backends "auto" may run on a communicator: NCCL where it has NCCL, the copy engines where
    every rank is on one node, and for `op` (with its options tuple) push where
    planning.auto_backends allows it."""
    kernel = None
    if options is not None and op in PUSH_AUTO_OPS:
        # The options tuples of _auto_backend's callers: the All-to-All's is (groups, reserved, kernel, backend).
        kernel = options[2] if op == "gemm_all_to_all" else options[4]
    major = torch.cuda.get_device_capability(comm.device)[0] if op in PUSH_AUTO_OPS else 0
    return auto_backends(op or "", comm.world_size, one_node=comm.one_node, nccl=comm.nccl, major=major,
                         kernel=kernel)


def _resolve_backend(comm: Communicator, backend: Optional[str]) -> str:
    """The backend a call runs: the caller's, else FLASHOVERLAP_BACKEND. "auto" stays "auto" where
    the communicator can run both (the op then asks the predictor per shape: `_auto_backend`),
    else it is the one the communicator can run."""
    if backend is None:
        backend = _env.backend()
    if backend == "peer":  # gemm_all_reduce_rmsnorm's own; its caller checked it
        return backend
    if backend == "push":  # the GEMM ops' own; checked again for callers of torch.ops directly
        _check_push(comm)
        return backend
    _check_backend(backend)
    if backend == "auto":
        allowed = _allowed_backends(comm)
        return allowed[0] if len(allowed) == 1 else "auto"
    if backend == "nccl" and not comm.nccl:
        raise ValueError(f"backend: communicator {comm.name!r} was made without NCCL (nccl=False); "
                         "use backend='copy_engine' or 'auto'")
    return backend


_BACKEND_CHOICES: "OrderedDict[tuple, str]" = OrderedDict()


def _auto_backend(comm: Communicator, op: str, m: int, n: int, k: int, dtype: str, options: tuple,
                  matrix=None) -> str:
    """The backend "auto" runs for this call: the one whose plan the predictor times fastest for
    the shape (the same on every rank: same shape, same profiles), remembered for the 256 most
    recent calls."""
    key = (comm.name, op, m, n, k, dtype, options, None if matrix is None else tuple(map(tuple, matrix)))
    hit = _BACKEND_CHOICES.pop(key, None)
    if hit is None:
        props = torch.cuda.get_device_properties(comm.device)
        hit = _core.choose_backend(op, m, n, k, comm.world_size, dtype, props.multi_processor_count, props.major,
                                   options, _allowed_backends(comm, op, options), matrix)
    _BACKEND_CHOICES[key] = hit
    while len(_BACKEND_CHOICES) > 256:
        _BACKEND_CHOICES.popitem(last=False)
    return hit


def _resolve_order(order: Optional[str]) -> str:
    """The caller's order, else FLASHOVERLAP_ORDER (default "auto")."""
    order = _env.order() if order is None else order
    _check_order(order)
    return order


def _gemm_all_reduce_impl(x: torch.Tensor, weight: torch.Tensor, group_name: str, mode: str = "auto",
                          bands_per_group: Optional[int] = None, kernel: Optional[str] = None,
                          backend: Optional[str] = None, order: Optional[str] = None) -> torch.Tensor:
    return _run_gemm_all_reduce(x, weight, group_name, mode, bands_per_group, kernel, backend, order)[0]


def _op_options(mode, bands_per_group, kernel, backend, order, fused_norm: bool) -> tuple:
    """The options tuple the core takes for GEMM + AllReduce (environment settings included)."""
    return (mode, bands_per_group, _env.reserved_sms(), _env.max_groups(), kernel, None, backend, order, fused_norm)


def _rs_options(mode, bands_per_group, kernel, backend: str) -> tuple:
    """The options tuple the core takes for GEMM + ReduceScatter (environment settings included)."""
    return (mode, bands_per_group, _env.reserved_sms(), _env.max_groups(), kernel, backend)


def _run_gemm_all_reduce(x, weight, group_name, mode, bands_per_group, kernel, backend, order, norm=None):
    """The op's body: (out, schedule). norm: (residual_in, residual_out, weight) pointers, eps and
    the peer buffers (backend "peer"; else None) of the fused add + RMSNorm run on each group's
    rows after its AllReduce (overlap only: where the schedule is "sequential" the caller reduces
    (peer) and norms the whole output itself)."""
    m, n, k = check_gemm_operands(x, weight)
    comm = communicator_by_name(group_name)
    _check_mode(mode, bands_per_group)
    backend = _resolve_backend(comm, backend)
    if backend == "peer" and norm is None:
        raise ValueError("backend: 'peer' runs gemm_all_reduce_rmsnorm only; use 'nccl', 'copy_engine' or 'auto'")
    order = _resolve_order(order)
    check_device("x", x, comm.device)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, "sequential"
    _nvrtc.ensure_loaded()
    if _env.force_sequential():
        mode, bands_per_group = "sequential", None
    dtype, stream = dtype_name(x.dtype), _stream_handle(x.device)
    plan_args = _op_options(mode, bands_per_group, kernel, backend, order, norm is not None)
    if backend == "auto":
        backend = _auto_backend(comm, "gemm_all_reduce", m, n, k, dtype, plan_args)
        plan_args = _op_options(mode, bands_per_group, kernel, backend, order, norm is not None)
    if backend in ("copy_engine", "push") and mode != "sequential":
        # The output, or on 2 ranks (gathered: the peer's partials and sums of
        # one shard each, in whole 128-row bands) up to two bands more.
        comm.ensure_peer_buffers((m + 256) * n * out.element_size())

    def call(staging_ptr: int = 0):
        return _core.gemm_all_reduce(comm.name, x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, dtype,
                                     stream, plan_args, staging_ptr, norm)

    schedule, staged = call()
    if schedule == "staging":
        # A swizzled plan reduces in a staging buffer, taken from torch's allocator on this
        # stream: the op's last use of it is ordered before whatever this stream runs after it.
        # (Every rank plans alike, so all grow their copy-engine slots together.)
        if backend in ("copy_engine", "push"):
            comm.ensure_peer_buffers(staged)
        staging = torch.empty(staged // x.element_size(), dtype=x.dtype, device=x.device)
        schedule, _ = call(staging.data_ptr())
    if schedule == "sequential":
        # Overlap does not pay here (or was not asked for): exactly the unfused
        # composition, torch's library GEMM (cuBLAS) then one AllReduce (the peer
        # backend's caller reduces and normalizes in one kernel).
        if backend == "peer":
            return out, schedule  # the caller runs the GEMM into its peer buffer
        torch.matmul(x, weight.t(), out=out)
        if comm.torch_collectives:
            torch.distributed.all_reduce(out, group=comm.group)
        else:
            _core.all_reduce(comm.name, out.data_ptr(), out.numel(), dtype, stream)
    return out, schedule


_MAX_NORM_N = _core.ADD_RMSNORM_MAX_N


def _check_norm_operands(x: torch.Tensor, weight: torch.Tensor, residual, norm_weight, eps) -> None:
    """What the fused add + RMSNorm needs beyond the GEMM's checks, before anything runs."""
    n = weight.shape[0]
    residual = check_tensor("residual", residual)
    norm_weight = check_tensor("norm_weight", norm_weight, ndim=1)
    if tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"residual: expected shape {(*x.shape[:-1], n)} (that of x @ weight.T), "
                         f"got {tuple(residual.shape)}")
    if tuple(norm_weight.shape) != (n,):
        raise ValueError(f"norm_weight: expected shape ({n},), got {tuple(norm_weight.shape)}")
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected the dtype of x ({x.dtype}), got {t.dtype}")
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x}")
    if n > _MAX_NORM_N:
        raise ValueError(f"weight: the fused RMSNorm takes hidden sizes up to {_MAX_NORM_N}, got N={n}")
    check_eps(eps)


def _gemm_all_reduce_rmsnorm_impl(x, weight, residual, norm_weight, eps: float, group_name: str,
                                  mode: str = "auto", bands_per_group: Optional[int] = None,
                                  kernel: Optional[str] = None, backend: Optional[str] = None):
    m, n, _ = check_gemm_operands(x, weight)
    _check_norm_operands(x, weight, residual, norm_weight, eps)
    _check_backend(backend, norm=True)
    comm = communicator_by_name(group_name)
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        check_device(name, t, comm.device)
    residual_out = torch.empty_like(residual)
    peer = _peer_norm_group(comm, m, n, x.dtype) if backend == "peer" and m else None
    buffers = None if peer is None else peer.core_buffers()
    norm = (residual.data_ptr(), residual_out.data_ptr(), norm_weight.data_ptr(), float(eps), buffers)
    # Groups of whole rows: the norm of a group needs every column of its rows.
    out, schedule = _run_gemm_all_reduce(x, weight, group_name, mode, bands_per_group, kernel, backend,
                                         "banded", norm)
    if schedule == "sequential" and out.numel():
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        dtype, stream = dtype_name(x.dtype), _stream_handle(x.device)
        if peer is not None:
            # The whole output as one group: cuBLAS stores the partial straight into this
            # rank's peer buffer, where the other ranks read it.
            partial = peer.partial(out.numel() // n, n, x.dtype)
            torch.matmul(x.reshape(-1, x.shape[-1]), weight.t(), out=partial)
            peer.launch(partial, residual, norm_weight, out, residual_out, eps, min(sms, 256), pull=True)
        else:
            _core.add_rmsnorm(out.data_ptr(), residual.data_ptr(), residual_out.data_ptr(), norm_weight.data_ptr(),
                              out.numel() // n, n, float(eps), dtype, x.device.index, stream, sms)
    return out, residual_out


def _peer_norm_group(comm: Communicator, m: int, n: int, dtype: torch.dtype):
    """backend="peer": the communicator's peer-norm group (made by the public op), its buffers
    grown (collectively, outside capture) to an [m, n] output."""
    from . import peer_norm

    state = peer_norm.gemm_peer_group(comm)
    world = comm.world_size
    if not state.ensure(_core.allreduce_rmsnorm_buffer_bytes(world, m, n, dtype_name(dtype), pull=True)):
        raise RuntimeError(f"backend: 'peer' could not map the peer buffers of communicator {comm.name!r} "
                           "on every rank (see the warning above); use backend='nccl' or 'copy_engine'")
    return state


def _gemm_all_reduce_rmsnorm_fake(x, weight, residual, norm_weight, eps: float, group_name: str,
                                  mode: str = "auto", bands_per_group: Optional[int] = None,
                                  kernel: Optional[str] = None, backend: Optional[str] = None):
    return x.new_empty((*x.shape[:-1], weight.shape[0])), torch.empty_like(residual)


def _gemm_all_reduce_fake(x: torch.Tensor, weight: torch.Tensor, group_name: str, mode: str = "auto",
                          bands_per_group: Optional[int] = None, kernel: Optional[str] = None,
                          backend: Optional[str] = None, order: Optional[str] = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _rs_shape(x: torch.Tensor, weight: torch.Tensor, world: int) -> tuple[int, int, int]:
    """(M, N, K) of a GEMM + ReduceScatter: x must be [M, K] with M divisible by the world size,
    as torch.distributed.reduce_scatter_tensor requires of its input."""
    m, n, k = check_gemm_operands(x, weight, devices=False)
    if x.dim() != 2:
        raise ValueError(f"x: expected [M, K] (the rows are scattered), got shape {tuple(x.shape)}")
    if m % world:
        raise ValueError(f"x: M={m} must be divisible by the world size {world}")
    return m, n, k


def _gemm_reduce_scatter_impl(x: torch.Tensor, weight: torch.Tensor, group_name: str, mode: str = "auto",
                              bands_per_group: Optional[int] = None, kernel: Optional[str] = None,
                              backend: Optional[str] = None) -> torch.Tensor:
    comm = communicator_by_name(group_name)
    m, n, k = _rs_shape(x, weight, comm.world_size)
    _check_mode(mode, bands_per_group)
    backend = _resolve_backend(comm, backend)
    check_device("x", x, comm.device)
    shard = m // comm.world_size
    if m == 0:
        return x.new_empty((0, n))
    _nvrtc.ensure_loaded()
    if _env.force_sequential():
        mode, bands_per_group = "sequential", None
    dtype, stream = dtype_name(x.dtype), _stream_handle(x.device)
    options = _rs_options(mode, bands_per_group, kernel, backend)
    if backend == "auto":
        backend = _auto_backend(comm, "gemm_reduce_scatter", m, n, k, dtype, options)
        options = _rs_options(mode, bands_per_group, kernel, backend)
    plan = _core.communicator_rs_plan(comm.name, m, n, k, dtype, stream, options)
    if plan["schedule"] == "overlap":
        if backend in ("copy_engine", "push"):
            # Each peer's slot holds what it sends of every output row (every rank plans alike,
            # so all grow their slots together).
            comm.ensure_peer_buffers(plan["out_rows"] * n * x.element_size())
        # Whole bands of output (the caller sees the first M / world rows) and the send buffer the
        # GEMM stores into, both from torch's allocator on this stream: the op's last use of them
        # is ordered before whatever this stream runs after it.
        out = torch.empty((plan["out_rows"], n), dtype=x.dtype, device=x.device)
        # Push sums in the GEMM's epilogue: its tiles go to out or to the peer, never to a send buffer.
        send = out if backend == "push" else torch.empty((plan["send_rows"], n), dtype=x.dtype, device=x.device)
        schedule = _core.gemm_reduce_scatter(comm.name, x.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                             send.data_ptr(), m, n, k, dtype, stream, options)
        if schedule == "overlap":
            return out[:shard]
    # Exactly the unfused composition: the library GEMM, then one ReduceScatter.
    full = torch.matmul(x, weight.t())
    out = torch.empty((shard, n), dtype=x.dtype, device=x.device)
    if not comm.nccl:
        # The group's own collectives, whatever its backend: an AllReduce every backend has.
        torch.distributed.all_reduce(full, group=comm.group)
        out.copy_(full[comm.rank * shard:(comm.rank + 1) * shard])
    elif comm.torch_collectives:
        torch.distributed.reduce_scatter_tensor(out, full, group=comm.group)
    else:
        _core.reduce_scatter(comm.name, full.data_ptr(), out.data_ptr(), out.numel(), dtype, stream)
    return out


def _gemm_reduce_scatter_fake(x: torch.Tensor, weight: torch.Tensor, group_name: str, mode: str = "auto",
                              bands_per_group: Optional[int] = None, kernel: Optional[str] = None,
                              backend: Optional[str] = None) -> torch.Tensor:
    world = communicator_by_name(group_name).world_size
    return x.new_empty((x.shape[0] // world, weight.shape[0]))


class _TableCache:
    """Device copies of the All-to-All tables, per (device, shape, splits, options): calls with the
    same routing reuse them, the `size` most recent are kept, and those a CUDA graph captured are
    kept for the life of the process (the graph reads them at every replay). Tables are made only
    outside capture: a capture of new splits is refused with a clear error."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._recent: "OrderedDict[tuple, tuple]" = OrderedDict()
        self._captured: dict = {}

    def get(self, key: tuple, make, capturing: bool) -> tuple:
        hit = self._captured.get(key)
        if hit is None:
            hit = self._recent.pop(key, None)
            if hit is None:
                if capturing:
                    raise ValueError("gemm_all_to_all: these split sizes are first seen during CUDA graph "
                                     "capture; call the op once with them before capturing")
                hit = make()
            if capturing:
                self._captured[key] = hit
            else:
                self._recent[key] = hit
                while len(self._recent) > self._size:
                    self._recent.popitem(last=False)
        return hit


_A2A_TABLES = _TableCache()


# Group count of gemm_all_to_all when neither groups nor split_matrix is given: ranks only know
# their own splits then, and must agree without talking.
DEFAULT_A2A_GROUPS = 4
_A2A_CHOICES: "OrderedDict[tuple, int]" = OrderedDict()


def _a2a_choice(comm: Communicator, flat: list, n: int, k: int, dtype: str, reserved, kernel,
                backend: str) -> tuple[str, int]:
    """The predictor's (schedule, group count) for a routing (the same on every rank: same matrix,
    same model), remembered for the 64 most recent routings."""
    world = comm.world_size
    key = (comm.device.index, tuple(flat), n, k, dtype, reserved, kernel, backend)
    hit = _A2A_CHOICES.pop(key, None)
    if hit is None:
        props = torch.cuda.get_device_properties(comm.device)
        matrix = [flat[p * world:(p + 1) * world] for p in range(world)]
        hit = _core.plan_all_to_all_groups(n, k, matrix, dtype, props.multi_processor_count, props.major,
                                           reserved, kernel, backend)[:2]
    _A2A_CHOICES[key] = hit
    while len(_A2A_CHOICES) > 64:
        _A2A_CHOICES.popitem(last=False)
    return hit


def _gemm_all_to_all_impl(x: torch.Tensor, weight: torch.Tensor, input_split_sizes, output_split_sizes,
                          group_name: str, groups: Optional[int] = None, kernel: Optional[str] = None,
                          split_matrix=None, backend: Optional[str] = None) -> torch.Tensor:
    comm = communicator_by_name(group_name)
    m, n, k = check_gemm_operands(x, weight)
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K] (rows grouped by destination rank), got shape {tuple(x.shape)}")
    world = comm.world_size
    sends = check_splits("input_split_sizes", input_split_sizes, world, m)
    recvs = check_splits("output_split_sizes", output_split_sizes, world)
    flat = None
    if split_matrix is not None:
        if len(split_matrix) != world * world:
            raise ValueError(f"split_matrix: expected {world}x{world} entries, got {len(split_matrix)}")
        rows = [list(split_matrix[p * world:(p + 1) * world]) for p in range(world)]
        flat = [v for row in check_split_matrix(rows, world, comm.rank, sends, recvs) for v in row]
    if groups is not None:
        check_groups(groups)
    explicit = backend not in (None, "auto")
    backend = _resolve_backend(comm, backend)
    if backend != "nccl" and flat is None:
        # Every rank must size the staging slots alike: only the whole matrix says how.
        if explicit:
            raise ValueError(f"backend: the {backend!r} All-to-All needs split_matrix (every rank sizes its "
                             "staging slots from the whole routing)")
        backend = "nccl"
    check_device("x", x, comm.device)
    out = torch.empty((sum(recvs), n), dtype=x.dtype, device=x.device)
    _nvrtc.ensure_loaded()
    dtype, stream = dtype_name(x.dtype), _stream_handle(x.device)
    reserved = _env.reserved_sms()
    matrix = None if flat is None else [flat[p * world:(p + 1) * world] for p in range(world)]
    if backend == "auto":
        backend = _auto_backend(comm, "gemm_all_to_all", m, n, k, dtype, (groups or 1, reserved, kernel, "auto"),
                                matrix)
    no_exchange = backend == "nccl" and not comm.nccl
    if groups is None or no_exchange:
        schedule, groups = ("overlap", DEFAULT_A2A_GROUPS) if flat is None else _a2a_choice(
            comm, flat, n, k, dtype, reserved, kernel, backend)
        if no_exchange:
            schedule = "sequential"  # no NCCL here, and no matrix for the copy engines
        if schedule == "sequential" and comm.torch_collectives:
            # The library GEMM, then the group's own exchange.
            import torch.distributed as dist

            y = torch.matmul(x, weight.t())
            dist.all_to_all_single(out, y, recvs, sends, group=comm.group)
            return out
        if schedule == "sequential":
            groups = 1  # without an NCCL ProcessGroup: our GEMM, then one exchange
    options = (groups, reserved, kernel, backend)
    if backend in ("copy_engine", "push"):
        # Each slot holds every row one rank sends another (the same size on every rank: the
        # same matrix); pushed, the whole bands of the sender's grid holding them (one more than
        # their count when they start inside a band; the core checks the slot is enough).
        most = max((v for i, v in enumerate(flat) if i // world != i % world), default=0)
        band = _core.A2A_SEGMENT_ROWS
        rows = (-(-most // band) + 1) * band if backend == "push" else max(most, 1)
        comm.ensure_peer_buffers(rows * n * x.element_size())

    # With the whole routing (the matrix), the core tiles x's rows on one band grid (no
    # destination padded to whole bands); without it, each destination on its own bands.
    def upload():
        table_bytes, rows = _core.all_to_all_tables(m, n, k, dtype, x.device.index, comm.rank, sends, recvs,
                                                    options, matrix)
        # Up from pinned memory without blocking the host.
        if not table_bytes:
            return torch.empty(0, dtype=torch.int32, device=x.device), rows
        host = torch.frombuffer(bytearray(table_bytes), dtype=torch.int32).pin_memory()
        return host.to(x.device, non_blocking=True), rows

    key = (x.device.index, comm.rank, m, n, k, dtype, tuple(sends), tuple(recvs), options,
           matrix is not None and tuple(flat))
    tables, send_rows = _A2A_TABLES.get(key, upload, torch.cuda.is_current_stream_capturing())
    # Cached tables may be reused from another stream: the allocator must not recycle them until
    # this stream is done with them.
    tables.record_stream(torch.cuda.current_stream(x.device))
    words = tables.numel()
    counters = torch.zeros(groups, dtype=torch.int32, device=x.device)
    send = torch.empty((send_rows, n), dtype=x.dtype, device=x.device)
    _core.gemm_all_to_all(comm.name, x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k, dtype, stream,
                          sends, recvs, (send.data_ptr(), send_rows, tables.data_ptr(), words, counters.data_ptr()),
                          options, matrix)
    return out


def _gemm_all_to_all_fake(x: torch.Tensor, weight: torch.Tensor, input_split_sizes, output_split_sizes,
                          group_name: str, groups: Optional[int] = None, kernel: Optional[str] = None,
                          split_matrix=None, backend: Optional[str] = None) -> torch.Tensor:
    return x.new_empty((sum(output_split_sizes), weight.shape[0]))


_register("gemm", _gemm_impl, _gemm_fake)
_register("gemm_reduce_scatter", _gemm_reduce_scatter_impl, _gemm_reduce_scatter_fake)
_register("gemm_all_reduce_rmsnorm", _gemm_all_reduce_rmsnorm_impl, _gemm_all_reduce_rmsnorm_fake)
_register("gemm_all_to_all", _gemm_all_to_all_impl, _gemm_all_to_all_fake)
_register("gemm_all_reduce", _gemm_all_reduce_impl, _gemm_all_reduce_fake)


KERNELS = ("sm80", "sm90_n128", "sm90_n256")


def _check_kernel(kernel: Optional[str]) -> None:
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS} or None, got {kernel!r}")


def _check_backend(backend: Optional[str], norm: bool = False, push: bool = False) -> None:
    """norm: gemm_all_reduce_rmsnorm's, which also runs on "peer"; push: a GEMM op's, which also
    runs on "push"."""
    allowed = (*(_env.GEMM_BACKENDS if push or norm else _env.BACKENDS), *(("peer",) if norm else ()))
    if backend is not None and backend not in allowed:
        hint = {"peer": " ('peer' runs gemm_all_reduce_rmsnorm only)",
                "push": " ('push' runs the GEMM ops only: gemm_all_reduce, gemm_reduce_scatter, "
                        "gemm_all_reduce_rmsnorm, gemm_all_to_all)"
                }.get(backend, "")
        raise ValueError(f"backend: expected one of {allowed} or None, got {backend!r}{hint}")


def _check_push(comm: Communicator) -> None:
    """What backend="push" needs of the communicator, before anything runs: 2 ranks of one node
    (each GEMM stores into the other's memory) on Hopper (the sm_90 GEMM's epilogue pushes)."""
    if comm.world_size != 2 or not comm.one_node:
        raise ValueError(f"backend: 'push' runs on exactly 2 ranks of one node; communicator {comm.name!r} has "
                         f"{comm.world_size}{'' if comm.one_node else ' across nodes'}: use 'copy_engine', 'nccl' "
                         "or 'auto'")
    major = torch.cuda.get_device_capability(comm.device)[0]
    if major != 9:
        raise ValueError(f"backend: 'push' stores from the sm_90 GEMM (Hopper); {comm.device} is sm_{major}x")


def _check_order(order: Optional[str]) -> None:
    if order is not None and order not in _env.ORDERS:
        raise ValueError(f"order: expected one of {_env.ORDERS} or None, got {order!r}")


def _check_positive_int(name: str, value: Optional[int]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")


def _check_mode(mode: str, bands_per_group: Optional[int]) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode: expected one of {_MODES}, got {mode!r}")
    _check_positive_int("bands_per_group", bands_per_group)


def gemm(x: torch.Tensor, weight: torch.Tensor, *, kernel: Optional[str] = None,
         raster_bands: Optional[int] = None, sms: Optional[int] = None) -> torch.Tensor:
    """``x @ weight.T`` with flashoverlap's GEMM kernel alone (no signals, no communication).

    x: [..., K], weight: [N, K] (nn.Linear layout), both bfloat16 or both float16, contiguous,
    on one CUDA device; N and K multiples of 8. kernel: "sm80" (any sm_80+ GPU), "sm90_n128" or
    "sm90_n256" (Hopper only); default: sm80, or on Hopper 256-wide tiles unless 128-wide ones
    finish in at most 0.9x the waves (small M, where wide tiles leave SMs idle). raster_bands: row bands per
    L2 raster block of the tile order (1: row by row); default: the planner's choice. sms: SMs
    (persistent CTAs) the kernel uses, at most the device's; default: all of them.
    """
    check_gemm_operands(x, weight, devices=False)
    _check_kernel(kernel)
    _check_positive_int("raster_bands", raster_bands)
    _check_positive_int("sms", sms)
    check_device("x", x)
    check_device("weight", weight, x.device)
    return torch.ops.flashoverlap.gemm(x, weight, kernel, raster_bands, sms)


def _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend, order=None,
                  norm: bool = False):
    """The argument checks of the GEMM ops, in the documented order (shapes and dtypes, options,
    an initialised process group, devices), then the communicator (created collectively on first
    use) and what backend="push" needs of it. Returns (M, N, K, communicator). norm: the
    fused-norm op's (backend "peer" allowed too)."""
    m, n, k = check_gemm_operands(x, weight, devices=False)
    _check_mode(mode, bands_per_group)
    _check_kernel(kernel)
    _check_backend(backend, norm, push=True)
    _check_order(order)
    comm = _communicator_of(x, group, communicator, weight)
    if backend == "push":
        _check_push(comm)
    return m, n, k, comm


def _communicator_of(x: torch.Tensor, group, communicator, weight: Optional[torch.Tensor] = None) -> Communicator:
    """An initialised process group, the tensors' devices, then the communicator (created
    collectively on first use), checked to sit on x's device."""
    if not isinstance(group, (str, Communicator)) and communicator is None:
        resolve_group(group)
    check_device("x", x)
    if weight is not None:
        check_device("weight", weight, x.device)
    comm = get_communicator(group, communicator=communicator)
    check_device("x", x, comm.device)
    return comm


def gemm_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *,
                    communicator=None, mode: str = "auto", bands_per_group: Optional[int] = None,
                    kernel: Optional[str] = None, backend: Optional[str] = None,
                    order: Optional[str] = None) -> torch.Tensor:
    """``torch.distributed.all_reduce(x @ weight.T)`` (sum), with the AllReduce of each finished
    wave group of the GEMM overlapping the rest of the GEMM.

    group: a ProcessGroup (default: the world group), a communicator name, or a Communicator.
      flashoverlap's communicator for a ProcessGroup is created on first use (collectively).
    mode: "auto" (overlap where the predictor says it wins, else GEMM then AllReduce),
      "overlap" or "sequential".
    bands_per_group: force every wave group to hold this many row bands of output tiles
      (default: chosen by the predictor).
    kernel: the GEMM kernel, as for :func:`gemm`.
    backend: what moves each group's bytes: "copy_engine" (copies into peers' memory on the copy
      engines, and a sum on the few SMs the GEMM leaves free; every rank on one node), "nccl"
      (ncclAllReduce), "push" (2 ranks of one node, Hopper: the GEMM's epilogue stores every tile
      into the other rank's memory too, over NVLink while it computes, and each group is summed
      on the 4-16 SMs the GEMM leaves free as both ranks' tiles land: no copy engine, no NCCL),
      or "auto" (per shape, whichever of :func:`flashoverlap.planning.auto_backends` the
      predictor times fastest: NCCL, the copy engines on one node, push on 2 Hopper ranks; NCCL
      alone off one node; :func:`backend_of` says which); default:
      FLASHOVERLAP_BACKEND, else "auto". The first call of a larger output with the copy engines
      grows the peer buffers, collectively. Where the plan falls back to running the GEMM then
      the AllReduce, the AllReduce is the group's own (NCCL) whatever the backend.
      On 2 Hopper ranks with push or the copy engines, an even M, the banded order and no
      bands_per_group (which names the other plan's groups), the call runs
      the gathered AllReduce instead: each rank owns half of the rows; its GEMM computes the
      other half first and sends it, then adds the peer's partial to its own half in the
      epilogue and gives the peer the finished sums (pushed from the same epilogue, or copied per
      group), which land in the peer's output: no SM sums anything and none is reserved
      (``plan_of(...).gathered``; FLASHOVERLAP_GATHERED_ALLREDUCE=0 turns it off).
    order: how the overlapped GEMM walks its tiles and groups them: "banded" (groups of whole row
      bands, each raster-ordered inside and reduced in place in the output), "swizzled" (one L2
      raster over the whole output, groups of whole waves reduced in a staging buffer the size of
      the output, then copied into place) or "auto" (whichever the predictor says is faster);
      default: FLASHOVERLAP_ORDER, else "auto". bands_per_group implies "banded".
    """
    _, _, _, comm = _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend, order)
    return torch.ops.flashoverlap.gemm_all_reduce(x, weight, comm.name, mode, bands_per_group, kernel, backend,
                                                  order)


def plan_of(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *, communicator=None,
            mode: str = "auto", bands_per_group: Optional[int] = None, kernel: Optional[str] = None,
            backend: Optional[str] = None, order: Optional[str] = None, fused_norm: bool = False) -> "_core.Plan":
    """The plan ``gemm_all_reduce`` runs for these arguments (tiles, waves, groups, predicted timeline);
    with ``fused_norm=True``, the plan ``gemm_all_reduce_rmsnorm`` runs (banded, the norm charged to
    each group)."""
    m, n, k, comm = _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend, order,
                                  norm=bool(fused_norm))
    order = "banded" if fused_norm else _resolve_order(order)
    if _env.force_sequential():
        mode, bands_per_group = "sequential", None
    backend = _call_backend(comm, "gemm_all_reduce", m, n, k, dtype_name(x.dtype), backend,
                            _op_options(mode, bands_per_group, kernel, "auto", order, bool(fused_norm)))
    options = _op_options(mode, bands_per_group, kernel, backend, order, bool(fused_norm))
    return _core.communicator_plan(comm.name, m, n, k, dtype_name(x.dtype), _stream_handle(x.device), options)


def _call_backend(comm: Communicator, op: str, m: int, n: int, k: int, dtype: str, backend: Optional[str],
                  options: tuple) -> str:
    """The backend a GEMM + AllReduce or ReduceScatter call of this shape runs (auto resolved)."""
    backend = _resolve_backend(comm, backend)
    return _auto_backend(comm, op, m, n, k, dtype, options) if backend == "auto" else backend


def backend_of(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *, communicator=None,
               op: str = "gemm_all_reduce", mode: str = "auto", bands_per_group: Optional[int] = None,
               kernel: Optional[str] = None, backend: Optional[str] = None, order: Optional[str] = None) -> str:
    """The backend ("nccl", "copy_engine" or "push") that ``gemm_all_reduce`` (op="gemm_all_reduce") or
    ``gemm_reduce_scatter`` (op="gemm_reduce_scatter") runs for these arguments: "auto" is decided
    per shape by the predictor, like the op does."""
    if op not in ("gemm_all_reduce", "gemm_reduce_scatter"):
        raise ValueError(f"op: expected 'gemm_all_reduce' or 'gemm_reduce_scatter', got {op!r}")
    if op == "gemm_all_reduce":
        m, n, k, comm = _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend,
                                      order)
    else:
        comm = _checked_rs_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend)
        m, n, k = _rs_shape(x, weight, comm.world_size)
    if _env.force_sequential():
        mode, bands_per_group = "sequential", None
    options = (_op_options(mode, bands_per_group, kernel, "auto", _resolve_order(order), False)
               if op == "gemm_all_reduce" else _rs_options(mode, bands_per_group, kernel, "auto"))
    return _call_backend(comm, op, m, n, k, dtype_name(x.dtype), backend, options)


def compile_kernels(arch: str, hidden: Optional[Sequence[int]] = None) -> "list[tuple[str, str, int]]":
    """Compiles every kernel variant for ``arch`` (e.g. "sm_80", "sm_90a") into the cubin cache and
    returns (kernel, defines, cubin bytes) for each. Needs NVRTC, not a GPU.

    ``all_reduce_rmsnorm``'s fastest kernels are compiled for the call's hidden size (one compile per
    size, on the first call that needs it): ``hidden`` lists the sizes to build them for here, so
    that a deployment's first calls find them in the cache (default: 8192 and 8200, the compile
    check's). Each must be an integer (int or anything with ``__index__``), a multiple of 8 up to
    16384; a float or a string is refused, not rounded."""
    if hidden is not None and (isinstance(hidden, (str, bytes)) or not hasattr(hidden, "__iter__")):
        raise TypeError(f"hidden: expected a sequence of hidden sizes, got {type(hidden).__name__}")
    _nvrtc.ensure_loaded()
    return _core.compile_kernels(arch, None if hidden is None else list(hidden))


def gemm_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *, communicator=None,
                        mode: str = "auto", bands_per_group: Optional[int] = None,
                        kernel: Optional[str] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``torch.distributed.reduce_scatter_tensor`` of ``x @ weight.T`` (sum): rank r gets rows
    r*M/world .. (r+1)*M/world - 1, as [M / world, N]. The ReduceScatter of each finished wave
    group of the GEMM overlaps the rest of the GEMM and receives straight into the output rows
    (the GEMM stores its tiles where the collective wants them).

    x: [M, K] with M divisible by the world size; weight: [N, K]; both bfloat16 or both float16.
    group, communicator, mode, bands_per_group (local row bands of every shard per group), kernel,
    backend: as for :func:`gemm_all_reduce`. With the copy engines each group's chunks go straight
    into their owners' staging slots and each rank sums its own on the SMs the GEMM leaves free;
    with "push" (2 Hopper ranks) the GEMM stores the tiles of the other rank's shard straight into
    its slot (over NVLink, as it computes them), and computes its own shard's tiles later, adding
    what the peer pushed before storing them: no sum after the GEMM and every SM computing; with
    NCCL, one ncclReduceScatter per group (24 SMs left free for it)."""
    comm = _checked_rs_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend)
    return torch.ops.flashoverlap.gemm_reduce_scatter(x, weight, comm.name, mode, bands_per_group, kernel, backend)


def reduce_scatter_plan_of(x: torch.Tensor, weight: torch.Tensor, group: GroupLike = None, *, communicator=None,
                           mode: str = "auto", bands_per_group: Optional[int] = None,
                           kernel: Optional[str] = None, backend: Optional[str] = None) -> dict:
    """The plan ``gemm_reduce_scatter`` runs for these arguments, as a dict (schedule, ctas, waves,
    buffers, predicted times, and one dict per wave group)."""
    comm = _checked_rs_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend)
    m, n, k = _rs_shape(x, weight, comm.world_size)
    if _env.force_sequential():
        mode, bands_per_group = "sequential", None
    dtype = dtype_name(x.dtype)
    backend = _call_backend(comm, "gemm_reduce_scatter", m, n, k, dtype, backend,
                            _rs_options(mode, bands_per_group, kernel, "auto"))
    options = _rs_options(mode, bands_per_group, kernel, backend)
    return _core.communicator_rs_plan(comm.name, m, n, k, dtype_name(x.dtype), _stream_handle(x.device), options)


def _checked_rs_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend):
    _, _, _, comm = _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend)
    _rs_shape(x, weight, comm.world_size)
    return comm


def gemm_all_reduce_rmsnorm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                            norm_weight: torch.Tensor, eps: float = 1e-6, group: GroupLike = None, *,
                            communicator=None, mode: str = "auto", bands_per_group: Optional[int] = None,
                            kernel: Optional[str] = None,
                            backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm after a row-parallel linear layer, returned as new tensors:
    ``residual_out = all_reduce(x @ weight.T) + residual`` and
    ``out = rms_norm(residual_out) * norm_weight`` (fp32 statistics, eps inside the root).

    Each wave group's rows are normalized on the communication stream as soon as their AllReduce
    completes, on the SMs the GEMM leaves free, so most of the norm hides behind the rest of the
    GEMM. residual: the shape of ``x @ weight.T``; norm_weight: [N], N <= 16384; all one dtype.
    The other arguments are those of :func:`gemm_all_reduce` (the groups are always whole row
    bands), and one more backend: "peer" (ranks of one node with peer access): each rank's GEMM
    stores its partial into a peer buffer of its own, and one kernel per wave group, on the SMs
    the GEMM leaves free, reads the group's rows of every rank's partial over NVLink, sums each
    owner's slice, adds the residual, normalizes and stores the rows into every rank: one pass
    over the data, no NCCL, no copy engine. Each rank's rows are thus normalized by another rank
    with that rank's residual and norm_weight, so "peer" needs both the same on every rank (as
    tensor parallelism has them); the other backends use each rank's own. Its buffers hold three [M, N] areas per rank (made
    and grown collectively, outside CUDA graph capture, and kept until
    :func:`destroy_peer_groups`); "auto" never picks it. "push" (2 ranks, Hopper) runs as for
    :func:`gemm_all_reduce`, each group's norm after its sum; "auto" chooses among NCCL, the copy
    engines and push as for :func:`gemm_all_reduce`. Returns (out, residual_out)."""
    # Every argument is checked before the communicator is looked up (or created, collectively).
    check_gemm_operands(x, weight, devices=False)
    _check_norm_operands(x, weight, residual, norm_weight, eps)
    _, _, _, comm = _checked_call(x, weight, group, communicator, mode, bands_per_group, kernel, backend, norm=True)
    for name, t in (("residual", residual), ("norm_weight", norm_weight)):
        check_device(name, t, comm.device)
    if backend == "peer":
        from . import peer_norm

        peer_norm.gemm_peer_group(comm, create=True).check_error()
    return torch.ops.flashoverlap.gemm_all_reduce_rmsnorm(x, weight, residual, norm_weight, float(eps), comm.name,
                                                          mode, bands_per_group, kernel, backend)


def gemm_all_to_all(x: torch.Tensor, weight: torch.Tensor, input_split_sizes, output_split_sizes,
                    group: GroupLike = None, *, communicator=None, groups: Optional[int] = None,
                    split_matrix=None, kernel: Optional[str] = None, backend: Optional[str] = None) -> torch.Tensor:
    """``torch.distributed.all_to_all_single(out, x @ weight.T, output_split_sizes,
    input_split_sizes)``: the expert-parallel combine. x: [T, K] with its rows grouped by
    destination rank (input_split_sizes[p] rows for rank p, summing to T); returns
    [sum(output_split_sizes), N], the rows from rank p at offset sum(output_split_sizes[:p]).

    The GEMM computes the same fraction of every destination's rows per wave group, and each
    group's rows go to their peers while the next group
    computes. Every rank must run the same number of groups:
      groups: that number (1..64), the same on every rank; or
      split_matrix: the whole routing, [world][world] ints (or a tensor) with split_matrix[p][q]
        the rows rank p sends rank q, the same on every rank (its row for this rank must equal
        input_split_sizes and its column output_split_sizes); the predictor then picks the group
        count from the slowest rank's GEMM and the busiest rank's links (the same on every rank),
        or, where no count is predicted to beat it, runs torch.matmul then the group's
        all_to_all_single (the sequential schedule; one group where the group is not NCCL).
      With neither, DEFAULT_A2A_GROUPS (4) groups. One group is the GEMM, then the exchange.
    backend: "copy_engine" (each group's rows copied into their receivers' staging slots, and from
      there into the output, all on the copy engines: the GEMM keeps every SM; needs split_matrix,
      from which every rank sizes the slots alike), "nccl" (send/receive per peer), "push" (2 ranks
      of one node, Hopper, needs split_matrix: the GEMM's epilogue stores the tiles of the other
      rank's rows straight into its staging slot, over NVLink while it computes, and each rank
      copies what landed into its output), or "auto" (default, FLASHOVERLAP_BACKEND: with
      split_matrix and every rank on one node, whichever of NCCL, the copy engines and, on 2
      Hopper ranks, push the predictor times fastest for the routing; else NCCL). Without NCCL (a communicator made with nccl=False) and
      without split_matrix: torch.matmul then all_to_all_single.
    Splits are checked (one entry per rank, ints >= 0, input summing to T). Capturable in CUDA
    graphs once the op has run with the same split sizes outside capture (its tables are made then
    and kept for the graph)."""
    _, _, _, comm = _checked_call(x, weight, group, communicator, "auto", None, kernel, backend)
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, K] (rows grouped by destination rank), got shape {tuple(x.shape)}")
    sends = check_splits("input_split_sizes", input_split_sizes, comm.world_size, x.shape[0])
    recvs = check_splits("output_split_sizes", output_split_sizes, comm.world_size)
    flat = None
    if split_matrix is not None:
        rows = check_split_matrix(split_matrix, comm.world_size, comm.rank, sends, recvs)
        flat = [v for row in rows for v in row]
    if groups is not None:
        check_groups(groups)
    return torch.ops.flashoverlap.gemm_all_to_all(x, weight, sends, recvs, comm.name, groups, kernel, flat, backend)
