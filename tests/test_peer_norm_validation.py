"""all_reduce_rmsnorm's argument checks: each bad input gets a clear error naming the argument,
before any process group or device is needed."""

from __future__ import annotations

import pytest
import torch

import flashoverlap

BF16 = torch.bfloat16


def args(tokens=16, hidden=64, dtype=BF16):
    return (torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype),
            torch.rand(hidden).to(dtype))


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda x, r, w: (x.float(), r, w), TypeError, ["x", "bfloat16"]),
    (lambda x, r, w: (x, r[:, :8], w), ValueError, ["residual", "shape"]),
    (lambda x, r, w: (x, r, w[:8]), ValueError, ["weight", "hidden"]),
    (lambda x, r, w: (x, r.half(), w), TypeError, ["residual", "torch.bfloat16"]),
    (lambda x, r, w: (x[:, :60].contiguous(), r[:, :60].contiguous(), w[:60]), ValueError, ["multiple of 8"]),
    (lambda x, r, w: (x.t(), r, w), ValueError, ["x", "contiguous"]),
    (lambda x, r, w: (x[0], r, w), ValueError, ["x", "2-D"]),
])
def test_bad_tensors_are_named(mutate, exc, words) -> None:
    with pytest.raises(exc) as info:
        flashoverlap.all_reduce_rmsnorm(*mutate(*args()))
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(eps=0.0), ["eps"]),
    (dict(eps=True), ["eps"]),
    (dict(residual_out="half"), ["residual_out", "sharded"]),
    (dict(ctas=0), ["ctas"]),
    (dict(ctas=1000), ["ctas"]),
])
def test_bad_options_are_named(kwargs, words) -> None:
    with pytest.raises(ValueError) as info:
        flashoverlap.all_reduce_rmsnorm(*args(), **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_widest_hidden_size() -> None:
    with pytest.raises(ValueError, match="16384"):
        flashoverlap.all_reduce_rmsnorm(*args(2, 16392))


def test_valid_arguments_need_torch_distributed() -> None:
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        flashoverlap.all_reduce_rmsnorm(*args())


def test_partial_lies_in_this_ranks_x_area_and_needs_room() -> None:
    """Where backend='peer' stores a rank's partial: its own buffer's x area (after the header and
    the out and residual areas of the pull layout), refused where the buffers are too small."""
    from flashoverlap import _core

    rows, hidden = 100, 64
    need = _core.allreduce_rmsnorm_buffer_bytes(2, rows, hidden, "bfloat16", pull=True)
    area = rows * hidden * 2
    bases = [1 << 40, 2 << 40]
    assert _core.allreduce_rmsnorm_partial((bases, need, 1, 0), rows, hidden, "bfloat16") == bases[1] + need - area
    with pytest.raises(ValueError, match="peer buffers"):
        _core.allreduce_rmsnorm_partial((bases, need, 1, 0), rows + 1, hidden, "bfloat16")
    with pytest.raises(ValueError, match="rank"):
        _core.allreduce_rmsnorm_partial((bases, need, 2, 0), rows, hidden, "bfloat16")
