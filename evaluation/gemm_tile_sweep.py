"""Every Hopper tile width x raster height of flashoverlap's GEMM against cuBLAS on one GPU, bf16,
over the 17 shapes of bench_gemm.py: the data behind plan/'s default tile width (HOPPER_TILE_N).
Same method as bench_gemm.py (interleaved with cuBLAS, rotated random operands, CUDA events,
median of --iters runs); TFLOP/s per configuration, then each one's geometric mean and minimum of
cuBLAS time / its time.

    python evaluation/gemm_tile_sweep.py [--iters 20] [--out evaluation/results/gemm_tiles_h100.txt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from flashoverlap.bench import write_lines

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemm import SHAPES, report, time_shape  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    if props.major != 9:
        print(f"{props.name} is not Hopper: the sm90 kernels do not run here", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = props.multi_processor_count
    configs = {"default": {}}
    for bn in (128, 256):
        for raster in (1, 4, 8, 16):
            configs[f"n{bn}_r{raster}"] = {"kernel": f"sm90_n{bn}", "raster": raster}
    for bn in (128, 256):
        configs[f"n{bn}_sms{sms - 16}"] = {"kernel": f"sm90_n{bn}", "sms": sms - 16}
    lines, say = report(props)
    say(f"# bf16 TFLOP/s, median of {args.iters} interleaved runs; nB_rR = sm90 kernel with B-wide tiles, raster "
        f"blocks of R bands; nB_smsS = default raster on S CTAs; default = what flashoverlap.gemm picks")
    names = ["cublas"] + list(configs)
    say("shape".ljust(17) + "".join(f"{n:>12}" for n in names))
    ratios = {n: [] for n in configs}
    for (m, n, k) in SHAPES:
        t = time_shape(m, n, k, torch.bfloat16, configs, args.iters)
        flops = 2 * m * n * k / 1e6
        for name in configs:
            ratios[name].append(t["cublas"] / t[name])
        say(f"{m}x{n}x{k}".ljust(17) + "".join(f"{flops / t[c]:12.0f}" for c in names))
    say("")
    say("cuBLAS time / time (all SMs for cuBLAS): geometric mean, minimum over the shapes")
    for name, r in ratios.items():
        say(f"  {name:<12} {statistics.geometric_mean(r):.3f}  {min(r):.3f}")
    if args.out:
        write_lines(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
