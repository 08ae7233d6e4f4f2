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


def _plan(args: argparse.Namespace):
    """The plan the `plan` and `show` arguments describe."""
    import torch

    import flashoverlap

    m, n, k = args.shape
    return flashoverlap.plan_gemm_all_reduce(m, n, k, args.world_size, dtype=getattr(torch, args.dtype), sms=args.sms,
                                             mode=args.mode, bands_per_group=args.bands_per_group,
                                             backend=args.backend, order=args.order, fused_norm=args.fused_norm)


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--sms", type=int, default=132, help="multiprocessors of the GPU (default: H200's 132)")
    p.add_argument("--mode", default="auto", choices=["auto", "overlap", "sequential"])
    p.add_argument("--bands-per-group", type=int, default=None)
    p.add_argument("--backend", default="nccl", choices=["nccl", "copy_engine", "push", "auto"],
                   help="push: 2 ranks of one Hopper node (its model fitted on 2x H100 and 2x H200); auto: the fastest predicted")
    p.add_argument("--order", default="auto", choices=["auto", "banded", "swizzled"])
    p.add_argument("--fused-norm", action="store_true",
                   help="the plan of gemm_all_reduce_rmsnorm (a fused add + RMSNorm after each group)")


def cmd_plan(args: argparse.Namespace) -> int:
    print(_plan(args).describe())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from . import profiles

    used = profiles.load_for_device(args.gpu, args.sms, args.nccl) if args.gpu else []
    plan = _plan(args)
    print(plan.describe())
    print("profile: " + (", ".join(str(p) for p in used) if used else
                         "none (built-in constants; `flashoverlap tune` measures this machine)"))
    if args.plot:
        plot_timeline(plan, args.plot)
        print(f"timeline drawn to {args.plot}")
    return 0


def plot_timeline(plan, path: str) -> None:
    """The predicted timeline: the GEMM, each group's collective, and the sequential baseline."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(10, 2.8))
    groups = plan.groups
    if plan.schedule == "overlap":
        ends = [g["gemm_done_us"] for g in groups]
        ax.barh(2, max(ends), color="#4c72b0", label="GEMM (signaling)")
        for i, g in enumerate(groups):
            ax.barh(1, g["comm_end_us"] - g["comm_start_us"], left=g["comm_start_us"],
                    color=("#dd8452", "#c44e52")[i % 2], edgecolor="white")
            ax.axvline(g["gemm_done_us"], color="grey", lw=0.5, ls=":")
    else:
        ax.barh(2, plan.predicted_overlap_us, color="#4c72b0", label="(sequential plan)")
    ax.barh(0, plan.predicted_sequential_us, color="#8c8c8c", label="sequential GEMM + collective")
    ax.set_yticks([0, 1, 2], ["sequential", "collectives", "GEMM"])
    ax.set_xlabel("predicted time (us)")
    m, n, k = plan.shape
    ax.set_title(f"{m}x{n}x{k}, {plan.world_size} ranks: {plan.schedule}, {len(groups)} group(s), "
                 f"{plan.predicted_us:.0f} us vs {plan.predicted_sequential_us:.0f} us sequential")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_tune(args: argparse.Namespace) -> int:
    from . import tune

    if args.preset:
        world, shapes = tune.preset_shapes(args.preset)
        if args.world_size is not None and args.world_size != world:
            raise SystemExit(f"--world-size {args.world_size} contradicts --preset {args.preset} (TP={world})")
    else:
        world, shapes = args.world_size or 1, args.shapes or [(4096, 8192, 4096)]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(ops) - {"all_reduce", "reduce_scatter", "all_to_all", "gemm"}
    if unknown:
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; expected all_reduce, reduce_scatter, all_to_all, gemm")
    path, profile = tune.tune(shapes, world, ops, args.dtype, args.iters, args.out, args.fresh)
    print(tune.summary(profile))
    print(f"written to {path}")
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


def _int_list(text: str) -> list:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_compile(args: argparse.Namespace) -> int:
    import flashoverlap

    for arch in args.arch.split(","):
        try:
            built = flashoverlap.compile_kernels(arch, args.hidden)
        except ValueError as e:
            print(f"flashoverlap compile: {e}", file=sys.stderr)
            return 2
        for kernel, defines, size in built:
            print(f"{arch:8} {kernel:40} {defines:12} {size:8d} bytes")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flashoverlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("plan", help="show the plan for a shape (no GPU needed)")
    p.add_argument("shape", type=_shape, nargs="?", default=(4096, 8192, 4096), help="MxNxK (default 4096x8192x4096)")
    _add_plan_arguments(p)
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("show", help="the plan for a shape and its predicted timeline, from a GPU's profile if one exists")
    s.add_argument("shape", type=_shape, help="MxNxK")
    _add_plan_arguments(s)
    s.add_argument("--gpu", default="NVIDIA H200", help="GPU model whose profiles to use ('' for none)")
    s.add_argument("--nccl", default=None, help="NCCL version of the collective curves to use (default: the "
                   "version loaded in this process, if any)")
    s.add_argument("--plot", default=None, help="also draw the timeline to this PNG (needs matplotlib)")
    s.set_defaults(func=cmd_show)

    t = sub.add_parser("tune", help="measure this machine's profile (collective curves, GEMM times) into the cache")
    t.add_argument("--world-size", type=int, default=None, help="ranks (one per GPU; collectives need >= 2)")
    t.add_argument("--ops", default="all_reduce,reduce_scatter,all_to_all,gemm", help="comma-separated: "
                   "all_reduce, reduce_scatter, all_to_all, gemm")
    t.add_argument("--shapes", type=_shape, nargs="*", default=None, help="MxNxK of the GEMMs to time")
    t.add_argument("--preset", default=None, help="a model's shapes and TP size, e.g. llama-3-70b-tp2")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    t.add_argument("--iters", type=int, default=20)
    t.add_argument("--out", default=None, help="profile file (default: the cache dir's file for this machine)")
    t.add_argument("--fresh", action="store_true", help="start over instead of resuming an interrupted run")
    t.set_defaults(func=cmd_tune)

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
    c.add_argument("--hidden", default=None, type=_int_list,
                   help="hidden sizes to build all_reduce_rmsnorm's hidden-size kernels for, e.g. 4096,8192 "
                        "(default 8192,8200)")
    c.set_defaults(func=cmd_compile)

    args = parser.parse_args(argv)
    if args.command in ("plan", "show"):
        try:
            return args.func(args)
        except (ValueError, TypeError) as e:  # a plan's arguments the planner refuses, named
            parser.error(f"{args.command}: {e}")
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
