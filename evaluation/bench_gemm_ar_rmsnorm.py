"""GEMM + AllReduce + fused add-RMSNorm on all local GPUs against its baselines, measured in the same run.

For each shape (x [M, K] per rank, w [N, K], residual [M, N] per rank, norm_weight [N]; both
outputs [M, N]: residual_out = all_reduce(x @ w.T) + residual, out = rms_norm(residual_out) *
norm_weight, fp32 statistics, eps = 1e-6, vLLM's fused_add_rms_norm after a row-parallel layer):

  cublas   torch.matmul alone
  nccl     torch.distributed.all_reduce of an [M, N] buffer alone
  norm     the torch add + RMSNorm alone on an [M, N] input (the sum and the statistics in fp32:
           torch.nn.functional.rms_norm on the fp32 sum where torch has it, else
           r * rsqrt(mean(r^2) + eps); both outputs cast back to the input dtype)
  seq      cuBLAS, then NCCL AllReduce, then that add + RMSNorm (the unfused composition)
  seq_fused  cuBLAS, then NCCL AllReduce, then flashoverlap's one-kernel add + RMSNorm on every SM
           (the sequential baseline with the fastest fused norm this machine has)
  fo       flashoverlap.gemm_all_reduce_rmsnorm (mode auto: overlapped where the predictor says
           it wins, each group's rows normalized right after its AllReduce; else GEMM, AllReduce,
           then flashoverlap's add + RMSNorm kernel; default backend)
  forced   the same with mode="overlap"
  fo_nccl  the same as fo with backend="nccl"
  fo_peer  the same as fo with backend="peer" (each rank's GEMM stores its partial in its peer
           buffer; one kernel per group reads every rank's rows over NVLink, sums, adds the
           residual and normalizes, on the SMs the GEMM leaves free)
  fo_push  the same as fo with backend="push" (each GEMM's epilogue stores every tile into the other
           rank's slot too; each group is summed, added and normalized on the SMs the GEMM leaves
           free once both ranks' tiles are in; 2 Hopper ranks only, NaN elsewhere)

Before timing, both outputs of seq, fo, forced, fo_nccl, fo_peer and fo_push are checked against the fp32
composition (the fp32 product all-reduced in fp32, plus the residual, normalized in fp32): the
relative error is the Frobenius norm of the difference over that of the reference, maximum over
ranks. The schedule and group count are those of flashoverlap.plan_of(x, w, fused_norm=True),
the plan fo runs. Times are medians of CUDA-event-timed iterations after warm-up, the variants
interleaved, pooled over 3 rounds across all shapes, maximum over ranks; inputs rotate over
buffers larger than L2. Writes <out>.csv, <out>.json (environment) and <out>.txt.

    python evaluation/bench_gemm_ar_rmsnorm.py [--iters 30] [--shapes 4096x8192x4096 ...] [--world-size W] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

from flashoverlap import _core, _env, bench
from flashoverlap.cli import _shape

SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))]
EPS = 1e-6
VARIANTS = ("cublas", "nccl", "norm", "seq", "seq_fused", "fo", "forced", "fo_nccl", "fo_peer", "fo_push")
CHECKED = ("seq", "seq_fused", "fo", "forced", "fo_nccl", "fo_peer", "fo_push")
SPEEDUPS = ("fo", "forced", "fo_nccl", "fo_peer", "fo_push")


def measure_round(m: int, n: int, k: int, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
    import torch.distributed as dist

    import flashoverlap

    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    # x, w, the residual and the norm baseline's input per set.
    sets = bench.input_sets((m * k + n * k + 2 * m * n) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(sets)]
    ys = [torch.randn(m, n, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    # The residual stream and the norm weight are replicated in tensor parallelism: the same on
    # every rank (backend="peer" relies on it: ranks normalize each other's rows).
    norm_gen = torch.Generator(device="cuda").manual_seed(1234)
    residuals = [torch.randn(m, n, device="cuda", dtype=dtype, generator=norm_gen) for _ in range(sets)]
    norm_weight = (torch.rand(n, device="cuda", generator=norm_gen) + 0.5).to(dtype)
    norm_weight_f = norm_weight.float()
    # Zeros: summed in place every iteration, random values would grow to inf over the run.
    full = torch.zeros(m, n, device="cuda", dtype=dtype)
    rms_norm = getattr(torch.nn.functional, "rms_norm", None)

    def add_rmsnorm(y, residual):
        """The best plain-torch fused_add_rms_norm: (out, residual_out), sum and statistics in fp32."""
        r = y.float() + residual.float()
        if rms_norm is not None:
            out = rms_norm(r, (n,), norm_weight_f, EPS)
        else:
            out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight_f
        return out.to(dtype), r.to(dtype)

    def cublas(i):
        return torch.matmul(xs[i % sets], ws[i % sets].t())

    def nccl(i):
        dist.all_reduce(full)

    def norm(i):
        return add_rmsnorm(ys[i % sets], residuals[i % sets])

    def seq(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        dist.all_reduce(y)
        return add_rmsnorm(y, residuals[i % sets])

    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    dtype_name = str(dtype).removeprefix("torch.")

    def seq_fused(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        dist.all_reduce(y)
        residual_out = torch.empty_like(y)
        _core.add_rmsnorm(y.data_ptr(), residuals[i % sets].data_ptr(), residual_out.data_ptr(),
                          norm_weight.data_ptr(), m, n, EPS, dtype_name, torch.cuda.current_device(),
                          torch.cuda.current_stream().cuda_stream, sms)
        return y, residual_out

    def fo(i):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight, EPS)

    def forced(i):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight, EPS,
                                                    mode="overlap")

    def fo_nccl(i):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight, EPS,
                                                    backend="nccl")

    def fo_peer(i):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight, EPS,
                                                    backend="peer")

    def fo_push(i):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight, EPS,
                                                    backend="push")

    # Correctness of the exact calls being timed, against the fp32 composition.
    res_ref = xs[0].float() @ ws[0].float().t()
    dist.all_reduce(res_ref)
    res_ref += residuals[0].float()
    out_ref = res_ref * torch.rsqrt(res_ref.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight_f
    errors = {}
    fns = {"cublas": cublas, "nccl": nccl, "norm": norm, "seq": seq, "seq_fused": seq_fused, "fo": fo,
           "forced": forced, "fo_nccl": fo_nccl, "fo_peer": fo_peer}
    # The same on every rank (the error keys must agree: _max_over_ranks is collective).
    if dist.get_world_size() == 2 and torch.cuda.get_device_capability()[0] == 9:
        fns["fo_push"] = fo_push
    for name in CHECKED:
        if name not in fns:
            errors[f"err_out_{name}"] = errors[f"err_res_{name}"] = math.nan
            continue
        out, res = fns[name](0)
        errors[f"err_out_{name}"] = float((out.float() - out_ref).norm() / out_ref.norm())
        errors[f"err_res_{name}"] = float((res.float() - res_ref).norm() / res_ref.norm())
    del res_ref, out_ref
    plan = flashoverlap.plan_of(xs[0], ws[0], fused_norm=True)
    dist.barrier()
    times = bench.interleaved_times_us(fns, iters, warmup)
    schedule, groups, _ = bench.schedule_of(plan)
    return times, {"schedule": schedule, "groups": groups, "errors": errors}


def _worker(rank, world, init_method, shapes, dtype_name, iters, warmup, result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    try:
        pooled, facts = bench.pooled_rounds(measure_round, shapes, dtype, iters, warmup)
        rows = []
        for s in shapes:
            t = {name: bench._max_over_ranks(statistics.median(v)) for name, v in pooled[s].items()}
            row = {"m": s[0], "n": s[1], "k": s[2], "world_size": world,
                   **{f"{v}_us": t.get(v, math.nan) for v in VARIANTS},
                   "schedule": facts[s]["schedule"], "groups": facts[s]["groups"]}
            for v in SPEEDUPS:
                row[f"{v}_vs_seq"] = row["seq_us"] / row[f"{v}_us"]
                row[f"{v}_vs_seq_fused"] = row["seq_fused_us"] / row[f"{v}_us"]
            # Same keys in the same order on every rank: _max_over_ranks is collective.
            for key, e in facts[s]["errors"].items():
                row[key] = bench._max_over_ranks(e)
            rows.append(row)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"meta": bench.environment(world), "rows": rows}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


geo = bench.geo_min


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="*", default=SHAPES)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (>= 2; 1 for a smoke test)")
    p.add_argument("--out", default=None, help="path without extension (default: "
                   "evaluation/results/bench_gemm_ar_rmsnorm_<gpu>x<world>_<dtype>)")
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"bench_gemm_ar_rmsnorm_{gpu}x{world}_{args.dtype}")
    os.environ.update(bench.SAFE_ENV)
    data = bench.spawn_ranks(_worker, world, list(args.shapes), args.dtype, args.iters, args.warmup)
    rows = data["rows"]
    lines = [f"# GEMM + AllReduce + add-RMSNorm, {world} x {data['meta']['gpu']}, {args.dtype}, "
             f"{data['meta']['date']}; command: {data['meta']['command']}; peer kernel {_env.format_norm_config(_env.norm_config())}",
             "# times in us (median, max over ranks); x = seq time / that variant's time; "
             "err = relative error vs fp32 of out (o) and residual_out (r)",
             f"{'M x N x K':>18} " + " ".join(f"{v:>10}" for v in VARIANTS) +
             f" {'sched':>10} {'groups':>6} {'fo x':>7} {'forced x':>8} {'nccl x':>7} {'peer x':>7} {'push x':>7}" +
             "".join(f" {f'{v} {o}':>10}" for v in SPEEDUPS for o in ("o", "r"))]
    for r in rows:
        lines.append(f"{r['m']:>6}x{r['n']}x{r['k']:<5} " + " ".join(f"{r[v + '_us']:10.1f}" for v in VARIANTS) +
                     f" {r['schedule']:>10} {r['groups']:>6} {r['fo_vs_seq']:6.3f}x {r['forced_vs_seq']:7.3f}x "
                     f"{r['fo_nccl_vs_seq']:6.3f}x {r['fo_peer_vs_seq']:6.3f}x {r['fo_push_vs_seq']:6.3f}x" +
                     "".join(f" {r[f'err_{o}_{v}']:10.1e}" for v in SPEEDUPS for o in ("out", "res")))
    for key, what in (("fo_vs_seq", "fo over sequential cuBLAS + NCCL + torch add-RMSNorm"),
                      ("fo_vs_seq_fused", "fo over sequential cuBLAS + NCCL + one-kernel add-RMSNorm"),
                      ("forced_vs_seq", "forced overlap over sequential"),
                      ("fo_nccl_vs_seq", "fo with backend='nccl' over sequential"),
                      ("fo_nccl_vs_seq_fused", "fo with backend='nccl' over sequential with the one-kernel norm"),
                      ("fo_peer_vs_seq", "fo with backend='peer' over sequential"),
                      ("fo_peer_vs_seq_fused", "fo with backend='peer' over sequential with the one-kernel norm"),
                      ("fo_push_vs_seq", "fo with backend='push' over sequential"),
                      ("fo_push_vs_seq_fused", "fo with backend='push' over sequential with the one-kernel norm")):
        g, lo = geo(rows, key)
        lines.append(f"{what}: geometric mean {g:.3f}x, min {lo:.3f}x")
    for base in ("seq", "seq_fused"):
        err = max(max(r[f"err_out_{base}"], r[f"err_res_{base}"]) for r in rows)
        lines.append(f"max relative error of the {base} baseline itself: {err:.1e}")
    print("\n".join(lines))
    bench.write_outputs(out, lines, rows, data["meta"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
