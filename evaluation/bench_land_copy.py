"""Local device-to-device copies beside a GEMM: what the push All-to-All's landings cost.

With backend="push" a rank's GEMM stores the rows for its peer straight into the peer's staging
slot over NVLink; the receiver then copies each group's rows from its slot into its output
(cudaMemcpyAsync, device to device, on the reduce stream) while its own GEMM is still running.
This times those copies on one GPU (they never leave it): alone, and back to back on a
high-priority stream beside a cuBLAS GEMM on another stream, with the GEMM's slowdown. GB/s counts
the bytes read and written (twice the size). Median of --iters runs after a warm-up of every
variant; buffers rotate over 4 sets.

    python evaluation/bench_land_copy.py [--iters 30] [--sizes 4 16 64] [--out PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from flashoverlap import bench


def timed(fn, stream: torch.cuda.Stream, iters: int) -> float:
    """Median time (us) of fn(i) on `stream`, one call per measurement."""
    ts = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            s.record()
            fn(i)
            e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1000)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64], help="MiB per copy")
    ap.add_argument("--out", default=None, help="also write the table to PATH.txt")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16, generator=gen)
    gemm_stream, copy_stream = torch.cuda.Stream(priority=0), torch.cuda.Stream(priority=-1)
    meta = bench.environment(1)
    lines = [f"# local D2D copies beside a GEMM, {meta['gpu']}, {meta['date']}; command: {meta['command']}",
             "# GEMM 8192x8192x4096 bf16 (cuBLAS) on one stream; copies (Tensor.copy_, cudaMemcpyAsync) on a "
             "high-priority other stream; us, medians; GB/s = read + write bytes",
             f"{'MiB':>5} {'copy':>8} {'GB/s':>6} {'gemm':>8} {'copies':>6} {'gemm beside':>11} {'slowdown':>8} "
             f"{'copy beside':>11} {'GB/s':>6}"]
    gemm = lambda i: torch.matmul(a, b.t())  # noqa: E731
    for mib in args.sizes:
        n = mib << 19  # bf16 elements
        src = [torch.randn(n, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4)]
        dst = [torch.empty_like(s) for s in src]
        copy = lambda i: dst[i % 4].copy_(src[i % 4])  # noqa: E731
        for _ in range(5):  # warm-up: clocks, cuBLAS heuristics, the copy path
            timed(copy, copy_stream, 3)
            timed(gemm, gemm_stream, 3)
        copy_us, gemm_us = timed(copy, copy_stream, args.iters), timed(gemm, gemm_stream, args.iters)
        reps = max(1, int(gemm_us // copy_us))  # as many copies as fit in one GEMM
        beside_gemm, beside_copy = [], []
        for i in range(args.iters + 3):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            torch.cuda.synchronize()
            with torch.cuda.stream(gemm_stream):
                ev[0].record()
                gemm(i)
                ev[1].record()
            with torch.cuda.stream(copy_stream):
                ev[2].record()
                for r in range(reps):
                    copy(r)
                ev[3].record()
            torch.cuda.synchronize()
            if i >= 3:
                beside_gemm.append(ev[0].elapsed_time(ev[1]) * 1000)
                beside_copy.append(ev[2].elapsed_time(ev[3]) * 1000 / reps)
        g, c = statistics.median(beside_gemm), statistics.median(beside_copy)
        rate = lambda us: 2 * (mib << 20) / us / 1e3  # noqa: E731
        lines.append(f"{mib:>5} {copy_us:8.1f} {rate(copy_us):6.0f} {gemm_us:8.1f} {reps:>6} {g:11.1f} "
                     f"{g / gemm_us:7.3f}x {c:11.1f} {rate(c):6.0f}")
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".txt", "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
