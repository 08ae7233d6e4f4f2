"""The fused add + RMSNorm kernel alone on one GPU (the norm that follows each wave group's
AllReduce in gemm_all_reduce_rmsnorm) against the fp32 composition, over CTA counts that
leave rows per warp uneven and rows whose width is not a multiple of a lane step."""

from __future__ import annotations

import pytest
import torch

from flashoverlap import _core

pytestmark = pytest.mark.gpus(1)

CASES = [
    # rows, n, ctas, dtype
    (1, 8, 1, torch.bfloat16),
    (17, 8, 3, torch.float16),
    (300, 2056, 1, torch.bfloat16),
    (1000, 4096, 4, torch.float16),
    (4097, 8192, 16, torch.bfloat16),
    (513, 16384, 132, torch.bfloat16),
    (2048, 1032, 24, torch.float16),
    (65, 520, 200, torch.bfloat16),
]


@pytest.mark.parametrize("rows,n,ctas,dtype", CASES)
def test_matches_fp32_composition(rows: int, n: int, ctas: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * 7919 + n)
    x = torch.randn(rows, n, device="cuda", dtype=dtype, generator=gen)
    residual = torch.randn(rows, n, device="cuda", dtype=dtype, generator=gen)
    weight = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(dtype)
    eps = 1e-6
    # The sum is rounded to the dtype before the statistics, as vLLM's kernel does.
    r_ref = (x.float() + residual.float()).to(dtype)
    rf = r_ref.float()
    out_ref = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    residual_out = torch.full_like(x, float("nan"))
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    _core.add_rmsnorm(x.data_ptr(), residual.data_ptr(), residual_out.data_ptr(), weight.data_ptr(), rows, n, eps,
                      name, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream, ctas)
    torch.cuda.synchronize()
    assert torch.equal(residual_out, r_ref)
    # Per row, so that one skipped or doubly-normalized row fails the test.
    row_err = (x.float() - out_ref).norm(dim=-1) / out_ref.norm(dim=-1)
    assert float(row_err.max()) <= 1e-2, row_err.max()
