"""FlashOverlap's E1 speedup table for every primitive and world size, from the benchmark
CSVs under evaluation/results/ (each measured with its baselines in the same run):

  AllReduce          bench_gemm_ar_<gpu>x<world>_<dtype>.csv        (python evaluation/bench_gemm_ar.py)
  ReduceScatter      bench_gemm_rs_<gpu>x<world>_<dtype>.csv        (python evaluation/bench_gemm_rs.py)
  All-to-All         bench_gemm_a2a_<gpu>x<world>_<dtype>.csv       (python evaluation/bench_gemm_a2a.py)
  AllReduce+RMSNorm  bench_gemm_ar_rmsnorm_<gpu>x<world>_<dtype>.csv (python evaluation/bench_gemm_ar_rmsnorm.py)

For each primitive, world size and baseline: the geometric mean, and the min-max, over shapes
of baseline time / flashoverlap time (>1: flashoverlap faster). No measurement is made here;
a primitive without a CSV is listed as not measured.

    python evaluation/e1_speedup.py [--results evaluation/results] [--out evaluation/results/e1_speedup.txt]
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import re
import statistics
import sys

# Per primitive: the CSV prefix, and (baseline label, speedup column) pairs.
PRIMITIVES = [
    ("AllReduce", "bench_gemm_ar", [("flashoverlap vs sequential cuBLAS + NCCL", "speedup"),
                                    ("flashoverlap (NCCL backend) vs sequential", "speedup_nccl"),
                                    ("flashoverlap (copy engines) vs sequential", "speedup_ce"),
                                    ("flashoverlap (push, 2 Hopper ranks) vs sequential", "speedup_push"),
                                    ("reference: cuBLAS || unrelated NCCL vs sequential", "concurrent_speedup")]),
    ("ReduceScatter", "bench_gemm_rs", [("flashoverlap vs sequential cuBLAS + NCCL", "fo_vs_seq"),
                                        ("flashoverlap (NCCL backend) vs sequential", "fo_nccl_vs_seq"),
                                        ("flashoverlap (copy engines) vs sequential", "fo_ce_vs_seq"),
                                        ("forced overlap (copy engines) vs sequential", "forced_ce_vs_seq"),
                                        ("flashoverlap (push, 2 Hopper ranks) vs sequential", "fo_push_vs_seq"),
                                        ("flashoverlap (push) vs torch Async-TP", "fo_push_vs_async_tp"),
                                        ("flashoverlap vs decomposition", "fo_vs_decomp"),
                                        ("flashoverlap vs torch Async-TP", "fo_vs_async_tp"),
                                        ("reference: cuBLAS || unrelated NCCL vs sequential", "concurrent_vs_seq")]),
    ("All-to-All", "bench_gemm_a2a", [("flashoverlap vs sequential cuBLAS + NCCL all_to_all_single", "fo_vs_seq"),
                                      ("flashoverlap (NCCL backend) vs sequential", "fo_nccl_vs_seq"),
                                      ("flashoverlap (copy engines) vs sequential", "fo_ce_vs_seq"),
                                      ("flashoverlap (push, 2 Hopper ranks) vs sequential", "fo_push_vs_seq"),
                                      ("forced overlap (push, 4 groups) vs sequential", "forced_push_vs_seq"),
                                      ("flashoverlap vs decomposition", "fo_vs_decomp")]),
    ("AllReduce+RMSNorm", "bench_gemm_ar_rmsnorm", [
        ("flashoverlap vs sequential cuBLAS + NCCL + torch add-RMSNorm", "fo_vs_seq"),
        ("flashoverlap vs sequential cuBLAS + NCCL + one-kernel add-RMSNorm", "fo_vs_seq_fused"),
        ("flashoverlap (NCCL backend) vs sequential + torch add-RMSNorm", "fo_nccl_vs_seq"),
        ("flashoverlap (peer backend) vs sequential + torch add-RMSNorm", "fo_peer_vs_seq"),
        ("flashoverlap (peer backend) vs sequential + one-kernel add-RMSNorm", "fo_peer_vs_seq_fused"),
        ("flashoverlap (push backend) vs sequential + one-kernel add-RMSNorm", "fo_push_vs_seq_fused")]),
]

NAME = re.compile(r"^(?P<prefix>.+)_(?P<gpu>[^_]+)x(?P<world>\d+)_(?P<dtype>[a-z0-9]+)\.csv$")


def summarize(values: list[float]) -> str:
    values = [v for v in values if v > 0 and v != float("inf")]
    if not values:
        return "not measured"
    return (f"{statistics.geometric_mean(values):.3f}x  (min {min(values):.3f}x, max {max(values):.3f}x, "
            f"{len(values)} shapes)")


def tables(results: str) -> list[str]:
    lines = []
    for primitive, prefix, baselines in PRIMITIVES:
        found = []
        for path in sorted(glob.glob(os.path.join(results, f"{prefix}_*.csv"))):
            match = NAME.match(os.path.basename(path))
            # bench_gemm_ar_* also matches bench_gemm_ar_rmsnorm_*: keep exact prefixes only.
            if match and match["prefix"] == prefix:
                found.append((int(match["world"]), match["gpu"], match["dtype"], path))
        lines.append(f"{primitive}:")
        if not found:
            lines.append("  not measured (no CSV)")
        for world, gpu, dtype, path in sorted(found):
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            lines.append(f"  {world} x {gpu}, {dtype}, {os.path.basename(path)}:")
            for label, column in baselines:
                values = [float(r[column]) for r in rows if r.get(column) not in (None, "")]
                lines.append(f"    {label:<68} {summarize(values)}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = ["# E1: speedup of flashoverlap over each baseline (baseline time / flashoverlap time), geometric "
             "mean and min-max over shapes, from the CSVs under " + os.path.relpath(args.results)] + tables(args.results)
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
