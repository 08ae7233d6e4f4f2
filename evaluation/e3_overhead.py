"""FlashOverlap's E3: what the reorderings cost, on one GPU, over the 16 shapes of the
GEMM + collective benchmarks (M in 2048..16384 x N 8192 x K in {1024, 3584, 4096, 14336}).

The library reorders in two places, and this measures both against the plain GEMM in one
interleaved loop (CUDA events, median, operands rotated past L2):

  signal      the signaling epilogue (one counter per group of 4 row bands), row-band order
  staged      the swizzled schedule's GEMM: every tile stored at its position in a staging
              buffer (pre-communication reorder in the epilogue, as the ReduceScatter and
              All-to-All layouts also do through their row tables)
  unreorder   the swizzled schedule's post-communication copy of the whole output into place,
              on the 24 SMs NCCL's share leaves (the only post-communication reordering left)

Overheads are reported as time ratios to the plain GEMM at the same SM count (108 CTAs, what
the overlapped GEMM gets beside NCCL), and the copy as a fraction of the plain GEMM's time.

    python evaluation/e3_overhead.py [--iters 30] [--out evaluation/results/e3_overhead_h200.txt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from flashoverlap import _core
from flashoverlap.bench import interleaved_times_us, write_lines

SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))]
SETS = 4
CTAS = 108
COPY_CTAS = 24


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    stream = torch.cuda.current_stream().cuda_stream
    lines = [f"# E3 overhead, {torch.cuda.get_device_name(0)}, bf16, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; "
             f"median of {args.iters} interleaved runs; GEMMs on {CTAS} CTAs, the copy on {COPY_CTAS}",
             f"{'M x N x K':>18} {'plain us':>9} {'signal':>8} {'staged':>8} {'copy us':>8} {'copy/GEMM':>9}"]
    ratios = {"signal": [], "staged": [], "copy": []}
    for m, n, k in SHAPES:
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
        outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
        tiles = -(-m // 128) * -(-n // 128)
        stagings = [torch.empty(tiles * 128 * 128 + 128 * 256, device="cuda", dtype=torch.bfloat16)
                    for _ in range(SETS)]

        def gemm(raster=None, signal=None, staged=False):
            def run(i):
                staging = stagings[i % SETS].data_ptr() if staged else 0
                _core.gemm(xs[i % SETS].data_ptr(), ws[i % SETS].data_ptr(), outs[i % SETS].data_ptr(), m, n, k,
                           "bfloat16", 0, stream, None, raster, CTAS, signal, staging)
            return run

        def copy(i):
            _core.unreorder(outs[i % SETS].data_ptr(), stagings[i % SETS].data_ptr(), m, n, "bfloat16", 0, stream,
                            COPY_CTAS, None, None, CTAS)

        fns = {"plain": gemm(), "plain_r1": gemm(raster=1), "signal": gemm(raster=1, signal=4),
               "staged": gemm(staged=True), "copy": copy}
        t = {name: statistics.median(v) for name, v in interleaved_times_us(fns, args.iters, SETS).items()}
        r = {"signal": t["signal"] / t["plain_r1"], "staged": t["staged"] / t["plain"], "copy": t["copy"] / t["plain"]}
        for key in ratios:
            ratios[key].append(r[key])
        lines.append(f"{m:>6}x{n}x{k:<5} {t['plain']:9.1f} {r['signal']:7.3f}x {r['staged']:7.3f}x "
                     f"{t['copy']:8.1f} {r['copy']:8.1%}")
    lines.append(f"geometric means: signaling {statistics.geometric_mean(ratios['signal']):.3f}x, staged stores "
                 f"{statistics.geometric_mean(ratios['staged']):.3f}x the plain GEMM; the un-reorder copy "
                 f"{statistics.mean(ratios['copy']):.1%} of the GEMM's time on average (hidden behind the GEMM "
                 "for every group but the last when it overlaps)")
    print("\n".join(lines))
    if args.out:
        write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
