"""flashoverlap.all_reduce / flashoverlap.reduce_scatter (plain collectives, no GEMM) on both
backends against torch.distributed, and the interference each backend causes to a concurrent
GEMM, on all local GPUs, the baselines measured in the same run.

Table 1, the collectives alone. Per kind (AllReduce, ReduceScatter) and size (MB = 2^20 bytes of
the per-rank input x, a flat randn tensor; rounded down to whole 16 * world-byte blocks, what the
copy-engine ReduceScatter moves):

  torch      the framework's NCCL: AllReduce = torch.distributed.all_reduce in place on a
             preallocated work buffer holding a copy of x (copied outside the timing, so the
             baseline pays neither the copy nor an allocation); ReduceScatter =
             torch.distributed.reduce_scatter_tensor of x into a preallocated output
  fo_nccl    flashoverlap.all_reduce / reduce_scatter(x, backend="nccl"): flashoverlap's own NCCL
             communicator (capped to its max CTAs, 24 by default); x is left as it was, so the
             AllReduce includes its clone of x and both allocate their output
  fo_ce      the same with backend="copy_engine", ctas=8: each rank copies its x (ReduceScatter:
             each peer's block) into the peers' staging slots on the copy engines, no SM, then sums
             the world's copies on 8 CTAs into a new output
  fo_ce_<c>  (--ctas-sweep) the same on c = 4 and 16 CTAs

Each is reported as the median time and the algorithm bandwidth (bytes of x per rank / time,
1 GB = 1e9 bytes; the CSV adds the bus bandwidth: x 2(w-1)/w for AllReduce, (w-1)/w for
ReduceScatter); ce/torch = fo_ce time / torch time (< 1: the copy engines are faster).

Table 2, the GEMM beside the collectives. Per GEMM shape MxNxK (the 16 benchmark shapes;
--quick: 4 of them; --shapes): torch.matmul(x [M, K], w [N, K].t()) on the compute stream, timed
by CUDA events around the GEMM alone, in four modes:

  alone      nothing else running
  torch      beside a back-to-back chain of torch.distributed.all_reduce (NCCL with the CTAs it
             chooses, not capped) in place on [M, N] work buffers (reset from random data before
             each trial: the in-place sums grow by the world size per call)
  fo_nccl    beside a chain of flashoverlap.all_reduce(backend="nccl") of [M, N] random buffers
  fo_ce      beside a chain of flashoverlap.all_reduce(backend="copy_engine", ctas=8)

The chain runs on a high-priority side stream, independent of the GEMM; its input is an unrelated
buffer of the GEMM's output size (M * N elements), rotated over enough buffers to exceed 2x L2.
The chain length is the number of calls whose stand-alone time covers 1.5x the stand-alone GEMM,
from medians that are the maximum over ranks, so that every rank issues the same collective calls.
Both streams wait on one GPU sleep (long enough for the host to enqueue the whole chain and the
GEMM), so they start together. Reported per mode: the GEMM's median time (max over ranks),
slowdown = GEMM beside / GEMM alone (per rank, the worst rank's), and cover = the fraction of the
GEMM's time the chain was running (median per rank, the lowest rank's; below 95% the slowdown
understates the interference and the cell is marked *). The bar "the reduction kernels use <= 8
CTAs" is read off the CTA count fo_ce passes (clamped to the SM count, as the op clamps it).

Correctness, before any timing: every variant at every size of table 1, and every chain call at
every GEMM output size of table 2, against the fp32 sum (fp32 all_reduce of x.float();
ReduceScatter: this rank's block of it): relative Frobenius error <= 1e-2, maximum over ranks.
flashoverlap's outputs are poisoned with NaN first (blocks freed right before the call, so the
caching allocator hands them out). A wrong result marks the row WRONG and the script exits 1.

Timing: CUDA events, medians after warm-up (bench.interleaved_times_us: variants interleaved, each
call taking the next of N operand sets, N such that N sets exceed 2x the L2 cache), table 1
pooled over 3 rounds across all sizes (bench.pooled_rounds), maximum over ranks. Environment
defaults: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.

Writes <out>.txt (both tables), <out>.csv (one row per size and per GEMM shape, column "table"
says which) and <out>.json (environment, checks). Runs at world size 1 too (a smoke test).

    python evaluation/bench_collectives.py [--sizes-mb 1 4 16 64] [--iters 50] [--world-size 2] [--quick]
        [--shapes 4096x8192x4096 ...] [--dtype bfloat16] [--ctas-sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from flashoverlap import bench
from flashoverlap.cli import _shape


def _load_sibling(name: str):
    """An evaluation script next to this one, by path (evaluation/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_flashoverlap_eval_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The AllReduce + RMSNorm benchmark's pure helpers: rotation, errors, the concurrency chain's
# length and coverage, the env defaults, number formatting, the min over ranks.
_ar = _load_sibling("bench_all_reduce_rmsnorm")
rotation_sets = _ar.rotation_sets
rel_error = _ar.rel_error
chain_length = _ar.chain_length
overlap_fraction = _ar.overlap_fraction
apply_env_defaults = _ar.apply_env_defaults
fmt = _ar.fmt
_finite = _ar._finite

KINDS = ("all_reduce", "reduce_scatter")
SIZES_MB = (1.0, 4.0, 16.0, 64.0)
SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))]
QUICK_SHAPES = [(4096, 8192, 4096), (8192, 8192, 1024), (8192, 8192, 3584), (16384, 8192, 4096)]
ITERS = 50
QUICK_ITERS = 10
WARMUP = 5
SEED = 8191
CE_CTAS = 8  # the copy-engine sum's CTAs: the issue's "<= 8 CTAs"
CTA_BAR = 8
SWEEP_CTAS = (4, 16)
CONC_MODES = ("torch", "fo_nccl", "fo_ce")
TOLERANCE = 1e-2
MIB = 1 << 20
MAX_SETS = 256  # 1 MB sets need ~60-80 of them to exceed 2x a 60 MB L2
# GPU sleep per chain call on top of the rmsnorm benchmark's gate: the public functions' Python
# checks cost the host tens of us per call, and the whole chain must be enqueued before it starts.
CALL_GATE_CYCLES = 200_000
MIN_COVER = _ar.MIN_COVER
CHAIN_COVER = _ar.CHAIN_COVER


# ---- pure logic (no GPU) ------------------------------------------------------------------------

def size_elements(mb: float, itemsize: int, world: int) -> int:
    """Elements of the per-rank x for `mb` MiB: whole 16 * world-byte blocks (the copy-engine
    ReduceScatter moves 16-byte vectors per rank block; also makes the count divisible by the
    world), rounded down, at least one block."""
    if not (mb > 0 and math.isfinite(mb)) or itemsize < 1 or world < 1 or 16 % itemsize:
        raise ValueError(f"size_elements: expected mb > 0, an itemsize dividing 16 and world >= 1, "
                         f"got {mb}, {itemsize}, {world}")
    unit = 16 * world
    nbytes = int(mb * MIB)
    return max(unit, nbytes - nbytes % unit) // itemsize


def cases(sizes_mb: Sequence[float], itemsize: int, world: int) -> list[tuple[str, float, int]]:
    """(kind, MB asked, elements) for every kind and size, sizes ascending; sizes that round to
    the same element count are timed once."""
    out, seen = [], set()
    for kind in KINDS:
        for mb in sorted(set(sizes_mb)):
            numel = size_elements(mb, itemsize, world)
            if (kind, numel) not in seen:
                seen.add((kind, numel))
                out.append((kind, mb, numel))
    return out


def set_bytes(kind: str, nbytes: int, world: int) -> int:
    """Bytes one operand set holds: x and the torch baseline's buffer (AllReduce: a work copy of
    x; ReduceScatter: its output). flashoverlap's outputs come from the caching allocator."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    return nbytes + (nbytes if kind == "all_reduce" else nbytes // world)


def variants(ctas_sweep: bool = False, ce_ctas: int = CE_CTAS) -> list[tuple[str, Optional[str], Optional[int]]]:
    """(name, flashoverlap backend or None for torch.distributed, CTAs) of table 1's variants."""
    v = [("torch", None, None), ("fo_nccl", "nccl", None), ("fo_ce", "copy_engine", ce_ctas)]
    if ctas_sweep:
        v += [(f"fo_ce_{c}", "copy_engine", c) for c in SWEEP_CTAS if c != ce_ctas]
    return v


def algbw_gbs(nbytes: int, us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes): bytes of x per rank over the time."""
    if not (_finite(us) and us > 0):
        return math.nan
    return nbytes / us / 1e3


def busbw_gbs(kind: str, nbytes: int, us: float, world: int) -> float:
    """Bus bandwidth (nccl-tests' convention): what each rank's links carry, algbw x 2(w-1)/w for
    AllReduce, x (w-1)/w for ReduceScatter; 0 at one rank."""
    factor = (2.0 if kind == "all_reduce" else 1.0) * (world - 1) / world
    return algbw_gbs(nbytes, us) * factor


def ratio(a: float, b: float) -> float:
    return a / b if _finite(a) and _finite(b) and b > 0 else math.nan


def slowdown(alone_us: float, beside_us: float) -> float:
    """GEMM time beside the chain over GEMM time alone (1.0: no interference)."""
    return ratio(beside_us, alone_us)


def effective_ctas(ctas: int, sms: int) -> int:
    """The CTAs the copy-engine sum runs on: the op clamps to the SM count."""
    return min(ctas, sms) if sms >= 1 else ctas


def ctas_verdict(ctas: int, sms: int, bar: int = CTA_BAR) -> str:
    """The bar "the reduction kernels use <= 8 CTAs", read off the CTA count the op is given."""
    return "PASS" if 1 <= effective_ctas(ctas, sms) <= bar else "FAIL"


def select_shapes(shapes: Optional[Sequence[tuple[int, int, int]]], quick: bool,
                  itemsize: int) -> list[tuple[int, int, int]]:
    """The GEMM shapes of table 2: the given ones, else the quick or the full list. The chain's
    [M, N] copy-engine AllReduce needs whole 16-byte vectors."""
    chosen = list(shapes) if shapes else list(QUICK_SHAPES if quick else SHAPES)
    for m, n, k in chosen:
        if min(m, n, k) < 1:
            raise ValueError(f"shapes: expected positive MxNxK, got {m}x{n}x{k}")
        if (m * n * itemsize) % 16:
            raise ValueError(f"shapes: the copy-engine AllReduce of the [M, N] output needs M*N*{itemsize} bytes "
                             f"to be a multiple of 16, got {m}x{n}x{k}")
    return chosen


def failed_names(errors: dict) -> str:
    return " ".join(name for name, e in errors.items() if not e <= TOLERANCE)


def status_of(errors: dict) -> str:
    """ok, WRONG (a result over the tolerance) or UNCHECKED (no check ran: not trusted either)."""
    if not errors:
        return "UNCHECKED"
    return "WRONG" if failed_names(errors) else "ok"


def standalone_row(kind: str, mb: float, numel: int, itemsize: int, world: int, dtype: str, sets: int,
                   times: dict, errors: dict, names: Sequence[str]) -> dict:
    """Table 1's row of a kind and size from the per-variant medians (us, max over ranks; missing:
    nan) and the check's errors (max over ranks). The same keys for every row of the table."""
    nbytes = numel * itemsize
    row = {"table": "standalone", "kind": kind, "mb": mb, "bytes": nbytes, "elements": numel, "dtype": dtype,
           "world_size": world, "sets": sets}
    for v in names:
        us = times.get(v, math.nan)
        row[f"{v}_us"] = us
        row[f"{v}_algbw_gbs"] = algbw_gbs(nbytes, us)
        row[f"{v}_busbw_gbs"] = busbw_gbs(kind, nbytes, us, world)
    row["ce_vs_torch"] = ratio(row.get("fo_ce_us", math.nan), row.get("torch_us", math.nan))
    row["nccl_vs_torch"] = ratio(row.get("fo_nccl_us", math.nan), row.get("torch_us", math.nan))
    row["max_rel_error"] = max(errors.values()) if errors else math.nan
    row["failed"] = failed_names(errors)
    row["status"] = status_of(errors)
    return row


def conc_row(shape: tuple[int, int, int], dtype: str, itemsize: int, world: int, measured: dict,
             errors: dict) -> dict:
    """Table 2's row of a GEMM shape. measured: gemm_alone_us and, per mode, <mode>_alone_us (one
    chain call alone), chain_<mode>, gemm_with_<mode>_us, slowdown_<mode>, cover_<mode> (already
    reduced over ranks); errors: the chain calls' check at [M, N]."""
    m, n, k = shape
    row = {"table": "concurrency", "m": m, "n": n, "k": k, "dtype": dtype, "world_size": world,
           "ar_mb": m * n * itemsize / MIB, "gemm_alone_us": measured.get("gemm_alone_us", math.nan)}
    for mode in CONC_MODES:
        for key in (f"{mode}_alone_us", f"chain_{mode}", f"gemm_with_{mode}_us", f"slowdown_{mode}",
                    f"cover_{mode}"):
            row[key] = measured.get(key, math.nan)
        row[f"cover_ok_{mode}"] = bool(row[f"cover_{mode}"] >= MIN_COVER)
    row["max_rel_error"] = max(errors.values()) if errors else math.nan
    row["failed"] = failed_names(errors)
    row["status"] = status_of(errors)
    return row


def geo_max(rows: Sequence[dict], key: str) -> tuple[float, float]:
    """(geometric mean, max) of a positive column over the rows that measured it."""
    vals = [r[key] for r in rows if _finite(r.get(key)) and r[key] > 0]
    return (statistics.geometric_mean(vals), max(vals)) if vals else (math.nan, math.nan)


def any_wrong(rows: Sequence[dict]) -> bool:
    return any(r["status"] != "ok" for r in rows)


def _mb(v: float) -> str:
    return f"{v:g}"


def standalone_table(rows: Sequence[dict], meta: dict, names: Sequence[str]) -> list[str]:
    """Table 1: a line per kind and size (us, then GB/s per variant), then the wrong results."""
    lines = [f"# standalone collectives: {meta['world_size']} x {meta['gpu']}, {meta['dtype']}, {meta['date']}; "
             f"command: {meta['command']}",
             "# us: median of CUDA-event-timed calls, max over ranks; bw_<v>: algorithm bandwidth in GB/s (bytes "
             "of x per rank / time); MB: 2^20 bytes of x per rank; ce/torch = fo_ce us / torch us (< 1: the copy "
             f"engines are faster); fo_ce sums on {meta['ce_ctas']} CTAs, fo_nccl runs NCCL on at most "
             f"{meta['nccl_max_ctas']} CTAs, torch on NCCL's own choice",
             f"{'kind':>14} {'MB':>5} " + " ".join(f"{v:>9}" for v in names) + " " +
             " ".join(f"{'bw_' + v:>11}" for v in names) + f" {'ce/torch':>8} {'nccl/torch':>10} {'err':>8} "
             f"{'status':>6}"]
    for r in rows:
        lines.append(f"{r['kind']:>14} {_mb(r['mb']):>5} " + " ".join(fmt(r[f'{v}_us'], 9) for v in names) + " " +
                     " ".join(fmt(r[f'{v}_algbw_gbs'], 11) for v in names) +
                     f" {fmt(r['ce_vs_torch'], 8, '.3f')} {fmt(r['nccl_vs_torch'], 10, '.3f')} "
                     f"{fmt(r['max_rel_error'], 8, '.1e')} {r['status']:>6}")
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['status']} RESULT {r['kind']} {_mb(r['mb'])} MB: {r['failed'] or 'not checked'} "
                         f"(tolerance {TOLERANCE}, max error {fmt(r['max_rel_error'], 0, '.1e')})")
    return lines


def _cover_cell(cover: float) -> str:
    if not _finite(cover):
        return f"{'n/a':>6}"
    return f"{format(cover * 100, '.0f') + '%' + ('*' if cover < MIN_COVER else ''):>6}"


def conc_table(rows: Sequence[dict], meta: dict) -> list[str]:
    """Table 2: per GEMM shape, the GEMM alone and beside each chain (us, slowdown, cover), then the
    geometric means, which backend interferes less, and the CTA bar."""
    lines = ["", f"# GEMM beside a chain of AllReduces: torch.matmul(x, w.t()) on the compute stream, alone and "
                 "beside back-to-back AllReduces of an [M, N] buffer on a high-priority side stream (us: median, max "
                 "over ranks; x = slowdown = GEMM beside / alone, the worst rank's; cov = share of the GEMM the "
                 f"chain ran, * below {MIN_COVER:.0%}: the slowdown then understates the interference); chains = "
                 "calls per trial, " + "/".join(CONC_MODES),
             f"{'M x N x K':>18} {'AR_MB':>6} {'alone':>8} " +
             " ".join(f"{'w/' + mode:>10} {'x_' + mode:>9} {'cov':>6}" for mode in CONC_MODES) +
             f" {'chains':>9} {'err':>8} {'status':>6}"]
    for r in rows:
        shape = f"{r['m']}x{r['n']}x{r['k']}"
        lines.append(f"{shape:>18} {_mb(round(r['ar_mb'], 1)):>6} "
                     f"{fmt(r['gemm_alone_us'], 8)} " +
                     " ".join(f"{fmt(r[f'gemm_with_{mode}_us'], 10)} {fmt(r[f'slowdown_{mode}'], 9, '.3f', 'x')} "
                              f"{_cover_cell(r[f'cover_{mode}'])}" for mode in CONC_MODES) +
                     f" {'/'.join(str(r[f'chain_{mode}']) for mode in CONC_MODES):>9} "
                     f"{fmt(r['max_rel_error'], 8, '.1e')} {r['status']:>6}")
    if rows:
        parts = []
        for mode in CONC_MODES:
            g, hi = geo_max(rows, f"slowdown_{mode}")
            parts.append(f"{mode} {fmt(g, 0, '.3f', 'x')} (max {fmt(hi, 0, '.3f', 'x')})")
        lines.append("GEMM slowdown, geometric mean over shapes: " + ", ".join(parts))
        for other in ("fo_nccl", "torch"):
            both = [r for r in rows if _finite(r["slowdown_fo_ce"]) and _finite(r[f"slowdown_{other}"])]
            less = sum(r["slowdown_fo_ce"] < r[f"slowdown_{other}"] for r in both)
            lines.append(f"the copy engines slow the GEMM less than {other} on {less} of {len(both)} shapes")
        low = [f"{r['m']}x{r['n']}x{r['k']} {mode}" for r in rows for mode in CONC_MODES if not r[f"cover_ok_{mode}"]]
        if low:
            lines.append(f"cover below {MIN_COVER:.0%} (slowdown not valid): {', '.join(low)}")
    lines.append(f"copy-engine reduction CTAs: {meta['ce_ctas_effective']} (fo_ce's ctas={meta['ce_ctas']}, "
                 f"{meta['sms']} SMs) <= {CTA_BAR}: {meta['ce_ctas_verdict']}; fo_nccl: NCCL capped at "
                 f"{meta['nccl_max_ctas']} CTAs; torch: NCCL uncapped")
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['status']} RESULT AllReduce of {r['m']}x{r['n']} (GEMM {r['m']}x{r['n']}x{r['k']}): "
                         f"{r['failed'] or 'not checked'}")
    return lines


def csv_rows(standalone: Sequence[dict], concurrency: Sequence[dict]) -> list[dict]:
    """Both tables' rows with one set of columns (the union, in first-seen order; blanks where a
    table has no such column), as one CSV needs."""
    keys: dict[str, None] = {}
    for r in (*standalone, *concurrency):
        keys.update(dict.fromkeys(r))
    return [{k: r.get(k, "") for k in keys} for r in (*standalone, *concurrency)]


def default_out(gpu_name: str, world: int, dtype: str) -> str:
    gpu = gpu_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                        f"bench_collectives_{gpu}x{world}_{dtype}")


# ---- the ranks ----------------------------------------------------------------------------------

class _Rank:
    """One rank's state: the device facts every rank agrees on, and the variants' callables."""

    def __init__(self, cfg: dict):
        import torch.distributed as dist

        import flashoverlap

        self.fo = flashoverlap
        self.cfg = cfg
        self.dtype = getattr(torch, cfg["dtype"])
        self.itemsize = self.dtype.itemsize
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        # The same on every rank: set counts and chain lengths decide the collective calls.
        self.sms = int(_ar._min_over_ranks(float(props.multi_processor_count)))
        self.l2 = int(_ar._min_over_ranks(float(getattr(props, "L2_cache_size", 0) or _ar.L2_DEFAULT)))
        self.variants = [tuple(v) for v in cfg["variants"]]
        self.ce_ctas = cfg["ce_ctas"]
        # Collective: makes flashoverlap's communicator on every rank before any timing.
        self.nccl_max_ctas = flashoverlap.get_communicator().max_ctas

    def _gen(self, salt: int) -> torch.Generator:
        return torch.Generator(device="cuda").manual_seed(SEED + salt + 100_003 * (self.rank + 1))

    def buffers(self, kind: str, numel: int, salt: int = 0) -> tuple[list, list]:
        """Random x per set (fresh per call: the in-place baseline's growth stays bounded), and the
        torch baseline's buffers (AllReduce: copies of x; ReduceScatter: outputs)."""
        sets = rotation_sets(set_bytes(kind, numel * self.itemsize, self.world), self.l2, maximum=MAX_SETS)
        gen = self._gen(salt + numel)
        xs = [torch.randn(numel, device="cuda", dtype=self.dtype, generator=gen) for _ in range(sets)]
        if kind == "all_reduce":
            bufs = [x.clone() for x in xs]
        else:
            bufs = [torch.empty(numel // self.world, device="cuda", dtype=self.dtype) for _ in range(sets)]
        return xs, bufs

    def fns(self, kind: str, xs: list, bufs: list) -> dict:
        import torch.distributed as dist

        sets = len(xs)

        def torch_fn(i):
            j = i % sets
            if kind == "all_reduce":
                dist.all_reduce(bufs[j])
            else:
                dist.reduce_scatter_tensor(bufs[j], xs[j])
            return bufs[j]

        op = self.fo.all_reduce if kind == "all_reduce" else self.fo.reduce_scatter

        def fo_fn(backend, ctas):
            return lambda i: op(xs[i % sets], backend=backend, ctas=ctas)

        return {name: torch_fn if backend is None else fo_fn(backend, ctas) for name, backend, ctas in self.variants}

    def check(self, kind: str, xs: list, bufs: list, fns: dict) -> dict:
        """Each variant's relative error on set 0 against the fp32 sum, max over ranks (the same
        variants in the same order on every rank: the max is collective)."""
        import torch.distributed as dist

        ref = xs[0].float()
        dist.all_reduce(ref)
        if kind == "reduce_scatter":
            ref = ref.reshape(self.world, -1)[self.rank]
        errors = {}
        for name, fn in fns.items():
            if name == "torch" and kind == "all_reduce":
                bufs[0].copy_(xs[0])
            elif name != "torch":
                # NaN in the block the allocator hands the op next: an unwritten output cannot pass
                # as an earlier variant's correct result (the temporary is freed at once).
                torch.empty(ref.shape, device="cuda", dtype=self.dtype).fill_(math.nan)
            errors[name] = rel_error(fn(0), ref)
        torch.cuda.synchronize()
        return {name: bench._max_over_ranks(e) for name, e in errors.items()}

    def measure(self, kind: str, numel: int, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
        """One round of one kind and size (bench.pooled_rounds' measure; all ranks call it alike)."""
        import torch.distributed as dist

        xs, bufs = self.buffers(kind, numel)
        fns = self.fns(kind, xs, bufs)
        dist.barrier()
        return bench.interleaved_times_us(fns, iters, warmup), {"sets": len(xs)}

    def concurrency(self, shape: tuple[int, int, int], iters: int, warmup: int) -> tuple[dict, dict]:
        """The GEMM alone and beside each chain (see the module docstring): (measured, errors)."""
        import torch.distributed as dist

        m, n, k = shape
        dtype, fo = self.dtype, self.fo
        gen = self._gen(7 * (m + 3 * n + 5 * k))
        gsets = rotation_sets((m * k + n * k) * self.itemsize, self.l2, maximum=MAX_SETS)
        gx = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(gsets)]
        gw = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(gsets)]
        csets = rotation_sets(set_bytes("all_reduce", m * n * self.itemsize, self.world), self.l2, maximum=MAX_SETS)
        cx = [torch.randn(m, n, device="cuda", dtype=dtype, generator=gen) for _ in range(csets)]
        works = [x.clone() for x in cx]

        def gemm(i):
            return torch.matmul(gx[i % gsets], gw[i % gsets].t())

        def torch_call(j):
            dist.all_reduce(works[j % csets])
            return works[j % csets]

        calls = {"torch": torch_call,
                 "fo_nccl": lambda j: fo.all_reduce(cx[j % csets], backend="nccl"),
                 "fo_ce": lambda j: fo.all_reduce(cx[j % csets], backend="copy_engine", ctas=self.ce_ctas)}
        # The check first: the copy engines' first call of this size grows the staging slots (a
        # collective host step that must not land inside a timing).
        errors = self.check("all_reduce", cx, works, calls)

        alone = bench.interleaved_times_us({"gemm": gemm, **calls}, max(5, iters // 5), warmup)
        med = {name: bench._max_over_ranks(statistics.median(v)) for name, v in alone.items()}
        chains = {mode: chain_length(med["gemm"], med[mode]) for mode in CONC_MODES}
        gate = _ar.GATE_CYCLES + CALL_GATE_CYCLES * max(chains.values())
        side = torch.cuda.Stream(priority=-1)
        main = torch.cuda.current_stream()
        modes = ("alone", *CONC_MODES)
        samples = {mode: [] for mode in modes}
        dist.barrier()
        for it in range(warmup + iters):
            for mode in modes:
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                if mode == "torch":
                    for w, x in zip(works, cx):
                        w.copy_(x)
                # Both streams wait on this sleep: the chain and the GEMM start together however
                # long the host takes to enqueue them.
                torch.cuda._sleep(gate)
                side.wait_stream(main)
                if mode != "alone":
                    with torch.cuda.stream(side):
                        ev[2].record()
                        for j in range(chains[mode]):
                            calls[mode](j)
                        ev[3].record()
                ev[0].record()
                gemm(it)
                ev[1].record()
                main.wait_stream(side)
                if it >= warmup:
                    samples[mode].append(ev)
        torch.cuda.synchronize()
        gemm_us = {mode: statistics.median(e[0].elapsed_time(e[1]) * 1e3 for e in evs) for mode, evs in samples.items()}
        measured = {"gemm_alone_us": bench._max_over_ranks(gemm_us["alone"])}
        for mode in CONC_MODES:
            cover = statistics.median(overlap_fraction(e[0].elapsed_time(e[1]), e[0].elapsed_time(e[2]),
                                                       e[0].elapsed_time(e[3])) for e in samples[mode])
            measured[f"{mode}_alone_us"] = med[mode]
            measured[f"chain_{mode}"] = chains[mode]
            measured[f"gemm_with_{mode}_us"] = bench._max_over_ranks(gemm_us[mode])
            measured[f"slowdown_{mode}"] = bench._max_over_ranks(slowdown(gemm_us["alone"], gemm_us[mode]))
            measured[f"cover_{mode}"] = _ar._min_over_ranks(cover)
        return measured, errors


def _worker(rank, world, init_method, cfg, result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    try:
        ctx = _Rank(cfg)
        names = [v[0] for v in ctx.variants]
        # Every variant at every size before any timing (the same calls in the same order on
        # every rank).
        checks = {}
        for kind, mb, numel in cfg["cases"]:
            xs, bufs = ctx.buffers(kind, numel, salt=1)
            checks[(kind, numel)] = ctx.check(kind, xs, bufs, ctx.fns(kind, xs, bufs))
            del xs, bufs
            if rank == 0:
                errors = checks[(kind, numel)]
                print(f"checked {kind} {_mb(mb)} MB: max relative error {max(errors.values()):.1e}"
                      + (f", WRONG: {failed_names(errors)}" if failed_names(errors) else ""), flush=True)
        shapes = [(kind, numel) for kind, _, numel in cfg["cases"]]
        pooled, facts = bench.pooled_rounds(ctx.measure, shapes, ctx.dtype, cfg["iters"], cfg["warmup"])
        rows = []
        for kind, mb, numel in cfg["cases"]:
            times = {name: bench._max_over_ranks(statistics.median(v)) for name, v in pooled[(kind, numel)].items()}
            rows.append(standalone_row(kind, mb, numel, ctx.itemsize, world, cfg["dtype"],
                                       facts[(kind, numel)]["sets"], times, checks[(kind, numel)], names))
        conc = []
        for shape in cfg["shapes"]:
            measured, errors = ctx.concurrency(tuple(shape), cfg["iters"], cfg["warmup"])
            conc.append(conc_row(tuple(shape), cfg["dtype"], ctx.itemsize, world, measured, errors))
            if rank == 0:
                print(f"GEMM {'x'.join(map(str, shape))}: " +
                      ", ".join(f"{mode} {conc[-1][f'slowdown_{mode}']:.3f}x" for mode in CONC_MODES), flush=True)
        if rank == 0:
            meta = {**bench.environment(world), "dtype": cfg["dtype"], "sms": ctx.sms, "l2_bytes": ctx.l2,
                    "ce_ctas": ctx.ce_ctas, "ce_ctas_effective": effective_ctas(ctx.ce_ctas, ctx.sms),
                    "ce_ctas_verdict": ctas_verdict(ctx.ce_ctas, ctx.sms), "cta_bar": CTA_BAR,
                    "nccl_max_ctas": ctx.nccl_max_ctas, "variants": [list(v) for v in ctx.variants],
                    "tolerance": TOLERANCE, "chain_cover": CHAIN_COVER, "min_cover": MIN_COVER,
                    "checks": {f"{kind} {numel}": e for (kind, numel), e in checks.items()}}
            with open(result_path, "w") as f:
                json.dump({"meta": meta, "rows": rows, "conc": conc}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=list(SIZES_MB),
                   help="per-rank input sizes of table 1 in MiB (default 1 4 16 64)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed iterations per variant (default {ITERS}; --quick: {QUICK_ITERS})")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (1 for a smoke test)")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_SHAPES)} GEMM shapes and fewer iterations")
    p.add_argument("--shapes", type=_shape, nargs="+", default=None,
                   help="MxNxK GEMM shapes of table 2 (default: the 16 benchmark shapes)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--ctas-sweep", action="store_true",
                   help=f"also time the copy engines' sum on {' and '.join(map(str, SWEEP_CTAS))} CTAs")
    p.add_argument("--out", default=None, help="path without extension (default: evaluation/results/"
                                               "bench_collectives_<gpu>x<world>_<dtype>)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    apply_env_defaults()
    itemsize = getattr(torch, args.dtype).itemsize
    world = args.world_size or torch.cuda.device_count()
    if world < 1:
        p.error("no CUDA device")
    try:
        todo = cases(args.sizes_mb, itemsize, world)
        shapes = select_shapes(args.shapes, args.quick, itemsize)
    except ValueError as e:
        p.error(str(e))
    iters = args.iters or (QUICK_ITERS if args.quick else ITERS)
    out = args.out or default_out(torch.cuda.get_device_name(0), world, args.dtype)
    cfg = {"cases": todo, "shapes": [list(s) for s in shapes], "dtype": args.dtype, "iters": iters,
           "warmup": args.warmup, "variants": [list(v) for v in variants(args.ctas_sweep)], "ce_ctas": CE_CTAS}
    data = bench.spawn_ranks(_worker, world, cfg)
    rows, conc, meta = data["rows"], data["conc"], data["meta"]
    names = [v[0] for v in meta["variants"]]
    lines = standalone_table(rows, meta, names) + conc_table(conc, meta)
    print("\n".join(lines))
    bench.write_outputs(out, lines, csv_rows(rows, conc), meta)
    print(f"wrote {out}.txt, {out}.csv, {out}.json")
    return 1 if any_wrong([*rows, *conc]) else 0


if __name__ == "__main__":
    sys.exit(main())
