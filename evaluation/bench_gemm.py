"""flashoverlap's GEMM kernel alone (no signals, all SMs) against cuBLAS, one GPU.

For one kernel variant: relative error against fp32 on shapes with tails (both
dtypes, output memory poisoned with NaN first), then TFLOP/s of the kernel and
of torch.matmul (cuBLAS) measured in the same run on random bf16 data, inputs
rotated over three buffers, median of 20 CUDA-event-timed runs.

    python evaluation/bench_gemm.py sm90_n256
    python evaluation/bench_gemm.py sm80
"""

from __future__ import annotations

import statistics
import sys

import torch

import flashoverlap

CHECK_SHAPES = [(128, 128, 64), (1, 8, 8), (77, 1024, 1024), (1000, 4096, 1024), (3000, 136, 4104),
                (4096, 8192, 4096), (300, 264, 72)]
SPEED_SHAPES = [(2048, 8192, 4096), (4096, 8192, 4096), (8192, 8192, 8192), (4096, 8192, 14336),
                (16384, 8192, 1024), (8192, 8192, 3584)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def median_us(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000


def main(variant: str) -> int:
    torch.backends.cuda.matmul.allow_tf32 = False
    correct = True
    for dt in (torch.bfloat16, torch.float16):
        for (m, n, k) in CHECK_SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            w = torch.randn(n, k, device="cuda", dtype=dt)
            torch.empty(m * n + 1024, device="cuda", dtype=dt).fill_(float("nan"))
            out = flashoverlap.gemm(x, w, kernel=variant)
            torch.cuda.synchronize()
            e, nan = rel(out, x.float() @ w.float().T), bool(out.isnan().any())
            correct &= e < 1e-2 and not nan
            print(f"{variant} {str(dt)[6:]} {m}x{n}x{k} err {e:.1e} nan {nan}", flush=True)
    ratios = []
    for (m, n, k) in SPEED_SHAPES:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        turn = [0]

        def operands():
            turn[0] = (turn[0] + 1) % 3
            return xs[turn[0]], ws[turn[0]]

        def cublas():
            x, w = operands()
            return torch.matmul(x, w.t())

        def ours():
            x, w = operands()
            return flashoverlap.gemm(x, w, kernel=variant)

        tc, to = median_us(cublas), median_us(ours)
        flops = 2 * m * n * k / 1e6
        ratios.append(tc / to)
        print(f"{variant} {m}x{n}x{k}: cublas {flops / tc:.0f} TF, ours {flops / to:.0f} TF, ratio {tc / to:.3f}",
              flush=True)
    print(f"{variant} geomean ratio {statistics.geometric_mean(ratios):.3f} correct={correct}")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "sm90_n256"))
