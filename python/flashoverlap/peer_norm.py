"""AllReduce + residual add + RMSNorm over NVLink peer memory on a few SMs (TokenWeave's fused
op, built on peer-to-peer loads and stores instead of NVLink multicast).

Each rank pushes the other ranks' slices of its partial sum into their peer buffers, reduces and
normalizes its own slice of the tokens, and stores the normalized rows into every rank's buffer;
each value crosses NVLink once each way. The buffers are made once per ProcessGroup (CUDA IPC
handles exchanged through the group, so any backend works, gloo included) and grown on demand
outside CUDA-graph capture. Groups that span nodes, or GPUs without peer access, get the same
result from torch.distributed's all_reduce and a torch RMSNorm.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from . import _core, _env
from ._streams import current_stream_handle
from ._validation import check_device, check_tensor, dtype_name
from .communicator import resolve_group
from .ops import _LIB, _register

_log = logging.getLogger("flashoverlap")

RESIDUAL_MODES = ("full", "sharded")
MAX_WORLD = 8
MAX_HIDDEN = 16384
# CTAs per call: few enough to leave the SMs to overlapping compute.
DEFAULT_CTAS = 16
CE_MAX_CTAS = 32

_LIB.define("all_reduce_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str group_name, "
            "str residual_out='full', int? ctas=None) -> (Tensor, Tensor)")


def wait_timeout_ns() -> int:
    """FLASHOVERLAP_PEER_TIMEOUT_S: give up a peer wait after this many seconds (the call's
    outputs are then garbage and the error is raised at the next call); unset: wait forever."""
    raw = os.environ.get("FLASHOVERLAP_PEER_TIMEOUT_S", "").strip()
    if not raw:
        return 0
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"FLASHOVERLAP_PEER_TIMEOUT_S: expected seconds, got {raw!r}") from None
    return max(1, int(seconds * 1e9))


class PeerGroup:
    """The peer buffers of one ProcessGroup on this rank's device. Creation and growth are
    collective over the group (every rank calls with the same sizes, as the op's callers do)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, op: str = "all_reduce_rmsnorm"):
        self.group, self.device, self.op = group, device, op
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # The kernel's shape and the copy engines' settings must match across ranks (the parts and
        # the mode of a call do), so the ranks compare them and all raise alike (a bad value on one
        # rank too: none is left waiting for the others).
        try:
            config, ce, error = _env.norm_config(), _env.norm_copy_engines(), None
        except ValueError as e:
            config, ce, error = None, None, str(e)
        facts = [None] * self.world
        dist.all_gather_object(facts, (socket.gethostname(), config, ce, error), group=group)
        errors = [f"rank {r}: {e}" for r, (_, _, _, e) in enumerate(facts) if e is not None]
        if errors:
            raise ValueError(f"{op}: {'; '.join(errors)}")
        for i, name in ((1, "FLASHOVERLAP_NORM_CONFIG"), (2, "FLASHOVERLAP_NORM_CE_MIN_TOKENS / _CHUNKS")):
            values = {f[i] for f in facts}
            if len(values) > 1:
                raise ValueError(f"{op}: {name} differs across the group's ranks ({sorted(values)}); "
                                 "set it alike on every rank")
        self.config = config
        self.ce_min_tokens, self.ce_chunks = ce
        self.peer = len({f[0] for f in facts}) == 1 and self.world <= MAX_WORLD
        self._lanes: Optional["_core.NormLanes"] = None
        self.memory: Optional["_core.PeerMemory"] = None

    @functools.cached_property
    def sms(self) -> int:
        """The device's SM count (asked once: torch's query costs microseconds a call)."""
        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def ensure(self, nbytes: int) -> bool:
        """Whether the peer path serves this call: its buffers then hold `nbytes`."""
        if not self.peer or (self.memory is not None and self.memory.bytes >= nbytes):
            return self.peer
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{self.op}: the peer buffers must grow to {nbytes} bytes, which cannot "
                             "happen during CUDA graph capture; run the op once with this many tokens first")
        size = max(16 << 20, 1 << (nbytes - 1).bit_length())
        # Every rank's kernels on the old buffers must be done before any rank frees its own.
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        # The copy lanes count watched calls from the new buffers' zeroed epoch word.
        self._lanes = None
        memory = _core.PeerMemory(self.device.index, size)
        handles = [None] * self.world
        dist.all_gather_object(handles, memory.handle(), group=self.group)
        error = None
        try:
            memory.attach(self.rank, handles)
        except Exception as e:  # no peer access: every rank must agree to fall back
            error = f"{type(e).__name__}: {e}"
        errors = [None] * self.world
        dist.all_gather_object(errors, error, group=self.group)
        failed = [e for e in errors if e is not None]
        if failed:
            memory.close()
            self.peer = False
            _log.warning("%s: peer buffers could not be mapped (%s); %s", self.op, failed[0],
                         "using torch.distributed all_reduce and a torch RMSNorm for this group"
                         if self.op == "all_reduce_rmsnorm" else "backend='peer' cannot run on this group")
            return False
        self.memory = memory
        return True

    def core_buffers(self) -> tuple:
        """(every rank's buffer base, bytes each, this rank, wait timeout in ns, kernel config), as the
        core takes them."""
        return self.memory.bases, self.memory.bytes, self.rank, wait_timeout_ns(), self.config

    def partial(self, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's partial area (pull layout, an output of [rows, hidden]) as a tensor that
        aliases the buffer: a producer storing there spares `launch(pull=True)` its copy.
        Valid until the buffers grow."""
        ptr = _core.allreduce_rmsnorm_partial(self.core_buffers(), rows, hidden, dtype_name(dtype))
        return _alias(ptr, (rows, hidden), dtype)

    def copy_engines(self, tokens: int, ctas: int, full: bool = True) -> bool:
        """Whether a call of `tokens` rows on `ctas` CTAs keeping the full residual (else sharded)
        lets the copy engines move them (2 ranks, from FLASHOVERLAP_NORM_CE_MIN_TOKENS on, by
        default the _env thresholds of its residual mode, up to CE_MAX_CTAS: with more, the
        kernel's own stores move the rows faster, 448 against 475 us at 8K tokens on 64 CTAs on
        2x H200): the same answer on every rank."""
        least = self.ce_min_tokens
        if least is None:
            least = _env.NORM_CE_MIN_TOKENS_FULL if full else _env.NORM_CE_MIN_TOKENS_SHARDED
        return self.world == 2 and 0 < least <= tokens and ctas <= CE_MAX_CTAS

    def launch(self, x, residual, weight, out, residual_out, eps: float, ctas: int, *, full: bool = True,
               pull: bool = False, config=None, residual_sliced: bool = False,
               copy_engines: bool = False) -> None:
        """Enqueues the kernel over x's rows on this device's current stream, on this group's
        buffers (made and large enough: `ensure`). pull: the buffers are laid out for
        gemm_all_reduce_rmsnorm's backend="peer" (x is copied into this rank's partial first,
        unless x is `partial(...)`);
        config: (threads, unroll, stages, oneshot) of the kernel, default the group's (FLASHOVERLAP_NORM_CONFIG).
        residual_sliced: `residual` holds this rank's slice rows only (full=False).
        copy_engines (2 ranks): the copy engines move the rows, kernels of `ctas` CTAs (one at a
        time) only sum and normalize."""
        hidden = x.shape[-1]
        tokens = x.numel() // hidden
        lanes = None
        if copy_engines:
            if self._lanes is None:
                self._lanes = _core.NormLanes(self.device.index)
            lanes = self._lanes
        _core.allreduce_rmsnorm_launch(self.device.index, (x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                                           out.data_ptr(), residual_out.data_ptr()),
                                       self.memory.bases, self.memory.bytes, self.rank, tokens, hidden, float(eps), full,
                                       dtype_name(x.dtype), ctas, wait_timeout_ns(),
                                       current_stream_handle(self.device.index), pull=pull,
                                       config=config or self.config, residual_sliced=residual_sliced,
                                       lanes=lanes, chunks=self.ce_chunks)

    def check_error(self) -> None:
        # Only a bounded wait can record an error, and reading the word waits for the device:
        # calls without FLASHOVERLAP_PEER_TIMEOUT_S never pay that host round trip.
        # (Nor during graph capture, where a synchronous copy would break it.)
        if not wait_timeout_ns() or self.memory is None or torch.cuda.is_current_stream_capturing():
            return
        if self.memory.header_word(_core.ALLREDUCE_RMSNORM_ERROR_WORD):
            raise RuntimeError(f"{self.op}: a peer wait timed out (FLASHOVERLAP_PEER_TIMEOUT_S); the ranks did not "
                               "call the op together. The group's peer buffers are unusable.")


class _DeviceArray:
    """Device memory torch does not own, described by the CUDA array interface
    (2-byte elements: the interface has no bf16, the tensor is viewed as the dtype)."""

    def __init__(self, ptr: int, shape: tuple[int, int]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "<i2", "data": (ptr, False),
                                         "strides": None, "version": 2}


def _alias(ptr: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize != 2:
        raise TypeError(f"peer buffers hold bf16 or fp16, got {dtype}")
    return torch.as_tensor(_DeviceArray(ptr, shape), device="cuda").view(dtype)


_GROUPS: dict[str, PeerGroup] = {}


def _name(group: dist.ProcessGroup, device: torch.device) -> str:
    return f"pg:{group.group_name}:{device.index}"


def gemm_peer_group(comm, create: bool = False) -> PeerGroup:
    """gemm_all_reduce_rmsnorm's backend="peer" buffers for a communicator: a group of their own
    (laid out for the GEMM's partials), never shared with all_reduce_rmsnorm's, whose calls might
    otherwise write a layout the other op is still reading. create: make it (collective) where
    it does not exist; raises where the communicator's ranks cannot map each other's memory."""
    name = f"{_name(comm.group, comm.device)}:gemm"
    state = _GROUPS.get(name)
    if state is None:
        if not create:
            raise ValueError(f"backend: no peer buffers for communicator {comm.name!r}; call "
                             "flashoverlap.gemm_all_reduce_rmsnorm(..., backend='peer') first")
        state = _GROUPS[name] = PeerGroup(comm.group, comm.device, op="gemm_all_reduce_rmsnorm")
    if not state.peer:
        raise ValueError(f"backend: 'peer' needs every rank of communicator {comm.name!r} on one node (at most "
                         f"{MAX_WORLD}) with peer access; use backend='nccl' or 'copy_engine'")
    return state


def _slice(tokens: int, world: int, rank: int) -> tuple[int, int]:
    """The rows of `tokens` that `rank` owns: the core's split, which the kernel's matches."""
    return _core.allreduce_rmsnorm_slice(tokens, world, rank)


def _check(x, residual, weight, eps, residual_out, ctas) -> tuple[int, int]:
    check_tensor("x", x, 2)
    check_tensor("residual", residual, 2)
    check_tensor("weight", weight, 1)
    tokens, hidden = x.shape
    # A sharded call may take this rank's slice of the residual (checked once the group is known).
    if residual.shape != x.shape and not (residual_out == "sharded" and residual.shape[1:] == x.shape[1:]):
        raise ValueError(f"residual: expected the shape of x {tuple(x.shape)}"
                         + (" (or, with residual_out='sharded', this rank's slice of it)" if residual_out == "sharded"
                            else "") + f", got {tuple(residual.shape)}")
    if weight.shape[0] != hidden:
        raise ValueError(f"weight: expected [{hidden}] (the hidden size of x), got {tuple(weight.shape)}")
    for name, t in (("residual", residual), ("weight", weight)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name}: expected {x.dtype} like x, got {t.dtype}")
    if hidden % 8 != 0 or not 8 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x: the hidden size must be a multiple of 8 in 8..{MAX_HIDDEN}, got {hidden}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a float > 0, got {eps!r}")
    if residual_out not in RESIDUAL_MODES:
        raise ValueError(f"residual_out: expected one of {RESIDUAL_MODES}, got {residual_out!r}")
    if ctas is not None and (isinstance(ctas, bool) or not isinstance(ctas, int) or not 1 <= ctas <= 256):
        raise ValueError(f"ctas: expected an int in 1..256, got {ctas!r}")
    return tokens, hidden


def torch_add_rms_norm(s, residual, weight, eps):
    """vLLM's fused_add_rms_norm after an AllReduce `s`, in torch ops (differentiable):
    r = round(s + residual); out = round(r * rsqrt(mean(r^2) + eps) * weight), fp32 inside.
    Returns (out, r)."""
    r = (s.float() + residual.float()).to(s.dtype)
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(s.dtype), r


def _residual_sliced(x, residual, residual_out, world: int, rank: int) -> bool:
    """Whether `residual` is this rank's slice of the tokens (sharded calls only; the full
    residual otherwise); raises where it is neither the full residual nor the slice."""
    tokens = x.shape[0]
    if residual.shape[0] == tokens:
        return False
    a, b = _slice(tokens, world, rank)
    if residual_out != "sharded" or residual.shape[0] != b - a:
        raise ValueError(f"residual: expected [{tokens}, {x.shape[1]}] or, with residual_out='sharded', this "
                         f"rank's slice of the tokens, rows {a}..{b - 1}: [{b - a}, {x.shape[1]}]; got "
                         f"{tuple(residual.shape)}")
    return True


def _gather_residual(residual, tokens: int, group, world: int) -> torch.Tensor:
    """The full residual from every rank's slice (slices differ by a row at most: padded)."""
    rows = -(-tokens // world)
    padded = residual.new_zeros((rows, residual.shape[1]))
    padded[:residual.shape[0]] = residual
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    slices = [_slice(tokens, world, r) for r in range(world)]
    return torch.cat([part[:b - a] for part, (a, b) in zip(parts, slices)])


def _torch_fallback(x, residual, weight, eps, group, residual_out, world, rank):
    if residual.shape[0] != x.shape[0]:
        residual = _gather_residual(residual, x.shape[0], group, world)
    s = x.clone()
    dist.all_reduce(s, group=group)
    out, r = torch_add_rms_norm(s, residual, weight, eps)
    if residual_out == "sharded":
        a, b = _slice(x.shape[0], world, rank)
        r = r[a:b].clone()
    return out, r


def _impl(x, residual, weight, eps: float, group_name: str, residual_out: str = "full",
          ctas: Optional[int] = None):
    tokens, hidden = _check(x, residual, weight, eps, residual_out, ctas)
    state = _GROUPS.get(group_name)
    if state is None:
        raise ValueError(f"group_name: no flashoverlap peer group {group_name!r}; call "
                         "flashoverlap.all_reduce_rmsnorm(...) with the ProcessGroup first")
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        check_device(name, t, state.device)
    world, rank = state.world, state.rank
    sliced = _residual_sliced(x, residual, residual_out, world, rank)
    dtype = dtype_name(x.dtype)
    # Off-node, or the mapping failed on some rank: the same result from torch.distributed.
    # (The buffer size is asked only of peer groups: those have at most MAX_WORLD ranks.)
    if not (state.peer and state.ensure(_core.allreduce_rmsnorm_buffer_bytes(world, tokens, hidden, dtype))):
        return _torch_fallback(x, residual, weight, float(eps), state.group, residual_out, world, rank)
    a, b = _slice(tokens, world, rank)
    out = torch.empty_like(x)
    res = torch.empty_like(x) if residual_out == "full" else x.new_empty((b - a, hidden))
    ctas = min(ctas or DEFAULT_CTAS, state.sms)
    state.launch(x, residual, weight, out, res, eps, ctas, full=residual_out == "full", residual_sliced=sliced,
                 copy_engines=state.copy_engines(tokens, ctas, residual_out == "full"))
    return out, res


def _fake(x, residual, weight, eps: float, group_name: str, residual_out: str = "full",
          ctas: Optional[int] = None):
    if residual_out == "full":
        return x.new_empty(x.shape), x.new_empty(x.shape)
    state = _GROUPS[group_name]
    a, b = _slice(x.shape[0], state.world, state.rank)
    return x.new_empty(x.shape), x.new_empty((b - a, x.shape[1]))


_register("all_reduce_rmsnorm", _impl, _fake)


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       group: Optional[dist.ProcessGroup] = None, *, residual_out: str = "full",
                       ctas: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's fused_add_rms_norm after an AllReduce of x over ``group``:
    ``r = all_reduce(x) + residual; out = r * rsqrt(mean(r^2) + eps) * weight``; returns (out, r).

    x, residual: [tokens, hidden] (bf16 or fp16, hidden a multiple of 8 up to 16384), residual the
    same on every rank (as in tensor parallelism); weight: [hidden], also the same on every rank
    (each rank normalizes its slice of the tokens with its own weight and shares the rows).
    residual_out: "full" (every rank gets all of r) or "sharded" (each rank gets only its slice
    of the tokens, rows tokens*rank//world .. tokens*(rank+1)//world - 1: less traffic and
    memory). A sharded call also takes `residual` as that slice alone ([slice rows, hidden],
    what the previous sharded call returned: the rows this rank reduces are all it reads), so
    that a model's layers can keep the residual sharded from one fused call to the next
    (TokenWeave's layout); `out` is every token's row either way. ctas: CTAs of the kernel (default 16), the SMs it
    takes from concurrent work. On 2 ranks and up to 32 CTAs, from 512 tokens keeping the full residual and 4096
    sharded (FLASHOVERLAP_NORM_CE_MIN_TOKENS), the copy engines move the rows and the kernel only sums and normalizes.

    Every rank of the group calls it with the same shapes. The first call for a group, and the
    first with more tokens than before, are collective host calls (the peer buffers are made or
    grown: not during CUDA graph capture). Groups spanning nodes or without peer access compute
    the same with torch.distributed.all_reduce and torch ops."""
    tokens, hidden = _check(x, residual, weight, eps, residual_out, ctas)
    pg = resolve_group(group)
    device = x.device
    name = _name(pg, device)
    state = _GROUPS.get(name)
    # A known group answers world and rank without asking torch.distributed again.
    world, rank = (state.world, state.rank) if state is not None else (dist.get_world_size(pg), dist.get_rank(pg))
    _residual_sliced(x, residual, residual_out, world, rank)
    if device.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got a tensor on {device}")
    if state is None:
        _GROUPS[name] = PeerGroup(pg, device)
    else:
        state.check_error()
    return torch.ops.flashoverlap.all_reduce_rmsnorm(x, residual, weight, float(eps), name, residual_out, ctas)


def destroy_peer_groups() -> None:
    """Frees every peer buffer, on every rank: after synchronizing this device and, while the
    process groups live, meeting every peer (a peer's watched call writes its epoch into this
    rank's buffer after its copy, which this rank's kernel need not wait for)."""
    if _GROUPS and torch.cuda.is_available():
        torch.cuda.synchronize()
    for state in _GROUPS.values():
        if state.memory is not None and state.world > 1 and dist.is_initialized():
            dist.barrier(group=state.group)
    for state in _GROUPS.values():
        if state.memory is not None:
            state.memory.close()
    _GROUPS.clear()
