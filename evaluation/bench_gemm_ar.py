"""GEMM + AllReduce on all local GPUs against its baselines, measured in the same run.

For each shape: cuBLAS GEMM alone, flashoverlap's GEMM alone, NCCL AllReduce of
the output alone, sequential cuBLAS + NCCL, and flashoverlap.gemm_all_reduce
(mode "auto": overlapped where the predictor says it wins, else cuBLAS then
NCCL), forced overlap for the mechanism itself, and the independent-concurrency
reference (cuBLAS and an NCCL AllReduce of an unrelated buffer launched
together on two streams). Writes a CSV and a JSON of the environment under
evaluation/results/.

    python evaluation/bench_gemm_ar.py                 # the 16 shapes of the issue
    python evaluation/bench_gemm_ar.py --shapes 4096x8192x4096
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from flashoverlap import bench
from flashoverlap.cli import _shape

SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024), (8192, 3584))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="*", default=SHAPES)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=None, help="CSV path (default: evaluation/results/bench_gemm_ar_<gpu>x<world>.csv)")
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        print(f"this benchmark needs >= 2 GPUs, found {world}", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"bench_gemm_ar_{gpu}x{world}_{args.dtype}.csv")
    bench.run(args.shapes, dtype=args.dtype, iters=args.iters, warmup=args.warmup, csv_path=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
