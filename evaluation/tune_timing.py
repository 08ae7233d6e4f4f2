"""How `flashoverlap tune` should time a GEMM so that its profile predicts the GEMM inside an op.

The same kernels (cuBLAS, and flashoverlap.gemm with each tile width on 108 CTAs, as the NCCL
overlap leaves it) timed four ways on one GPU, each with CUDA events, median of 30 calls after 3
of warm-up, inputs rotated over buffers larger than L2:

  sync     every call synchronized before the next starts (what tune did first);
  sleep1   a ~1 ms GPU sleep enqueued before every call, no synchronization (the call waits in
           the queue, as an op's launches do; tune times collectives so);
  burst    one sleep, then every call queued back to back;
  settled  GPU load (bench.keep_busy) for bench.SETTLE_S first, then the timed calls back to back
           (the steady state of a loaded GPU);
  tune     tune's timing: bench.interleaved_times_us of the variant alone (SETTLE_S of GPU load
           first, then each call queued behind 1-20 ms of load);
  mixed    bench.interleaved_times_us over the three variants (what the benchmarks do).

Then the ramp: 400 calls of one GEMM back to back after 0.5 s idle, each call's time (a loaded
GPU slows down after some tens of milliseconds: power, not heat).

    python evaluation/tune_timing.py [--out evaluation/results/tune_timing_h200.txt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import flashoverlap
from flashoverlap import bench, tune

SHAPES = [(16384, 8192, 4096), (8192, 8192, 1024), (8192, 8192, 3584), (4096, 8192, 14336), (2048, 8192, 1024)]
MODES = ("sync", "sleep1", "burst", "settled", "tune")


def timed(fn, iters: int, mode: str) -> float:
    if mode == "tune":
        return tune._median_us(fn, iters)
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    if mode == "settled":
        bench.keep_busy(bench.load_calls(bench.SETTLE_S)[0])
        return statistics.median(bench.call_times_us(fn, iters))
    if mode == "burst":
        torch.cuda._sleep(4_000_000)
    return statistics.median(bench.call_times_us(fn, iters, sleep_cycles=2_000_000 if mode == "sleep1" else 0,
                                                 sync=mode == "sync"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    lines = [f"GPU: {torch.cuda.get_device_name()}; median us of {args.iters} calls; kernel@CTAs",
             f"{'M x N x K':>16} {'variant':9} " + " ".join(f"{m:>8}" for m in (*MODES, "mixed")) + "  mixed/tune"]
    print("\n".join(lines), flush=True)
    for m, n, k in SHAPES:
        sets = bench.input_sets((m * k + n * k) * 2)
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(sets)]
        fns = {"cublas": lambda i: torch.matmul(xs[i % sets], ws[i % sets].t()),
               "n128@108": lambda i: flashoverlap.gemm(xs[i % sets], ws[i % sets], kernel="sm90_n128", sms=108),
               "n256@108": lambda i: flashoverlap.gemm(xs[i % sets], ws[i % sets], kernel="sm90_n256", sms=108)}
        res = {name: {mode: timed(f, args.iters, mode) for mode in MODES} for name, f in fns.items()}
        mixed = bench.interleaved_times_us(fns, args.iters, 3)
        for name, r in res.items():
            r["mixed"] = statistics.median(mixed[name])
            line = (f"{f'{m}x{n}x{k}':>16} {name:9} " + " ".join(f"{v:8.1f}" for v in r.values())
                    + f"  {r['mixed'] / r['tune']:.3f}x")
            lines.append(line)
            print(line, flush=True)
    lines.append("ramp: call index @ GPU time since the first call: that call's us")
    for m, n, k in SHAPES[:1]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        for name, fn in (("cublas", lambda: torch.matmul(x, w.t())),
                         ("n128@108", lambda: flashoverlap.gemm(x, w, kernel="sm90_n128", sms=108))):
            fn()
            torch.cuda.synchronize()
            time.sleep(0.5)
            torch.cuda._sleep(20_000_000)
            us = bench.call_times_us(lambda i: fn(), 400)
            at = [sum(us[:i + 1]) / 1e3 for i in range(len(us))]
            marks = " ".join(f"#{i}@{at[i]:.0f}ms:{us[i]:.0f}" for i in (0, 10, 20, 50, 100, 200, 399))
            lines.append(f"{f'{m}x{n}x{k}':>16} {name:9} {marks}; median of the first 20 "
                         f"{statistics.median(us[:20]):.0f}, of the last 100 {statistics.median(us[-100:]):.0f}")
            print(lines[-1], flush=True)
    if args.out:
        bench.write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
