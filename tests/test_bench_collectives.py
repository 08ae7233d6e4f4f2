"""evaluation/bench_collectives.py without a GPU: its sizes and element counts, rotation, variants,
bandwidth and slowdown arithmetic, the CTA verdict, the rows, both tables and the CSV rows."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation_scripts import ROOT, load

SCRIPT = ROOT / "evaluation" / "bench_collectives.py"
bc = load("bench_collectives")

L2 = 60 << 20
NAMES = ["torch", "fo_nccl", "fo_ce"]
META = {"world_size": 2, "gpu": "NVIDIA H200", "dtype": "bfloat16", "date": "today", "command": "python x",
        "ce_ctas": 8, "ce_ctas_effective": 8, "ce_ctas_verdict": "PASS", "sms": 132, "nccl_max_ctas": 24}


# ---- sizes --------------------------------------------------------------------------------------

def test_one_mib_of_bf16_over_two_ranks() -> None:
    assert bc.size_elements(1, 2, 2) == 524288
    assert bc.size_elements(64, 2, 2) == 64 * 524288


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("mb", [1, 4, 16, 64, 0.3, 1e-6])
def test_element_counts_are_whole_blocks_of_16_bytes_per_rank(world, mb) -> None:
    numel = bc.size_elements(mb, 2, world)
    nbytes = numel * 2
    # What the copy-engine ReduceScatter needs, hence also the AllReduce (16 bytes) and torch's
    # reduce_scatter_tensor (a count divisible by the world).
    assert nbytes % (16 * world) == 0 and numel % world == 0
    assert (numel // world * 2) % 16 == 0
    # Rounded down, by less than one block, but never to nothing.
    assert nbytes <= max(mb * bc.MIB, 16 * world) and nbytes > mb * bc.MIB - 16 * world


def test_a_world_that_does_not_divide_the_size_rounds_down() -> None:
    assert bc.size_elements(1, 2, 3) == (1048576 - 1048576 % 48) // 2 == 524280
    assert bc.size_elements(1e-6, 2, 4) == 32  # one 64-byte block
    for bad in ((0, 2, 2), (-1, 2, 2), (math.nan, 2, 2), (1, 2, 0), (1, 3, 2)):
        with pytest.raises(ValueError):
            bc.size_elements(*bad)


def test_cases_cover_both_kinds_ascending_without_duplicates() -> None:
    todo = bc.cases([64, 1, 4, 16, 4], 2, 2)
    assert [(kind, mb) for kind, mb, _ in todo] == [(k, mb) for k in ("all_reduce", "reduce_scatter")
                                                   for mb in (1, 4, 16, 64)]
    assert all(numel == bc.size_elements(mb, 2, 2) for _, mb, numel in todo)
    # Two sizes that round to one element count are timed once.
    assert len(bc.cases([1e-6, 2e-6], 2, 2)) == 2


# ---- rotation -----------------------------------------------------------------------------------

def test_sets_hold_x_and_the_torch_buffer() -> None:
    assert bc.set_bytes("all_reduce", bc.MIB, 2) == 2 * bc.MIB
    assert bc.set_bytes("reduce_scatter", bc.MIB, 2) == bc.MIB + bc.MIB // 2
    assert bc.set_bytes("reduce_scatter", bc.MIB, 4) == bc.MIB + bc.MIB // 4
    with pytest.raises(ValueError, match="kind"):
        bc.set_bytes("all_gather", bc.MIB, 2)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("mb", [1, 4, 16, 64])
def test_rotation_exceeds_twice_the_l2(kind, mb) -> None:
    per_set = bc.set_bytes(kind, bc.size_elements(mb, 2, 2) * 2, 2)
    sets = bc.rotation_sets(per_set, L2, maximum=bc.MAX_SETS)
    assert sets >= 2 and sets * per_set >= 2 * L2
    assert sets == 2 or (sets - 1) * per_set < 2 * L2  # no more than needed


def test_small_sizes_are_not_capped_below_twice_the_l2() -> None:
    assert bc.rotation_sets(bc.set_bytes("all_reduce", bc.MIB, 2), L2, maximum=bc.MAX_SETS) == 60
    # 1.5 MiB sets: 80 of them, above the rmsnorm benchmark's cap of 64.
    assert bc.rotation_sets(bc.set_bytes("reduce_scatter", bc.MIB, 2), L2, maximum=bc.MAX_SETS) == 80


# ---- variants, bandwidth, slowdown, CTAs --------------------------------------------------------

def test_variants_and_the_cta_sweep() -> None:
    assert bc.variants() == [("torch", None, None), ("fo_nccl", "nccl", None), ("fo_ce", "copy_engine", 8)]
    swept = bc.variants(ctas_sweep=True)
    assert [name for name, _, _ in swept] == ["torch", "fo_nccl", "fo_ce", "fo_ce_4", "fo_ce_16"]
    assert [(b, c) for _, b, c in swept[3:]] == [("copy_engine", 4), ("copy_engine", 16)]
    assert [name for name, _, _ in bc.variants(True, ce_ctas=4)] == ["torch", "fo_nccl", "fo_ce", "fo_ce_16"]


def test_algorithm_and_bus_bandwidth() -> None:
    assert bc.algbw_gbs(bc.MIB, 10.0) == pytest.approx(104.8576)
    assert bc.algbw_gbs(64 * bc.MIB, 200.0) == pytest.approx(64 * 1.048576e6 / 200.0 / 1e3)
    assert bc.busbw_gbs("all_reduce", bc.MIB, 10.0, 2) == pytest.approx(104.8576)
    assert bc.busbw_gbs("all_reduce", bc.MIB, 10.0, 4) == pytest.approx(104.8576 * 1.5)
    assert bc.busbw_gbs("reduce_scatter", bc.MIB, 10.0, 4) == pytest.approx(104.8576 * 0.75)
    assert bc.busbw_gbs("all_reduce", bc.MIB, 10.0, 1) == 0.0
    for us in (math.nan, 0.0, -1.0, math.inf):
        assert math.isnan(bc.algbw_gbs(bc.MIB, us))


def test_slowdown_is_beside_over_alone() -> None:
    assert bc.slowdown(1000.0, 1100.0) == pytest.approx(1.1)
    assert bc.slowdown(1000.0, 1000.0) == 1.0
    assert math.isnan(bc.slowdown(math.nan, 1000.0)) and math.isnan(bc.slowdown(0.0, 1000.0))


def test_the_cta_bar_is_the_count_passed_clamped_to_the_sms() -> None:
    assert bc.ctas_verdict(bc.CE_CTAS, 132) == "PASS"
    assert bc.ctas_verdict(4, 132) == "PASS"
    assert bc.ctas_verdict(16, 132) == "FAIL"
    assert bc.ctas_verdict(16, 8) == "PASS" and bc.effective_ctas(16, 8) == 8
    assert bc.ctas_verdict(0, 132) == "FAIL"


# ---- table 1 ------------------------------------------------------------------------------------

def _row(kind="all_reduce", mb=1, times=None, errors=None, names=NAMES):
    times = times if times is not None else {"torch": 20.0, "fo_nccl": 25.0, "fo_ce": 16.0}
    errors = errors if errors is not None else {"torch": 2e-3, "fo_nccl": 2e-3, "fo_ce": 3e-3}
    numel = bc.size_elements(mb, 2, 2)
    return bc.standalone_row(kind, mb, numel, 2, 2, "bfloat16", 60, times, errors, names)


def test_standalone_row_values() -> None:
    row = _row()
    assert (row["table"], row["kind"], row["bytes"], row["elements"], row["sets"]) == ("standalone", "all_reduce",
                                                                                       bc.MIB, 524288, 60)
    assert row["torch_us"] == 20.0 and row["fo_ce_us"] == 16.0
    assert row["fo_ce_algbw_gbs"] == pytest.approx(bc.MIB / 16.0 / 1e3)
    assert row["fo_ce_busbw_gbs"] == pytest.approx(bc.MIB / 16.0 / 1e3)  # 2(w-1)/w = 1 at two ranks
    assert row["ce_vs_torch"] == pytest.approx(0.8) and row["nccl_vs_torch"] == pytest.approx(1.25)
    assert row["max_rel_error"] == 3e-3 and row["failed"] == "" and row["status"] == "ok"
    # The same columns with a variant not measured.
    missing = _row(times={"torch": 20.0, "fo_nccl": 25.0})
    assert list(missing) == list(row) and math.isnan(missing["fo_ce_us"]) and math.isnan(missing["ce_vs_torch"])


def test_wrong_and_unchecked_rows() -> None:
    wrong = _row(errors={"torch": 2e-3, "fo_nccl": 0.02, "fo_ce": math.nan})
    assert wrong["failed"] == "fo_nccl fo_ce" and wrong["status"] == "WRONG"
    assert _row(errors={"torch": 2e-3, "fo_nccl": 1e-2, "fo_ce": 1e-2})["status"] == "ok"  # inclusive
    assert _row(errors={})["status"] == "UNCHECKED"
    assert bc.any_wrong([_row(), wrong]) and not bc.any_wrong([_row(), _row(mb=4)])
    assert bc.any_wrong([_row(errors={})])


def test_standalone_table_has_the_columns_and_values() -> None:
    rows = [_row(), _row("reduce_scatter", 64, {"torch": 400.0, "fo_nccl": 420.0, "fo_ce": 300.0})]
    lines = bc.standalone_table(rows, META, NAMES)
    assert "2 x NVIDIA H200, bfloat16" in lines[0]
    assert "fo_ce sums on 8 CTAs" in lines[1] and "at most 24 CTAs" in lines[1]
    assert lines[2].split() == ["kind", "MB", "torch", "fo_nccl", "fo_ce", "bw_torch", "bw_fo_nccl", "bw_fo_ce",
                                "ce/torch", "nccl/torch", "err", "status"]
    first = next(x for x in lines if x.split()[:2] == ["all_reduce", "1"]).split()
    assert first[2:5] == ["20.0", "25.0", "16.0"]
    assert first[5:8] == [f"{bc.MIB / v / 1e3:.1f}" for v in (20.0, 25.0, 16.0)]
    assert first[8:] == ["0.800", "1.250", "3.0e-03", "ok"]
    second = next(x for x in lines if x.split()[:2] == ["reduce_scatter", "64"]).split()
    assert second[5] == f"{64 * bc.MIB / 400.0 / 1e3:.1f}" and second[8] == "0.750"
    assert not any("RESULT" in x for x in lines)


def test_standalone_table_names_wrong_results_and_the_sweep() -> None:
    names = NAMES + ["fo_ce_4", "fo_ce_16"]
    times = {"torch": 20.0, "fo_nccl": 25.0, "fo_ce": 16.0, "fo_ce_4": 21.0, "fo_ce_16": 14.0}
    errors = {"torch": 2e-3, "fo_nccl": 2e-3, "fo_ce": 3e-3, "fo_ce_4": 3e-3, "fo_ce_16": 0.5}
    lines = bc.standalone_table([_row(mb=4, times=times, errors=errors, names=names)], META, names)
    assert "fo_ce_16" in lines[2].split() and "bw_fo_ce_4" in lines[2].split()
    line = next(x for x in lines if x.split()[:2] == ["all_reduce", "4"]).split()
    assert line[2:7] == ["20.0", "25.0", "16.0", "21.0", "14.0"] and line[-1] == "WRONG"
    assert any(x.startswith("WRONG RESULT all_reduce 4 MB: fo_ce_16") for x in lines)


# ---- table 2 ------------------------------------------------------------------------------------

def _measured(alone=1000.0, beside=None, cover=None, chains=None):
    beside = beside or {"torch": 1300.0, "fo_nccl": 1150.0, "fo_ce": 1040.0}
    cover = cover or {"torch": 1.0, "fo_nccl": 1.0, "fo_ce": 0.99}
    chains = chains or {"torch": 4, "fo_nccl": 5, "fo_ce": 6}
    out = {"gemm_alone_us": alone}
    for mode in bc.CONC_MODES:
        out.update({f"{mode}_alone_us": 300.0, f"chain_{mode}": chains[mode], f"gemm_with_{mode}_us": beside[mode],
                    f"slowdown_{mode}": bc.slowdown(alone, beside[mode]), f"cover_{mode}": cover[mode]})
    return out


def _conc(shape=(4096, 8192, 4096), errors=None, **kw):
    errors = errors if errors is not None else {"torch": 2e-3, "fo_nccl": 2e-3, "fo_ce": 3e-3}
    return bc.conc_row(shape, "bfloat16", 2, 2, _measured(**kw), errors)


def test_concurrency_row() -> None:
    row = _conc()
    assert (row["table"], row["m"], row["n"], row["k"], row["ar_mb"]) == ("concurrency", 4096, 8192, 4096, 64.0)
    assert row["slowdown_torch"] == pytest.approx(1.3) and row["slowdown_fo_ce"] == pytest.approx(1.04)
    assert row["chain_fo_ce"] == 6 and row["cover_ok_fo_ce"] and row["status"] == "ok"
    low = _conc(cover={"torch": 0.5, "fo_nccl": 1.0, "fo_ce": math.nan})
    assert not low["cover_ok_torch"] and not low["cover_ok_fo_ce"] and low["cover_ok_fo_nccl"]
    assert _conc(errors={"torch": 2e-3, "fo_nccl": 2e-3, "fo_ce": 0.3})["status"] == "WRONG"


def test_concurrency_table_has_slowdowns_cover_and_the_cta_bar() -> None:
    rows = [_conc(), _conc((8192, 8192, 1024), alone=500.0, beside={"torch": 700.0, "fo_nccl": 600.0, "fo_ce": 650.0},
                           cover={"torch": 1.0, "fo_nccl": 0.9, "fo_ce": 1.0})]
    lines = bc.conc_table(rows, META)
    header = next(x for x in lines if x.lstrip().startswith("M x N x K")).split()
    for column in ("AR_MB", "alone", "w/torch", "x_torch", "w/fo_nccl", "x_fo_nccl", "w/fo_ce", "x_fo_ce", "cov",
                   "chains", "err", "status"):
        assert column in header
    first = next(x for x in lines if x.split()[:1] == ["4096x8192x4096"]).split()
    assert first[1:3] == ["64", "1000.0"]
    assert first[3:12] == ["1300.0", "1.300x", "100%", "1150.0", "1.150x", "100%", "1040.0", "1.040x", "99%"]
    assert first[12:] == ["4/5/6", "3.0e-03", "ok"]
    second = next(x for x in lines if x.split()[:1] == ["8192x8192x1024"]).split()
    assert second[8] == "90%*"  # fo_nccl covered too little of the GEMM
    text = "\n".join(lines)
    assert f"fo_ce {math.sqrt(1.04 * 1.3):.3f}x (max 1.300x)" in text
    assert f"torch {math.sqrt(1.3 * 1.4):.3f}x (max 1.400x)" in text
    assert "the copy engines slow the GEMM less than fo_nccl on 1 of 2 shapes" in text
    assert "the copy engines slow the GEMM less than torch on 2 of 2 shapes" in text
    assert "cover below 95% (slowdown not valid): 8192x8192x1024 fo_nccl" in text
    assert "copy-engine reduction CTAs: 8 (fo_ce's ctas=8, 132 SMs) <= 8: PASS" in text
    assert "RESULT" not in text


def test_concurrency_table_names_a_wrong_chain_result() -> None:
    lines = bc.conc_table([_conc(errors={"torch": 2e-3, "fo_nccl": 2e-3, "fo_ce": 0.3})], META)
    assert any(x.startswith("WRONG RESULT AllReduce of 4096x8192 (GEMM 4096x8192x4096): fo_ce") for x in lines)


def test_geometric_mean_skips_unmeasured_rows() -> None:
    rows = [{"x": 1.21}, {"x": 1.0}, {"x": math.nan}, {}]
    g, hi = bc.geo_max(rows, "x")
    assert g == pytest.approx(1.1) and hi == 1.21
    assert all(math.isnan(v) for v in bc.geo_max([{}], "x"))


# ---- shapes, outputs, CLI -----------------------------------------------------------------------

def test_shapes_default_quick_and_given() -> None:
    assert len(bc.SHAPES) == 16 and len(set(bc.SHAPES)) == 16
    assert {(n, k) for _, n, k in bc.SHAPES} == {(8192, 4096), (8192, 14336), (8192, 1024), (8192, 3584)}
    assert {m for m, _, _ in bc.SHAPES} == {2048, 4096, 8192, 16384}
    assert bc.select_shapes(None, False, 2) == bc.SHAPES
    quick = bc.select_shapes(None, True, 2)
    assert len(quick) == 4 and set(quick) <= set(bc.SHAPES)
    assert bc.select_shapes([(128, 64, 32)], True, 2) == [(128, 64, 32)]
    with pytest.raises(ValueError, match="multiple of 16"):
        bc.select_shapes([(3, 5, 7)], False, 2)
    with pytest.raises(ValueError, match="positive"):
        bc.select_shapes([(0, 8192, 4096)], False, 2)


def test_csv_holds_both_tables(tmp_path) -> None:
    standalone = [_row(), _row("reduce_scatter", 4)]
    conc = [_conc()]
    rows = bc.csv_rows(standalone, conc)
    assert len(rows) == 3 and all(list(r) == list(rows[0]) for r in rows)
    assert rows[0]["m"] == "" and rows[2]["kind"] == "" and rows[2]["slowdown_fo_ce"] == pytest.approx(1.04)
    out = str(tmp_path / "sub" / "bench")
    bc.bench.write_outputs(out, ["line"], rows, {"gpu": "x"})
    with open(out + ".csv") as f:
        read = list(csv.DictReader(f))
    assert [r["table"] for r in read] == ["standalone", "standalone", "concurrency"]
    assert read[1]["kind"] == "reduce_scatter" and read[2]["m"] == "4096"
    assert Path(out + ".txt").read_text() == "line\n" and Path(out + ".json").exists()


def test_default_output_name() -> None:
    out = Path(bc.default_out("NVIDIA H200", 2, "bfloat16"))
    assert out.parent == ROOT / "evaluation" / "results"
    assert out.name == "bench_collectives_h200x2_bfloat16"


def test_environment_defaults_disable_multicast_without_overriding() -> None:
    env = {"NCCL_NVLS_ENABLE": "1"}
    bc.apply_env_defaults(env)
    assert env == {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_parser_options() -> None:
    args = bc.build_parser().parse_args([])
    assert args.sizes_mb == [1.0, 4.0, 16.0, 64.0] and args.iters is None and not args.quick
    assert args.dtype == "bfloat16" and not args.ctas_sweep and args.shapes is None
    args = bc.build_parser().parse_args(["--sizes-mb", "0.5", "2", "--shapes", "4096x8192x4096", "--ctas-sweep",
                                         "--quick", "--iters", "7", "--world-size", "1", "--out", "/tmp/x"])
    assert args.sizes_mb == [0.5, 2.0] and args.shapes == [(4096, 8192, 4096)] and args.ctas_sweep
    assert (args.quick, args.iters, args.world_size, args.out) == (True, 7, 1, "/tmp/x")


def test_help_runs_without_a_gpu() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    for option in ("--sizes-mb", "--iters", "--world-size", "--quick", "--shapes", "--dtype", "--ctas-sweep",
                   "--out"):
        assert option in done.stdout
    assert "fo_ce" in done.stdout and "torch.distributed.all_reduce" in done.stdout
