"""Replays a committed E2 run on the CPU: the installed predictor re-predicts every measured
partition of GEMM + AllReduce (with or without the fused norm) and GEMM + ReduceScatter from the
same profiles, and the errors against the run's measurements are compared with the ones the run
recorded. A change to the model can so be checked against real measurements without a GPU.

    python evaluation/e2_replay.py [CSV] [--sms 132] [--verbose] [--all-to-all | --auto]

CSV: an e2_predictive_search.py table (default: evaluation/results/e2_predictive_search_h200x1.csv);
its .json sidecar names the GPU, world size, NCCL version and backend, and its kernel column the
GEMM kernel each partition ran (sm90_n256 where the column is missing or empty). Partitions of other ops,
and predictor-chosen partitions the replayed predictor would no longer choose, are skipped (the
count is printed). The profiles are the bundled ones and those in the cache dir: to replay a run
with the profile `tune` made beside it, put that file in $FLASHOVERLAP_CACHE_DIR/profiles-v1/.

--auto replays the AllReduce calls that ran with mode auto instead: the plan each call makes (on
push, the gathered AllReduce among its candidates, which no partition row runs), predicted again,
against its measured time, per kind of plan.

--all-to-all replays the run's GEMM + All-to-All cases instead (E2 routes them by
e2_predictive_search.skewed_split_matrix, which the replay rebuilds): every measured group count
re-predicted by plan_gemm_all_to_all, and the predicted-best count's measured time against the
best measured one (the sequential schedule included).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CSV = os.path.join(HERE, "results", "e2_predictive_search_h200x1.csv")
OPS = {"all_reduce": False, "all_reduce_rmsnorm": True, "reduce_scatter": False}  # op -> fused norm
# The kernel of runs made before the CSV had a kernel column (after 128 x 256 became the default).
OLD_KERNEL = "sm90_n256"


def _load_run(path: str, sms: int) -> dict:
    """The run's .json sidecar, with the profiles of its GPU, SM count and NCCL version loaded."""
    from flashoverlap import profiles

    with open(os.path.splitext(path)[0] + ".json") as f:
        meta = json.load(f)
    profiles.load_for_device(meta["gpu"], sms, meta["nccl"])
    return meta


# Since then the ReduceScatter on the copy engines (2 Hopper ranks) and on push sums in the GEMM's
# epilogue (combined stores); runs before it timed the reduction-kernel path, which the current
# model no longer plans for those backends, so their ReduceScatter partitions are not replayed.
COMBINED_STORES_SINCE = "2026-11-26T03:00"


def _sum_path(meta: dict, op: str) -> bool:
    return (op == "reduce_scatter" and meta.get("backend") in ("copy_engine", "push")
            and meta.get("date", "") < COMBINED_STORES_SINCE)


def replay(path: str, sms: int = 132) -> dict:
    """{"cases": {(op, m, n, k): [(replayed us, measured us, recorded us), ...]}, "skipped": n}."""
    from flashoverlap import planning

    meta = _load_run(path, sms)
    cases, skipped = {}, 0
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["kind"] != "partition" or r["op"] not in OPS or _sum_path(meta, r["op"]):
                skipped += r["kind"] == "partition"
                continue
            m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
            common = dict(sms=sms, mode="overlap", backend=meta["backend"], kernel=r.get("kernel") or OLD_KERNEL,
                          bands_per_group=int(r["bands_per_group"]) if r["bands_per_group"] else None)
            if r["op"] == "reduce_scatter":
                plan = planning.plan_gemm_reduce_scatter(m, n, k, int(r["world_size"]), **common)
                groups, predicted = plan["groups"], plan["predicted_overlap_us"]
            else:
                plan = planning.plan_gemm_all_reduce(m, n, k, int(r["world_size"]), order="banded",
                                                     fused_norm=OPS[r["op"]], **common)
                groups, predicted = plan.groups, plan.predicted_overlap_us
            if ",".join(str(g["bands"][1] - g["bands"][0]) for g in groups) != r["band_counts"]:
                skipped += 1  # the replayed predictor partitions this shape otherwise
                continue
            cases.setdefault((r["op"], m, n, k), []).append((predicted, float(r["measured_us"]),
                                                             float(r["predicted_us"])))
    return {"cases": cases, "skipped": skipped}


def replay_auto(path: str, sms: int = 132) -> list:
    """The run's "auto" rows of GEMM + AllReduce (with or without the fused norm): what the
    installed predictor plans for the call as mode and kernel auto plan it on the run's backend
    (on push the gathered AllReduce among the candidates, which the partition rows never run),
    against the measured time: [(op, m, n, k, kind, replayed us, measured us, recorded us)],
    kind "gathered", "overlap" or "sequential". A row whose replayed prediction is more than 1%
    off the recorded one was planned otherwise then and is left out."""
    from flashoverlap import planning

    meta = _load_run(path, sms)
    rows = []
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["kind"] != "auto" or r["op"] not in ("all_reduce", "all_reduce_rmsnorm"):
                continue
            m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
            plan = planning.plan_gemm_all_reduce(m, n, k, int(r["world_size"]), sms=sms, backend=meta["backend"],
                                                 fused_norm=OPS[r["op"]])
            recorded = float(r["predicted_us"])
            if abs(plan.predicted_us - recorded) > 0.01 * recorded:
                continue
            kind = "gathered" if plan.gathered is not None and plan.predicted_us == plan.gathered["predicted_us"] \
                else plan.schedule
            rows.append((r["op"], m, n, k, kind, plan.predicted_us, float(r["measured_us"]), recorded))
    return rows


def replay_all_to_all(path: str, sms: int = 132) -> dict:
    """{(m, n, k): {"rows": [(groups, replayed us, measured us, recorded us)], "sequential":
    (replayed us, measured us), "pick": groups the replayed predictor picks (0: sequential)}}."""
    import torch

    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # the E2 script's routing, beside this one
    from e2_predictive_search import skewed_split_matrix
    from flashoverlap import planning

    meta = _load_run(path, sms)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    cases = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["op"] != "all_to_all" or r["kind"] not in ("partition", "sequential"):
                continue
            m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
            if (m, n, k) not in cases:
                matrix = skewed_split_matrix(int(r["world_size"]), m)
                # The layout the run recorded: natural (what the model plans by default), or
                # padded (push before 2026-11-26: each destination in whole 128-row bands); older
                # runs split each destination's rows near-equally, padded to whole bands.
                layout = meta.get("a2a_layout")
                segment_rows = {"natural": None, "padded": 128}.get(layout, 1)
                pred = planning.plan_gemm_all_to_all(matrix, n, k, dtype=dtype[r["dtype"]], sms=sms,
                                                     backend=meta["backend"], _segment_rows=segment_rows)
                cases[(m, n, k)] = {"pred": pred, "rows": [], "sequential": None,
                                    "pick": 0 if pred.schedule == "sequential" else pred.groups}
            case = cases[(m, n, k)]
            if r["kind"] == "sequential":
                case["sequential"] = (case["pred"].sequential_us, float(r["measured_us"]))
            else:
                g = int(r["groups"])
                case["rows"].append((g, case["pred"].predicted_us[g], float(r["measured_us"]),
                                     float(r["predicted_us"])))
    return cases


def summary_all_to_all(cases: dict) -> dict:
    """Mean |error| of the replayed and recorded predictions over the measured group counts; the
    replayed predictor's pick (its measured time, where that count was measured) against the
    best measured of the counts and sequential: mean and min; and, as E2 judges it, the measured
    group count with the least replayed prediction against the best measured count
    (`best_pick_mean`, `best_pick_min`)."""
    replayed = [abs(p - m) / m for c in cases.values() for _, p, m, _ in c["rows"]]
    recorded = [abs(r - m) / m for c in cases.values() for _, _, m, r in c["rows"]]
    best = [min(m for _, _, m, _ in c["rows"]) / min(c["rows"], key=lambda row: row[1])[2] for c in cases.values()]
    picks, unmeasured = [], 0
    for c in cases.values():
        measured = {g: m for g, _, m, _ in c["rows"]}
        if c["sequential"] is not None:
            measured[0] = c["sequential"][1]
        if c["pick"] not in measured:
            unmeasured += 1
            continue
        picks.append(min(measured.values()) / measured[c["pick"]])
    return {"replayed": statistics.mean(replayed), "recorded": statistics.mean(recorded),
            "pick_mean": statistics.mean(picks) if picks else float("nan"),
            "pick_min": min(picks) if picks else float("nan"), "unmeasured": unmeasured,
            "best_pick_mean": statistics.mean(best), "best_pick_min": min(best)}


def summary(cases: dict, which: int) -> dict:
    """Mean |error|, per op and signed, and the predicted-best partition's measured time over the
    best measured (mean, min) for predictions column `which` (0 replayed, 2 recorded)."""
    errors = {}
    for (op, *_), rows in cases.items():
        errors.setdefault(op, []).extend((row[which] - row[1]) / row[1] for row in rows)
    signed = [e for v in errors.values() for e in v]
    picks = [min(r[1] for r in rows) / min(rows, key=lambda r: r[which])[1] for rows in cases.values()]
    return {"mean": statistics.mean(abs(e) for e in signed), "signed": statistics.mean(signed),
            "per_op": {op: statistics.mean(abs(e) for e in v) for op, v in errors.items()},
            "pick_mean": statistics.mean(picks), "pick_min": min(picks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", default=DEFAULT_CSV)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--all-to-all", action="store_true", help="replay the GEMM + All-to-All cases")
    ap.add_argument("--auto", action="store_true",
                    help="replay the AllReduce calls' own plans (mode auto: the gathered AllReduce included)")
    args = ap.parse_args(argv)
    if args.auto:
        rows = replay_auto(args.csv, args.sms)
        if not rows:
            print(f"no auto AllReduce row of {args.csv} replays", file=sys.stderr)
            return 1
        for kind in sorted({row[4] for row in rows}):
            mine = [row for row in rows if row[4] == kind]
            if args.verbose:
                for op, m, n, k, _, replayed, measured, _ in mine:
                    print(f"{op:>20} {m}x{n}x{k} {kind}: measured {measured:8.1f} replayed {replayed:8.1f} "
                          f"({replayed / measured - 1:+.1%})")
            errors = [(row[5] - row[6]) / row[6] for row in mine]
            print(f"{kind}: {len(mine)} calls, mean |error| {statistics.mean(map(abs, errors)):.2%}, "
                  f"signed {statistics.mean(errors):+.2%}")
        return 0
    if args.all_to_all:
        a2a = replay_all_to_all(args.csv, args.sms)
        if not a2a:
            print(f"no All-to-All case in {args.csv}", file=sys.stderr)
            return 1
        if args.verbose:
            for (m, n, k), c in sorted(a2a.items()):
                rows = " ".join(f"g{g}: {meas:.0f}/{rep:.0f}" for g, rep, meas, _ in sorted(c["rows"]))
                seq = c["sequential"]
                print(f"{m}x{n}x{k}: measured/replayed {rows}"
                      + (f" seq: {seq[1]:.0f}/{seq[0]:.0f}" if seq else "") + f"; picks {c['pick'] or 'sequential'}")
        s = summary_all_to_all(a2a)
        print(f"{sum(len(c['rows']) for c in a2a.values())} All-to-All partitions of {len(a2a)} cases from "
              f"{args.csv}: mean |error| recorded {s['recorded']:.2%}, replayed {s['replayed']:.2%}; replayed "
              f"pick / best measured: mean {s['pick_mean']:.4f}, min {s['pick_min']:.4f} "
              f"({s['unmeasured']} picks not measured); predicted-best measured count / best measured: "
              f"mean {s['best_pick_mean']:.4f}, min {s['best_pick_min']:.4f}")
        return 0
    result = replay(args.csv, args.sms)
    cases = result["cases"]
    if not cases:
        print(f"nothing to replay in {args.csv} (skipped {result['skipped']})", file=sys.stderr)
        return 1
    if args.verbose:
        for (op, m, n, k), rows in sorted(cases.items()):
            for replayed, measured, recorded in rows:
                print(f"{op:>20} {m}x{n}x{k}: measured {measured:8.1f} recorded {recorded:8.1f} "
                      f"replayed {replayed:8.1f}")
    print(f"{sum(map(len, cases.values()))} partitions of {len(cases)} cases replayed from {args.csv} "
          f"({result['skipped']} skipped)")
    for name, which in (("recorded", 2), ("replayed", 0)):
        s = summary(cases, which)
        ops = ", ".join(f"{op} {e:.2%}" for op, e in sorted(s["per_op"].items()))
        print(f"{name}: mean |error| {s['mean']:.2%} ({ops}), signed {s['signed']:+.2%}; predicted-best / "
              f"measured best: mean {s['pick_mean']:.4f}, min {s['pick_min']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
