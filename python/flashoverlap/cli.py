"""`flashoverlap` / `python -m flashoverlap`: the main job.

With >= 2 GPUs, benchmarks the overlapped GEMM + AllReduce on all local GPUs
against the sequential baseline; without, shows the plan for a default shape
(tiles, waves, wave groups and the predicted timeline).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK (e.g. 4096x8192x4096), got {text!r}") from None
    return m, n, k


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    import flashoverlap

    m, n, k = args.shape
    plan = flashoverlap.plan_gemm_all_reduce(m, n, k, args.world_size, dtype=getattr(torch, args.dtype), sms=args.sms,
                                             mode=args.mode, bands_per_group=args.bands_per_group,
                                             backend=args.backend, order=args.order)
    print(plan.describe())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    bench.run(args.shapes or bench.DEFAULT_SHAPES, dtype=args.dtype, iters=args.iters, warmup=args.warmup,
              world_size=args.world_size, csv_path=args.csv)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    import flashoverlap
    from flashoverlap import _core, _nvrtc

    print(f"flashoverlap {flashoverlap.__version__}, torch {torch.__version__}")
    print(f"GPUs: {_gpu_count()}")
    print(f"cubin cache: {_core.cache_dir()}")
    try:
        path = _nvrtc.ensure_loaded()
        print(f"NVRTC {'.'.join(map(str, _core.nvrtc_version()))}: {path}")
    except RuntimeError as e:
        print(f"NVRTC: {e}")
    print(f"NCCL: {_core.nccl_path() or 'not loaded in this process'}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    import flashoverlap

    for arch in args.arch.split(","):
        for kernel, defines, size in flashoverlap.compile_kernels(arch):
            print(f"{arch:8} {kernel:40} {defines:12} {size:8d} bytes")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flashoverlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("plan", help="show the plan for a shape (no GPU needed)")
    p.add_argument("shape", type=_shape, nargs="?", default=(4096, 8192, 4096), help="MxNxK (default 4096x8192x4096)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sms", type=int, default=132, help="multiprocessors of the GPU (default: H200's 132)")
    p.add_argument("--mode", default="auto", choices=["auto", "overlap", "sequential"])
    p.add_argument("--bands-per-group", type=int, default=None)
    p.add_argument("--backend", default="nccl", choices=["nccl", "copy_engine", "auto"])
    p.add_argument("--order", default="auto", choices=["auto", "banded", "swizzled"])
    p.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="GEMM + AllReduce vs sequential cuBLAS + NCCL on all local GPUs")
    b.add_argument("--shapes", type=_shape, nargs="*", default=None, help="MxNxK ...")
    b.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    b.add_argument("--iters", type=int, default=30)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--world-size", type=int, default=None)
    b.add_argument("--csv", default=None, help="write rows here (and metadata beside it as .json)")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="versions, NVRTC, NCCL and cache locations")
    i.set_defaults(func=cmd_info)

    c = sub.add_parser("compile", help="compile every kernel with NVRTC for the given archs (no GPU needed)")
    c.add_argument("--arch", default="sm_80,sm_90a")
    c.set_defaults(func=cmd_compile)

    args = parser.parse_args(argv)
    if args.command is None:
        # The main job: a benchmark where there are GPUs to run it, else the plan.
        if _gpu_count() >= 2:
            return cmd_bench(parser.parse_args(["bench"]))
        print(f"{_gpu_count()} GPU(s) here: the benchmark needs >= 2. "
              "Showing the plan for the default shape on 2 x H200 instead.\n")
        return cmd_plan(parser.parse_args(["plan"]))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
