"""The fused add + RMSNorm kernel on one GPU: time and output bytes per us per CTA on 4, 8,
16, 24, 32 and all CTAs (the rate the predictor charges per group when the norm runs on the
SMs the GEMM leaves free), against the torch composition, same run, CUDA events, median.
Then the same norm on 16 and 24 CTAs *beside* flashoverlap's GEMM running on the other SMs
(an 8192^3 GEMM on a second stream, long enough to cover the norm): the rate a wave group's
norm gets while overlapping.

    python evaluation/bench_add_rmsnorm.py [--rows 1024 4096 16384] [--n 8192] [--iters 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import flashoverlap
from flashoverlap import _core
from flashoverlap.bench import interleaved_times_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="*", default=[1024, 4096, 16384])
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = torch.cuda.current_stream().cuda_stream
    eps = 1e-6
    print(f"# {torch.cuda.get_device_name(0)}; add + RMSNorm of [rows, {args.n}] bf16; median of {args.iters}")
    for rows in args.rows:
        sets = 4
        xs = [torch.randn(rows, args.n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        rs = [torch.randn(rows, args.n, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        outs = [torch.empty_like(xs[0]) for _ in range(sets)]
        w = torch.rand(args.n, device="cuda", dtype=torch.bfloat16) + 0.5

        def ours(ctas):
            return lambda i: _core.add_rmsnorm(xs[i % sets].data_ptr(), rs[i % sets].data_ptr(),
                                               outs[i % sets].data_ptr(), w.data_ptr(), rows, args.n, eps,
                                               "bfloat16", 0, stream, ctas)

        def torch_norm(i):
            r = xs[i % sets].float() + rs[i % sets].float()
            return (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)

        ctas_list = [4, 8, 16, 24, 32, sms]
        fns = {f"ours{c}": ours(c) for c in ctas_list}
        fns["torch"] = torch_norm
        t = {k: statistics.median(v) for k, v in interleaved_times_us(fns, args.iters, 3).items()}
        cells = "  ".join(f"{c}: {t[f'ours{c}']:7.1f} us {rows * args.n * 2 / t[f'ours{c}'] / c:6.0f}"
                          for c in ctas_list)
        print(f"rows {rows:6}  torch {t['torch']:7.1f} us   ours (CTAs: us, output bytes/us/CTA)  {cells}")
    beside_gemm(args.n, args.iters, stream, sms, eps)
    return 0


def beside_gemm(n: int, iters: int, stream: int, sms: int, eps: float) -> None:
    rows = 4096
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for ctas in (16, 24):
        times, gemm_times = [], []
        for i in range(iters + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g0, g1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # Both streams start from here; the norm a little after the GEMM's CTAs hold their SMs.
            side.wait_stream(torch.cuda.current_stream())
            g0.record()
            flashoverlap.gemm(a, b, sms=sms - ctas)
            g1.record()
            with torch.cuda.stream(side):
                torch.cuda._sleep(20_000)
                start.record()
                _core.add_rmsnorm(x.data_ptr(), r.data_ptr(), out.data_ptr(), w.data_ptr(), rows, n, eps, "bfloat16",
                                  0, side.cuda_stream, ctas)
                end.record()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(start.elapsed_time(end) * 1e3)
                gemm_times.append(g0.elapsed_time(g1) * 1e3)
        t, tg = statistics.median(times), statistics.median(gemm_times)
        covered = "yes" if t < tg * 0.9 else "NO (norm outlasts the GEMM: rate is not 'beside')"
        print(f"beside the GEMM on {sms - ctas} SMs: norm of [{rows}, {n}] on {ctas} CTAs {t:7.1f} us "
              f"({rows * n * 2 / t / ctas:6.0f} output bytes/us/CTA); GEMM {tg:7.1f} us; covered: {covered}")


if __name__ == "__main__":
    sys.exit(main())
