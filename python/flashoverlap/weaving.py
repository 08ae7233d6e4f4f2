"""Token weaving (TokenWeave): a batch's tokens cut into two halves so that
one half's communication runs while the other half computes.

`token_split` cuts the batch near the middle where the halves' GEMMs run
the fewest waves, so that splitting costs the GEMMs as little as it can (a
wave-aware cut, see rust/plan/token_split.rs); `weave` runs a sequence of (compute,
communicate) stages over the two halves: every compute on the caller's
stream, every communicate on a side stream, so that half A's communicate of
stage i overlaps half B's compute of stage i, and half B's communicate
overlaps half A's compute of stage i + 1. The communicate steps should use
few SMs (`all_reduce_rmsnorm(..., ctas=8)`) or none, else they take the SMs
the other half's compute needs.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import torch

from . import _core

__all__ = ["TokenSplit", "gemm_waves", "token_split", "weave"]

# The library's Hopper GEMM tile (rows, columns). cuBLAS picks its own per shape
# (evaluation/results/cublas_tiles_h200.txt): for its GEMMs the waves are a proxy.
DEFAULT_TILE = (128, 256)
# SMs of an H100/H200 SXM: the CTAs of a wave where no device says otherwise.
DEFAULT_CTAS = 132
# The halves may differ by a quarter of the tokens (37.5% / 62.5% at most).
DEFAULT_SKEW = 0.25


class TokenSplit(NamedTuple):
    """`first` tokens then `second` (0: the batch is not split); the waves the
    layer's GEMMs run over both halves, and over the whole batch."""

    first: int
    second: int
    waves: int
    unsplit_waves: int


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if value > 0xFFFFFFFF:
        raise ValueError(f"{name}: at most {0xFFFFFFFF}, got {value}")
    return value


def token_split(tokens: int, gemms: Union[int, Sequence[tuple[int, int]]], *, skew: float = DEFAULT_SKEW,
                tile: tuple[int, int] = DEFAULT_TILE, ctas: Optional[int] = None,
                device: Union[torch.device, int, str, None] = None) -> TokenSplit:
    """TokenWeave's wave-aware cut of `tokens` for the GEMMs of the layer
    that runs on each half: `gemms` is a list of their (N, K) (each with the
    tokens as its rows, e.g. a tensor-parallel MLP's gate/up and down shards
    and the attention's output projection), or one N.

    The cut falls on a `tile[0]`-row boundary, so the halves hold exactly the
    whole batch's tiles. Among the cuts whose halves differ by at most
    `skew` x tokens (the overlap needs them alike; where no cut is that
    even, the most even one), it takes the fewest waves of `ctas` tiles over
    the GEMMs, each weighted by its K, then the most even halves, the larger
    one first. A batch of fewer than two row bands is not split
    (`second == 0`). `waves` / `unsplit_waves`: the GEMMs' waves over both
    halves / over the whole batch.
    `ctas`: the CTAs of one wave, default the SM count of `device` (default:
    the current CUDA device; 132 where there is none)."""
    tokens = _positive_int("tokens", tokens)
    layer = _check_gemms(gemms)
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew <= 1:
        raise ValueError(f"skew: expected a number in [0, 1], got {skew!r}")
    if not (isinstance(tile, (tuple, list)) and len(tile) == 2):
        raise ValueError(f"tile: expected (rows, columns), got {tile!r}")
    tile = (_positive_int("tile[0]", tile[0]), _positive_int("tile[1]", tile[1]))
    if ctas is None:
        ctas = _device_sms(device)
    ctas = _positive_int("ctas", ctas)
    cut = _core.wave_aware_split(tokens, layer, tile, ctas, float(skew))
    if cut is None:
        waves = sum(gemm_waves(tokens, n, tile=tile, ctas=ctas) for n, _ in layer)
        return TokenSplit(tokens, 0, waves, waves)
    return TokenSplit(*cut)


def _check_gemms(gemms: Any) -> list[tuple[int, int]]:
    if isinstance(gemms, int) and not isinstance(gemms, bool):
        return [(_positive_int("gemms", gemms), 1)]
    if isinstance(gemms, (str, bytes)) or not isinstance(gemms, Sequence) or not gemms:
        raise ValueError(f"gemms: expected N or a non-empty list of (N, K), got {gemms!r}")
    layer = []
    for i, g in enumerate(gemms):
        if not (isinstance(g, (tuple, list)) and len(g) == 2):
            raise ValueError(f"gemms[{i}]: expected (N, K), got {g!r}")
        layer.append((_positive_int(f"gemms[{i}] N", g[0]), _positive_int(f"gemms[{i}] K", g[1])))
    return layer


def gemm_waves(tokens: int, n: int, *, tile: tuple[int, int] = DEFAULT_TILE, ctas: int = DEFAULT_CTAS) -> int:
    """Waves of `ctas` tiles that a GEMM with `tokens` rows and `n` columns of `tile` tiles runs."""
    tiles = -(-tokens // tile[0]) * -(-n // tile[1])
    return -(-tiles // ctas)


def _device_sms(device: Union[torch.device, int, str, None]) -> int:
    if device is None:
        if not torch.cuda.is_available():
            return DEFAULT_CTAS
        device = torch.cuda.current_device()
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return DEFAULT_CTAS
    return torch.cuda.get_device_properties(device).multi_processor_count


Step = Callable[..., Any]
Stage = tuple[Step, Optional[Step]]

_side_streams: dict[int, torch.cuda.Stream] = {}
_side_lock = threading.Lock()


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for the communicate steps, so that
    their few CTAs get SMs as soon as any frees up."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _side_lock:
        if index not in _side_streams:
            _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
        return _side_streams[index]


def _check_stages(stages: Any) -> list[Stage]:
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise ValueError("stages: expected a non-empty sequence of (compute, communicate) pairs")
    checked = []
    for i, stage in enumerate(stages):
        if not (isinstance(stage, (tuple, list)) and len(stage) == 2):
            raise ValueError(f"stages[{i}]: expected a (compute, communicate) pair, got {stage!r}")
        compute, communicate = stage
        if not callable(compute):
            raise ValueError(f"stages[{i}]: compute must be callable, got {compute!r}")
        if communicate is not None and not callable(communicate):
            raise ValueError(f"stages[{i}]: communicate must be callable or None, got {communicate!r}")
        checked.append((compute, communicate))
    return checked


def _check_inputs(inputs: Any) -> tuple[torch.Tensor, ...]:
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not isinstance(inputs, (tuple, list)) or not inputs:
        raise ValueError("inputs: expected a tensor or a non-empty tuple of tensors")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"inputs[{i}]: expected a tensor of at least one dimension (tokens first), got "
                             f"{type(t).__name__ if not isinstance(t, torch.Tensor) else f'shape {tuple(t.shape)}'}")
    tokens, device = inputs[0].shape[0], inputs[0].device
    for i, t in enumerate(inputs):
        if t.shape[0] != tokens:
            raise ValueError(f"inputs[{i}]: expected {tokens} tokens (inputs[0]'s first dimension), got "
                             f"shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"inputs[{i}]: expected device {device} (that of inputs[0]), got {t.device}")
    return tuple(inputs)


def _check_split(split: Any, tokens: int) -> tuple[int, int]:
    if isinstance(split, bool):
        raise ValueError(f"split: expected a TokenSplit, (first, second) or the first half's tokens, got {split!r}")
    if isinstance(split, int):
        first, second = split, tokens - split
    elif isinstance(split, (tuple, list)) and len(split) >= 2:
        first, second = split[0], split[1]
    else:
        raise ValueError(f"split: expected a TokenSplit, (first, second) or the first half's tokens, got {split!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, second)):
        raise ValueError(f"split: expected integer token counts, got ({first!r}, {second!r})")
    # An empty batch is one empty half.
    if first < min(1, tokens) or second < 0 or first + second != tokens:
        raise ValueError(f"split: expected first >= 1, second >= 0 and first + second == {tokens} tokens, "
                         f"got ({first}, {second})")
    return first, second


def _as_state(value: Any, where: str) -> tuple:
    if isinstance(value, tuple):
        return value
    if isinstance(value, torch.Tensor):
        return (value,)
    raise TypeError(f"{where}: expected a tensor or a tuple, got {type(value).__name__}")


def _used_on(state: tuple, stream: torch.cuda.Stream) -> None:
    """Tells the caching allocator that `stream` uses the state's CUDA tensors,
    so that memory freed on the other stream is not handed out again before
    `stream` is done with it."""
    for t in state:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(stream)


def weave(stages: Sequence[Stage], inputs: Union[torch.Tensor, Sequence[torch.Tensor]],
          split: Union[TokenSplit, tuple[int, int], int], *, comm_stream: Optional[torch.cuda.Stream] = None,
          merge: bool = True) -> Any:
    """Runs `stages` over the two halves of `inputs` (tensors whose first
    dimension is the tokens; the halves are views of them, not copies).

    Each stage is a pair `(compute, communicate)`: `compute(*state)` and
    `communicate(*state)` each take the half's state and return the next (a
    tensor or a tuple); `communicate` may be None. Every compute runs on the
    caller's current stream, every communicate on `comm_stream` (default: a
    high-priority stream of the device), ordered by events: a half's
    communicate after its compute, its next compute after its communicate,
    and the caller's stream after both halves' last step. Each half goes
    through the same steps in the same order as it would alone.

    `split`: a `TokenSplit`, `(first, second)` or the first half's token
    count; a split with `second == 0` runs the batch as one half. Returns the
    final state with each tensor's halves concatenated along the first
    dimension (`merge=True`, the final states must then be tensors with the
    half's tokens first; a state of one tensor comes back as that tensor),
    or the list of the halves' final states (`merge=False`).
    On CPU tensors the steps simply run in order. CUDA-graph capturable where
    the steps are."""
    stages = _check_stages(stages)
    inputs = _check_inputs(inputs)
    first, second = _check_split(split, inputs[0].shape[0])
    halves = [tuple(t.narrow(0, 0, first) for t in inputs)]
    if second:
        halves.append(tuple(t.narrow(0, first, second) for t in inputs))
    if inputs[0].is_cuda:
        states = _run_streams(stages, halves, inputs[0].device, comm_stream)
    else:
        states = _run_in_order(stages, halves)
    return _merge(states, (first, second)) if merge else states


def _run_in_order(stages: list[Stage], halves: list[tuple]) -> list[tuple]:
    states = list(halves)
    for i, (compute, communicate) in enumerate(stages):
        for h in range(len(states)):
            states[h] = _as_state(compute(*states[h]), f"stages[{i}] compute")
            if communicate is not None:
                states[h] = _as_state(communicate(*states[h]), f"stages[{i}] communicate")
    return states


def _run_streams(stages: list[Stage], halves: list[tuple], device: torch.device,
                 comm_stream: Optional[torch.cuda.Stream]) -> list[tuple]:
    main = torch.cuda.current_stream(device)
    side = comm_stream if comm_stream is not None else _side_stream(device)
    if side == main:
        raise ValueError("comm_stream: must differ from the current stream, else nothing overlaps")
    if side.device != main.device:
        raise ValueError(f"comm_stream: expected a stream of {main.device} (that of the inputs), got one of {side.device}")
    states = list(halves)
    pending: list[Optional[torch.cuda.Event]] = [None] * len(states)  # a half's last communicate
    side_used = False
    try:
        for i, (compute, communicate) in enumerate(stages):
            for h in range(len(states)):
                if pending[h] is not None:
                    main.wait_event(pending[h])
                    pending[h] = None
                states[h] = _as_state(compute(*states[h]), f"stages[{i}] compute")
                if communicate is None:
                    continue
                computed = torch.cuda.Event()
                computed.record(main)
                _used_on(states[h], side)
                side_used = True
                with torch.cuda.stream(side):
                    side.wait_event(computed)
                    states[h] = _as_state(communicate(*states[h]), f"stages[{i}] communicate")
                    _used_on(states[h], main)
                    pending[h] = torch.cuda.Event()
                    pending[h].record(side)
    except BaseException:
        # A step raised, perhaps halfway through its kernels: the caller's
        # stream still comes after everything enqueued on the side stream.
        if side_used:
            main.wait_stream(side)
        raise
    for event in pending:
        if event is not None:
            main.wait_event(event)
    return states


def _merge(states: list[tuple], split: tuple[int, int]) -> Any:
    if len(states) == 1:
        merged = states[0]
    else:
        a, b = states
        if len(a) != len(b):
            raise ValueError(f"merge: the halves' final states differ in length ({len(a)} and {len(b)})")
        merged = []
        for j, (x, y) in enumerate(zip(a, b)):
            for half, t, tokens in ((0, x, split[0]), (1, y, split[1])):
                if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != tokens:
                    raise ValueError(f"merge: final state [{j}] of half {half} must be a tensor of {tokens} "
                                     f"tokens first, got {_describe(t)}; pass merge=False to take the halves")
            merged.append(torch.cat((x, y)))
        merged = tuple(merged)
    return merged[0] if len(merged) == 1 else merged


def _describe(t: Any) -> str:
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
