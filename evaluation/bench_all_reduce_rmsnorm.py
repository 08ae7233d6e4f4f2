"""flashoverlap.all_reduce_rmsnorm (AllReduce + residual add + RMSNorm over NVLink peer memory on a
few CTAs) on all local GPUs against its baselines, measured in the same run.

Per token count T (x [T, hidden] fresh randn per rank, residual [T, hidden] randn and the same on
every rank, weight [hidden] uniform in [0.5, 1.5) and the same on every rank; eps 1e-6; the op
computes r = all_reduce(x) + residual, out = r * rsqrt(mean(r^2) + eps) * weight, fp32 math):

  nccl             torch.distributed.all_reduce alone, in place on a work buffer holding a copy of
                   x (the copy is made outside the timing)
  nccl_norm        the same all_reduce on the work buffer, then the best eager torch add + RMSNorm:
                   r = y.float().add_(residual); out = F.rms_norm(r, (hidden,), weight_fp32, eps)
                   (r * rsqrt(mean(r^2) + eps) * weight where torch has no rms_norm); both cast back.
                   In place, no copy of x inside the timing: the baseline's best case, as in a
                   tensor-parallel layer whose AllReduce input is a dead temporary. The speed bar's
                   baseline (with nccl_cnorm when measured: the faster of the two)
  nccl_norm_clone  the same with x.clone() all-reduced (x preserved, as the fused op preserves it);
                   for reference only, not a bar
  nccl_cnorm       (--compiled-norm) nccl_norm with the add + RMSNorm compiled by torch.compile
  symm             torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group) alone, in place on a
                   symmetric-memory buffer already holding x (symm_mem.empty + rendezvous, done once
                   per token count; no copy in the timing; no norm). "n/a" with the reason where
                   symmetric memory is unavailable or fails on any rank
  symm_copy        x copied into that buffer, two_shot_all_reduce_, the sum copied out into a fresh
                   tensor: what vLLM's SymmMemCommunicator.all_reduce runs for a tensor outside
                   symmetric memory (no norm); for reference, not a bar: the fused op, like it, takes
                   x where the caller has it and returns new tensors
  fo_<c>           the fused op, residual_out="full", ctas=c, for c in 8, 16, 32 (and, at 1024 and
                   8192 tokens, 2, 4, 64 and 132 for the CTA curve; clamped to the SM count), as
                   the op runs it: on 2 ranks from 4096 tokens on up to 32 CTAs the copy engines
                   move the rows (FLASHOVERLAP_NORM_CE_MIN_TOKENS=0 times the kernel's own stores)
  fo_sharded_<c>   the same with residual_out="sharded" (each rank gets only its rows of r)
  api_16           flashoverlap.all_reduce_rmsnorm(..., ctas=16), the public function, timed alone
  fo_<c>@<T>x<U>[s<S>][o|r]  (--configs) the fused kernel compiled with T threads per CTA and U
                   vectors in flight per lane, each CTA pipelining its rows in up to S parts (the
                   default is 512x4s8r: up to 8 on >= 32 CTAs where at least 4 fit, else one; the
                   ring from 16 rows a CTA; 512x4s8: the same on plain loads), the shared-memory
                   ring where r is given (Hopper), one-shot where o is given (on 2 ranks every rank
                   reduces every row), full residual, c in 8, 16, 32: the sweep that picks the
                   kernel's shape (its best<=32 per config is listed)
  fo_pull[_sharded]_32[@config]  (--pull) the kernel in its pull layout on 32 CTAs (and each
                   --configs config), x copied beforehand into this rank's partial area of a peer
                   buffer of its own per operand set, as symm's x lies in its buffer: each owner
                   loads the peers' rows of its slice over NVLink, no push step; not a bar (no
                   public function takes x in peer memory), listed with its ratio to symm

fo_<c> and fo_sharded_<c> call the registered op torch.ops.flashoverlap.all_reduce_rmsnorm, what
the public function dispatches to and what a CUDA graph replays; the public function adds its
Python argument checks and group lookup (and, only with FLASHOVERLAP_PEER_TIMEOUT_S set, a
synchronous read of the error word), so it is timed on its own (api_16, in its own interleaved
run after the others, each iteration starting behind the same ~1 ms GPU sleep).

Bars (2x H200, hidden 8192, bf16): "best<=32" = the fastest of fo_8, fo_16, fo_32 (full);
speedup = baseline / best<=32 >= 1.5x at 1024-4096 tokens and >= 1.3x at 8192-16384 tokens;
best<=32 <= 1.05 x symm at every token count; the GEMM keeps >= 90% of its speed beside the op
(below). A token count PASSes when every bar that applies is measured and met, is PARTIAL when one
could not be measured (symm n/a) and none failed, and FAILs on a missed bar or a wrong result.

Correctness, before any timing: every variant, for every token count and for one not divisible by
the world size (1001 unless the world divides it; checked only), against the fp32 reference (the
fp32 all_reduce of x.float() plus the residual, normalized in fp32): relative Frobenius error of
out and of r (the sharded variants against their rows of r) <= 1e-2, maximum over ranks; the
fused op's outputs are poisoned with NaN first (best effort: NaN blocks are freed right before
the call so that the caching allocator hands them out).

Timing: CUDA events, medians after warm-up (bench.interleaved_times_us: variants interleaved,
each call taking the next of N operand sets, N such that N sets of x exceed 2x the L2 cache),
pooled over 3 rounds across all token counts (bench.pooled_rounds), maximum over ranks. The
in-place variants (nccl, nccl_norm, symm) sum their buffer again on every call, so its values grow
by the world size per call; fresh randn every round keeps them finite at the default --iters
(timing does not depend on the values).

CTA curve: fo (full) at 2, 4, 8, 16, 32, 64, 132 CTAs (clamped to the SM count) for 1024 and 8192
tokens, from the same interleaved runs: a table and <out>_ctas.png.

Concurrency: a cuBLAS GEMM (torch.matmul, --gemm MxNxK, default 8192^3) on the compute stream,
timed with CUDA events alone, beside the fused op (ctas 8, 8192 tokens, residual_out full) called
back to back on a high-priority side stream, and beside NCCL all_reduce of the same [8192, hidden]
tensor on that stream (reference). The side stream's chain is long enough to cover 1.5x the
stand-alone GEMM (the count from stand-alone medians, maximum over ranks, so every rank issues the
same calls), and both streams start together behind a GPU sleep (the host enqueues everything
first). ratio = GEMM alone / GEMM beside, the worst rank's; bar >= 0.90 for fo; "cover" is the
fraction of the GEMM's time the chain was running (below 95% the ratio is not valid).

Writes <out>.txt (the tables), <out>.csv (one row per token count), <out>.json (environment,
checks, concurrency) and <out>_ctas.png. Exits 1 if any variant's result is wrong.

    python evaluation/bench_all_reduce_rmsnorm.py [--tokens 128 512 ...] [--hidden 8192] [--dtype bfloat16]
        [--iters 50] [--world-size 2] [--quick] [--gemm 8192x8192x8192] [--compiled-norm] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Optional, Sequence

import torch

from flashoverlap import _env, bench
from flashoverlap.cli import _shape

TOKENS = (128, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_TOKENS = (1024, 8192)
QUICK_ITERS = 10
ITERS = 50
HIDDEN = 8192
EPS = 1e-6
SEED = 2718
FO_CTAS = (8, 16, 32)  # the "<= 32 CTAs" of the bars; best<=32 is the fastest of these
CURVE_CTAS = (2, 4, 8, 16, 32, 64, 132)
CURVE_TOKENS = (1024, 8192)
API_CTAS = 16
CHECK_ONLY_TOKENS = 1001
# (first tokens, last tokens, minimum speedup over the NCCL + torch norm baseline)
SPEEDUP_BARS = ((1024, 4096, 1.5), (8192, 16384, 1.3))
SYMM_BAR = 1.05
CONC_BAR = 0.90
CONC_TOKENS = 8192
CONC_CTAS = 8
GEMM_SHAPE = (8192, 8192, 8192)
CHAIN_COVER = 1.5  # the side chain lasts this many stand-alone GEMM times
MIN_COVER = 0.95
GATE_CYCLES = 2_000_000  # ~1 ms of GPU sleep before each concurrency trial
TOLERANCE = 1e-2
L2_DEFAULT = 60 << 20  # H200
ROTATION_FACTOR = 2.0
MAX_SETS = 64


# ---- pure logic (no GPU) ------------------------------------------------------------------------

def token_lists(tokens: Optional[Sequence[int]], quick: bool, world: int) -> tuple[list[int], list[int]]:
    """(timed token counts, checked token counts): the given ones (else the quick or the full list),
    sorted, duplicates dropped; the checked ones add the first odd count from 1001 that the world
    size does not divide (the sharded slices then differ in size across ranks)."""
    timed = sorted(set(tokens if tokens else (QUICK_TOKENS if quick else TOKENS)))
    if not timed or timed[0] < 1:
        raise ValueError(f"tokens: expected counts >= 1, got {timed}")
    extra = CHECK_ONLY_TOKENS
    while world > 1 and extra % world == 0:
        extra += 2
    return timed, sorted(set(timed) | {extra})


def clamp_ctas(ctas: Sequence[int], sms: int) -> list[int]:
    """CTA counts as the op runs them: at most one CTA per SM (the op clamps to the SM count;
    listing a clamped count twice would time the same thing twice)."""
    if sms < 1 or any(c < 1 for c in ctas):
        raise ValueError(f"clamp_ctas: expected counts >= 1 and sms >= 1, got {list(ctas)}, {sms}")
    return sorted({min(c, sms) for c in ctas})


def ctas_at(tokens: int, fo_ctas: Sequence[int], curve_ctas: Sequence[int],
            curve_tokens: Sequence[int] = CURVE_TOKENS) -> list[int]:
    """The full-residual CTA counts timed at a token count: the bar's, plus the curve's there."""
    return sorted(set(fo_ctas) | (set(curve_ctas) if tokens in curve_tokens else set()))


def rotation_sets(bytes_per_set: int, l2_bytes: int, factor: float = ROTATION_FACTOR, minimum: int = 2,
                  maximum: int = MAX_SETS) -> int:
    """Operand sets to rotate over so that the rotation exceeds factor x L2 (no call finds its
    inputs in L2 from its previous use), at least 2, at most `maximum`."""
    if bytes_per_set < 1:
        raise ValueError(f"rotation_sets: expected bytes_per_set >= 1, got {bytes_per_set}")
    return max(minimum, min(maximum, math.ceil(factor * l2_bytes / bytes_per_set)))


def speedup_bar(tokens: int) -> Optional[float]:
    """The minimum speedup over the NCCL + torch norm baseline at a token count; None: no bar."""
    for lo, hi, bar in SPEEDUP_BARS:
        if lo <= tokens <= hi:
            return bar
    return None


def _finite(v) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v)) and math.isfinite(v)


def best_of(times: dict, ctas: Sequence[int], prefix: str = "fo_") -> tuple[int, float]:
    """(CTA count, us) of the fastest measured variant `<prefix><c>`; (0, nan) if none was."""
    found = [(times[f"{prefix}{c}"], c) for c in ctas if _finite(times.get(f"{prefix}{c}"))]
    if not found:
        return 0, math.nan
    us, c = min(found)
    return c, us


def parse_config(text: str) -> tuple:
    """'256x2' -> (256, 2, 1, False, False), '512x4s4o' -> (512, 4, 4, True, False): threads per
    CTA, vectors in flight per lane, the most parts each CTA pipelines its rows in (1: the steps
    one after the other), one-shot (o: 2 ranks, full residual: every rank reduces every row) and
    the ring (r: rows through shared memory in bulk copies, Hopper)."""
    try:
        return _env.parse_norm_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def config_name(config: Sequence[int]) -> str:
    return _env.format_norm_config(config)


def config_lines(rows: list, configs: Sequence[Sequence[int]], fo_ctas: Sequence[int]) -> list[str]:
    """Per token count, best<=32 (full residual) of the default kernel and of each swept config,
    with the config's time over the default's (< 1: the config is faster)."""
    if not configs:
        return []
    names = [config_name(c) for c in configs]
    lines = ["", "# kernel config sweep: best<=32 us (full residual), and / default best",
             f"{'tokens':>6} {'default':>9} " + " ".join(f"{n:>16}" for n in names)]
    for r in rows:
        cells = []
        for n in names:
            _, us = best_of({f"fo_{c}": r.get(f"fo_{c}@{n}_us", math.nan) for c in fo_ctas}, fo_ctas)
            cells.append(f"{fmt(us, 8)} {fmt(us / r['best_us'] if _finite(us) else math.nan, 6, '.3f', 'x')}")
        lines.append(f"{r['tokens']:>6} {fmt(r['best_us'], 9)} " + " ".join(f"{c:>16}" for c in cells))
    return lines


def pull_lines(rows: list) -> list[str]:
    """Each pull variant's time and its ratio to symm (x already in peer memory for both)."""
    names = sorted(k[:-3] for k in (rows[0] if rows else {}) if k.startswith("fo_pull"))
    if not names:
        return []
    lines = ["", "# pull mode (x already in this rank's peer buffer, like symm's input): us, and / symm"]
    for r in rows:
        cells = [f"{n}={fmt(r[n + '_us'], 0)}({fmt(r[n + '_us'] / r['symm_us'], 0, '.3f')})" for n in names]
        lines.append(f"{r['tokens']:>6} symm={fmt(r['symm_us'], 0)} shard={fmt(r['best_sharded_us'], 0)} "
                     f"full={fmt(r['best_us'], 0)} " + " ".join(cells))
    return lines


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of got against the fp32 reference; inf for a wrong shape or a NaN."""
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf
    if ref.numel() == 0:
        return 0.0
    e = float((got.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return e if math.isfinite(e) else math.inf


def judge(row: dict) -> dict:
    """The bars of one token count: speed_bar (None where no speed bar applies), speed / symm:
    "pass", "FAIL", "n/a" (not measurable) or "-" (no bar), verdict PASS / PARTIAL / FAIL."""
    bar = speedup_bar(row["tokens"])
    if bar is None:
        speed = "-"
    elif not _finite(row["speedup"]):
        speed = "n/a"
    else:
        speed = "pass" if row["speedup"] >= bar else "FAIL"
    symm = ("pass" if row["vs_symm"] <= SYMM_BAR else "FAIL") if _finite(row["vs_symm"]) else "n/a"
    states = [s for s in (speed, symm) if s != "-"]
    if row["failed"] or "FAIL" in states:
        verdict = "FAIL"
    elif "n/a" in states:
        verdict = "PARTIAL"
    else:
        verdict = "PASS"
    return {"speed_bar": bar, "speed": speed, "symm": symm, "verdict": verdict}


def make_row(tokens: int, hidden: int, dtype: str, world: int, sets: int, times: dict, errors: dict,
             symm_note: str, fo_ctas: Sequence[int], all_ctas: Sequence[int],
             configs: Sequence[Sequence[int]] = ()) -> dict:
    """A token count's row from the per-variant times (us, max over ranks; a missing variant is nan)
    and the check's errors (max over ranks). Same keys for every token count (one CSV)."""
    nan = math.nan
    row = {"tokens": tokens, "hidden": hidden, "dtype": dtype, "world_size": world, "sets": sets}
    for v in ("nccl", "nccl_norm", "nccl_norm_clone", "nccl_cnorm", "symm", "symm_copy"):
        row[f"{v}_us"] = times.get(v, nan)
    for c in all_ctas:
        row[f"fo_{c}_us"] = times.get(f"fo_{c}", nan)
    for c in fo_ctas:
        row[f"fo_sharded_{c}_us"] = times.get(f"fo_sharded_{c}", nan)
    row[f"api_{API_CTAS}_us"] = times.get(f"api_{API_CTAS}", nan)
    for config in configs:
        for c in fo_ctas:
            name = f"fo_{c}@{config_name(config)}"
            row[f"{name}_us"] = times.get(name, nan)
    for name in sorted(times):
        if name.startswith("fo_pull"):
            row[f"{name}_us"] = times[name]
    row["best_ctas"], row["best_us"] = best_of(times, fo_ctas)
    row["best_sharded_ctas"], row["best_sharded_us"] = best_of(times, fo_ctas, "fo_sharded_")
    baselines = [t for t in (row["nccl_norm_us"], row["nccl_cnorm_us"]) if _finite(t)]
    row["baseline_us"] = min(baselines) if baselines else nan
    row["speedup"] = row["baseline_us"] / row["best_us"] if _finite(row["best_us"]) else nan
    row["speedup_sharded"] = row["baseline_us"] / row["best_sharded_us"] if _finite(row["best_sharded_us"]) else nan
    row["vs_symm"] = row["best_us"] / row["symm_us"] if _finite(row["symm_us"]) else nan
    row["vs_symm_copy"] = row["best_us"] / row["symm_copy_us"] if _finite(row["symm_copy_us"]) else nan
    row["symm_note"] = symm_note
    row["max_rel_error"] = max(errors.values()) if errors else nan
    row["failed"] = " ".join(name for name, e in errors.items() if not e <= TOLERANCE)
    verdict = judge(row)
    row["speed_bar"] = verdict["speed_bar"] if verdict["speed_bar"] is not None else nan
    row["speed_pass"], row["symm_pass"], row["verdict"] = verdict["speed"], verdict["symm"], verdict["verdict"]
    return row


def fmt(v, width: int, spec: str = ".1f", suffix: str = "") -> str:
    """A right-aligned number, or n/a where it was not measured."""
    return f"{'n/a':>{width}}" if not _finite(v) else f"{format(v, spec) + suffix:>{width}}"


def table(rows: list, meta: dict, dtype: str, fo_ctas: Sequence[int]) -> list[str]:
    """The main table: one line per token count, then the verdict summary and any wrong result."""
    lines = [f"# AllReduce + add + RMSNorm, {meta['world_size']} x {meta['gpu']}, hidden {rows[0]['hidden']}, {dtype}, "
             f"{meta['date']}; command: {meta['command']}; kernel {config_name(_env.norm_config())}",
             "# times in us (median, max over ranks); best = fastest fo (residual full) on <= 32 CTAs [its CTAs]; "
             "x norm = baseline / best (baseline: NCCL in place + torch add-RMSNorm, the faster of eager and compiled "
             f"where measured); /symm = best / symm (bar <= {SYMM_BAR}); s+cp = symm with x copied in and the sum "
             f"out (vLLM's way; no bar), /s+cp = best / s+cp; shard = fastest residual_out='sharded'; "
             f"api = the public function on {API_CTAS} CTAs (its per-call host sync included)",
             f"{'tokens':>6} {'nccl':>8} {'nccl_norm':>9} {'clone':>8} {'cnorm':>8} {'symm':>8} {'s+cp':>8} " +
             " ".join(f"{f'fo_{c}':>8}" for c in fo_ctas) +
             f" {'best':>8} {'[c]':>4} {'shard':>8} {'api':>8} {'x norm':>7} {'bar':>5} {'/symm':>6} "
             f"{'/s+cp':>6} {'speed':>5} {'symm':>5} {'verdict':>7} {'err':>8}"]
    for r in rows:
        bar = f"{r['speed_bar']:.1f}x" if _finite(r["speed_bar"]) else "-"
        lines.append(f"{r['tokens']:>6} {fmt(r['nccl_us'], 8)} {fmt(r['nccl_norm_us'], 9)} "
                     f"{fmt(r['nccl_norm_clone_us'], 8)} {fmt(r['nccl_cnorm_us'], 8)} {fmt(r['symm_us'], 8)} "
                     f"{fmt(r['symm_copy_us'], 8)} " +
                     " ".join(fmt(r[f"fo_{c}_us"], 8) for c in fo_ctas) +
                     f" {fmt(r['best_us'], 8)} {r['best_ctas']:>4} {fmt(r['best_sharded_us'], 8)} "
                     f"{fmt(r[f'api_{API_CTAS}_us'], 8)} {fmt(r['speedup'], 7, '.2f', 'x')} {bar:>5} "
                     f"{fmt(r['vs_symm'], 6, '.3f')} {fmt(r['vs_symm_copy'], 6, '.3f')} {r['speed_pass']:>5} {r['symm_pass']:>5} {r['verdict']:>7} "
                     f"{fmt(r['max_rel_error'], 8, '.1e')}")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("PASS", "PARTIAL", "FAIL")}
    lines.append(f"bars: {counts['PASS']} PASS, {counts['PARTIAL']} PARTIAL (a bar not measurable), "
                 f"{counts['FAIL']} FAIL of {len(rows)} token counts")
    for r in rows:
        if r["symm_note"]:
            lines.append(f"symm n/a at {r['tokens']} tokens: {r['symm_note']}")
        if r["failed"]:
            lines.append(f"WRONG RESULT at {r['tokens']} tokens: {r['failed']} over relative error {TOLERANCE} "
                         f"(max {r['max_rel_error']:.1e})")
    return lines


def curve_rows(rows: list, ctas: Sequence[int]) -> list:
    """The rows that hold the whole CTA curve."""
    return [r for r in rows if all(_finite(r.get(f"fo_{c}_us")) for c in ctas)]


def curve_lines(rows: list, ctas: Sequence[int]) -> list[str]:
    lines = ["", "# time (us) of fo (residual full) vs its CTA count; the baselines of the same token count for scale"]
    found = curve_rows(rows, ctas)
    if not found:
        return lines + ["no token count with the CTA curve was timed"]
    lines.append(f"{'tokens':>6} " + " ".join(f"{c:>8}" for c in ctas) + f" {'baseline':>9} {'symm':>8}")
    for r in found:
        lines.append(f"{r['tokens']:>6} " + " ".join(fmt(r[f'fo_{c}_us'], 8) for c in ctas) +
                     f" {fmt(r['baseline_us'], 9)} {fmt(r['symm_us'], 8)}")
    return lines


def plot_curve(rows: list, ctas: Sequence[int], path: str) -> str:
    """<path>: the CTA curve per token count with the baselines as horizontal lines. Returns what
    happened (the PNG is skipped, with the reason, without matplotlib or curve data)."""
    found = curve_rows(rows, ctas)
    if not found:
        return "no PNG: no token count with the CTA curve was timed"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError as e:
        return f"no PNG: matplotlib is not available ({e})"
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in found:
        (line,) = ax.plot(ctas, [r[f"fo_{c}_us"] for c in ctas], marker="o", label=f"fo, {r['tokens']} tokens")
        if _finite(r["baseline_us"]):
            ax.axhline(r["baseline_us"], color=line.get_color(), ls="--", lw=1,
                       label=f"NCCL + torch add-RMSNorm, {r['tokens']}")
        if _finite(r["symm_us"]):
            ax.axhline(r["symm_us"], color=line.get_color(), ls=":", lw=1,
                       label=f"symm two_shot_all_reduce_, {r['tokens']}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())  # plain microseconds, not 10^k
    ax.set_xticks(list(ctas))
    ax.set_xticklabels([str(c) for c in ctas])
    ax.set_xlabel("CTAs")
    ax.set_ylabel("time (us, median, max over ranks)")
    ax.set_title(f"all_reduce_rmsnorm, hidden {found[0]['hidden']}, {found[0]['dtype']}, "
                 f"world {found[0]['world_size']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def chain_length(gemm_us: float, op_us: float, cover: float = CHAIN_COVER, cap: int = 10_000) -> int:
    """Back-to-back calls whose stand-alone time covers `cover` GEMM times (at least 1)."""
    if not (_finite(gemm_us) and _finite(op_us)) or op_us <= 0:
        raise ValueError(f"chain_length: expected positive times, got {gemm_us}, {op_us}")
    return max(1, min(cap, math.ceil(cover * gemm_us / op_us)))


def overlap_fraction(gemm_end: float, chain_start: float, chain_end: float) -> float:
    """The fraction of the GEMM [0, gemm_end] during which the chain [chain_start, chain_end] ran
    (times relative to the GEMM's start)."""
    if gemm_end <= 0:
        return 0.0
    return max(0.0, min(chain_end, gemm_end) - max(chain_start, 0.0)) / gemm_end


def conc_verdict(ratio: float, cover: float, bar: float = CONC_BAR) -> str:
    if not _finite(ratio):
        return "n/a"
    if not cover >= MIN_COVER:
        return f"INVALID (the calls covered {cover:.0%} of the GEMM)"
    return "PASS" if ratio >= bar else "FAIL"


def conc_lines(conc: dict) -> list[str]:
    g = conc
    lines = ["", f"# concurrency: cuBLAS GEMM {g['gemm']} on the compute stream, alone and beside back-to-back calls "
                 "on a high-priority side stream (us: median, max over ranks; ratio: worst rank)",
             f"GEMM alone {fmt(g['gemm_alone_us'], 0)} us"]
    for name, what in (("fo", f"fo ({g['ctas']} CTAs, {g['tokens']} tokens)"),
                       ("nccl", f"NCCL all_reduce ({g['tokens']} x {g['hidden']}, reference)")):
        lines.append(f"beside {what}: GEMM {fmt(g[f'gemm_with_{name}_us'], 0)} us, "
                     f"{fmt(g[f'ratio_{name}'], 0, '.3f')} of its stand-alone speed"
                     + (f" (bar >= {CONC_BAR:.2f}): {g['verdict']}" if name == "fo" else "") +
                     f"; {g[f'chain_{name}']} calls of {fmt(g[f'{name}_alone_us'], 0)} us each alone, "
                     f"covering {fmt(g[f'cover_{name}'] * 100, 0, '.0f')}% of the GEMM")
    return lines


def apply_env_defaults(environ=os.environ) -> None:
    """NVLink multicast off unless the caller set these (only ever to the disabling values here;
    the spawned ranks get them forced by bench.init_worker)."""
    for key, value in bench.SAFE_ENV.items():
        environ.setdefault(key, value)


def default_out(gpu_name: str, world: int, dtype: str) -> str:
    gpu = gpu_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"bench_all_reduce_rmsnorm_{gpu}x{world}_{dtype}")


# ---- the ranks ----------------------------------------------------------------------------------

def _min_over_ranks(v: float) -> float:
    return -bench._max_over_ranks(-v)


class _Case:
    """The operands of one token count on this rank and its variants: name -> (fn(i), kind, mode),
    kind "sum" (an AllReduce alone) or "norm" (returns (out, r)), mode "full" or "sharded"."""

    def __init__(self, ctx: "_Rank", tokens: int, sets: int):
        import torch.distributed as dist

        import flashoverlap

        self.tokens, self.sets = tokens, sets
        h, dtype = ctx.hidden, ctx.dtype
        gen = torch.Generator(device="cuda").manual_seed(SEED + 7 * tokens + 100_003 * (ctx.rank + 1))
        # Replicated in tensor parallelism: the same residual and weight on every rank.
        shared = torch.Generator(device="cuda").manual_seed(SEED + 7 * tokens)
        self.xs = [torch.randn(tokens, h, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
        self.residuals = [torch.randn(tokens, h, device="cuda", dtype=dtype, generator=shared) for _ in range(sets)]
        self.weight = (torch.rand(h, device="cuda", generator=shared) + 0.5).to(dtype)
        weight_f = self.weight.float()
        self.works = [x.clone() for x in self.xs]
        self.symm_bufs, self.symm_note = ctx.symm_buffers(tokens, sets)
        if self.symm_bufs is not None:
            for buf, x in zip(self.symm_bufs, self.xs):
                buf.copy_(x)
        xs, residuals, works, symm_bufs, weight = self.xs, self.residuals, self.works, self.symm_bufs, self.weight
        rms_norm = getattr(torch.nn.functional, "rms_norm", None)

        def add_rmsnorm(y, residual):
            r = y.float().add_(residual)
            if rms_norm is not None:
                out = rms_norm(r, (h,), weight_f, EPS)
            else:
                out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight_f
            return out.to(dtype), r.to(dtype)

        def nccl(i):
            dist.all_reduce(works[i % sets])
            return works[i % sets]

        def nccl_norm(i):
            y = works[i % sets]
            dist.all_reduce(y)
            return add_rmsnorm(y, residuals[i % sets])

        def nccl_norm_clone(i):
            y = xs[i % sets].clone()
            dist.all_reduce(y)
            return add_rmsnorm(y, residuals[i % sets])

        def nccl_cnorm(i):
            y = works[i % sets]
            dist.all_reduce(y)
            return ctx.cnorm(y, residuals[i % sets], weight_f)

        def symm(i):
            buf = symm_bufs[i % sets]
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", ctx.group_name)
            return buf

        def symm_copy(i):
            buf = symm_bufs[i % sets]
            buf.copy_(xs[i % sets])
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", ctx.group_name)
            return buf.clone()

        op = torch.ops.flashoverlap.all_reduce_rmsnorm

        def fo(ctas, mode):
            return lambda i: op(xs[i % sets], residuals[i % sets], weight, EPS, ctx.op_name, mode, ctas)

        def fo_config(ctas, config):
            """The kernel compiled as `config`, launched on the op's peer buffers (made by api_16's
            first call, which runs before any of these), with the copy engines where the op would
            use them."""
            from flashoverlap import peer_norm

            def call(i):
                x, residual = xs[i % sets], residuals[i % sets]
                out, r = torch.empty_like(x), torch.empty_like(x)
                group = peer_norm._GROUPS[ctx.op_name]
                group.launch(x, residual, weight, out, r, EPS, ctas, config=config,
                             copy_engines=group.copy_engines(x.shape[0], ctas))
                return out, r
            return call

        def api(i):
            return flashoverlap.all_reduce_rmsnorm(xs[i % sets], residuals[i % sets], weight, EPS, ctas=API_CTAS)

        v = {"nccl": (nccl, "sum", None), "nccl_norm": (nccl_norm, "norm", "full"),
             "nccl_norm_clone": (nccl_norm_clone, "norm", "full")}
        if ctx.cnorm is not None:
            v["nccl_cnorm"] = (nccl_cnorm, "norm", "full")
        if symm_bufs is not None:
            v["symm"] = (symm, "sum", None)
            v["symm_copy"] = (symm_copy, "sum", None)
        # The public function first: its first call per group (and with more tokens) makes or grows the
        # peer buffers, a collective host step the registered op must not meet inside a timing.
        v[f"api_{API_CTAS}"] = (api, "norm", "full")
        for c in ctas_at(tokens, ctx.fo_ctas, ctx.curve_ctas, ctx.curve_tokens):
            v[f"fo_{c}"] = (fo(c, "full"), "norm", "full")
        for c in ctx.fo_ctas:
            v[f"fo_sharded_{c}"] = (fo(c, "sharded"), "norm", "sharded")
        for config in ctx.configs:
            for c in ctx.fo_ctas:
                v[f"fo_{c}@{config_name(config)}"] = (fo_config(c, tuple(config)), "norm", "full")
        if ctx.pull:
            self._pull_variants(ctx, v)
        self.variants = v

    def _pull_variants(self, ctx: "_Rank", v: dict) -> None:
        """fo_pull[_sharded]_<c>[@config] (c: the most CTAs of the bars): the kernel in pull mode
        with x already in this rank's partial area (as a producer storing there leaves it; symm's x
        likewise lies in its buffer), one peer group per operand set so that the rotation matches
        symm's."""
        from flashoverlap.peer_norm import _slice

        tokens, sets, weight = self.tokens, self.sets, self.weight
        partials = ctx.pull_partials(tokens, sets)
        for (_, part), x in zip(partials, self.xs):
            part.copy_(x)
        a, b = _slice(tokens, ctx.world, ctx.rank)
        residuals = self.residuals

        def call(ctas, full, config):
            def run(i):
                group, part = partials[i % sets]
                out = torch.empty_like(part)
                r = torch.empty_like(part) if full else part.new_empty((b - a, part.shape[1]))
                group.launch(part, residuals[i % sets], weight, out, r, EPS, ctas, full=full, pull=True,
                             config=config)
                return out, r
            return run

        for config in [None] + [tuple(c) for c in ctx.configs]:
            tag = "" if config is None else f"@{config_name(config)}"
            for c in ctx.fo_ctas[-1:]:
                v[f"fo_pull_{c}{tag}"] = (call(c, True, config), "norm", "full")
                v[f"fo_pull_sharded_{c}{tag}"] = (call(c, False, config), "norm", "sharded")

    def check(self, ctx: "_Rank") -> dict:
        """Each variant's relative error on operand set 0 against the fp32 reference (this rank)."""
        import torch.distributed as dist

        from flashoverlap.peer_norm import _slice

        ref_sum = self.xs[0].float()
        dist.all_reduce(ref_sum)
        ref_r = ref_sum + self.residuals[0].float()
        ref_out = ref_r * torch.rsqrt(ref_r.pow(2).mean(-1, keepdim=True) + EPS) * self.weight.float()
        a, b = _slice(self.tokens, ctx.world, ctx.rank)
        errors = {}
        for name, (fn, kind, mode) in self.variants.items():
            # The in-place variants start from x again.
            self.works[0].copy_(self.xs[0])
            if self.symm_bufs is not None:
                self.symm_bufs[0].copy_(self.xs[0])
            if name.startswith(("fo_", "api_")):
                # The op allocates its outputs: leave NaN in the blocks the allocator hands out next,
                # so that rows it never writes cannot read as an earlier variant's correct result.
                rows = self.tokens if mode == "full" else b - a
                poison = [torch.empty(self.tokens, ctx.hidden, device="cuda", dtype=ctx.dtype),
                          torch.empty(rows, ctx.hidden, device="cuda", dtype=ctx.dtype)]
                for t in poison:
                    t.fill_(math.nan)
                del poison, t
            got = fn(0)
            if kind == "sum":
                errors[name] = rel_error(got, ref_sum)
            else:
                out, r = got
                errors[name] = max(rel_error(out, ref_out), rel_error(r, ref_r if mode == "full" else ref_r[a:b]))
        torch.cuda.synchronize()
        return errors


class _Rank:
    """One rank's state across token counts and rounds."""

    def __init__(self, cfg: dict):
        import torch.distributed as dist

        from flashoverlap.peer_norm import _name

        self.cfg = cfg
        self.dtype = getattr(torch, cfg["dtype"])
        self.hidden = cfg["hidden"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # The same counts on every rank: the variant lists, hence the collective calls, must match.
        self.sms = int(_min_over_ranks(float(props.multi_processor_count)))
        self.l2 = int(_min_over_ranks(float(getattr(props, "L2_cache_size", 0) or L2_DEFAULT)))
        self.fo_ctas = clamp_ctas(cfg["fo_ctas"], self.sms)
        self.curve_ctas = clamp_ctas(cfg["curve_ctas"], self.sms)
        self.curve_tokens = tuple(cfg["curve_tokens"])
        self.configs = [tuple(c) for c in cfg.get("configs", [])]
        self.pull = bool(cfg.get("pull"))
        self.pull_groups: list = []
        self.pull_tokens = 0
        self.group_name = dist.group.WORLD.group_name
        self.op_name = _name(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()))
        self.symm: dict[int, tuple] = {}
        self.symm_mem, error = None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            torch.ops.symm_mem.two_shot_all_reduce_  # raises where the op is not built
            self.symm_mem = symm_mem
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self.symm_error = self._agree(error, "unavailable on another rank")
        self.cnorm, self.cnorm_note = None, "not requested (--compiled-norm)"
        if cfg["compiled_norm"]:
            self._compile_norm()

    @staticmethod
    def _agree(error: str, elsewhere: str) -> str:
        """The error if any rank had one: every rank then skips the same collective calls."""
        failed = bench._max_over_ranks(1.0 if error else 0.0) > 0
        return (error or elsewhere) if failed else ""

    def _compile_norm(self) -> None:
        hidden, dtype = self.hidden, self.dtype
        rms_norm = getattr(torch.nn.functional, "rms_norm", None)

        def norm(y, residual, weight_f):
            r = y.float() + residual.float()
            if rms_norm is not None:
                out = rms_norm(r, (hidden,), weight_f, EPS)
            else:
                out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight_f
            return out.to(dtype), r.to(dtype)

        error = ""
        try:
            compiled = torch.compile(norm)
            y = torch.randn(8, hidden, device="cuda", dtype=dtype)
            compiled(y, y, torch.ones(hidden, device="cuda"))
            torch.cuda.synchronize()
        except Exception as e:
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        error = self._agree(error, "torch.compile failed on another rank")
        if error:
            self.cnorm_note = error
        else:
            self.cnorm, self.cnorm_note = compiled, ""

    def sets(self, tokens: int) -> int:
        return rotation_sets(tokens * self.hidden * self.dtype.itemsize, self.l2)

    def pull_partials(self, tokens: int, sets: int) -> list:
        """`sets` (peer group, partial area of [tokens, hidden]) pairs in pull layout, each group's
        buffers made for this token count (collective: every rank asks alike). The buffers of the
        previous token count are freed first: one per operand set would not fit at every size."""
        import torch.distributed as dist

        from flashoverlap import _core
        from flashoverlap._validation import dtype_name
        from flashoverlap.peer_norm import PeerGroup

        if self.pull_tokens != tokens:
            torch.cuda.synchronize()
            dist.barrier()
            self.free_pull_buffers()
            self.pull_tokens = tokens
        while len(self.pull_groups) < sets:
            self.pull_groups.append(PeerGroup(dist.group.WORLD, torch.device("cuda", torch.cuda.current_device()),
                                              op="pull"))
        nbytes = _core.allreduce_rmsnorm_buffer_bytes(self.world, tokens, self.hidden, dtype_name(self.dtype),
                                                      pull=True)
        pairs = []
        for group in self.pull_groups[:sets]:
            if not group.ensure(nbytes):
                raise RuntimeError("pull: no peer access")
            pairs.append((group, group.partial(tokens, self.hidden, self.dtype)))
        return pairs

    def free_pull_buffers(self) -> None:
        """Closes every pull group's buffers (pull_partials makes them again)."""
        for group in self.pull_groups:
            if group.memory is not None:
                group.memory.close()
                group.memory = None

    def symm_buffers(self, tokens: int, sets: int) -> tuple[Optional[list], str]:
        """`sets` symmetric-memory buffers of [tokens, hidden] (kept across rounds: the rendezvous is
        collective and slow), or (None, why) on every rank if any rank failed."""
        if tokens in self.symm:
            return self.symm[tokens]
        bufs, error = None, self.symm_error
        if not error:
            try:
                bufs = []
                for _ in range(sets):
                    buf = self.symm_mem.empty((tokens, self.hidden), dtype=self.dtype, device="cuda")
                    self.symm_mem.rendezvous(buf, self.group_name)
                    bufs.append(buf)
                bufs[0].normal_()
                # One call here, so that a failure shows before the timing loop.
                torch.ops.symm_mem.two_shot_all_reduce_(bufs[0], "sum", self.group_name)
                torch.cuda.synchronize()
            except Exception as e:
                error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            error = self._agree(error, "failed on another rank")
        if error:
            bufs = None
        self.symm[tokens] = (bufs, error)
        return self.symm[tokens]

    def measure(self, tokens: int, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
        """One round of one token count (bench.pooled_rounds' measure; all ranks call it alike)."""
        import torch.distributed as dist

        case = _Case(self, tokens, self.sets(tokens))
        api = f"api_{API_CTAS}"
        fns = {name: v[0] for name, v in case.variants.items() if name != api}
        dist.barrier()
        times = bench.interleaved_times_us(fns, iters, warmup)
        # The public function's per-call host sync would stall the queue for the variants after it.
        times.update(bench.interleaved_times_us({api: case.variants[api][0]}, iters, warmup))
        return times, {}


def measure_concurrency(ctx: _Rank, cfg: dict, iters: int, warmup: int) -> dict:
    """The GEMM alone and beside chains of the fused op / NCCL on a side stream (see the docstring)."""
    import torch.distributed as dist

    import flashoverlap

    tokens, ctas = cfg["conc_tokens"], min(cfg["conc_ctas"], ctx.sms)
    m, n, k = cfg["gemm"]
    h, dtype = ctx.hidden, ctx.dtype
    gen = torch.Generator(device="cuda").manual_seed(SEED + 31 + ctx.rank)
    shared = torch.Generator(device="cuda").manual_seed(SEED + 31)
    a = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
    b = torch.randn(k, n, device="cuda", dtype=dtype, generator=gen)
    x = torch.randn(tokens, h, device="cuda", dtype=dtype, generator=gen)
    residual = torch.randn(tokens, h, device="cuda", dtype=dtype, generator=shared)
    weight = (torch.rand(h, device="cuda", generator=shared) + 0.5).to(dtype)
    work = x.clone()
    flashoverlap.all_reduce_rmsnorm(x, residual, weight, EPS, ctas=ctas)  # sizes the peer buffers, outside timing
    op = torch.ops.flashoverlap.all_reduce_rmsnorm
    calls = {"fo": lambda: op(x, residual, weight, EPS, ctx.op_name, "full", ctas),
             "nccl": lambda: dist.all_reduce(work)}
    alone = bench.interleaved_times_us({"gemm": lambda i: torch.matmul(a, b), "fo": lambda i: calls["fo"](),
                                        "nccl": lambda i: calls["nccl"]()}, max(5, iters // 5), warmup)
    # From maxima over ranks: every rank computes the same chain lengths, so issues the same calls.
    med = {name: bench._max_over_ranks(statistics.median(v)) for name, v in alone.items()}
    chains = {name: chain_length(med["gemm"], med[name]) for name in ("fo", "nccl")}
    gate = GATE_CYCLES + 100_000 * max(chains.values())
    side = torch.cuda.Stream(priority=-1)
    main = torch.cuda.current_stream()
    samples = {mode: [] for mode in ("alone", "fo", "nccl")}
    for it in range(warmup + iters):
        for mode in samples:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            work.copy_(x)  # the NCCL chain sums in place: bounded growth
            # Both streams wait on this sleep, so the side chain and the GEMM start together
            # however long the host takes to enqueue them.
            torch.cuda._sleep(gate)
            side.wait_stream(main)
            if mode != "alone":
                with torch.cuda.stream(side):
                    ev[2].record()
                    for _ in range(chains[mode]):
                        calls[mode]()
                    ev[3].record()
            ev[0].record()
            torch.matmul(a, b)
            ev[1].record()
            main.wait_stream(side)
            if it >= warmup:
                samples[mode].append(ev)
    torch.cuda.synchronize()
    gemm_us, cover = {}, {}
    for mode, evs in samples.items():
        gemm_us[mode] = statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in evs)
        if mode != "alone":
            cover[mode] = statistics.median(overlap_fraction(e[0].elapsed_time(e[1]), e[0].elapsed_time(e[2]),
                                                             e[0].elapsed_time(e[3])) for e in evs)
    result = {"gemm": "x".join(map(str, (m, n, k))), "tokens": tokens, "hidden": h, "ctas": ctas,
              "gemm_alone_us": bench._max_over_ranks(gemm_us["alone"])}
    for name in ("fo", "nccl"):
        result[f"{name}_alone_us"] = med[name]
        result[f"chain_{name}"] = chains[name]
        result[f"gemm_with_{name}_us"] = bench._max_over_ranks(gemm_us[name])
        result[f"ratio_{name}"] = _min_over_ranks(gemm_us["alone"] / gemm_us[name])
        result[f"cover_{name}"] = _min_over_ranks(cover[name])
    result["verdict"] = conc_verdict(result["ratio_fo"], result["cover_fo"])
    return result


def _worker(rank, world, init_method, cfg, result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    ctx = None
    try:
        ctx = _Rank(cfg)
        # Correctness of every variant at every token count before any timing; errors max over
        # ranks (the same variants in the same order on every rank: _max_over_ranks is collective).
        checks = {}
        for tokens in cfg["checked"]:
            case = _Case(ctx, tokens, ctx.sets(tokens))
            errors = {name: bench._max_over_ranks(e) for name, e in case.check(ctx).items()}
            del case
            checks[tokens] = {"errors": errors,
                              "failed": [name for name, e in errors.items() if not e <= TOLERANCE]}
            if rank == 0:
                print(f"checked {tokens} tokens: max relative error {max(errors.values()):.1e}"
                      + (f", FAILED: {' '.join(checks[tokens]['failed'])}" if checks[tokens]["failed"] else ""),
                      flush=True)
        shapes = [(t,) for t in cfg["timed"]]
        pooled, _ = bench.pooled_rounds(ctx.measure, shapes, ctx.dtype, cfg["iters"], cfg["warmup"])
        all_ctas = sorted(set(ctx.fo_ctas) | set(ctx.curve_ctas))
        rows = []
        for (tokens,) in shapes:
            times = {name: bench._max_over_ranks(statistics.median(v)) for name, v in pooled[(tokens,)].items()}
            rows.append(make_row(tokens, ctx.hidden, cfg["dtype"], world, ctx.sets(tokens), times,
                                 checks[tokens]["errors"], ctx.symm[tokens][1], ctx.fo_ctas, all_ctas,
                                 ctx.configs))
        conc = measure_concurrency(ctx, cfg, cfg["iters"], cfg["warmup"])
        if rank == 0:
            meta = {**bench.environment(world), "hidden": ctx.hidden, "sms": ctx.sms, "l2_bytes": ctx.l2,
                    "fo_ctas": ctx.fo_ctas, "curve_ctas": ctx.curve_ctas, "curve_tokens": list(ctx.curve_tokens),
                    "eps": EPS, "tolerance": TOLERANCE, "compiled_norm": ctx.cnorm_note or "measured",
                    "checks": {str(t): c for t, c in checks.items()}, "concurrency": conc,
                    "bars": {"speedup": [list(b) for b in SPEEDUP_BARS], "vs_symm_max": SYMM_BAR,
                             "gemm_ratio_min": CONC_BAR}}
            with open(result_path, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f)
    finally:
        flashoverlap.destroy_peer_groups()
        if ctx is not None:
            ctx.free_pull_buffers()
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help=f"token counts to time (default {' '.join(map(str, TOKENS))}; --quick: "
                        f"{' '.join(map(str, QUICK_TOKENS))})")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=None, help=f"timed iterations per variant (default {ITERS}; "
                                                            f"--quick: {QUICK_ITERS})")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (1 for a smoke test)")
    p.add_argument("--quick", action="store_true", help="fewer token counts and iterations")
    p.add_argument("--gemm", type=_shape, default=GEMM_SHAPE, help="MxNxK of the concurrency test's GEMM")
    p.add_argument("--conc-tokens", type=int, default=CONC_TOKENS)
    p.add_argument("--conc-ctas", type=int, default=CONC_CTAS)
    p.add_argument("--compiled-norm", action="store_true",
                   help="also time NCCL + a torch.compile'd add-RMSNorm (then the bar's baseline is the faster)")
    p.add_argument("--configs", type=parse_config, nargs="*", default=[],
                   help="also time the fused kernel as each THREADSxUNROLL[sSTAGES] (e.g. 512x2 512x4s4)")
    p.add_argument("--pull", action="store_true",
                   help="also time the kernel in pull mode on x already in its peer buffer")
    p.add_argument("--out", default=None, help="path without extension (default: evaluation/results/"
                                               "bench_all_reduce_rmsnorm_<gpu>x<world>_<dtype>)")
    args = p.parse_args(argv)
    apply_env_defaults()
    world = args.world_size or torch.cuda.device_count()
    if world < 1:
        p.error("no CUDA device")
    timed, checked = token_lists(args.tokens, args.quick, world)
    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    out = args.out or default_out(torch.cuda.get_device_name(0), world, args.dtype)
    cfg = {"timed": timed, "checked": checked, "hidden": args.hidden, "dtype": args.dtype, "iters": iters,
           "warmup": args.warmup, "fo_ctas": list(FO_CTAS), "curve_ctas": list(CURVE_CTAS),
           "curve_tokens": list(CURVE_TOKENS), "conc_tokens": args.conc_tokens, "conc_ctas": args.conc_ctas,
           "gemm": list(args.gemm), "compiled_norm": args.compiled_norm,
           "configs": [list(c) for c in args.configs], "pull": args.pull}
    data = bench.spawn_ranks(_worker, world, cfg)
    rows, meta = data["rows"], data["meta"]
    lines = table(rows, meta, args.dtype, meta["fo_ctas"])
    lines += curve_lines(rows, meta["curve_ctas"])
    lines += config_lines(rows, cfg["configs"], meta["fo_ctas"])
    lines += pull_lines(rows)
    lines += conc_lines(meta["concurrency"])
    lines += ["", "# correctness (relative error vs fp32, max over ranks, every variant; checked before timing)"]
    wrong = False
    for t, c in meta["checks"].items():
        wrong |= bool(c["failed"])
        lines.append(f"{t:>6} tokens: max {max(c['errors'].values()):.1e}" +
                     (f"  WRONG: {' '.join(c['failed'])}" if c["failed"] else "  ok"))
    if meta["compiled_norm"] != "measured":
        lines.append(f"nccl_cnorm: {meta['compiled_norm']}")
    print("\n".join(lines))
    bench.write_outputs(out, lines, rows, meta)
    print(plot_curve(rows, meta["curve_ctas"], out + "_ctas.png"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
