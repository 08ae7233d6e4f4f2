"""GEMM + All-to-All (the expert-parallel combine) on all local GPUs against its baselines, measured
in the same run.

For each case (x [T, K] per rank with its rows grouped by destination rank, w [N, K] per rank,
out [rows received, N]) the routing is a split matrix, matrix[p][q] = rows rank p sends rank q,
every rank sending T rows. --routing skewed (the default): one destination, drawn from a seeded
RNG, receives HOT_SHARE (60%) of every rank's rows and the rest is spread unevenly over the other
destinations (the same matrix on every run); --routing uniform: T / world rows to each rank.

  cublas      torch.matmul alone
  nccl        torch.distributed.all_to_all_single of a [T, N] buffer with the same splits, alone
  seq         cuBLAS then NCCL all_to_all_single (the unfused composition)
  fo          flashoverlap.gemm_all_to_all(split_matrix=matrix): the predictor picks the group count
              and (backend auto) the backend it times faster for the routing
  fo_nccl     the same with backend="nccl"
  fo_ce       the same with backend="copy_engine" (split_matrix is what lets the copy engines run)
  fo_push     the same with backend="push" (2 Hopper ranks: each GEMM stores the tiles of the other
              rank's rows straight into its staging slot over NVLink; NaN elsewhere)
  forced_push backend="push" with PUSH_GROUPS groups forced (the mechanism, whatever the predictor
              says of it: its push constants are estimates)
  fo_g<G>     gemm_all_to_all with groups=G forced, for G in FORCED_GROUPS, on NCCL (backend="nccl";
              the mechanism at each group count)
  decomp      the GEMM split into 4 chunks, chunk c taking the c-th quarter of every destination's
              rows: those rows are gathered (index_select) into a contiguous chunk grouped by
              destination, multiplied by one cuBLAS call, and exchanged by all_to_all_single on a
              second stream while the next chunk computes. A chunk's rows from a source are the
              c-th quarter of that source's block in out, so they arrive in a per-chunk buffer
              (in source order) and one index_copy_ on the same stream puts them in their final
              rows of out (FlashOverlap's VanillaDecomposition for All-to-All)

Every variant is checked against the fp32 all_to_all_single of every rank's x @ w^T (x and w
all-gathered) before timing, outputs poisoned with NaN first. Times are medians of
CUDA-event-timed iterations after warm-up, the variants interleaved, pooled over 3 rounds across
all cases, maximum over ranks; inputs rotate over buffers larger than L2. Each row also records
the predictor's group count and time on each backend, the predictions auto chooses the backend
by (gemm_all_to_all has no backend_of to say which it ran); the summary gives fo's, fo_nccl's
and fo_ce's speedups over seq. Writes <out>.csv, <out>.json (environment) and <out>.txt; exits 1
if any variant's relative error exceeds 1e-2.

    python evaluation/bench_gemm_a2a.py [--iters 30] [--routing skewed|uniform] [--shapes 4096x8192x4096 ...]
                                        [--world-size 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
from typing import NamedTuple

import torch

from flashoverlap import bench
from flashoverlap.cli import _shape

# Issue 4's bar is over its own six cases (the MoE down projection N 4096 x K 14336 and 8192 x 4096),
# not over the 16 shapes of the other GEMM ops: both sets run by default, the bar's verdict on its own.
BAR_SHAPES = [(t, n, k) for t in (2048, 4096, 8192) for (n, k) in ((4096, 14336), (8192, 4096))]
BAR_MEAN, BAR_MIN = 1.10, 0.98
SHAPES = [(t, n, k) for t in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))]
SHAPES += [s for s in BAR_SHAPES if s not in SHAPES]
CHUNKS = 4
FORCED_GROUPS = (2, 4, 8, 16)
PUSH_GROUPS = 4
VARIANTS = ("cublas", "nccl", "seq", "fo", "fo_nccl", "fo_ce", "fo_push", "forced_push",
            *(f"fo_g{g}" for g in FORCED_GROUPS), "decomp")
BACKENDS = (("nccl", "nccl"), ("ce", "copy_engine"))  # (column suffix, backend)
ROUTINGS = ("skewed", "uniform")
HOT_SHARE = 0.6
SEED = 2025
TOLERANCE = 1e-2


def apportion(total: int, weights: list[float]) -> list[int]:
    """``total`` rows split in proportion to ``weights`` (largest remainder; ties to the lower index),
    summing exactly to ``total``."""
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    shares = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[:total - sum(shares)]:
        shares[i] += 1
    return shares


def routing(world: int, tokens: int, kind: str = "skewed", seed: int = SEED, hot_share: float = HOT_SHARE) -> list:
    """The split matrix of a case: matrix[p][q] rows rank p sends rank q, each row summing to ``tokens``.
    skewed: one destination (drawn from the RNG) gets round(hot_share * tokens) of every rank's rows
    and each rank spreads the rest over the other destinations with its own weights in [0.1, 1]
    (up to 10x apart), as a popular expert and a long tail do; uniform: tokens / world each (the
    remainder to the lowest ranks). Pure: the same (world, tokens, kind, seed) give the same matrix."""
    if world < 1 or tokens < 0:
        raise ValueError(f"routing: expected world >= 1 and tokens >= 0, got world {world}, tokens {tokens}")
    if kind == "uniform":
        return [[tokens // world + int(q < tokens % world) for q in range(world)] for _ in range(world)]
    if kind != "skewed":
        raise ValueError(f"routing: expected one of {ROUTINGS}, got {kind!r}")
    if world == 1:
        return [[tokens]]
    rng = random.Random(f"{seed}:{world}:{tokens}")
    hot = rng.randrange(world)
    hot_rows = round(hot_share * tokens)
    matrix = []
    for _ in range(world):
        rest = apportion(tokens - hot_rows, [rng.uniform(0.1, 1.0) for _ in range(world - 1)])
        matrix.append(rest[:hot] + [hot_rows] + rest[hot:])
    return matrix


def offsets(splits: list[int]) -> list[int]:
    """Where each split's block starts: [0, s0, s0 + s1, ...] (one entry per split)."""
    starts, at = [], 0
    for s in splits:
        starts.append(at)
        at += s
    return starts


class Chunk(NamedTuple):
    """One chunk of the decomposition on one rank."""
    input_splits: list   # rows sent to each destination in this chunk
    output_splits: list  # rows received from each source in this chunk
    send_rows: list      # rows of x making up the chunk's GEMM input, in destination order
    recv_rows: list      # rows of out that the chunk's received rows (in source order) land in


def decomposition(matrix: list, rank: int, chunks: int = CHUNKS) -> list[Chunk]:
    """The chunks of ``rank`` for ``matrix``: chunk c sends rows [s*c//chunks, s*(c+1)//chunks) of
    each destination's block of s rows in x. Every sender applies the same arithmetic to its own
    count, so what rank p sends rank q in chunk c is what q expects from p, and those rows are the
    same sub-range of p's block in q's out (at sum(column[:p])): contiguous, but apart from the
    chunk's rows from other sources, hence the per-chunk buffer and recv_rows."""
    world = len(matrix)
    sends = list(matrix[rank])
    recvs = [matrix[p][rank] for p in range(world)]
    send_at, recv_at = offsets(sends), offsets(recvs)
    plan = []
    for c in range(chunks):
        parts = []
        for counts, starts in ((sends, send_at), (recvs, recv_at)):
            splits, rows = [], []
            for count, start in zip(counts, starts):
                a, b = count * c // chunks, count * (c + 1) // chunks
                splits.append(b - a)
                rows.extend(range(start + a, start + b))
            parts.append((splits, rows))
        (input_splits, send_rows), (output_splits, recv_rows) = parts
        plan.append(Chunk(input_splits, output_splits, send_rows, recv_rows))
    return plan


def measure_round(m: int, n: int, k: int, dtype: torch.dtype, iters: int, warmup: int, *,
                  kind: str) -> tuple[dict, dict]:
    import torch.distributed as dist

    import flashoverlap

    world, rank = dist.get_world_size(), dist.get_rank()
    matrix = routing(world, m, kind)
    sends = matrix[rank]
    recvs = [matrix[p][rank] for p in range(world)]
    received = sum(recvs)
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    sets = bench.input_sets((m * k + n * k) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(sets)]
    full = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    nccl_out = torch.empty(received, n, device="cuda", dtype=dtype)
    side = torch.cuda.Stream(priority=-1)
    poison = True

    def new_out(rows: int) -> torch.Tensor:
        out = torch.empty(rows, n, device="cuda", dtype=dtype)
        return out.fill_(math.nan) if poison else out

    def cublas(i):
        return torch.matmul(xs[i % sets], ws[i % sets].t())

    def nccl(i):
        dist.all_to_all_single(nccl_out, full, recvs, sends)

    def seq(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        out = new_out(received)
        dist.all_to_all_single(out, y, recvs, sends)
        return out

    def predicted(backend):
        def run(i):
            return flashoverlap.gemm_all_to_all(xs[i % sets], ws[i % sets], sends, recvs, split_matrix=matrix,
                                                backend=backend)
        return run

    def forced(groups, backend="nccl"):
        def run(i):
            return flashoverlap.gemm_all_to_all(xs[i % sets], ws[i % sets], sends, recvs, groups=groups,
                                                backend=backend, split_matrix=matrix)
        return run

    chunks = [(c, torch.tensor(c.send_rows, device="cuda", dtype=torch.long),
               torch.tensor(c.recv_rows, device="cuda", dtype=torch.long)) for c in decomposition(matrix, rank)]

    def decomp(i):
        x, w = xs[i % sets], ws[i % sets]
        out = new_out(received)
        main = torch.cuda.current_stream()
        held = []
        # Every rank issues every chunk's exchange, empty or not: all_to_all_single is collective.
        for chunk, send_rows, recv_rows in chunks:
            part = torch.matmul(x.index_select(0, send_rows), w.t())  # [chunk rows, N], grouped by destination
            recv = new_out(len(chunk.recv_rows))
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dist.all_to_all_single(recv, part, chunk.output_splits, chunk.input_splits)
                out.index_copy_(0, recv_rows, recv)
            held += [part, recv]
        main.wait_stream(side)
        for t in held:
            t.record_stream(side)
        return out

    fns = {"cublas": cublas, "nccl": nccl, "seq": seq, "fo": predicted(None), "fo_nccl": predicted("nccl"),
           "fo_ce": predicted("copy_engine"), **{f"fo_g{g}": forced(g) for g in FORCED_GROUPS}, "decomp": decomp}
    # The same on every rank (the error keys must agree: the max over ranks is collective).
    push = world == 2 and torch.cuda.get_device_capability()[0] == 9
    if push:
        fns["fo_push"], fns["forced_push"] = predicted("push"), forced(PUSH_GROUPS, "push")
    errors = relative_errors({name: f for name, f in fns.items() if name not in ("cublas", "nccl")},
                             xs[0], ws[0], matrix, received)
    poison = False
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    facts = {"matrix": matrix, "errors": errors}
    for suffix, backend in BACKENDS:
        pred = flashoverlap.plan_gemm_all_to_all(matrix, n, k, dtype=dtype, sms=props.multi_processor_count,
                                                 compute_capability=torch.cuda.get_device_capability(),
                                                 backend=backend)
        # What the op runs on this backend: the sequential schedule's prediction where it falls back.
        sequential = pred.schedule == "sequential"
        facts[f"groups_{suffix}"] = 0 if sequential else pred.groups
        facts[f"predicted_{suffix}_us"] = pred.sequential_us if sequential else pred.predicted_us[pred.groups]
        if backend == "nccl":
            facts["predicted_seq_us"] = pred.sequential_us  # seq's exchange is NCCL's
    facts["groups_push"] = 0
    if push:
        pred = flashoverlap.plan_gemm_all_to_all(matrix, n, k, dtype=dtype, sms=props.multi_processor_count,
                                                 backend="push")
        facts["groups_push"] = 0 if pred.schedule == "sequential" else pred.groups
    dist.barrier()
    times = bench.interleaved_times_us(fns, iters, warmup)
    return times, facts


def relative_errors(fns: dict, x: torch.Tensor, w: torch.Tensor, matrix: list, received: int) -> dict:
    """Each function's output for operand set 0 against the fp32 all_to_all_single of every rank's
    x @ w^T (relative Frobenius norm; a NaN, an unwritten row, counts as infinite)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    every_x = torch.empty(world * x.shape[0], x.shape[1], device="cuda", dtype=x.dtype)
    every_w = torch.empty(world * w.shape[0], w.shape[1], device="cuda", dtype=w.dtype)
    dist.all_gather_into_tensor(every_x, x.contiguous())
    dist.all_gather_into_tensor(every_w, w.contiguous())
    t, n = x.shape[0], w.shape[0]
    parts = []
    for p in range(world):
        start = p * t + sum(matrix[p][:rank])
        parts.append(every_x[start:start + matrix[p][rank]].float() @ every_w[p * n:(p + 1) * n].float().t())
    ref = torch.cat(parts)
    del every_x, every_w, parts
    errors = {}
    for name, f in fns.items():
        # The op allocates its own output: leave NaN in the block the allocator hands out next,
        # so that rows it never writes cannot read as the previous variant's correct result.
        torch.empty(received, n, device="cuda", dtype=x.dtype).fill_(math.nan)
        out = f(0)
        if out.shape != ref.shape:
            raise RuntimeError(f"{name}: expected an output of shape {tuple(ref.shape)}, got {tuple(out.shape)}")
        e = float((out.float() - ref).norm() / ref.norm()) if received else 0.0
        errors[name] = e if not math.isnan(e) else math.inf
    return errors


def make_row(shape: tuple, world: int, kind: str, times: dict, facts: dict) -> dict:
    """A case's row from the per-variant times (us, already the max over ranks) and its facts
    (errors already the max over ranks)."""
    m, n, k = shape
    best_g = min(FORCED_GROUPS, key=lambda g: times.get(f"fo_g{g}", math.inf))
    row = {"m": m, "n": n, "k": k, "world_size": world, "routing": kind,
           **{f"{v}_us": times.get(v, math.nan) for v in VARIANTS},
           **{key: facts[key] for suffix, _ in BACKENDS for key in (f"groups_{suffix}", f"predicted_{suffix}_us")},
           "predicted_seq_us": facts["predicted_seq_us"], "groups_push": facts["groups_push"],
           "best_forced_groups": best_g}
    for v in ("fo", "fo_nccl", "fo_ce", "fo_push", "forced_push"):
        row[f"{v}_vs_seq"] = row["seq_us"] / row[f"{v}_us"]
    row["fo_vs_decomp"] = row["decomp_us"] / row["fo_us"]
    row["best_forced_vs_seq"] = row["seq_us"] / row[f"fo_g{best_g}_us"]
    row["max_rel_error"] = max(facts["errors"].values())
    row["failed"] = " ".join(name for name, e in facts["errors"].items() if not e <= TOLERANCE)
    row["split_matrix"] = json.dumps(facts["matrix"], separators=(",", ":"))
    return row


def _worker(rank, world, init_method, shapes, dtype_name, kind, iters, warmup, result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    try:
        pooled, facts = bench.pooled_rounds(functools.partial(measure_round, kind=kind), shapes, dtype, iters, warmup)
        rows = []
        for s in shapes:
            times = {name: bench._max_over_ranks(statistics.median(v)) for name, v in pooled[s].items()}
            errors = {name: bench._max_over_ranks(e) for name, e in facts[s]["errors"].items()}
            rows.append(make_row(s, world, kind, times, {**facts[s], "errors": errors}))
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"meta": {**bench.environment(world), "routing": kind, "chunks": CHUNKS}, "rows": rows}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


geo = bench.geo_min


def table(rows: list, meta: dict, dtype: str) -> list[str]:
    """The printed table: header, one line per case, geometric means, and any case over TOLERANCE."""
    lines = [f"# GEMM + All-to-All, {meta['world_size']} x {meta['gpu']}, {dtype}, {meta['routing']} routing, "
             f"{meta['date']}; command: {meta['command']}",
             "# times in us (median, max over ranks); vs X = X time / fo time (fo: groups and backend from the "
             "predictor); nccl x, ce x = seq time / fo_nccl, fo_ce time; G n, G ce = the predicted group count on "
             "each backend (0: sequential), pred n, pred ce = its predicted time (what auto picks the backend by), "
             "pred seq = sequential's; push x, fpush x = seq time / fo_push, forced_push time, G p = push's "
             f"predicted group count (forced_push: {PUSH_GROUPS}); best g = the fastest forced count (NCCL)",
             f"{'T x N x K':>18} " + " ".join(f"{v:>9}" for v in VARIANTS) +
             f" {'G n':>4} {'pred n':>8} {'G ce':>4} {'pred ce':>8} {'pred seq':>8} {'vs seq':>7} {'nccl x':>7} "
             f"{'ce x':>7} {'G p':>4} {'push x':>7} {'fpush x':>7} {'vs dec':>7} {'best g':>6} {'g vs seq':>8} "
             f"{'err':>8}"]
    for r in rows:
        lines.append(f"{r['m']:>6}x{r['n']}x{r['k']:<5} " + " ".join(f"{r[v + '_us']:9.1f}" for v in VARIANTS) +
                     f" {r['groups_nccl']:>4} {r['predicted_nccl_us']:8.1f} {r['groups_ce']:>4} "
                     f"{r['predicted_ce_us']:8.1f} {r['predicted_seq_us']:8.1f} {r['fo_vs_seq']:6.3f}x "
                     f"{r['fo_nccl_vs_seq']:6.3f}x {r['fo_ce_vs_seq']:6.3f}x {r['groups_push']:>4} "
                     f"{r['fo_push_vs_seq']:6.3f}x {r['forced_push_vs_seq']:6.3f}x {r['fo_vs_decomp']:6.3f}x "
                     f"{r['best_forced_groups']:>6} {r['best_forced_vs_seq']:7.3f}x {r['max_rel_error']:8.1e}")
    for key, what in (("fo_vs_seq", "fo (backend auto) over sequential cuBLAS + NCCL all_to_all_single"),
                      ("fo_nccl_vs_seq", "fo_nccl (backend nccl) over sequential cuBLAS + NCCL all_to_all_single"),
                      ("fo_ce_vs_seq", "fo_ce (backend copy_engine) over sequential cuBLAS + NCCL all_to_all_single"),
                      ("fo_push_vs_seq", "fo_push (backend push) over sequential cuBLAS + NCCL all_to_all_single"),
                      ("forced_push_vs_seq", f"forced_push (backend push, {PUSH_GROUPS} groups) over sequential"),
                      ("fo_vs_decomp", "fo over decomposition"),
                      ("best_forced_vs_seq", "fastest forced group count (NCCL) over sequential")):
        g, lo = geo(rows, key)
        lines.append(f"{what}: geometric mean {g:.3f}x, min {lo:.3f}x")
    lines += bar_lines(rows)
    for r in rows:
        if r["failed"]:
            lines.append(f"WRONG RESULT {r['m']}x{r['n']}x{r['k']}: {r['failed']} over relative error {TOLERANCE} "
                         f"(max {r['max_rel_error']:.1e})")
    return lines


def bar_lines(rows: list) -> list[str]:
    """Issue 4's verdict on its six cases (BAR_SHAPES) for auto and each backend: geometric mean
    over sequential >= BAR_MEAN and none below BAR_MIN; says which cases did not run."""
    cases = [r for r in rows if (r["m"], r["n"], r["k"]) in BAR_SHAPES]
    missing = len(BAR_SHAPES) - len(cases)
    head = (f"issue 4's bar over its {len(BAR_SHAPES)} cases (T in 2048, 4096, 8192 x (N, K) in (4096, 14336), "
            f"(8192, 4096)): geometric mean >= {BAR_MEAN:.2f}x, none below {BAR_MIN:.2f}x")
    if missing:
        return [f"{head}: not measured ({missing} of its cases not in this run)"]
    lines = [head]
    for key, name in (("fo_vs_seq", "fo (auto)"), ("fo_nccl_vs_seq", "fo_nccl"), ("fo_ce_vs_seq", "fo_ce"),
                      ("fo_push_vs_seq", "fo_push")):
        g, lo = geo(cases, key)
        verdict = ("not measured" if math.isnan(g) else
                   "PASS" if g >= BAR_MEAN and lo >= BAR_MIN else "FAIL")
        lines.append(f"  {name:<10} {g:.3f}x, min {lo:.3f}x: {verdict}")
    return lines


def default_out(gpu_name: str, world: int, dtype: str, kind: str) -> str:
    """evaluation/results/bench_gemm_a2a_<gpu>x<world>_<dtype> for the skewed routing (the file E1
    reads); uniform routings go to bench_gemm_a2a_uniform_..., a prefix of their own."""
    gpu = gpu_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    prefix = "bench_gemm_a2a" if kind == "skewed" else f"bench_gemm_a2a_{kind}"
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{prefix}_{gpu}x{world}_{dtype}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=_shape, nargs="*", default=SHAPES, help="TxNxK: tokens per rank, N, K")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (>= 2; 1 for a smoke test)")
    p.add_argument("--routing", default="skewed", choices=ROUTINGS)
    p.add_argument("--out", default=None, help="path without extension (default: evaluation/results/"
                                               "bench_gemm_a2a[_uniform]_<gpu>x<world>_<dtype>)")
    args = p.parse_args()
    world = args.world_size or torch.cuda.device_count()
    out = args.out or default_out(torch.cuda.get_device_name(0), world, args.dtype, args.routing)
    os.environ.update(bench.SAFE_ENV)
    data = bench.spawn_ranks(_worker, world, list(args.shapes), args.dtype, args.routing, args.iters, args.warmup)
    rows = data["rows"]
    lines = table(rows, data["meta"], args.dtype)
    print("\n".join(lines))
    bench.write_outputs(out, lines, rows, data["meta"])
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
