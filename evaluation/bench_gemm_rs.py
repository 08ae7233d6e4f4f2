"""GEMM + ReduceScatter on all local GPUs against its baselines, measured in the same run.

For each shape (x [M, K] per rank, w [N, K], out [M / world, N]):

  cublas      torch.matmul alone
  nccl        torch.distributed.reduce_scatter_tensor of an [M, N] buffer alone
  seq         cuBLAS then NCCL ReduceScatter (the unfused composition)
  fo          flashoverlap.gemm_reduce_scatter (mode and backend auto: overlapped
              where the predictor says it wins, else the unfused composition; the
              backend the predictor times faster for the shape)
  fo_nccl     the same with backend="nccl" (mode auto)
  fo_ce       the same with backend="copy_engine" (mode auto)
  forced      flashoverlap.gemm_reduce_scatter with mode="overlap" (backend auto)
  forced_ce   the same with backend="copy_engine"
  fo_push     the same as fo with backend="push" (each GEMM stores the tiles of the other
              rank's shard straight into its slot; 2 Hopper ranks only, NaN elsewhere)
  forced_push the same with mode="overlap"
  decomp      the GEMM split along M into 4 chunks (each the same sub-range of
              every rank's shard, so each chunk's ReduceScatter lands in final
              rows), each chunk's ReduceScatter on a second stream while the next
              chunk computes (FlashOverlap's VanillaDecomposition)
  async_tp    torch.ops.symm_mem.fused_matmul_reduce_scatter (torch Async-TP,
              peer-to-peer, multicast off)
  concurrent  cuBLAS and a ReduceScatter of an unrelated buffer launched together
              on two streams, no dependency (the independent-concurrency reference)

Every variant is checked against the fp32 composition before timing (a variant over
relative error 1e-2 is named as a wrong result). Times are medians of CUDA-event-timed
iterations after warm-up, the variants interleaved, pooled over 3 rounds across all
shapes, maximum over ranks; inputs rotate over buffers larger than L2. Each row also
records the backend auto picked (flashoverlap.backend_of) and the schedule each backend
plans; the summary gives fo's, fo_nccl's and fo_ce's speedups over seq and the verdict
on the copy-engine bar (fo_ce's geometric mean over seq >= 1.25x, every copy-engine
result right). Writes <out>.csv, <out>.json (environment) and <out>.txt.

    python evaluation/bench_gemm_rs.py [--iters 30] [--shapes 4096x8192x4096 ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys

import torch

from flashoverlap import bench
from flashoverlap.cli import _shape

SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))]
CHUNKS = 4
VARIANTS = ("cublas", "nccl", "seq", "fo", "fo_nccl", "fo_ce", "forced", "forced_ce", "fo_push", "forced_push",
            "decomp", "async_tp", "concurrent")
TOLERANCE = 1e-2
CE_BAR = 1.25  # the bar: copy-engine gemm_reduce_scatter's geometric mean over sequential
BACKENDS = (("nccl", "nccl"), ("ce", "copy_engine"))  # (column suffix, backend) auto chooses from
SCHEDULES = (*BACKENDS, ("push", "push"))  # the backends whose planned schedule each row records


def measure_round(m: int, n: int, k: int, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
    import torch.distributed as dist

    import flashoverlap

    world, rank = dist.get_world_size(), dist.get_rank()
    shard = m // world
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    sets = bench.input_sets((m * k + n * k) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(sets)]
    full = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    unrelated = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    out_buf = torch.empty(shard, n, device="cuda", dtype=dtype)
    side = torch.cuda.Stream(priority=-1)
    group = dist.group.WORLD

    def cublas(i):
        return torch.matmul(xs[i % sets], ws[i % sets].t())

    def nccl(i):
        dist.reduce_scatter_tensor(out_buf, full)

    def seq(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        out = torch.empty(shard, n, device="cuda", dtype=dtype)
        dist.reduce_scatter_tensor(out, y)
        return out

    def op(**kwargs):
        def run(i):
            return flashoverlap.gemm_reduce_scatter(xs[i % sets], ws[i % sets], **kwargs)
        return run

    bounds = [shard * c // CHUNKS for c in range(CHUNKS + 1)]

    def decomp(i):
        x3 = xs[i % sets].view(world, shard, k)
        out = torch.empty(shard, n, device="cuda", dtype=dtype)
        main = torch.cuda.current_stream()
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            if a == b:
                continue
            part = torch.matmul(x3[:, a:b], ws[i % sets].t())  # [world, b - a, N], contiguous
            parts.append(part)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dist.reduce_scatter_tensor(out[a:b], part.view(-1, n))
        main.wait_stream(side)
        for p in parts:
            p.record_stream(side)
        return out

    async_tp_error = None
    try:
        # Registers torch.ops.symm_mem ("import torch.distributed..." here would make torch a
        # local name of this function, unbound above).
        importlib.import_module("torch.distributed._symmetric_memory")

        def async_tp(i):
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(xs[i % sets], ws[i % sets].t(), "sum", 0,
                                                                  group.group_name)
        async_tp(0)
    except Exception as e:  # reported in the table, never silently dropped
        async_tp_error = f"{type(e).__name__}: {e}"
        async_tp = None

    def concurrent(i):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        with torch.cuda.stream(side):
            dist.reduce_scatter_tensor(out_buf, unrelated)
        main.wait_stream(side)
        return y

    ref = (xs[0].float() @ ws[0].float().t())
    dist.all_reduce(ref)
    ref = ref[rank * shard:(rank + 1) * shard]
    fns = {"cublas": cublas, "nccl": nccl, "seq": seq, "fo": op(), "fo_nccl": op(backend="nccl"),
           "fo_ce": op(backend="copy_engine"), "forced": op(mode="overlap"),
           "forced_ce": op(mode="overlap", backend="copy_engine"), "decomp": decomp, "concurrent": concurrent}
    if async_tp is not None:
        fns["async_tp"] = async_tp
    # The same on every rank (the error keys must agree: the max over ranks is collective).
    push = world == 2 and torch.cuda.get_device_capability()[0] == 9
    if push:
        fns["fo_push"], fns["forced_push"] = op(backend="push"), op(mode="overlap", backend="push")
    errors = {}
    for name, f in fns.items():
        if name not in ("cublas", "nccl", "concurrent"):
            e = float((f(0).float() - ref).norm() / ref.norm())
            errors[name] = e if not math.isnan(e) else math.inf  # a NaN must not hide from max()
    plan = flashoverlap.reduce_scatter_plan_of(xs[0], ws[0])
    facts = {"schedule": plan["schedule"], "groups": len(plan["groups"]),
             "backend": flashoverlap.backend_of(xs[0], ws[0], op="gemm_reduce_scatter"), "errors": errors,
             "async_tp_error": async_tp_error}
    for suffix, backend in SCHEDULES:
        facts[f"schedule_{suffix}"] = (flashoverlap.reduce_scatter_plan_of(xs[0], ws[0], backend=backend)["schedule"]
                                       if backend != "push" or push else "n/a")
    dist.barrier()
    times = bench.interleaved_times_us(fns, iters, warmup)
    return times, facts


def make_row(shape: tuple, world: int, times: dict, facts: dict) -> dict:
    """A shape's row from the per-variant times (us, already the max over ranks) and its facts
    (errors already the max over ranks)."""
    m, n, k = shape
    row = {"m": m, "n": n, "k": k, "world_size": world, **{f"{v}_us": times.get(v, math.nan) for v in VARIANTS},
           "backend": facts["backend"], "schedule": facts["schedule"], "groups": facts["groups"],
           **{f"schedule_{suffix}": facts.get(f"schedule_{suffix}", "n/a") for suffix, _ in SCHEDULES}}
    for base in ("seq", "decomp", "async_tp"):
        row[f"fo_vs_{base}"] = row[f"{base}_us"] / row["fo_us"]
    for v in ("fo_nccl", "fo_ce", "forced_ce", "fo_push", "forced_push", "concurrent"):
        row[f"{v}_vs_seq"] = row["seq_us"] / row[f"{v}_us"]
    row["fo_push_vs_async_tp"] = row["async_tp_us"] / row["fo_push_us"]
    row["max_rel_error"] = max(facts["errors"].values())
    row["failed"] = " ".join(name for name, e in facts["errors"].items() if not e <= TOLERANCE)
    row["async_tp_error"] = facts["async_tp_error"] or ""
    return row


def _worker(rank, world, init_method, shapes, dtype_name, iters, warmup, result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    try:
        pooled, facts = bench.pooled_rounds(measure_round, shapes, dtype, iters, warmup)
        rows = []
        for s in shapes:
            times = {name: bench._max_over_ranks(statistics.median(v)) for name, v in pooled[s].items()}
            errors = {name: bench._max_over_ranks(e) for name, e in facts[s]["errors"].items()}
            rows.append(make_row(s, world, times, {**facts[s], "errors": errors}))
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"meta": bench.environment(world), "rows": rows}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


geo = bench.geo_min


def ce_verdict(rows: list) -> str:
    """The copy-engine bar: PASS where fo_ce's geometric mean over seq is >= CE_BAR and no
    copy-engine variant gave a wrong result, FAIL otherwise, n/a where fo_ce has no time."""
    if any({"fo_ce", "forced_ce"} & set(r["failed"].split()) for r in rows):
        return "FAIL"
    g, _ = geo(rows, "fo_ce_vs_seq")
    if math.isnan(g):
        return "n/a"
    return "PASS" if g >= CE_BAR else "FAIL"


def table(rows: list, meta: dict, dtype: str) -> list[str]:
    """The printed table: header, one line per shape, geometric means, auto's backends, the
    copy-engine bar's verdict, and any wrong result."""
    lines = [f"# GEMM + ReduceScatter, {meta['world_size']} x {meta['gpu']}, {dtype}, {meta['date']}; "
             f"command: {meta['command']}",
             "# times in us (median, max over ranks); vs X = X time / fo time (fo: mode and backend auto); "
             "nccl x, ce x, fce x, push x, fpush x = seq time / fo_nccl, fo_ce, forced_ce, fo_push, forced_push "
             "time; backend = auto's pick "
             "(flashoverlap.backend_of); sched = fo's schedule",
             f"{'M x N x K':>18} " + " ".join(f"{v:>10}" for v in VARIANTS) +
             f" {'backend':>11} {'sched':>10} {'vs seq':>7} {'nccl x':>7} {'ce x':>7} {'fce x':>7} {'push x':>7} "
             f"{'fpush x':>7} {'vs dec':>7} "
             f"{'vs atp':>7} {'conc x':>7} {'err':>8}"]
    for r in rows:
        lines.append(f"{r['m']:>6}x{r['n']}x{r['k']:<5} " + " ".join(f"{r[v + '_us']:10.1f}" for v in VARIANTS) +
                     f" {r['backend']:>11} {r['schedule']:>10} {r['fo_vs_seq']:6.3f}x {r['fo_nccl_vs_seq']:6.3f}x "
                     f"{r['fo_ce_vs_seq']:6.3f}x {r['forced_ce_vs_seq']:6.3f}x {r['fo_push_vs_seq']:6.3f}x "
                     f"{r['forced_push_vs_seq']:6.3f}x {r['fo_vs_decomp']:6.3f}x "
                     f"{r['fo_vs_async_tp']:6.3f}x {r['concurrent_vs_seq']:6.3f}x {r['max_rel_error']:8.1e}")
    for key, what in (("fo_vs_seq", "fo (backend auto) over sequential cuBLAS + NCCL"),
                      ("fo_nccl_vs_seq", "fo_nccl (backend nccl) over sequential cuBLAS + NCCL"),
                      ("fo_ce_vs_seq", "fo_ce (backend copy_engine) over sequential cuBLAS + NCCL"),
                      ("fo_push_vs_seq", "fo_push (backend push) over sequential cuBLAS + NCCL"),
                      ("forced_push_vs_seq", "forced_push (backend push, mode overlap) over sequential"),
                      ("fo_push_vs_async_tp", "fo_push over torch Async-TP"),
                      ("fo_vs_decomp", "fo over decomposition"), ("fo_vs_async_tp", "fo over torch Async-TP"),
                      ("concurrent_vs_seq", "independent-concurrency reference over sequential")):
        g, lo = geo(rows, key)
        lines.append(f"{what}: geometric mean {g:.3f}x, min {lo:.3f}x")
    picks = [r["backend"] for r in rows]
    lines.append("backend auto picked: " + ", ".join(f"{b} for {picks.count(b)} of {len(rows)} shapes"
                                                     for _, b in BACKENDS))
    lines.append(f"copy-engine bar (fo_ce geometric mean over sequential >= {CE_BAR:.2f}x, every copy-engine "
                 f"result right): {ce_verdict(rows)}")
    for r in rows:
        if r["failed"]:
            lines.append(f"WRONG RESULT {r['m']}x{r['n']}x{r['k']}: {r['failed']} over relative error {TOLERANCE} "
                         f"(max {r['max_rel_error']:.1e})")
    if any(r["async_tp_error"] for r in rows):
        lines.append(f"torch Async-TP failed: {rows[0]['async_tp_error']}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="*", default=SHAPES)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (>= 2; 1 for a smoke test)")
    p.add_argument("--out", default=None, help="path without extension (default: evaluation/results/bench_gemm_rs_<gpu>x<world>_<dtype>)")
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").replace(" ", "-").lower()
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"bench_gemm_rs_{gpu}x{world}_{args.dtype}")
    os.environ.update(bench.SAFE_ENV)
    data = bench.spawn_ranks(_worker, world, list(args.shapes), args.dtype, args.iters, args.warmup)
    rows = data["rows"]
    lines = table(rows, data["meta"], args.dtype)
    print("\n".join(lines))
    bench.write_outputs(out, lines, rows, data["meta"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
