"""evaluation/bench_gemm_rs.py without a GPU: its rows (every backend's speedups over seq), its
table, the geometric means per backend and the copy-engine bar's verdict."""

from __future__ import annotations

import math
import re

import pytest

from evaluation_scripts import load as _load


rs = _load("bench_gemm_rs")
META = {"world_size": 2, "gpu": "NVIDIA H200", "date": "today", "command": "python x"}


def _times(seq=1000.0, fo=800.0, fo_nccl=900.0, fo_ce=700.0, forced_ce=750.0):
    times = {v: 100.0 for v in rs.VARIANTS}
    times.update(seq=seq, fo=fo, fo_nccl=fo_nccl, fo_ce=fo_ce, forced=820.0, forced_ce=forced_ce, decomp=1000.0,
                 async_tp=1200.0, concurrent=500.0)
    return times


def _facts(backend="copy_engine", errors=None):
    names = ("seq", "fo", "fo_nccl", "fo_ce", "forced", "forced_ce", "decomp", "async_tp")
    return {"schedule": "overlap", "groups": 3, "backend": backend, "schedule_nccl": "sequential",
            "schedule_ce": "overlap", "errors": errors or {name: 3e-3 for name in names}, "async_tp_error": None}


def _row(shape=(4096, 8192, 4096), times=None, facts=None):
    return rs.make_row(shape, 2, times or _times(), facts or _facts())


def test_row_has_every_variant_and_each_backends_speedup() -> None:
    row = _row()
    assert (row["m"], row["n"], row["k"], row["world_size"]) == (4096, 8192, 4096, 2)
    assert all(f"{v}_us" in row for v in rs.VARIANTS)
    assert row["fo_vs_seq"] == pytest.approx(1.25)
    assert row["fo_nccl_vs_seq"] == pytest.approx(1000.0 / 900.0)
    assert row["fo_ce_vs_seq"] == pytest.approx(1000.0 / 700.0)
    assert row["forced_ce_vs_seq"] == pytest.approx(1000.0 / 750.0)
    assert row["fo_vs_decomp"] == pytest.approx(1.25) and row["fo_vs_async_tp"] == pytest.approx(1.5)
    assert row["concurrent_vs_seq"] == pytest.approx(2.0)
    assert (row["backend"], row["schedule"], row["schedule_nccl"], row["schedule_ce"]) == (
        "copy_engine", "overlap", "sequential", "overlap")
    assert row["max_rel_error"] == 3e-3 and row["failed"] == "" and row["async_tp_error"] == ""


def test_async_tp_missing_is_nan_not_an_error() -> None:
    times = _times()
    del times["async_tp"]
    row = _row(times=times)
    assert math.isnan(row["async_tp_us"]) and math.isnan(row["fo_vs_async_tp"])
    assert all(math.isnan(v) for v in rs.geo([row], "fo_vs_async_tp"))


def test_table_prints_every_variant_backend_and_geometric_means() -> None:
    rows = [_row((2048, 8192, 4096), _times(fo=800.0, fo_nccl=500.0, fo_ce=1000.0), _facts("nccl")),
            _row((4096, 8192, 4096), _times(fo=1250.0, fo_nccl=2000.0, fo_ce=400.0))]
    lines = rs.table(rows, META, "bfloat16")
    assert "GEMM + ReduceScatter, 2 x NVIDIA H200, bfloat16" in lines[0]
    header = lines[2].split()
    assert all(v in header for v in rs.VARIANTS)
    assert all(c in lines[2] for c in ("backend", "nccl x", "ce x", "fce x"))
    cases = [line for line in lines if re.match(r"\s*(2048|4096)x8192x4096", line)]
    assert len(cases) == 2
    assert "        nccl    overlap  1.250x  2.000x  1.000x  1.333x" in cases[0]
    assert " copy_engine    overlap  0.800x  0.500x  2.500x  1.333x" in cases[1]
    for name, means in (("fo (backend auto)", (1.25, 0.8)), ("fo_nccl (backend nccl)", (2.0, 0.5)),
                        ("fo_ce (backend copy_engine)", (1.0, 2.5))):
        line = next(x for x in lines if x.startswith(f"{name} over sequential cuBLAS + NCCL:"))
        assert f"geometric mean {math.sqrt(means[0] * means[1]):.3f}x, min {min(means):.3f}x" in line
    assert "backend auto picked: nccl for 1 of 2 shapes, copy_engine for 1 of 2 shapes" in lines
    # sqrt(1.0 * 2.5) = 1.58 >= 1.25, every result right.
    assert next(x for x in lines if x.startswith("copy-engine bar")).endswith(": PASS")
    assert not any("WRONG RESULT" in x or "Async-TP failed" in x for x in lines)


def test_ce_verdict_needs_the_bar_and_right_results() -> None:
    assert rs.CE_BAR == 1.25
    assert rs.ce_verdict([_row(times=_times(fo_ce=800.0))]) == "PASS"  # exactly 1.25x
    assert rs.ce_verdict([_row(times=_times(fo_ce=801.0))]) == "FAIL"
    assert rs.ce_verdict([_row(times=_times(fo_ce=math.nan))]) == "n/a"
    # A wrong copy-engine result fails the bar however fast; another variant's does not.
    for name, verdict in (("fo_ce", "FAIL"), ("forced_ce", "FAIL"), ("async_tp", "PASS")):
        errors = {**_facts()["errors"], name: 0.5}
        assert rs.ce_verdict([_row(times=_times(fo_ce=400.0), facts=_facts(errors=errors))]) == verdict, name


def test_wrong_results_and_async_tp_failures_are_reported() -> None:
    errors = {**_facts()["errors"], "fo_ce": math.inf, "decomp": 0.5}
    facts = {**_facts(errors=errors), "async_tp_error": "RuntimeError: no symm_mem"}
    row = _row(facts=facts)
    assert row["failed"] == "fo_ce decomp" and row["max_rel_error"] == math.inf
    lines = rs.table([row], META, "bfloat16")
    assert any(x.startswith("WRONG RESULT 4096x8192x4096: fo_ce decomp over relative error 0.01") for x in lines)
    assert next(x for x in lines if x.startswith("copy-engine bar")).endswith(": FAIL")
    assert "torch Async-TP failed: RuntimeError: no symm_mem" in lines


def test_docstring_lists_every_variant() -> None:
    assert all(f"\n  {v} " in rs.__doc__ for v in rs.VARIANTS)
