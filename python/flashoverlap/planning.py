"""Plans without a GPU: what an op would do for a shape on a given device."""

from __future__ import annotations

from typing import Optional

import torch

from . import _core, _env
from ._validation import dtype_name


def plan_gemm_all_reduce(m: int, n: int, k: int, world_size: int, *, dtype: torch.dtype = torch.bfloat16,
                         sms: int = 132, compute_capability: tuple[int, int] = (9, 0), mode: str = "auto",
                         bands_per_group: Optional[int] = None, reserved_sms: Optional[int] = None,
                         max_groups: Optional[int] = None) -> "_core.Plan":
    """The GEMM + AllReduce plan for out[m, n] = x[m, k] @ w[n, k]^T over ``world_size`` GPUs with
    ``sms`` multiprocessors (default: an H200). Needs no GPU."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
    return _core.plan_gemm_all_reduce(
        m, n, k, world_size, dtype_name(dtype), sms, compute_capability[0], mode, bands_per_group,
        _env.reserved_sms() if reserved_sms is None else reserved_sms,
        _env.max_groups() if max_groups is None else max_groups)
