"""E2's predictive-search evaluation without a GPU: candidate pruning on real plans, the error and
best-ratio metrics, the summary's bars, and the CDF plot."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import flashoverlap

from evaluation_scripts import load as _load
MAX_GROUPS = 16


e2 = _load("e2_predictive_search")


def _band_counts(plan) -> tuple:
    return tuple(b - a for a, b in (g["bands"] for g in plan.groups))


@pytest.mark.parametrize("m,k", [(2048, 4096), (4096, 1024), (8192, 4096), (16384, 14336), (16384, 1024)])
def test_partition_candidates_on_real_plans(m: int, k: int) -> None:
    plan = flashoverlap.plan_gemm_all_reduce(m, 8192, k, 2, mode="overlap", order="banded", backend="nccl",
                                             max_groups=MAX_GROUPS)
    tiles_m, own = plan.tiles[0], _band_counts(plan)
    cands = e2.partition_candidates(tiles_m, own, MAX_GROUPS)
    assert 2 <= len(cands) <= e2.MAX_CANDIDATES
    # One group (b = tiles_m) and exactly one predictor's choice: its very partition.
    assert [c for c in cands if c.groups == 1 and c.bands_per_group == tiles_m]
    chosen = [c for c in cands if c.chosen]
    assert len(chosen) == 1 and chosen[0].band_counts == own
    # No partition twice; the uniform ones each of another group count, what the op runs for b.
    assert len({c.band_counts for c in cands}) == len(cands) == len({c.name for c in cands})
    uniform = [c for c in cands if c.bands_per_group is not None]
    assert len({c.groups for c in uniform}) == len(uniform)
    for c in uniform:
        assert c.band_counts == e2.uniform_band_counts(tiles_m, c.bands_per_group)
        assert len(c.band_counts) == c.groups == math.ceil(tiles_m / c.bands_per_group)
        assert c.groups <= MAX_GROUPS
    for c in cands:
        assert sum(c.band_counts) == tiles_m
    assert [c.groups for c in cands] == sorted(c.groups for c in cands)
    # Each uniform partition but the predictor's is the most even of its group count: the smallest such b.
    for c in uniform:
        if not c.chosen and c.bands_per_group > 1:
            assert math.ceil(tiles_m / (c.bands_per_group - 1)) > c.groups


def test_partition_candidates_take_every_group_count_under_the_cap() -> None:
    # 16 bands: ceil(16 / b) takes the values 1, 2, 3, 4, 6, 8, 16; the predictor's split is uneven.
    cands = e2.partition_candidates(16, (3, 7, 6), MAX_GROUPS, cap=12)
    assert [(c.name, c.groups) for c in cands] == [("b16", 1), ("b8", 2), ("b6", 3), ("predictor", 3), ("b4", 4),
                                                   ("b3", 6), ("b2", 8), ("b1", 16)]
    assert [c.name for c in cands if c.chosen] == ["predictor"]
    # Group counts above the planner's cap are not candidates.
    assert max(c.groups for c in e2.partition_candidates(16, (16,), max_groups=4)) == 4


def test_a_uniform_predictor_choice_is_its_uniform_candidate() -> None:
    cands = e2.partition_candidates(10, (4, 4, 2), MAX_GROUPS, cap=12)
    chosen = [c for c in cands if c.chosen]
    assert [(c.name, c.bands_per_group, c.band_counts) for c in chosen] == [("b4", 4, (4, 4, 2))]
    assert "predictor" not in {c.name for c in cands}
    # b = 9 gives 2 groups (9, 1): not the most even, but the predictor's, so it is taken as is.
    cands = e2.partition_candidates(10, (9, 1), MAX_GROUPS, cap=12)
    assert [c.name for c in cands if c.groups == 2] == ["b9"]
    assert len({c.groups for c in cands}) == len(cands)


def test_the_cap_keeps_one_group_and_the_choice() -> None:
    for cap in (2, 3, 5):
        cands = e2.partition_candidates(128, (106, 17, 3, 2), MAX_GROUPS, cap=cap)
        assert len(cands) == cap
        assert {c.groups for c in cands if c.bands_per_group is not None} >= {1}
        assert [c.band_counts for c in cands if c.chosen] == [(106, 17, 3, 2)]
    # Spread in log(groups): with room for 4 besides the choice, the extremes and the middle.
    cands = e2.partition_candidates(128, (106, 17, 3, 2), MAX_GROUPS, cap=5)
    assert [c.groups for c in cands if not c.chosen] == [1, 2, 4, 16]


def test_uniform_bands() -> None:
    assert e2.uniform_band_counts(10, 4) == (4, 4, 2)
    assert e2.uniform_band_counts(8, 8) == (8,)
    assert e2.uniform_bands((4, 4, 2), 10) == 4
    assert e2.uniform_bands((16,), 16) == 16
    assert e2.uniform_bands((3, 7), 10) is None
    assert e2.uniform_bands((4, 4), 10) is None
    assert e2.uniform_bands((), 10) is None


def test_a2a_candidates() -> None:
    assert [c.groups for c in e2.a2a_candidates(6)] == list(e2.A2A_GROUPS)
    cands = e2.a2a_candidates(5)
    groups = [c.groups for c in cands]
    # The op keeps 8 routings' tables: the predictor's 5 goes in, the count nearest it in log scale goes.
    assert len(groups) == e2.A2A_TABLES_KEPT and 1 in groups and 5 in groups and 6 not in groups
    assert [c.groups for c in cands if c.chosen] == [5]
    assert groups == sorted(set(groups))
    assert [c.groups for c in e2.a2a_candidates(40, cap=3)] == [1, 6, 40]


def test_select_measured() -> None:
    cands = e2.partition_candidates(16, (3, 7, 6), MAX_GROUPS)
    assert e2.select_measured(cands, exhaustive=True) == cands
    assert [c.name for c in e2.select_measured(cands, exhaustive=False)] == ["b16", "b6", "predictor", "b4"]
    cands = e2.a2a_candidates(1)
    assert [c.groups for c in e2.select_measured(cands, exhaustive=False)] == [1, 2]


def test_skewed_split_matrix() -> None:
    matrix = e2.skewed_split_matrix(4, 4096)
    assert all(row == matrix[0] for row in matrix)
    assert all(sum(row) == 4096 for row in matrix)
    assert matrix[0] == sorted(matrix[0], reverse=True) and matrix[0][0] > 2 * matrix[0][3] > 0
    assert e2.skewed_split_matrix(2, 2048) == [[1366, 682], [1366, 682]]
    assert e2.skewed_split_matrix(1, 100) == [[100]]


def test_error_and_best_ratio() -> None:
    assert e2.abs_rel_error(105.0, 100.0) == pytest.approx(0.05)
    assert e2.abs_rel_error(95.0, 100.0) == pytest.approx(0.05)
    assert math.isnan(e2.abs_rel_error(100.0, math.nan))
    assert math.isnan(e2.abs_rel_error(math.nan, 100.0))
    # The least predicted (a) runs 110 us, the fastest measured (b) 100 us.
    pick, ratio = e2.best_ratio({"a": 90.0, "b": 100.0, "c": 95.0}, {"a": 110.0, "b": 100.0, "c": 120.0})
    assert pick == "a" and ratio == pytest.approx(100.0 / 110.0)
    pick, ratio = e2.best_ratio({"a": 90.0, "b": 100.0}, {"a": 80.0, "b": 100.0})
    assert pick == "a" and ratio == 1.0
    # Only what was measured counts.
    assert e2.best_ratio({"a": 90.0, "b": 100.0}, {"b": 100.0, "c": 50.0}) == ("b", 1.0)
    assert e2.best_ratio({}, {})[0] is None


def _case_rows(op: str, m: int, parts, seq=(500.0, 520.0), auto=(400.0, 410.0), err=2.5e-3) -> list:
    """Rows as the worker writes them: parts = [(name, predicted, measured, chosen)]."""
    base = {"op": op, "m": m, "n": 8192, "k": 4096, "world_size": 2, "dtype": "bfloat16"}

    def row(name, kind, predicted, measured, chosen=False):
        return {**base, "candidate": name, "kind": kind, "groups": 2, "bands_per_group": None, "band_counts": "",
                "chosen": chosen, "schedule": "overlap", "predicted_us": predicted, "measured_us": measured,
                "max_rel_error": err}

    return ([row(n, "partition", p, t, c) for n, p, t, c in parts] + [row("auto", "auto", *auto)] +
            [row("sequential", "sequential", *seq)])


def _rows(cases: int, error: float, ratio_case: float = 1.0, err: float = 2.5e-3) -> list:
    """`cases` cases whose partitions are all mispredicted by `error`; the last case's predicted
    best runs 1 / ratio_case slower than its best."""
    rows = []
    for i in range(cases):
        slow = 100.0 / ratio_case if i == cases - 1 else 100.0
        # "pick" is predicted fastest; "other" is measured fastest where ratio_case < 1.
        other = 110.0 if i < cases - 1 else 100.0
        rows += _case_rows(e2.OPS[i % 3], 1024 * (i + 1), [("pick", slow * (1 - error), slow, True),
                                                           ("other", other * (1 + error), other, False)], err=err)
    return rows


def test_annotate_marks_the_best_and_the_ratios() -> None:
    rows = e2.annotate(_case_rows("all_reduce", 4096, [("b8", 300.0, 330.0, False), ("predictor", 280.0, 350.0, True),
                                                       ("b1", 400.0, 390.0, False)]))
    by = {r["candidate"]: r for r in rows}
    assert by["predictor"]["pred_best"] and by["b8"]["measured_best"]
    assert not by["b8"]["pred_best"] and not by["predictor"]["measured_best"]
    assert by["b8"]["abs_rel_error"] == pytest.approx(30.0 / 330.0)
    assert all(r["best_ratio"] == pytest.approx(330.0 / 350.0) for r in rows)
    # Auto (410 us) against the best of the partitions and the sequential schedule (330 us).
    assert all(r["auto_ratio"] == pytest.approx(330.0 / 410.0) for r in rows)
    # The sequential schedule is never a partition.
    assert not by["sequential"]["pred_best"] and not by["sequential"]["measured_best"]


def test_summary_passes_within_the_bars() -> None:
    s = e2.summarize(e2.annotate(_rows(21, error=0.03)), exhaustive=True)
    assert s["cases"] == 21 and s["partitions_measured"] == 42
    assert s["mean_error"] == pytest.approx(0.03, rel=1e-6)
    assert s["mean_best_ratio"] == 1.0 and s["min_best_ratio"] == 1.0
    lines = e2.summary_lines(s)
    assert lines[0] == "cases: 21 (bar >= 20): PASS"
    assert "3.00% (bar <= 5%): PASS" in lines[1]
    assert "mean >= 0.99: PASS" in lines[3] and "min >= 0.95: PASS" in lines[3]
    assert "(bar <= 1e-02): PASS" in lines[-2]
    assert lines[-1] == "E2: PASS"


def test_summary_fails_what_misses_its_bar() -> None:
    s = e2.summarize(e2.annotate(_rows(20, error=0.08, ratio_case=0.9)), exhaustive=True)
    assert s["min_best_ratio"] == pytest.approx(0.9)
    assert s["mean_best_ratio"] == pytest.approx((19 + 0.9) / 20)
    assert s["worst_case"] == e2.case_label(("reduce_scatter", 20480, 8192, 4096))
    lines = e2.summary_lines(s)
    assert lines[0].endswith("PASS")
    assert "8.00% (bar <= 5%): FAIL" in lines[1]
    assert "mean >= 0.99: PASS" in lines[3] and "min >= 0.95: FAIL" in lines[3]
    assert lines[-1] == "E2: FAIL (error, min_ratio)"
    # Too few cases, an output off fp32, an unchecked output (NaN): each fails its bar.
    assert e2.summary_lines(e2.summarize(e2.annotate(_rows(3, 0.01, err=0.02)), True))[-1] == \
        "E2: FAIL (cases, correctness)"
    assert e2.summary_lines(e2.summarize(e2.annotate(_rows(20, 0.01, err=math.nan)), True))[-1] == \
        "E2: FAIL (correctness)"


def test_summary_without_the_exhaustive_measurement() -> None:
    lines = e2.summary_lines(e2.summarize(e2.annotate(_rows(20, error=0.01)), exhaustive=False))
    assert "bars not evaluated" in lines[3]
    assert lines[-1].startswith("E2: incomplete")
    lines = e2.summary_lines(e2.summarize(e2.annotate(_rows(20, error=0.2)), exhaustive=False))
    assert lines[-1] == "E2: FAIL (error)"


def test_table_lines() -> None:
    rows = e2.annotate(_case_rows("all_to_all", 2048, [("g1", 300.0, 330.0, False), ("g4", 280.0, 300.0, True)]))
    lines = e2.table_lines(rows)
    assert lines[0].startswith("A2A 2048x8192x4096: predictor's choice g4, predicted best g4, measured best g4")
    assert lines[2].split()[-1] == "*PM" and len(lines) == 1 + len(rows)


def test_error_cdf() -> None:
    xs, ps = e2.error_cdf([0.03, math.nan, 0.01, 0.02, 0.04])
    assert xs == [0.01, 0.02, 0.03, 0.04] and ps == [0.25, 0.5, 0.75, 1.0]
    assert e2.error_cdf([]) == ([], [])


def test_plot_error_cdf(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "cdf" / "e2.png"
    assert e2.plot_error_cdf({"AR": [0.01, 0.04, 0.02], "RS": [0.06], "all": [0.01, 0.04, 0.02, 0.06]}, str(path),
                             "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_error_cdf_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "e2.png"
    assert e2.plot_error_cdf({"AR": [0.01]}, str(path), "test") is False
    assert not path.exists()


def test_parse_cases() -> None:
    assert e2.parse_cases(["default"]) == e2.CASE_SETS["default"]
    assert len(e2.CASE_SETS["default"]) >= e2.MIN_CASES
    assert len(e2.CASE_SETS["all"]) == 16 * len(e2.OPS) and set(e2.CASE_SETS["default"]) <= set(e2.CASE_SETS["all"])
    assert e2.parse_cases(["ar:4096x8192x4096", "a2a:2048x8192x1024", "all_reduce:4096x8192x4096",
                           "arn:2048x8192x1024"]) == [
        ("all_reduce", 4096, 8192, 4096), ("all_to_all", 2048, 8192, 1024), ("all_reduce_rmsnorm", 2048, 8192, 1024)]
    for bad in ("gemm:4096x8192x4096", "ar:4096x8192", "rs:0x8192x4096", "bogus"):
        with pytest.raises(argparse.ArgumentTypeError, match="--cases"):
            e2.parse_cases([bad])


def test_backend_option() -> None:
    parse = e2.build_parser().parse_args
    assert parse([]).backend == "nccl"
    assert parse(["--backend", "copy_engine", "--quick"]).backend == "copy_engine"
    assert parse(["--backend", "nccl"]).backend == "nccl"
    # "auto" picks per shape and could mix backends within a case: not an option here.
    for bad in ("auto", "nvshmem"):
        with pytest.raises(SystemExit):
            parse(["--backend", bad])


def test_output_paths() -> None:
    root = Path(e2.RESULTS)
    # NCCL keeps the names it always had; the copy engines get their own beside them.
    out, png = e2.output_paths("NVIDIA H200", 2, "bfloat16", "nccl", quick=False)
    assert (Path(out), Path(png)) == (root / "e2_predictive_search_h200x2_bfloat16",
                                      root / "e2_prediction_error_cdf_h200x2.png")
    out, png = e2.output_paths("NVIDIA H200", 2, "bfloat16", "nccl", quick=True)
    assert (Path(out).name, Path(png).name) == ("e2_predictive_search_h200x2_bfloat16_quick",
                                                "e2_prediction_error_cdf_h200x2_quick.png")
    out, png = e2.output_paths("NVIDIA H100 80GB HBM3", 4, "float16", "copy_engine", quick=False)
    assert (Path(out).name, Path(png).name) == ("e2_predictive_search_h100-80gb-hbm3x4_float16_copy_engine",
                                                "e2_prediction_error_cdf_h100-80gb-hbm3x4_copy_engine.png")
    out, png = e2.output_paths("NVIDIA H200", 2, "bfloat16", "copy_engine", quick=True)
    assert Path(out).name.endswith("_copy_engine_quick") and Path(png).name.endswith("_copy_engine_quick.png")
    # An explicit --out is taken as is, whatever the backend.
    assert e2.output_paths("NVIDIA H200", 2, "bfloat16", "copy_engine", True, "/tmp/x") == ("/tmp/x",
                                                                                             "/tmp/x_error_cdf.png")


def test_a2a_backend_options() -> None:
    matrix = e2.skewed_split_matrix(2, 2048)
    assert e2.a2a_backend_options("nccl", matrix) == {"backend": "nccl", "split_matrix": matrix}
    assert e2.a2a_backend_options("copy_engine", matrix) == {"backend": "copy_engine", "split_matrix": matrix}
    assert e2.a2a_backend_options("push", matrix) == {"backend": "push", "split_matrix": matrix}
    with pytest.raises(ValueError, match="backend"):
        e2.a2a_backend_options("auto", matrix)


@pytest.mark.parametrize("backend", e2.BACKENDS)
def test_case_builders_pin_every_call_to_the_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each case's candidates, predictions and auto reference all run on --backend (the library's
    ops and plans stood in for on CPU; the All-to-All prediction is the real one)."""
    import torch
    import torch.distributed as dist

    calls = []

    def record(name, result):
        def fake(*args, **kwargs):
            calls.append((name, kwargs))
            return result
        return fake

    ar_plan = SimpleNamespace(tiles=(16, 64), groups=[{"bands": (0, 3)}, {"bands": (3, 16)}], schedule="overlap",
                              predicted_overlap_us=100.0, predicted_us=100.0, predicted_sequential_us=150.0)
    rs_plan = {"bands": 8, "groups": [{"bands": (0, 3)}, {"bands": (3, 8)}], "schedule": "overlap",
               "predicted_overlap_us": 80.0, "predicted_sequential_us": 120.0}
    real_a2a_plan = flashoverlap.plan_gemm_all_to_all
    for name, result in (("plan_of", ar_plan), ("gemm_all_reduce", None), ("reduce_scatter_plan_of", rs_plan),
                         ("gemm_reduce_scatter", None), ("gemm_all_to_all", None), ("get_communicator", None),
                         ("gemm_all_reduce_rmsnorm", None)):
        monkeypatch.setattr(flashoverlap, name, record(name, result))
    monkeypatch.setattr(flashoverlap, "plan_gemm_all_to_all",
                        lambda matrix, n, k, **kw: calls.append(("plan_gemm_all_to_all", kw)) or
                        real_a2a_plan(matrix, n, k, **kw))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132, major=9, minor=0))
    xs, ws = [torch.zeros(2048, 64, dtype=torch.bfloat16)], [torch.zeros(8192, 64, dtype=torch.bfloat16)]
    for op in e2.OPS:
        calls.clear()
        fns, info, _ = e2.CASE_BUILDERS[op](xs, ws, True, e2.MAX_CANDIDATES, backend)
        assert "auto" in fns and len(fns) >= 4
        for name, fn in fns.items():
            # torch.distributed's own collective, whatever the backend (but the norm op's own
            # sequential schedule, which the predictor models)
            if name != "sequential" or op == "all_reduce_rmsnorm":
                fn(0)
        made = [(f, kw) for f, kw in calls if f != "get_communicator"]
        assert made and all(kw.get("backend") == backend for _, kw in made), made
        # Partitions in mode overlap, auto in mode auto, on the same backend.
        if op != "all_to_all":
            runs = [kw for f, kw in made if f.startswith("gemm_")]
            modes = sorted(kw.get("mode", "auto") for kw in runs)
            assert modes.count("auto") == 1 and modes.count("overlap") == len(fns) - 2
            norm = op == "all_reduce_rmsnorm"
            assert {f for f, _ in made if f.startswith("gemm_")} == {
                {"all_reduce": "gemm_all_reduce", "reduce_scatter": "gemm_reduce_scatter"}.get(op,
                                                                                       "gemm_all_reduce_rmsnorm")}
            assert modes.count("sequential") == norm
            # The norm op's plans charge the norm to each group.
            assert all(kw.get("fused_norm", False) == norm for f, kw in made if f == "plan_of")
            continue
        matrix = e2.skewed_split_matrix(2, 2048)
        runs = [kw for f, kw in made if f == "gemm_all_to_all"]
        auto = [kw for kw in runs if "groups" not in kw]
        assert auto == [{"split_matrix": matrix, "backend": backend}]
        candidates = [kw for kw in runs if "groups" in kw]
        assert len(candidates) == len(fns) - 2
        # Every candidate has the whole routing, as auto does: the layout the predictor plans.
        assert all(kw.get("split_matrix") == matrix for kw in candidates)
        assert {info[f"g{kw['groups']}"]["predicted_us"] for kw in candidates} <= set(
            real_a2a_plan(matrix, 8192, 64, backend=backend).predicted_us.values())
