"""evaluation/bench_gemm_a2a.py without a GPU: its routings, the decomposition's chunk arithmetic
(checked by simulating the exchange), its rows and its table."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from evaluation_scripts import ROOT, load as _load


a2a = _load("bench_gemm_a2a")


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [2048, 4096, 8192, 16384, 1001])
def test_skewed_routing_sends_every_row_with_one_hot_destination(world, tokens) -> None:
    matrix = a2a.routing(world, tokens)
    assert len(matrix) == world and all(len(row) == world for row in matrix)
    assert all(isinstance(v, int) and v >= 0 for row in matrix for v in row)
    assert all(sum(row) == tokens for row in matrix)
    columns = [sum(row[q] for row in matrix) for q in range(world)]
    hot = columns.index(max(columns))
    # Every rank sends the hot destination 60% of its rows, more than to any other.
    assert all(row[hot] == round(a2a.HOT_SHARE * tokens) for row in matrix)
    assert all(row[hot] > max(v for q, v in enumerate(row) if q != hot) for row in matrix)
    assert columns[hot] == world * round(a2a.HOT_SHARE * tokens)
    assert columns[hot] > max(v for q, v in enumerate(columns) if q != hot)


def test_skewed_routing_spreads_the_rest_unevenly() -> None:
    matrix = a2a.routing(8, 16384)
    hot = max(range(8), key=lambda q: matrix[0][q])
    rest = [v for row in matrix for q, v in enumerate(row) if q != hot]
    assert max(rest) > 2 * min(rest)
    # Ranks weight their tails differently.
    assert len({tuple(row) for row in matrix}) == 8


def test_routing_is_deterministic_per_seed() -> None:
    assert a2a.routing(4, 8192, seed=7) == a2a.routing(4, 8192, seed=7)
    assert a2a.routing(4, 8192, seed=7) != a2a.routing(4, 8192, seed=8)
    assert a2a.routing(4, 8192) != a2a.routing(4, 4096)


def test_world_one_and_uniform_routings() -> None:
    assert a2a.routing(1, 2048) == [[2048]]
    assert a2a.routing(1, 2048, "uniform") == [[2048]]
    assert a2a.routing(4, 8192, "uniform") == [[2048] * 4] * 4
    assert a2a.routing(3, 10, "uniform") == [[4, 3, 3]] * 3
    with pytest.raises(ValueError, match="routing"):
        a2a.routing(2, 2048, "zipf")
    with pytest.raises(ValueError, match="world >= 1"):
        a2a.routing(0, 2048)


def test_apportion_sums_exactly_and_follows_the_weights() -> None:
    assert a2a.apportion(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert a2a.apportion(7, [3.0, 1.0]) == [5, 2]
    assert a2a.apportion(0, [0.5, 0.2]) == [0, 0]
    for total in (1, 99, 6553):
        assert sum(a2a.apportion(total, [0.13, 0.77, 0.4, 0.1])) == total


def _all_to_all(matrix, payloads):
    """What all_to_all_single delivers: rank r's out is, for each source p in order, p's block for r."""
    world = len(matrix)
    outs = []
    for r in range(world):
        out = []
        for p in range(world):
            start = sum(matrix[p][:r])
            out.extend(payloads[p][start:start + matrix[p][r]])
        outs.append(out)
    return outs


def _decomposed(matrix, chunks):
    """The decomposition run on labelled rows: each chunk's gathered rows exchanged with its splits,
    then scattered into out by recv_rows; None marks a row nothing wrote."""
    world = len(matrix)
    plans = [a2a.decomposition(matrix, r, chunks) for r in range(world)]
    outs = [[None] * sum(matrix[p][r] for p in range(world)) for r in range(world)]
    for c in range(chunks):
        sent = [[(p, i) for i in plans[p][c].send_rows] for p in range(world)]
        chunk_matrix = [plans[p][c].input_splits for p in range(world)]
        for r, received in enumerate(_all_to_all(chunk_matrix, sent)):
            assert len(received) == len(plans[r][c].recv_rows) == sum(plans[r][c].output_splits)
            for row, value in zip(plans[r][c].recv_rows, received):
                assert outs[r][row] is None, f"row {row} of rank {r} written twice"
                outs[r][row] = value
    return plans, outs


@pytest.mark.parametrize("matrix", [
    [[2048]],
    [[819, 1229], [819, 1229]],
    [[3, 0], [5, 1]],  # counts below the chunk count, and an empty pair
    [[1, 4, 2], [0, 0, 7], [9, 2, 0]],
    a2a.routing(4, 1001),
    a2a.routing(8, 333, "uniform"),
])
@pytest.mark.parametrize("chunks", [1, 4, 5])
def test_decomposition_lands_every_row_where_all_to_all_would(matrix, chunks) -> None:
    world = len(matrix)
    plans, outs = _decomposed(matrix, chunks)
    expected = _all_to_all(matrix, [[(p, i) for i in range(sum(matrix[p]))] for p in range(world)])
    assert outs == expected
    for r in range(world):
        # Every row of x is sent exactly once, and each chunk sends the same sub-range of every
        # destination's block: in order within a destination's block.
        assert sorted(i for c in plans[r] for i in c.send_rows) == list(range(sum(matrix[r])))
        for i, c in enumerate(plans[r]):
            assert len(c.send_rows) == sum(c.input_splits)
            assert c.output_splits == [plans[p][i].input_splits[r] for p in range(world)]
        for q in range(world):
            assert sum(c.input_splits[q] for c in plans[r]) == matrix[r][q]
            assert sum(c.output_splits[q] for c in plans[r]) == matrix[q][r]


def test_chunks_take_quarters_of_each_destinations_block() -> None:
    plan = a2a.decomposition([[10, 6], [4, 8]], 0, 4)
    assert [c.input_splits for c in plan] == [[2, 1], [3, 2], [2, 1], [3, 2]]
    assert [c.output_splits for c in plan] == [[2, 1], [3, 1], [2, 1], [3, 1]]
    assert plan[1].send_rows == [2, 3, 4, 11, 12]
    # Out holds rank 0's 10 rows, then rank 1's 4: chunk 1 is rows 2..4 and 11.
    assert plan[1].recv_rows == [2, 3, 4, 11]
    assert a2a.offsets([3, 0, 5]) == [0, 3, 3]


def _times(seq=1000.0, fo=800.0, decomp=900.0, fo_nccl=850.0, fo_ce=640.0, fo_push=500.0, forced_push=400.0):
    times = {v: 100.0 for v in a2a.VARIANTS}
    times.update(seq=seq, fo=fo, fo_nccl=fo_nccl, fo_ce=fo_ce, decomp=decomp, fo_g2=950.0, fo_g4=850.0, fo_g8=870.0,
                 fo_g16=990.0, fo_push=fo_push, forced_push=forced_push)
    # A variant that could not run (push off 2 Hopper ranks) has no time.
    return {k: v for k, v in times.items() if v is not None}


def _facts(errors=None):
    return {"matrix": [[819, 1229], [819, 1229]], "groups_nccl": 4, "predicted_nccl_us": 700.0, "groups_ce": 0,
            "predicted_ce_us": 650.0, "predicted_seq_us": 900.0, "groups_push": 3,
            "errors": errors or {"seq": 2e-3, "fo": 3e-3, "fo_nccl": 3e-3, "fo_ce": 2e-3, "decomp": 2e-3}}


def test_row_ratios_and_the_fastest_forced_count() -> None:
    row = a2a.make_row((2048, 8192, 4096), 2, "skewed", _times(), _facts())
    assert (row["m"], row["n"], row["k"], row["world_size"], row["routing"]) == (2048, 8192, 4096, 2, "skewed")
    assert row["fo_vs_seq"] == pytest.approx(1.25)
    assert row["fo_nccl_vs_seq"] == pytest.approx(1000.0 / 850.0)
    assert row["fo_ce_vs_seq"] == pytest.approx(1000.0 / 640.0)
    assert row["fo_vs_decomp"] == pytest.approx(1.125)
    assert row["fo_push_vs_seq"] == pytest.approx(2.0) and row["forced_push_vs_seq"] == pytest.approx(2.5)
    assert row["groups_push"] == 3
    # Both backends' predictions, sequential's beside them.
    assert (row["groups_nccl"], row["predicted_nccl_us"], row["groups_ce"], row["predicted_ce_us"],
            row["predicted_seq_us"]) == (4, 700.0, 0, 650.0, 900.0)
    assert row["best_forced_groups"] == 4
    assert row["best_forced_vs_seq"] == pytest.approx(1000.0 / 850.0)
    assert row["max_rel_error"] == 3e-3 and row["failed"] == ""
    assert row["split_matrix"] == "[[819,1229],[819,1229]]"
    assert all(f"{v}_us" in row for v in a2a.VARIANTS)


def test_rows_over_tolerance_are_named_and_reported() -> None:
    row = a2a.make_row((4096, 8192, 1024), 2, "skewed", _times(), _facts({"seq": 2e-3, "fo": math.inf,
                                                                         "fo_ce": 0.3, "decomp": 0.5}))
    assert row["failed"] == "fo fo_ce decomp" and row["max_rel_error"] == math.inf
    meta = {"world_size": 2, "gpu": "NVIDIA H200", "routing": "skewed", "date": "today", "command": "python x"}
    lines = a2a.table([row], meta, "bfloat16")
    assert any(line.startswith("WRONG RESULT 4096x8192x1024: fo fo_ce decomp") for line in lines)


def test_table_prints_every_case_and_the_geometric_means() -> None:
    rows = [a2a.make_row((t, 8192, 4096), 2, "skewed", _times(fo=f, fo_nccl=n, fo_ce=c), _facts())
            for t, f, n, c in ((2048, 800.0, 500.0, 1000.0), (4096, 1250.0, 2000.0, 400.0))]
    meta = {"world_size": 2, "gpu": "NVIDIA H200", "routing": "skewed", "date": "today", "command": "python x"}
    lines = a2a.table(rows, meta, "bfloat16")
    assert "2 x NVIDIA H200, bfloat16, skewed routing" in lines[0]
    header = lines[2].split()
    assert all(v in header for v in a2a.VARIANTS)
    assert all(c in lines[2] for c in ("G n", "pred n", "G ce", "pred ce", "nccl x", "ce x"))
    cases = [line for line in lines if re.match(r"\s*(2048|4096)x8192x4096", line)]
    assert len(cases) == 2
    # Each case line: the times, then both backends' predictions and the three speedups over seq.
    assert " 4    700.0    0    650.0    900.0  1.250x  2.000x  1.000x" in cases[0]
    for name, means in (("fo (backend auto)", (1.25, 0.8)), ("fo_nccl (backend nccl)", (2.0, 0.5)),
                        ("fo_ce (backend copy_engine)", (1.0, 2.5))):
        over_seq = next(line for line in lines if line.startswith(f"{name} over sequential"))
        assert f"geometric mean {math.sqrt(means[0] * means[1]):.3f}x, min {min(means):.3f}x" in over_seq
    assert not any("WRONG RESULT" in line for line in lines)


def test_push_columns_are_nan_where_push_cannot_run() -> None:
    row = a2a.make_row((2048, 8192, 4096), 4, "skewed", _times(fo_push=None, forced_push=None),
                       {**_facts(), "groups_push": 0})
    assert math.isnan(row["fo_push_us"]) and math.isnan(row["fo_push_vs_seq"])
    meta = {"world_size": 4, "gpu": "NVIDIA H200", "routing": "skewed", "date": "today", "command": "python x"}
    lines = a2a.table([row], meta, "bfloat16")
    push = next(line for line in lines if line.startswith("fo_push (backend push) over sequential"))
    assert "geometric mean nan" in push


def test_default_output_is_the_name_e1_reads_and_uniform_stays_apart() -> None:
    e1 = _load("e1_speedup")
    skewed = Path(a2a.default_out("NVIDIA H200", 2, "bfloat16", "skewed") + ".csv")
    assert skewed.parent == ROOT / "evaluation" / "results"
    match = e1.NAME.match(skewed.name)
    assert (match["prefix"], match["gpu"], match["world"], match["dtype"]) == ("bench_gemm_a2a", "h200", "2",
                                                                               "bfloat16")
    uniform = Path(a2a.default_out("NVIDIA H200", 2, "bfloat16", "uniform") + ".csv")
    assert e1.NAME.match(uniform.name)["prefix"] == "bench_gemm_a2a_uniform"


def test_cases_are_the_issue_shapes() -> None:
    # The 16 shapes of the other ops, then the three of issue 4's six cases not among them.
    assert len(a2a.SHAPES) == 19 and len(set(a2a.SHAPES)) == 19
    assert {(n, k) for _, n, k in a2a.SHAPES[:16]} == {(8192, 4096), (8192, 14336), (8192, 1024), (8192, 3584)}
    assert {t for t, _, _ in a2a.SHAPES[:16]} == {2048, 4096, 8192, 16384}
    assert a2a.SHAPES[16:] == [(2048, 4096, 14336), (4096, 4096, 14336), (8192, 4096, 14336)]
    assert a2a.VARIANTS[:6] == ("cublas", "nccl", "seq", "fo", "fo_nccl", "fo_ce") and a2a.VARIANTS[-1] == "decomp"
    # The docstring lists every variant (the forced counts as fo_g<G>).
    assert all(f"\n  {v} " in a2a.__doc__ for v in a2a.VARIANTS if not v.startswith("fo_g"))
    assert "\n  fo_g<G> " in a2a.__doc__


def test_bar_verdict_is_over_the_issues_six_cases_only() -> None:
    assert len(a2a.BAR_SHAPES) == 6 and set(a2a.BAR_SHAPES) <= set(a2a.SHAPES)
    assert (8192, 4096, 14336) in a2a.BAR_SHAPES and (16384, 8192, 4096) not in a2a.BAR_SHAPES
    # The bar's cases at 1.21x over seq (fo_ce 1.1x, one at 0.97x), plus a slow case off the bar.
    rows = [a2a.make_row(s, 2, "skewed", _times(seq=1210.0, fo=1000.0, fo_ce=1100.0 if i else 1247.0,
                                                fo_push=None), _facts())
            for i, s in enumerate(a2a.BAR_SHAPES)]
    rows.append(a2a.make_row((16384, 8192, 1024), 2, "skewed", _times(seq=500.0, fo=1000.0), _facts()))
    lines = a2a.bar_lines(rows)
    assert "over its 6 cases" in lines[0]
    verdict = {line.split()[0]: line for line in lines[1:]}
    assert verdict["fo"].endswith("1.210x, min 1.210x: PASS")
    assert "min 0.970x: FAIL" in verdict["fo_ce"]
    assert verdict["fo_push"].endswith("not measured")
    # A run without all six says so instead of a verdict on part of them.
    assert a2a.bar_lines(rows[1:])[0].endswith("not measured (1 of its cases not in this run)")
