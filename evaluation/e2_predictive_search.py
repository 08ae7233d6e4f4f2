"""FlashOverlap's E2: how well the predictor's numbers and its choice of partition hold up against
measurement, on all local GPUs, for GEMM + AllReduce, GEMM + ReduceScatter, GEMM + All-to-All and
GEMM + AllReduce + residual + RMSNorm.

Every op runs on one communication backend, --backend (default nccl, copy_engine, or push: 2
Hopper GPUs only, where its estimated constants get their first check): its
candidates, its predictions and its auto reference alike, so that a case compares partitions and
never backends (the backend "auto" would otherwise pick per shape). For each case (op, M x N x K)
the candidates are partitions of the GEMM into wave groups:

  all_reduce      flashoverlap.gemm_all_reduce(mode="overlap", backend=B, order="banded") with
                  bands_per_group = b (uniform groups of b row bands), one b per group count: the
                  smallest b giving ceil(tiles_m / b) groups, for group counts up to
                  FLASHOVERLAP_MAX_GROUPS (the predictor's search space), at most --max-candidates
                  spread evenly in log(groups), always with one group (b = tiles_m); plus the
                  predictor's own partition (bands_per_group unset), which is usually not uniform
  reduce_scatter  the same with flashoverlap.gemm_reduce_scatter(mode="overlap", backend=B), over the
                  row bands of each rank's shard
  all_reduce_rmsnorm  the same as all_reduce with flashoverlap.gemm_all_reduce_rmsnorm (each group's
                  fused add + RMSNorm runs after its collective on the communication stream; the
                  plans are plan_of(..., fused_norm=True)); its sequential schedule is the op's
                  own (mode="sequential": cuBLAS, the collective, one fused add-RMSNorm kernel),
                  which is what the predictor's sequential time models
  all_to_all      flashoverlap.gemm_all_to_all(groups=G, backend=B; with copy_engine and push also
                  split_matrix=, from which every rank sizes its staging slots alike), G in 1, 2,
                  3, 4, 6, 8, 12, 16 and the predictor's G, at most 8 (the op keeps the tables of 8
                  routings: more interleaved group counts would rebuild them on every call and
                  time the host); M is the rows
                  each rank sends, routed by a skewed matrix (rank q receives in proportion to
                  1 / (q + 1): one hot destination)

where B is --backend; and, as reference points, the op with mode auto on backend B (split_matrix=
for All-to-All: the predictor picks G or the sequential schedule) and the sequential schedule
(torch.matmul then the NCCL collective of torch.distributed, whatever --backend). For All-to-All
the predictor's choice among the partitions is its fastest G (AllToAllPrediction.groups), also
where it predicts the sequential schedule to win.

Each candidate's predicted time comes from the library: plan_of(..., mode="overlap",
bands_per_group=b, backend=B, order="banded").predicted_overlap_us,
reduce_scatter_plan_of(..., mode="overlap", bands_per_group=b, backend=B)["predicted_overlap_us"],
plan_gemm_all_to_all(matrix, N, K, sms=<this GPU's>, backend=B).predicted_us[G]; the sequential
schedule's is the plans' predicted sequential time. Every measured candidate is checked once against the fp32
torch composition before timing. Times are medians of CUDA-event-timed iterations after warm-up,
the candidates of a case interleaved, pooled over 3 rounds across all cases, maximum over ranks;
inputs rotate over buffers larger than L2.

Reported per candidate: predicted and measured time and |predicted - measured| / measured; per case:
the measured time of the predicted-best partition (least predicted time) against the best measured
partition (best ratio = best measured / predicted-best measured, <= 1), and the same for mode auto
against the best of the partitions and the sequential schedule. Bars (issue: E2 on 2x H200 over
>= 20 cases): mean |prediction error| over the measured partitions <= 5%; best ratio mean >= 0.99
and never below 0.95; relative error vs fp32 <= 1e-2. The best ratio needs every candidate
measured, so the default run is exhaustive: it measures every candidate of the 32 default cases
(8 shapes x 4 ops: ~30 s of GPU time by the committed 2x H200 AllReduce timings, an estimated 2-3
minutes with start-up and kernels in the cache; --cases all, 64 cases: ~50 s, 3-4 minutes). --no-exhaustive
measures only the predictor's choice, one group, the choice's neighbours in group count, auto and
the sequential schedule (enough for the prediction error; the best-ratio bars are then not
evaluated); --quick is a smoke run (4 small cases, few iterations, not exhaustive, outputs named
*_quick). World size 1 works as a smoke test (the collectives are trivial there).

Writes <out>.csv (one row per case and candidate), <out>.json (environment with the backend, and
summary), <out>.txt (the printed table) and a CDF of the prediction error,
e2_prediction_error_cdf_<gpu>x<world>.png, beside them (needs matplotlib; skipped with a note
without it). With --backend copy_engine (push) the default names end in _copy_engine (_push),
before any _quick, so that the backends' results sit side by side.

    python evaluation/e2_predictive_search.py [--world-size 2] [--cases default|all|quick|OP:MxNxK ...]
        [--backend nccl|copy_engine|push] [--no-exhaustive | --quick] [--iters 30] [--warmup 5]
        [--dtype bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Iterable, NamedTuple, Optional, Sequence

import torch

from flashoverlap import bench

OPS = ("all_reduce", "reduce_scatter", "all_to_all", "all_reduce_rmsnorm")
OP_ALIASES = {"ar": "all_reduce", "rs": "reduce_scatter", "a2a": "all_to_all", "arn": "all_reduce_rmsnorm"}
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A", "all_reduce_rmsnorm": "ARN"}
ALL_SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 1024), (8192, 14336),
                                                                        (8192, 3584))]
# Every M twice and every K twice: communication-bound (K 1024) to GEMM-bound (K 14336).
DEFAULT_SHAPES = [(2048, 8192, 4096), (2048, 8192, 1024), (4096, 8192, 3584), (4096, 8192, 14336),
                  (8192, 8192, 4096), (8192, 8192, 1024), (16384, 8192, 3584), (16384, 8192, 14336)]
CASE_SETS = {
    "default": [(op, *s) for s in DEFAULT_SHAPES for op in OPS],
    "all": [(op, *s) for s in ALL_SHAPES for op in OPS],
    "quick": [(op, 2048, 8192, 4096) for op in OPS],
}
A2A_GROUPS = (1, 2, 3, 4, 6, 8, 12, 16)
# gemm_all_to_all keeps the device tables of its 8 most recent routings (ops._TableCache).
A2A_TABLES_KEPT = 8
MAX_CANDIDATES = 12
# --backend: one backend per run, never "auto" (it picks per shape, and could mix backends among
# the candidates of one case).
BACKENDS = ("nccl", "copy_engine", "push")

ERROR_BAR = 0.05
MEAN_RATIO_BAR = 0.99
MIN_RATIO_BAR = 0.95
MIN_CASES = 20
CORRECTNESS_BAR = 1e-2

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Candidate(NamedTuple):
    """One partition of a case. bands_per_group: the uniform groups forced on the op (None: the
    predictor's own partition, or an All-to-All's group count); band_counts: row bands per group."""
    name: str
    groups: int
    bands_per_group: Optional[int]
    band_counts: tuple
    chosen: bool


def uniform_band_counts(tiles_m: int, bands_per_group: int) -> tuple:
    """Row bands per group of the op's uniform partition: b each, the last group the remainder."""
    return tuple(min(bands_per_group, tiles_m - start) for start in range(0, tiles_m, bands_per_group))


def uniform_bands(band_counts: Sequence[int], tiles_m: int) -> Optional[int]:
    """The bands_per_group that gives exactly this partition, or None where no uniform one does."""
    counts = tuple(band_counts)
    if not counts or sum(counts) != tiles_m:
        return None
    return counts[0] if counts == uniform_band_counts(tiles_m, counts[0]) else None


def spread(values: Iterable[int], keep: Iterable[int], cap: int) -> list[int]:
    """At most max(cap, len(keep)) of `values` (positive ints), always with `keep`, the rest added
    one by one as the value farthest in log scale from those already taken (ties: the smaller)."""
    taken = set(keep)
    rest = sorted(set(values) - taken)
    if not taken and rest:
        taken.add(rest.pop(0))
    while rest and len(taken) < cap:
        best = max(rest, key=lambda v: (min(abs(math.log(v) - math.log(t)) for t in taken), -v))
        taken.add(best)
        rest.remove(best)
    return sorted(taken)


def partition_candidates(tiles_m: int, predictor_counts: Sequence[int], max_groups: int,
                         cap: int = MAX_CANDIDATES) -> list[Candidate]:
    """The AllReduce / ReduceScatter candidates over `tiles_m` row bands: uniform partitions of
    distinct group counts up to `max_groups` (the smallest b for each count, the most even split),
    one group always among them, spread in log(groups); and the predictor's partition
    (`predictor_counts`, row bands per group): the uniform candidate of its group count where it is
    uniform, else one more candidate. At most `cap` in all, ordered by group count."""
    smallest_b: dict[int, int] = {}
    for b in range(1, tiles_m + 1):
        groups = -(-tiles_m // b)
        if groups <= max_groups:
            smallest_b.setdefault(groups, b)
    counts = tuple(predictor_counts)
    own_b = uniform_bands(counts, tiles_m)
    keep = {1}
    if own_b is not None:
        smallest_b[len(counts)] = own_b
        keep.add(len(counts))
    picked = spread(smallest_b, keep, cap if own_b is not None else cap - 1)
    out = [Candidate(f"b{smallest_b[g]}", g, smallest_b[g], uniform_band_counts(tiles_m, smallest_b[g]),
                     smallest_b[g] == own_b) for g in picked]
    if own_b is None:
        out.append(Candidate("predictor", len(counts), None, counts, True))
    return sorted(out, key=lambda c: (c.groups, c.bands_per_group is None))


def a2a_candidates(chosen: int, cap: int = A2A_TABLES_KEPT, choices: Sequence[int] = A2A_GROUPS) -> list[Candidate]:
    """The All-to-All candidates: group counts from `choices` and the predictor's `chosen`, one
    group always among them, at most `cap`, spread in log(groups)."""
    return [Candidate(f"g{g}", g, None, (), g == chosen) for g in spread(set(choices) | {chosen}, {1, chosen}, cap)]


def select_measured(candidates: Sequence[Candidate], exhaustive: bool) -> list[Candidate]:
    """Every candidate (exhaustive), else the predictor's choice, one group and the choice's
    neighbours in group count, in the candidates' order."""
    if exhaustive:
        return list(candidates)
    i = next(j for j, c in enumerate(candidates) if c.chosen)
    near = {candidates[j].name for j in (i - 1, i, i + 1) if 0 <= j < len(candidates)}
    return [c for c in candidates if c.name in near or c.groups == 1]


def skewed_split_matrix(world: int, rows: int) -> list[list[int]]:
    """matrix[p][q]: rows rank p sends rank q, every rank sending `rows`, rank q receiving in
    proportion to 1 / (q + 1) (rank 0 the hot destination); rounding goes to rank 0."""
    weights = [1.0 / (q + 1) for q in range(world)]
    row = [int(rows * w / sum(weights)) for w in weights]
    row[0] += rows - sum(row)
    return [list(row) for _ in range(world)]


def a2a_backend_options(backend: str, matrix: Sequence[Sequence[int]]) -> dict:
    """The keyword arguments pinning a gemm_all_to_all candidate (groups=G) to `backend`, with the
    whole routing on every backend: the op then tiles each rank's rows on one band grid (the
    layout the predictor plans), and the copy engines and push size their staging slots from it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return {"backend": backend, "split_matrix": matrix}


def output_paths(gpu_name: str, world: int, dtype: str, backend: str, quick: bool,
                 out: Optional[str] = None) -> tuple[str, str]:
    """(the outputs' path without extension, the CDF plot's path): `out` and the PNG beside it where
    given, else under RESULTS, named by GPU, world size and dtype, _copy_engine for that backend
    (NCCL keeps the names it always had) and _quick for a smoke run."""
    if out:
        return out, out + "_error_cdf.png"
    gpu = gpu_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    suffix = ("" if backend == "nccl" else f"_{backend}") + ("_quick" if quick else "")
    return (os.path.join(RESULTS, f"e2_predictive_search_{gpu}x{world}_{dtype}{suffix}"),
            os.path.join(RESULTS, f"e2_prediction_error_cdf_{gpu}x{world}{suffix}.png"))


def abs_rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured (NaN where either is missing)."""
    if not (measured > 0) or math.isnan(predicted):
        return math.nan
    return abs(predicted - measured) / measured


def best_ratio(predicted: dict, measured: dict) -> tuple[Optional[str], float]:
    """(the candidate of least predicted time, best measured time / its measured time) over the
    candidates measured (finite times in both dicts); (None, NaN) where there are none."""
    names = [c for c in measured if c in predicted and math.isfinite(measured[c]) and math.isfinite(predicted[c])]
    if not names:
        return None, math.nan
    pick = min(names, key=lambda c: predicted[c])
    return pick, min(measured[c] for c in names) / measured[pick]


def _case(row: dict) -> tuple:
    return row["op"], row["m"], row["n"], row["k"]


def case_label(case: tuple) -> str:
    op, m, n, k = case
    return f"{SHORT[op]} {m}x{n}x{k}"


def annotate(rows: Sequence[dict]) -> list[dict]:
    """Copies of the rows with the metrics: abs_rel_error per row; per case (on each of its rows)
    pred_best / measured_best (among the partitions), best_ratio (best measured partition / the
    predicted-best one) and auto_ratio (best measured of partitions and sequential / auto)."""
    out = [dict(r, abs_rel_error=abs_rel_error(r["predicted_us"], r["measured_us"])) for r in rows]
    for case in dict.fromkeys(_case(r) for r in out):
        mine = [r for r in out if _case(r) == case]
        parts = {r["candidate"]: r for r in mine if r["kind"] == "partition"}
        pick, ratio = best_ratio({c: r["predicted_us"] for c, r in parts.items()},
                                 {c: r["measured_us"] for c, r in parts.items()})
        finite = [r for r in parts.values() if math.isfinite(r["measured_us"])]
        fastest = min(finite, key=lambda r: r["measured_us"])["candidate"] if finite else None
        ref = [r["measured_us"] for r in mine if r["kind"] in ("partition", "sequential")
               and math.isfinite(r["measured_us"])]
        auto = [r["measured_us"] for r in mine if r["kind"] == "auto"]
        auto_ratio = min(ref) / auto[0] if ref and auto and auto[0] > 0 else math.nan
        for r in mine:
            r.update(pred_best=r["candidate"] == pick, measured_best=r["candidate"] == fastest, best_ratio=ratio,
                     auto_ratio=auto_ratio)
    return out


def _mean(values: Iterable[float]) -> float:
    v = [x for x in values if math.isfinite(x)]
    return statistics.fmean(v) if v else math.nan


def error_cdf(errors: Iterable[float]) -> tuple[list[float], list[float]]:
    """(sorted finite errors, fraction of errors <= each): the empirical CDF."""
    xs = sorted(e for e in errors if math.isfinite(e))
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def _quantile(xs: list[float], ps: list[float], q: float) -> float:
    return next((x for x, p in zip(xs, ps) if p >= q), math.nan)


def summarize(rows: Sequence[dict], exhaustive: bool) -> dict:
    """The run's metrics from annotated rows (see annotate)."""
    cases = list(dict.fromkeys(_case(r) for r in rows))
    parts = [r for r in rows if r["kind"] == "partition"]
    xs, ps = error_cdf(r["abs_rel_error"] for r in parts)
    first = {c: next(r for r in rows if _case(r) == c) for c in cases}
    ratios = {c: first[c]["best_ratio"] for c in cases if math.isfinite(first[c]["best_ratio"])}
    autos = [first[c]["auto_ratio"] for c in cases]
    worst = min(ratios, key=ratios.get) if ratios else None
    errors = [r["max_rel_error"] for r in rows]
    return {
        "cases": len(cases),
        "exhaustive": exhaustive,
        "partitions_measured": len(xs),
        "mean_error": _mean(xs),
        "median_error": _quantile(xs, ps, 0.5),
        "p90_error": _quantile(xs, ps, 0.9),
        "max_error": xs[-1] if xs else math.nan,
        "mean_error_chosen": _mean(r["abs_rel_error"] for r in parts if r["chosen"]),
        "mean_error_sequential": _mean(r["abs_rel_error"] for r in rows if r["kind"] == "sequential"),
        "mean_error_by_op": {op: _mean(r["abs_rel_error"] for r in parts if r["op"] == op)
                             for op in OPS if any(r["op"] == op for r in parts)},
        "mean_best_ratio": _mean(ratios.values()),
        "min_best_ratio": ratios[worst] if worst else math.nan,
        "worst_case": case_label(worst) if worst else "",
        "mean_auto_ratio": _mean(autos),
        "min_auto_ratio": min((a for a in autos if math.isfinite(a)), default=math.nan),
        "max_rel_error_vs_fp32": max(errors, key=lambda e: math.inf if math.isnan(e) else e, default=math.nan),
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def summary_lines(s: dict) -> list[str]:
    """The summary with each bar's PASS / FAIL (a NaN fails its bar)."""
    checks = {"cases": s["cases"] >= MIN_CASES, "error": s["mean_error"] <= ERROR_BAR,
              "correctness": s["max_rel_error_vs_fp32"] <= CORRECTNESS_BAR}
    by_op = ", ".join(f"{SHORT[op]} {e:.2%}" for op, e in s["mean_error_by_op"].items())
    lines = [f"cases: {s['cases']} (bar >= {MIN_CASES}): {_verdict(checks['cases'])}",
             f"mean |prediction error| over {s['partitions_measured']} measured partitions: {s['mean_error']:.2%} "
             f"(bar <= {ERROR_BAR:.0%}): {_verdict(checks['error'])}",
             f"  median {s['median_error']:.2%}, 90th percentile {s['p90_error']:.2%}, max {s['max_error']:.2%}; "
             f"per op: {by_op}; the predictor's choices only: {s['mean_error_chosen']:.2%}; "
             f"sequential schedule: {s['mean_error_sequential']:.2%}"]
    ratio = (f"best measured partition / predicted-best partition: mean {s['mean_best_ratio']:.4f}, "
             f"min {s['min_best_ratio']:.4f} ({s['worst_case']})")
    if s["exhaustive"]:
        checks["mean_ratio"] = s["mean_best_ratio"] >= MEAN_RATIO_BAR
        checks["min_ratio"] = s["min_best_ratio"] >= MIN_RATIO_BAR
        lines.append(f"{ratio} (bars: mean >= {MEAN_RATIO_BAR}: {_verdict(checks['mean_ratio'])}, "
                     f"min >= {MIN_RATIO_BAR}: {_verdict(checks['min_ratio'])})")
    else:
        lines.append(f"{ratio} among the measured candidates only: bars not evaluated (run exhaustive)")
    lines.append(f"mode auto vs the best measured of partitions and sequential: mean {s['mean_auto_ratio']:.4f}, "
                 f"min {s['min_auto_ratio']:.4f} (reference, no bar)")
    lines.append(f"max relative error vs fp32: {s['max_rel_error_vs_fp32']:.1e} (bar <= {CORRECTNESS_BAR:.0e}): "
                 f"{_verdict(checks['correctness'])}")
    failed = [name for name, ok in checks.items() if not ok]
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
    if not s["exhaustive"] and not failed:
        verdict = "incomplete (not exhaustive: the best-ratio bars were not evaluated)"
    lines.append(f"E2: {verdict}")
    return lines


def table_lines(rows: Sequence[dict]) -> list[str]:
    """Per case: its choices and ratios, then one line per measured candidate."""
    lines = []
    for case in dict.fromkeys(_case(r) for r in rows):
        mine = [r for r in rows if _case(r) == case]
        name = {key: next((r["candidate"] for r in mine if r[key]), "-") for key in ("chosen", "pred_best",
                                                                                     "measured_best")}
        auto = next((f"{r['schedule']} ({r['groups']} groups)" for r in mine if r["kind"] == "auto"), "not measured")
        lines.append(f"{case_label(case)}: predictor's choice {name['chosen']}, predicted best {name['pred_best']}, "
                     f"measured best {name['measured_best']}; best ratio {mine[0]['best_ratio']:.4f}; auto {auto}, "
                     f"auto ratio {mine[0]['auto_ratio']:.4f}")
        for r in mine:
            flags = "".join(f for f, key in (("*", "chosen"), ("P", "pred_best"), ("M", "measured_best")) if r[key])
            lines.append(f"  {r['candidate']:>10} {r['kind']:>10} {r['groups']:>3} groups {r['predicted_us']:9.1f} "
                         f"{r['measured_us']:9.1f} {r['abs_rel_error']:7.2%} {r['max_rel_error']:8.1e} {flags}")
    return lines


def plot_error_cdf(series: dict, path: str, title: str) -> bool:
    """The CDF of |prediction error| of each series (label -> errors) into `path` (PNG), with the
    bar; False (nothing written) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, errors in series.items():
        xs, ps = error_cdf(errors)
        if xs:
            style = {"color": "black", "lw": 2} if label == "all" else {}
            ax.step([100 * x for x in xs], ps, where="post", label=f"{label} ({len(xs)})", **style)
    ax.axvline(100 * ERROR_BAR, color="grey", ls="--", lw=1, label=f"bar {ERROR_BAR:.0%}")
    ax.set_xlabel("|predicted - measured| / measured (%)")
    ax.set_ylabel("fraction of candidates")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_cases(specs: Sequence[str]) -> list[tuple]:
    """Named sets (default, all, quick) and OP:MxNxK (OP: all_reduce, reduce_scatter, all_to_all,
    or ar, rs, a2a), in order, without repeats."""
    cases = []
    for spec in specs:
        if spec in CASE_SETS:
            cases += CASE_SETS[spec]
            continue
        op, _, shape = spec.partition(":")
        op = OP_ALIASES.get(op, op)
        try:
            m, n, k = (int(v) for v in shape.lower().split("x"))
        except ValueError:
            m = n = k = 0
        if op not in OPS or min(m, n, k) < 1:
            raise argparse.ArgumentTypeError(f"--cases: expected {', '.join(CASE_SETS)} or OP:MxNxK with OP one of "
                                             f"{', '.join(OPS + tuple(OP_ALIASES))}, got {spec!r}")
        cases.append((op, m, n, k))
    return list(dict.fromkeys(cases))


def _rel_error(out, ref) -> float:
    """Relative error of a tensor, or the worst of a tuple's (an op with several outputs)."""
    if isinstance(ref, tuple):
        return max(_rel_error(o, r) for o, r in zip(out, ref, strict=True))
    return float((out.float() - ref).norm() / ref.norm())


def _partition_info(c: Candidate, predicted_us: float, schedule: str, kernel: str = "") -> dict:
    """kernel: the GEMM kernel the partition runs, where the plan says (GEMM + AllReduce), so that
    e2_replay.py can re-predict the same launch."""
    return {"kind": "partition", "groups": c.groups, "bands_per_group": c.bands_per_group,
            "band_counts": ",".join(map(str, c.band_counts)), "chosen": c.chosen, "schedule": schedule,
            "predicted_us": predicted_us, "kernel": kernel}


def _reference_info(kind: str, groups: int, band_counts: Sequence[int], schedule: str, predicted_us: float) -> dict:
    return {"kind": kind, "groups": groups, "bands_per_group": None, "band_counts": ",".join(map(str, band_counts)),
            "chosen": False, "schedule": schedule, "predicted_us": predicted_us, "kernel": ""}


def _kernel_of(plan) -> str:
    """The Hopper GEMM kernel a gemm_all_reduce plan tiles for (sm90_n128 / sm90_n256), or ""
    elsewhere (one kernel there)."""
    import torch

    tile = getattr(plan, "tile", None)
    if tile is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return ""
    return f"sm90_n{tile[1]}"


def _banded_candidates(xs, ws, exhaustive: bool, max_candidates: int, run, plan_opts: dict):
    """The partitions and auto of an op planned by plan_of (GEMM + AllReduce, with or without the
    fused norm): (fns, info) where run(i, **options) calls the op on input set i."""
    import flashoverlap
    from flashoverlap import _env

    own = flashoverlap.plan_of(xs[0], ws[0], mode="overlap", **plan_opts)
    counts = [g["bands"][1] - g["bands"][0] for g in own.groups]
    fns, info = {}, {}
    for c in select_measured(partition_candidates(own.tiles[0], counts, _env.max_groups(), max_candidates),
                             exhaustive):
        plan = own if c.bands_per_group is None else flashoverlap.plan_of(
            xs[0], ws[0], mode="overlap", bands_per_group=c.bands_per_group, **plan_opts)
        fns[c.name] = lambda i, b=c.bands_per_group: run(i, mode="overlap", bands_per_group=b)
        info[c.name] = _partition_info(c, plan.predicted_overlap_us, plan.schedule, _kernel_of(plan))
    auto = flashoverlap.plan_of(xs[0], ws[0], **plan_opts)
    fns["auto"] = lambda i: run(i)
    info["auto"] = _reference_info("auto", len(auto.groups), [g["bands"][1] - g["bands"][0] for g in auto.groups],
                                   auto.schedule, auto.predicted_us)
    return fns, info, own


def _all_reduce_case(xs, ws, exhaustive: bool, max_candidates: int, backend: str):
    import torch.distributed as dist

    import flashoverlap

    sets, opts = len(xs), {"backend": backend, "order": "banded"}
    fns, info, own = _banded_candidates(
        xs, ws, exhaustive, max_candidates,
        lambda i, **kw: flashoverlap.gemm_all_reduce(xs[i % sets], ws[i % sets], **kw, **opts), opts)

    def sequential(i):
        out = torch.matmul(xs[i % sets], ws[i % sets].t())
        dist.all_reduce(out)
        return out

    fns["sequential"] = sequential
    info["sequential"] = _reference_info("sequential", 1, [own.tiles[0]], "sequential", own.predicted_sequential_us)

    def reference():
        ref = xs[0].float() @ ws[0].float().t()
        dist.all_reduce(ref)
        return ref

    return fns, info, reference


def _reduce_scatter_case(xs, ws, exhaustive: bool, max_candidates: int, backend: str):
    import torch.distributed as dist

    import flashoverlap
    from flashoverlap import _env

    sets, world, rank = len(xs), dist.get_world_size(), dist.get_rank()
    shard, n = xs[0].shape[0] // world, ws[0].shape[0]
    own = flashoverlap.reduce_scatter_plan_of(xs[0], ws[0], mode="overlap", backend=backend)
    counts = [g["bands"][1] - g["bands"][0] for g in own["groups"]]
    fns, info = {}, {}
    for c in select_measured(partition_candidates(own["bands"], counts, _env.max_groups(), max_candidates),
                             exhaustive):
        plan = own if c.bands_per_group is None else flashoverlap.reduce_scatter_plan_of(
            xs[0], ws[0], mode="overlap", bands_per_group=c.bands_per_group, backend=backend)
        fns[c.name] = lambda i, b=c.bands_per_group: flashoverlap.gemm_reduce_scatter(
            xs[i % sets], ws[i % sets], mode="overlap", bands_per_group=b, backend=backend)
        info[c.name] = _partition_info(c, plan["predicted_overlap_us"], plan["schedule"])
    auto = flashoverlap.reduce_scatter_plan_of(xs[0], ws[0], backend=backend)
    fns["auto"] = lambda i: flashoverlap.gemm_reduce_scatter(xs[i % sets], ws[i % sets], backend=backend)
    auto_us = auto["predicted_overlap_us" if auto["schedule"] == "overlap" else "predicted_sequential_us"]
    info["auto"] = _reference_info("auto", len(auto["groups"]), [g["bands"][1] - g["bands"][0] for g in auto["groups"]],
                                   auto["schedule"], auto_us)

    def sequential(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        out = torch.empty(shard, n, device="cuda", dtype=y.dtype)
        dist.reduce_scatter_tensor(out, y)
        return out

    fns["sequential"] = sequential
    info["sequential"] = _reference_info("sequential", 1, [own["bands"]], "sequential",
                                         own["predicted_sequential_us"])

    def reference():
        ref = xs[0].float() @ ws[0].float().t()
        dist.all_reduce(ref)
        return ref[rank * shard:(rank + 1) * shard]

    return fns, info, reference


def _all_to_all_case(xs, ws, exhaustive: bool, max_candidates: int, backend: str):
    import torch.distributed as dist

    import flashoverlap

    sets, world, rank = len(xs), dist.get_world_size(), dist.get_rank()
    n, k = ws[0].shape
    matrix = skewed_split_matrix(world, xs[0].shape[0])
    sends, recvs = matrix[rank], [row[rank] for row in matrix]
    # The communicator first: creating it loads this machine's profiles, which the prediction uses.
    flashoverlap.get_communicator()
    props = torch.cuda.get_device_properties(xs[0].device)
    pred = flashoverlap.plan_gemm_all_to_all(matrix, n, k, dtype=xs[0].dtype, sms=props.multi_processor_count,
                                             compute_capability=(props.major, props.minor), backend=backend)
    pinned = a2a_backend_options(backend, matrix)
    fns, info = {}, {}
    for c in select_measured(a2a_candidates(pred.groups, min(max_candidates, A2A_TABLES_KEPT)), exhaustive):
        fns[c.name] = lambda i, g=c.groups: flashoverlap.gemm_all_to_all(xs[i % sets], ws[i % sets], sends, recvs,
                                                                         groups=g, **pinned)
        info[c.name] = _partition_info(c, pred.predicted_us[c.groups], "overlap" if c.groups > 1 else "one group")
    fns["auto"] = lambda i: flashoverlap.gemm_all_to_all(xs[i % sets], ws[i % sets], sends, recvs,
                                                         split_matrix=matrix, backend=backend)
    if pred.schedule == "sequential":
        info["auto"] = _reference_info("auto", 1, [], "sequential", pred.sequential_us)
    else:
        info["auto"] = _reference_info("auto", pred.groups, [], "overlap" if pred.groups > 1 else "one group",
                                       pred.predicted_us[pred.groups])

    def sequential(i):
        y = torch.matmul(xs[i % sets], ws[i % sets].t())
        out = torch.empty(sum(recvs), n, device="cuda", dtype=y.dtype)
        dist.all_to_all_single(out, y, recvs, sends)
        return out

    fns["sequential"] = sequential
    info["sequential"] = _reference_info("sequential", 1, [], "sequential", pred.sequential_us)

    def reference():
        y = xs[0].float() @ ws[0].float().t()
        ref = torch.empty(sum(recvs), n, device="cuda", dtype=torch.float32)
        dist.all_to_all_single(ref, y, recvs, sends)
        return ref

    return fns, info, reference


NORM_EPS = 1e-5


def _all_reduce_rmsnorm_case(xs, ws, exhaustive: bool, max_candidates: int, backend: str):
    import torch.distributed as dist

    import flashoverlap

    sets, n = len(xs), ws[0].shape[0]
    # The same residual and norm weight on every rank, as tensor parallelism has them.
    device, dtype = xs[0].device, xs[0].dtype
    gen = torch.Generator(device=device).manual_seed(1357)
    residuals = [torch.randn(xs[0].shape[0], n, device=device, dtype=dtype, generator=gen) for _ in range(sets)]
    norm_weight = 1 + 0.1 * torch.randn(n, device=device, dtype=dtype, generator=gen)

    def run(i, **kw):
        return flashoverlap.gemm_all_reduce_rmsnorm(xs[i % sets], ws[i % sets], residuals[i % sets], norm_weight,
                                                    NORM_EPS, backend=backend, **kw)

    fns, info, own = _banded_candidates(xs, ws, exhaustive, max_candidates, run,
                                        {"backend": backend, "fused_norm": True})
    fns["sequential"] = lambda i: run(i, mode="sequential")
    info["sequential"] = _reference_info("sequential", 1, [own.tiles[0]], "sequential", own.predicted_sequential_us)

    def reference():
        res = xs[0].float() @ ws[0].float().t()
        dist.all_reduce(res)
        res += residuals[0].float()
        return res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + NORM_EPS) * norm_weight.float(), res

    return fns, info, reference


CASE_BUILDERS = {"all_reduce": _all_reduce_case, "reduce_scatter": _reduce_scatter_case,
                 "all_to_all": _all_to_all_case, "all_reduce_rmsnorm": _all_reduce_rmsnorm_case}


def measure_case(op: str, m: int, n: int, k: int, dtype: torch.dtype, iters: int, warmup: int, *, exhaustive: bool,
                 max_candidates: int, check: bool, backend: str = "nccl") -> tuple[dict, dict]:
    """One round of one case on every rank: (per-iteration times of every measured candidate and
    reference, {"info": what each is, "errors": each one's relative error vs fp32 where `check`})."""
    import torch.distributed as dist

    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(2468 + rank)
    sets = bench.input_sets((m * k + n * k) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(sets)]
    fns, info, reference = CASE_BUILDERS[op](xs, ws, exhaustive, max_candidates, backend)
    errors = {}
    if check:
        ref = reference()
        errors = {name: _rel_error(f(0), ref) for name, f in fns.items()}
        del ref
    dist.barrier()
    return bench.interleaved_times_us(fns, iters, warmup), {"info": info, "errors": errors}


def _worse(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _worker(rank, world, init_method, cases, dtype_name, iters, warmup, exhaustive, max_candidates, backend,
            result_path):
    import torch.distributed as dist

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    errors: dict = {}

    def measure(op, m, n, k, dtype, iters, warmup):
        # Each case's outputs are checked on its first call only (the discarded pass or round 1).
        case = (op, m, n, k)
        times, facts = measure_case(op, m, n, k, dtype, iters, warmup, exhaustive=exhaustive,
                                    max_candidates=max_candidates, check=case not in errors, backend=backend)
        errors.setdefault(case, facts["errors"])
        return times, facts

    try:
        pooled, facts = bench.pooled_rounds(measure, [tuple(c) for c in cases], dtype, iters, warmup)
        rows = []
        for case, times in pooled.items():
            op, m, n, k = case
            for name, samples in times.items():
                rows.append({"op": op, "m": m, "n": n, "k": k, "world_size": world, "dtype": dtype_name,
                             "candidate": name, **facts[case]["info"][name],
                             "measured_us": bench._max_over_ranks(statistics.median(samples)),
                             "max_rel_error": bench._max_over_ranks(errors[case].get(name, math.nan))})
        if rank == 0:
            with open(result_path, "w") as f:
                # The All-to-All's layout (the matrix passed: natural, push too since 2026-11-26),
                # for e2_replay.
                meta = {**bench.environment(world), "backend": backend, "a2a_layout": "natural"}
                json.dump({"meta": meta, "rows": rows}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="default: every local GPU (1 for a smoke test)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--cases", nargs="+", default=None,
                   help=f"{', '.join(CASE_SETS)} or OP:MxNxK ... (default: default, {len(CASE_SETS['default'])} "
                        f"cases; all: {len(CASE_SETS['all'])}; --quick: quick)")
    p.add_argument("--backend", default="nccl", choices=BACKENDS,
                   help="what moves every candidate's bytes, and what the predictions and mode auto assume "
                        "(default nccl)")
    p.add_argument("--exhaustive", action=argparse.BooleanOptionalAction, default=None,
                   help="measure every candidate (default; --quick: not)")
    p.add_argument("--quick", action="store_true", help="smoke run: the quick cases, 6 iterations, not exhaustive")
    p.add_argument("--max-candidates", type=int, default=MAX_CANDIDATES,
                   help=f"partitions per case (default {MAX_CANDIDATES}; All-to-All at most {A2A_TABLES_KEPT})")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per candidate (default 30; --quick: 6)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls per candidate and round (default 5; "
                                                            "--quick: 2)")
    p.add_argument("--out", default=None, help="path without extension (default: evaluation/results/"
                                               "e2_predictive_search_<gpu>x<world>_<dtype>[_copy_engine|_push][_quick])")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        cases = parse_cases(args.cases or ["quick" if args.quick else "default"])
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    exhaustive = (not args.quick) if args.exhaustive is None else args.exhaustive
    iters = args.iters or (6 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 5)
    if args.max_candidates < 2:
        raise SystemExit(f"--max-candidates: expected >= 2 (one group and the predictor's choice), "
                         f"got {args.max_candidates}")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise SystemExit("E2 needs CUDA GPUs; none is visible")
    world = args.world_size or torch.cuda.device_count()
    if args.backend == "push" and (world != 2 or torch.cuda.get_device_capability(0)[0] != 9):
        raise SystemExit(f"--backend push: runs on exactly 2 Hopper GPUs; this run has {world} x "
                         f"{torch.cuda.get_device_name(0)}")
    out, png = output_paths(torch.cuda.get_device_name(0), world, args.dtype, args.backend, args.quick, args.out)
    os.environ.update(bench.SAFE_ENV)
    started = time.monotonic()
    data = bench.spawn_ranks(_worker, world, cases, args.dtype, iters, warmup, exhaustive, args.max_candidates,
                             args.backend)
    wall_s = time.monotonic() - started
    rows = annotate(data["rows"])
    summary = summarize(rows, exhaustive)
    meta = data["meta"]
    lines = [f"# E2 predictive search, {world} x {meta['gpu']}, {args.dtype}, backend {meta['backend']}, "
             f"{meta['date']}; command: {meta['command']}",
             f"# {len(cases)} cases, {'every candidate measured' if exhaustive else 'sampled candidates'}; "
             f"{iters} iterations per candidate (median, {bench.ROUNDS} rounds, max over ranks); {wall_s:.0f} s",
             "# per candidate: name, kind, groups, predicted us, measured us, |error|, rel error vs fp32, "
             "flags (* the predictor's choice, P least predicted, M least measured among the partitions)",
             *table_lines(rows), *summary_lines(summary)]
    print("\n".join(lines))
    bench.write_outputs(out, lines, rows, {**meta, "summary": summary, "wall_s": wall_s, "iters": iters,
                                           "warmup": warmup})
    series = {SHORT[op]: [r["abs_rel_error"] for r in rows if r["op"] == op and r["kind"] == "partition"]
              for op in OPS if any(r["op"] == op for r in rows)}
    series["all"] = [e for v in series.values() for e in v]
    title = (f"E2: prediction error of {summary['partitions_measured']} partitions, {len(cases)} cases, "
             f"{world} x {meta['gpu']}, {meta['backend']}")
    if plot_error_cdf(series, png, title):
        print(f"wrote {out}.csv, .json, .txt and {png}")
    else:
        print(f"wrote {out}.csv, .json, .txt; matplotlib is not installed: no CDF plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
