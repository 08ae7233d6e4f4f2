"""A quick A/B of the copy engines' gemm_all_reduce: cuBLAS then NCCL against backend="copy_engine"
(mode auto; --forced adds mode "overlap") on the 16 shapes, interleaved in one steady-state run
(flashoverlap.bench.interleaved_times_us), one line per shape and the geometric mean. Planning reads
the environment once per process, so each setting under test is a run of its own:

    python evaluation/ab_gemm_ar_ce.py [--iters 30] [--forced]
    FLASHOVERLAP_CE_SUMS_QUEUE=own python evaluation/ab_gemm_ar_ce.py

Needs 2 GPUs. Times: medians, max over ranks; err: the copy-engine call's relative error against
fp32. The full table with every backend and baseline is bench_gemm_ar.py's; this one is for
comparing settings of the copy engines quickly (~15 s a run on 2x H200).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from flashoverlap import bench

SHAPES = [(m, 8192, k) for m in (2048, 4096, 8192, 16384) for k in (4096, 14336, 1024, 3584)]


def one_shape(m: int, n: int, k: int, rank: int, iters: int, forced: bool) -> dict:
    """Per-variant median times (us) on this rank, and the copy-engine call's error."""
    import torch.distributed as dist

    import flashoverlap

    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    sets = bench.input_sets((m * k + n * k) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5 for _ in range(sets)]

    def seq(i: int) -> torch.Tensor:
        out = torch.matmul(xs[i % sets], ws[i % sets].t())
        dist.all_reduce(out)
        return out

    def ce(mode: str):
        return lambda i: flashoverlap.gemm_all_reduce(xs[i % sets], ws[i % sets], backend="copy_engine", mode=mode)

    ref = xs[0].float() @ ws[0].float().t()
    dist.all_reduce(ref)
    err = float((ce("auto")(0).float() - ref).norm() / ref.norm())
    variants = {"seq": seq, "ce": ce("auto"), **({"forced": ce("overlap")} if forced else {})}
    dist.barrier()
    times = bench.interleaved_times_us(variants, iters, 10)
    return {"err": err, **{name: statistics.median(t) for name, t in times.items()}}


def worker(rank: int, world: int, init: str, iters: int, forced: bool, result: str) -> None:
    bench.init_worker(rank, world, init)
    import torch.distributed as dist

    import flashoverlap

    rows = []
    for m, n, k in SHAPES:
        mine = one_shape(m, n, k, rank, iters, forced)
        every = [None] * world
        dist.all_gather_object(every, mine)
        row = {key: max(r[key] for r in every) for key in mine}
        rows.append({"shape": f"{m}x{n}x{k}", **row, "speedup": row["seq"] / row["ce"]})
        if rank == 0:
            extra = f" forced {row['forced']:8.1f} {row['seq'] / row['forced']:.3f}x" if forced else ""
            print(f"{m:>6}x{n}x{k:<6} seq {row['seq']:8.1f} ce {row['ce']:8.1f} {row['seq'] / row['ce']:.3f}x"
                  f"{extra} err {row['err']:.1e}", flush=True)
    if rank == 0:
        geo = math.exp(statistics.mean(math.log(r["speedup"]) for r in rows))
        print(f"copy engines over cuBLAS then NCCL: geometric mean {geo:.4f}x, "
              f"min {min(r['speedup'] for r in rows):.3f}x, max err {max(r['err'] for r in rows):.1e}", flush=True)
        with open(result, "w") as f:
            json.dump(rows, f)
    flashoverlap.destroy_communicators()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--forced", action="store_true", help="also time mode='overlap'")
    args = p.parse_args()
    bench.spawn_ranks(worker, 2, args.iters, args.forced)


if __name__ == "__main__":
    main()
