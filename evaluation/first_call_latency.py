"""What the first call of a new shape costs on top of a repeated call (planning: the predictor's
search, tables uploaded; every kernel already compiled and loaded), for gemm_all_reduce on every
local GPU (world size 1 is allowed: it plans and enqueues the same way). Host wall time of the
call plus a synchronize, median over the shapes, with the repeated call's time subtracted.

    python evaluation/first_call_latency.py [--world-size W]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from flashoverlap import bench

SHAPES = [(m, 8192, k) for m in (2048, 3072, 4096, 6144, 8192, 12288) for k in (1024, 3584, 4096)]


def _worker(rank, world, init_method, result_path):
    import json

    import torch.distributed as dist

    import flashoverlap
    from flashoverlap import profiles

    bench.init_worker(rank, world, init_method)
    try:
        def call(m, n, k):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            flashoverlap.gemm_all_reduce(x, w)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3

        # Every kernel variant compiled into the cubin cache first (the bar's "kernel already
        # compiled": a plan may pick a variant the warm-up shapes below do not use, whose NVRTC
        # compile took 238 ms on a fresh 2x H200 machine), rank 0 first so the ranks do not both
        # compile; then the common kernels loaded, on shapes not measured.
        major, minor = torch.cuda.get_device_capability()
        if rank == 0:
            flashoverlap.compile_kernels(f"sm_{major}{minor}{'a' if major == 9 else ''}")
        dist.barrier()
        flashoverlap.compile_kernels(f"sm_{major}{minor}{'a' if major == 9 else ''}")
        for m, n, k in [(1024, 8192, 1024), (1024, 8192, 4096), (20000, 8192, 1024)]:
            call(m, n, k)
        rows = []
        for shape in SHAPES:
            first, again = call(*shape), call(*shape)
            rows.append((shape, first, again))
        if rank == 0:
            used = [str(p) for p in profiles.load_for_current_device()] or sorted(
                str(p) for p in profiles.candidates())
            with open(result_path, "w") as f:
                json.dump({"rows": rows, "profiles": used, "meta": bench.environment(world)}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None)
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    os.environ.update(bench.SAFE_ENV)
    data = bench.spawn_ranks(_worker, world)
    print(f"# first call of a new shape vs a repeated call, gemm_all_reduce, {world} x {data['meta']['gpu']}, "
          f"{data['meta']['date']}; profiles on disk: {data['profiles'] or 'none'}")
    extra = []
    for (m, n, k), first, again in data["rows"]:
        extra.append(first - again)
        print(f"{m:>6}x{n}x{k:<5} first {first:8.2f} ms  again {again:8.2f} ms  added {first - again:7.2f} ms")
    print(f"added by the first call: median {statistics.median(extra):.2f} ms, max {max(extra):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
