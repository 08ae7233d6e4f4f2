"""FlashOverlap's E1 correctness table: every overlapped op against the unfused torch composition
computed in fp32, on fresh random inputs, outputs poisoned with NaN first, per op, dtype and world
size (all local GPUs, one process each). Shapes include M, N and K that are not tile multiples,
and for All-to-All a skewed routing where rank 0 receives ~60% of the rows and a pair that
exchanges nothing. Reports the maximum relative (Frobenius) error over shapes and ranks.

    python evaluation/e1_correctness.py [--world-size N] [--out evaluation/results/e1_correctness_<gpu>x<world>.txt]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from flashoverlap import bench

SHAPES = [(77, 1032, 1000), (1000, 4096, 1024), (3000, 8192, 4104), (4096, 8192, 4096), (2048, 2056, 512)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-6


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def inputs(seed: int, rank: int, m: int, n: int, k: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank)
    return (torch.randn(m, k, device="cuda", dtype=dtype, generator=gen),
            torch.randn(n, k, device="cuda", dtype=dtype, generator=gen))


def poison(shape, dtype) -> None:
    block = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    del block


def fp32_sum(seed: int, world: int, m: int, n: int, k: int, dtype) -> torch.Tensor:
    ref = torch.zeros(m, n, device="cuda")
    for r in range(world):
        x, w = inputs(seed, r, m, n, k, dtype)
        ref += x.float() @ w.float().T
    return ref


def check_all(rank: int, world: int) -> list[tuple[str, str, float, int]]:
    """(op, dtype, max relative error, cases) for each op on this rank."""
    import flashoverlap

    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for dname, dtype in DTYPES.items():
        errors = {"gemm_all_reduce": [], "gemm_all_reduce (copy engines)": [], "gemm_all_reduce (push)": [],
                  "gemm_reduce_scatter": [], "gemm_reduce_scatter (push)": [], "gemm_all_reduce_rmsnorm": [],
                  "gemm_all_to_all": [], "gemm_all_to_all (push)": []}
        # The push backend: 2 Hopper ranks only (the same on every rank).
        push = world == 2 and torch.cuda.get_device_capability()[0] == 9
        for i, (m, n, k) in enumerate(SHAPES):
            seed = 1000 * i + len(dname)
            x, w = inputs(seed, rank, m, n, k, dtype)
            ref = fp32_sum(seed, world, m, n, k, dtype)
            for label, backend in (("gemm_all_reduce", "nccl"), ("gemm_all_reduce (copy engines)", "copy_engine"),
                                   *((("gemm_all_reduce (push)", "push"),) if push else ())):
                poison((m, n), dtype)
                errors[label].append(rel(flashoverlap.gemm_all_reduce(x, w, mode="overlap", backend=backend), ref))
            m_rs = m - m % world
            if m_rs:
                shard = m_rs // world
                poison((m_rs, n), dtype)
                out = flashoverlap.gemm_reduce_scatter(x[:m_rs].contiguous(), w, mode="overlap")
                ref_rs = fp32_sum(seed, world, m, n, k, dtype)[:m_rs][rank * shard:(rank + 1) * shard]
                errors["gemm_reduce_scatter"].append(rel(out, ref_rs))
                if push:
                    poison((m_rs, n), dtype)
                    out = flashoverlap.gemm_reduce_scatter(x[:m_rs].contiguous(), w, mode="overlap", backend="push")
                    errors["gemm_reduce_scatter (push)"].append(rel(out, ref_rs))
            gen = torch.Generator(device="cuda").manual_seed(seed + rank)
            residual = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
            norm_weight = torch.rand(n, device="cuda", dtype=dtype, generator=gen) + 0.5
            poison((m, n), dtype)
            out, res = flashoverlap.gemm_all_reduce_rmsnorm(x, w, residual, norm_weight, EPS, mode="overlap")
            r = ref + residual.float()
            out_ref = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.float()
            errors["gemm_all_reduce_rmsnorm"].append(max(rel(out, out_ref), rel(res, r)))
            # All-to-All: rank p sends rank r matrix[p][r] rows; rank 0 receives ~60%, and the
            # last rank sends nothing to rank 0 (where there are two or more).
            matrix = [[(m * 3 // 5 if r == 0 else (m - m * 3 // 5) // max(world - 1, 1)) for r in range(world)]
                      for _ in range(world)]
            if world > 1:
                matrix[-1][0] = 0
            sends = matrix[rank]
            recvs = [matrix[p][rank] for p in range(world)]
            xa, wa = inputs(seed + 1, rank, sum(sends), n, k, dtype)
            parts = []
            for p in range(world):
                xp, wp = inputs(seed + 1, p, sum(matrix[p]), n, k, dtype)
                start = sum(matrix[p][:rank])
                parts.append(xp[start:start + matrix[p][rank]].float() @ wp.float().T)
            ref_a2a = torch.cat(parts)
            for label, how in (("gemm_all_to_all", {}),
                               *((("gemm_all_to_all (push)", dict(split_matrix=matrix, groups=4, backend="push")),)
                                 if push else ())):
                poison((max(sum(recvs), 1), n), dtype)
                out = flashoverlap.gemm_all_to_all(xa, wa, sends, recvs, **how)
                errors[label].append(rel(out, ref_a2a) if sum(recvs) else 0.0)
        results += [(op, dname, max(v), len(v)) for op, v in errors.items() if v]
    return results


def _worker(rank, world, init_method, result_path):
    import json

    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    try:
        mine = check_all(rank, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            worst = [(op, d, max(g[i][2] for g in gathered), c) for i, (op, d, _, c) in enumerate(mine)]
            with open(result_path, "w") as f:
                json.dump({"meta": bench.environment(world), "rows": worst}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"e1_correctness_{gpu}x{world}.txt")
    data = bench.spawn_ranks(_worker, world)
    lines = [f"# E1 correctness, {world} x {data['meta']['gpu']}, {data['meta']['date']}: max relative error vs "
             f"the fp32 composition over {len(SHAPES)} shapes and all ranks (forced overlap; bar: <= 1e-2)",
             f"{'op':<34} {'dtype':<6} {'max rel error':>14} {'shapes':>7}  ok"]
    ok = True
    for op, dtype, err, cases in data["rows"]:
        good = err <= 1e-2
        ok &= good
        lines.append(f"{op:<34} {dtype:<6} {err:14.2e} {cases:7d}  {'yes' if good else 'NO'}")
    print("\n".join(lines))
    bench.write_lines(out, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
