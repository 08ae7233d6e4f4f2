"""evaluation/bench_all_reduce_rmsnorm.py without a GPU: its token and CTA lists, the rotation
arithmetic, the bars' verdicts, the rows and tables (symm n/a included), the CTA plot, and the
concurrency test's chain and coverage arithmetic."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest
import torch

from evaluation_scripts import ROOT, load as _load


ar = _load("bench_all_reduce_rmsnorm")

META = {"world_size": 2, "gpu": "NVIDIA H200", "date": "today", "command": "python x"}
ALL_CTAS = [2, 4, 8, 16, 32, 64, 132]


def _row(tokens=2048, *, norm=300.0, fo=(250.0, 180.0, 190.0), symm=175.0, cnorm=None, sharded=(240.0, 170.0, 200.0),
         curve=None, errors=None, note="", symm_copy=200.0):
    times = {"nccl": 100.0, "nccl_norm": norm, "nccl_norm_clone": norm + 40.0, "api_16": fo[1] + 30.0}
    times.update({f"fo_{c}": t for c, t in zip(ar.FO_CTAS, fo)})
    times.update({f"fo_sharded_{c}": t for c, t in zip(ar.FO_CTAS, sharded)})
    if symm is not None:
        times["symm"] = symm
        times["symm_copy"] = symm_copy
    if cnorm is not None:
        times["nccl_cnorm"] = cnorm
    if curve:
        times.update({f"fo_{c}": t for c, t in curve.items()})
    errors = errors or {"nccl_norm": 2e-3, "fo_16": 3e-3, "fo_sharded_16": 3e-3}
    return ar.make_row(tokens, 8192, "bfloat16", 2, 4, times, errors, note, ar.FO_CTAS, ALL_CTAS)


# ---- token and CTA lists ------------------------------------------------------------------------

def test_token_lists_default_quick_given_and_the_check_only_count() -> None:
    timed, checked = ar.token_lists(None, False, 2)
    assert timed == [128, 512, 1024, 2048, 4096, 8192, 16384]
    assert checked == sorted(timed + [1001])
    assert ar.token_lists(None, True, 2)[0] == [1024, 8192]
    # Given counts win over --quick, sorted, duplicates dropped; 1001 is added to the checks only.
    assert ar.token_lists([4096, 128, 4096], True, 2) == ([128, 4096], [128, 1001, 4096])
    assert ar.token_lists([1001], False, 2) == ([1001], [1001])


def test_check_only_count_is_not_divisible_by_the_world() -> None:
    for world in range(2, 9):
        extra = set(ar.token_lists([1024], False, world)[1]) - {1024}
        (count,) = extra
        assert count % world != 0 and count >= 1001
    assert ar.token_lists([1024], False, 7)[1] == [1003, 1024]  # 1001 = 7 * 11 * 13
    assert ar.token_lists([1024], False, 1)[1] == [1001, 1024]
    with pytest.raises(ValueError, match="tokens"):
        ar.token_lists([0, 8], False, 2)


def test_ctas_are_clamped_to_the_sm_count_without_duplicates() -> None:
    assert ar.clamp_ctas(ar.CURVE_CTAS, 132) == [2, 4, 8, 16, 32, 64, 132]
    assert ar.clamp_ctas(ar.CURVE_CTAS, 114) == [2, 4, 8, 16, 32, 64, 114]
    assert ar.clamp_ctas(ar.CURVE_CTAS, 16) == [2, 4, 8, 16]
    assert ar.clamp_ctas(ar.FO_CTAS, 20) == [8, 16, 20]
    with pytest.raises(ValueError):
        ar.clamp_ctas([0, 8], 132)
    with pytest.raises(ValueError):
        ar.clamp_ctas([8], 0)


def test_the_curve_counts_join_the_bar_counts_only_at_the_curve_token_counts() -> None:
    curve = ar.clamp_ctas(ar.CURVE_CTAS, 132)
    assert ar.ctas_at(1024, ar.FO_CTAS, curve) == curve
    assert ar.ctas_at(8192, ar.FO_CTAS, curve) == curve
    assert ar.ctas_at(2048, ar.FO_CTAS, curve) == [8, 16, 32]
    assert ar.ctas_at(2048, ar.FO_CTAS, curve, curve_tokens=(2048,)) == curve


# ---- rotation -----------------------------------------------------------------------------------

def test_rotation_sets_exceed_twice_the_l2_unless_capped() -> None:
    l2 = 60 << 20
    x_bytes = lambda tokens: tokens * 8192 * 2  # noqa: E731
    assert ar.rotation_sets(x_bytes(128), l2) == 60  # 2 MiB sets: 60 of them are 120 MiB
    assert ar.rotation_sets(x_bytes(512), l2) == 15
    assert ar.rotation_sets(x_bytes(1024), l2) == 8
    assert ar.rotation_sets(x_bytes(16384), l2) == 2  # one set is already 256 MiB: the minimum
    assert ar.rotation_sets(1024, l2) == ar.MAX_SETS
    for tokens in (128, 512, 1000, 1024, 3000, 8192):
        sets = ar.rotation_sets(x_bytes(tokens), l2)
        assert sets * x_bytes(tokens) >= 2 * l2
        assert sets == 2 or (sets - 1) * x_bytes(tokens) < 2 * l2  # and no more than needed
    with pytest.raises(ValueError):
        ar.rotation_sets(0, l2)


# ---- bars and rows ------------------------------------------------------------------------------

def test_speed_bars_per_token_count() -> None:
    assert [ar.speedup_bar(t) for t in (128, 512, 1024, 2048, 4096, 8192, 16384)] == [None, None, 1.5, 1.5, 1.5,
                                                                                        1.3, 1.3]
    assert ar.speedup_bar(6000) is None and ar.speedup_bar(32768) is None


def test_a_row_that_passes_every_bar() -> None:
    row = _row(2048)
    assert (row["best_ctas"], row["best_us"]) == (16, 180.0)
    assert (row["best_sharded_ctas"], row["best_sharded_us"]) == (16, 170.0)
    assert row["baseline_us"] == 300.0
    assert row["speedup"] == pytest.approx(300 / 180)
    assert row["vs_symm"] == pytest.approx(180 / 175)
    assert row["speedup_sharded"] == pytest.approx(300 / 170)
    assert (row["speed_pass"], row["symm_pass"], row["verdict"]) == ("pass", "pass", "PASS")
    assert row["speed_bar"] == 1.5 and row["failed"] == "" and row["max_rel_error"] == 3e-3


def test_a_row_under_the_speed_bar_fails() -> None:
    row = _row(2048, fo=(250.0, 220.0, 230.0), symm=215.0)  # 300 / 220 = 1.36x < 1.5x
    assert row["speedup"] == pytest.approx(300 / 220)
    assert (row["speed_pass"], row["symm_pass"], row["verdict"]) == ("FAIL", "pass", "FAIL")
    # The same times meet the 1.3x bar of the large token counts.
    assert _row(8192, fo=(250.0, 220.0, 230.0), symm=215.0)["verdict"] == "PASS"


def test_a_row_slower_than_symm_fails_even_where_no_speed_bar_applies() -> None:
    row = _row(2048, symm=150.0)  # 180 / 150 = 1.2 > 1.05
    assert (row["speed_pass"], row["symm_pass"], row["verdict"]) == ("pass", "FAIL", "FAIL")
    small = _row(128, norm=40.0, fo=(30.0, 25.0, 26.0), symm=20.0)  # 25 / 20 = 1.25
    assert (small["speed_pass"], small["symm_pass"], small["verdict"]) == ("-", "FAIL", "FAIL")
    ok = _row(128, norm=40.0, fo=(30.0, 25.0, 26.0), symm=24.5)  # 25 / 24.5 = 1.02
    assert (ok["speed_pass"], ok["symm_pass"], ok["verdict"]) == ("-", "pass", "PASS")
    assert math.isnan(ok["speed_bar"])


def test_symm_bar_edge_is_inclusive() -> None:
    assert _row(2048, symm=180.0 / 1.05)["symm_pass"] == "pass"
    assert _row(2048, symm=180.0 / 1.0501)["symm_pass"] == "FAIL"


def test_symm_not_available_is_n_a_and_partial_not_pass() -> None:
    row = _row(4096, symm=None, note="RuntimeError: no symmetric memory at world 1")
    assert math.isnan(row["symm_us"]) and math.isnan(row["vs_symm"])
    assert (row["speed_pass"], row["symm_pass"], row["verdict"]) == ("pass", "n/a", "PARTIAL")
    # A missed speed bar still fails without symm.
    assert _row(4096, fo=(290.0, 280.0, 285.0), symm=None)["verdict"] == "FAIL"
    lines = ar.table([row], META, "bfloat16", ar.FO_CTAS)
    line = next(x for x in lines if x.split()[:1] == ["4096"])
    assert line.split()[5] == "n/a"  # the symm column
    assert "n/a" in line.split()[-6:] and "PARTIAL" in line
    assert any(x.startswith("symm n/a at 4096 tokens: RuntimeError: no symmetric memory") for x in lines)


def test_a_wrong_result_fails_the_row_and_is_named() -> None:
    row = _row(2048, errors={"nccl_norm": 2e-3, "fo_16": math.inf, "fo_sharded_8": 0.02})
    assert row["failed"] == "fo_16 fo_sharded_8" and row["verdict"] == "FAIL"
    assert row["speed_pass"] == "pass" and row["symm_pass"] == "pass"
    lines = ar.table([row], META, "bfloat16", ar.FO_CTAS)
    assert any(x.startswith("WRONG RESULT at 2048 tokens: fo_16 fo_sharded_8") for x in lines)
    assert "bars: 0 PASS, 0 PARTIAL (a bar not measurable), 1 FAIL of 1 token counts" in lines


def test_the_compiled_baseline_counts_when_faster() -> None:
    assert _row(2048, cnorm=250.0)["baseline_us"] == 250.0
    assert _row(2048, cnorm=250.0)["speedup"] == pytest.approx(250 / 180)
    assert _row(2048, cnorm=350.0)["baseline_us"] == 300.0
    assert math.isnan(_row(2048)["nccl_cnorm_us"])


def test_rows_share_keys_with_and_without_the_curve() -> None:
    plain = _row(2048)
    curved = _row(1024, curve={2: 900.0, 4: 500.0, 64: 150.0, 132: 140.0})
    assert list(plain) == list(curved)
    assert math.isnan(plain["fo_2_us"]) and curved["fo_2_us"] == 900.0
    # The curve's CTA counts above 32 never become best<=32.
    assert curved["best_ctas"] == 16


def test_table_has_the_issue_columns_and_values() -> None:
    rows = [_row(2048), _row(8192, norm=1000.0, fo=(800.0, 700.0, 720.0), symm=690.0)]
    lines = ar.table(rows, META, "bfloat16", ar.FO_CTAS)
    assert "2 x NVIDIA H200, hidden 8192, bfloat16" in lines[0]
    header = lines[2].split()
    for column in ("tokens", "nccl", "nccl_norm", "symm", "s+cp", "fo_8", "fo_16", "fo_32", "best", "x", "norm",
                   "/symm", "/s+cp", "speed", "verdict", "err"):
        assert column in header
    first = next(x for x in lines if x.split()[:1] == ["2048"]).split()
    # nccl, nccl_norm, clone, cnorm, symm, symm with the copies
    assert first[1:7] == ["100.0", "300.0", "340.0", "n/a", "175.0", "200.0"]
    assert first[7:10] == ["250.0", "180.0", "190.0"]
    assert first[10:12] == ["180.0", "16"]
    assert "1.67x" in first and "1.5x" in first and "1.029" in first and first[-2] == "PASS"
    # best / symm, then best / symm with the copies (no bar: the verdict ignores it)
    assert first[first.index("1.029") + 1] == "0.900"
    second = next(x for x in lines if x.split()[:1] == ["8192"]).split()
    assert f"{1000 / 700:.2f}x" in second and "1.3x" in second
    assert "bars: 2 PASS, 0 PARTIAL (a bar not measurable), 0 FAIL of 2 token counts" in lines
    assert not any("WRONG RESULT" in x for x in lines)


# ---- CTA curve ----------------------------------------------------------------------------------

def _curve_rows():
    return [_row(1024, curve={2: 900.0, 4: 500.0, 64: 150.0, 132: 140.0}), _row(2048),
            _row(8192, norm=1000.0, fo=(800.0, 700.0, 720.0), symm=None,
                 curve={2: 5000.0, 4: 2600.0, 64: 650.0, 132: 640.0})]


def test_curve_table_lists_only_token_counts_with_the_whole_curve() -> None:
    lines = ar.curve_lines(_curve_rows(), ALL_CTAS)
    assert lines[2].split() == ["tokens", "2", "4", "8", "16", "32", "64", "132", "baseline", "symm"]
    body = [x.split() for x in lines[3:]]
    assert [b[0] for b in body] == ["1024", "8192"]
    assert body[0][1:] == ["900.0", "500.0", "250.0", "180.0", "190.0", "150.0", "140.0", "300.0", "175.0"]
    assert body[1][-1] == "n/a"
    assert ar.curve_lines([_row(2048)], ALL_CTAS)[-1] == "no token count with the CTA curve was timed"


def test_curve_png_is_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "out_ctas.png"
    assert ar.plot_curve(_curve_rows(), ALL_CTAS, str(path)) == f"wrote {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ar.plot_curve([_row(2048)], ALL_CTAS, str(tmp_path / "none.png")).startswith("no PNG")
    assert not (tmp_path / "none.png").exists()


def test_curve_png_is_skipped_without_matplotlib(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib then raises ImportError
    message = ar.plot_curve(_curve_rows(), ALL_CTAS, str(tmp_path / "x.png"))
    assert message.startswith("no PNG: matplotlib is not available")
    assert not (tmp_path / "x.png").exists()


# ---- concurrency --------------------------------------------------------------------------------

def test_chain_covers_the_gemm() -> None:
    assert ar.chain_length(1600.0, 700.0) == 4  # 1.5 * 1600 / 700 = 3.43
    assert ar.chain_length(1600.0, 800.0) == 3
    assert ar.chain_length(100.0, 5000.0) == 1
    assert ar.chain_length(1e9, 1.0) == 10_000
    for gemm, op in ((1600.0, 700.0), (1234.0, 56.0), (10.0, 3.0)):
        assert ar.chain_length(gemm, op) * op >= ar.CHAIN_COVER * gemm
    with pytest.raises(ValueError):
        ar.chain_length(1600.0, 0.0)
    with pytest.raises(ValueError):
        ar.chain_length(math.nan, 10.0)


def test_overlap_fraction() -> None:
    assert ar.overlap_fraction(1.0, 0.0, 2.0) == 1.0
    assert ar.overlap_fraction(1.0, -0.1, 0.5) == 0.5
    assert ar.overlap_fraction(2.0, 0.5, 1.5) == 0.5
    assert ar.overlap_fraction(1.0, 1.2, 3.0) == 0.0  # the chain started after the GEMM ended
    assert ar.overlap_fraction(0.0, 0.0, 1.0) == 0.0


def test_concurrency_verdict() -> None:
    assert ar.conc_verdict(0.95, 1.0) == "PASS"
    assert ar.conc_verdict(0.90, 1.0) == "PASS"
    assert ar.conc_verdict(0.89, 1.0) == "FAIL"
    assert ar.conc_verdict(0.99, 0.5).startswith("INVALID (the calls covered 50%")
    assert ar.conc_verdict(math.nan, 1.0) == "n/a"


def test_concurrency_lines() -> None:
    conc = {"gemm": "8192x8192x8192", "tokens": 8192, "hidden": 8192, "ctas": 8, "gemm_alone_us": 1600.0,
            "fo_alone_us": 700.0, "chain_fo": 4, "gemm_with_fo_us": 1700.0, "ratio_fo": 0.94, "cover_fo": 1.0,
            "nccl_alone_us": 500.0, "chain_nccl": 5, "gemm_with_nccl_us": 2100.0, "ratio_nccl": 0.76,
            "cover_nccl": 0.99, "verdict": "PASS"}
    text = "\n".join(ar.conc_lines(conc))
    assert "GEMM alone 1600.0 us" in text
    assert "beside fo (8 CTAs, 8192 tokens): GEMM 1700.0 us, 0.940 of its stand-alone speed (bar >= 0.90): PASS" in text
    assert "4 calls of 700.0 us each alone, covering 100% of the GEMM" in text
    assert "NCCL all_reduce (8192 x 8192, reference): GEMM 2100.0 us, 0.760" in text


# ---- the rest -----------------------------------------------------------------------------------

def test_rel_error() -> None:
    ref = torch.randn(6, 8)
    assert ar.rel_error(ref.to(torch.bfloat16), ref) < 1e-2
    assert ar.rel_error(ref.clone(), ref) == 0.0
    assert ar.rel_error(ref * 1.1, ref) == pytest.approx(0.1, rel=1e-4)
    assert ar.rel_error(ref[:3], ref) == math.inf  # a sharded residual of the wrong rows
    bad = ref.clone()
    bad[2, 3] = math.nan
    assert ar.rel_error(bad, ref) == math.inf
    assert ar.rel_error(torch.empty(0, 8), torch.empty(0, 8)) == 0.0


def test_environment_defaults_disable_multicast_without_overriding() -> None:
    env = {"NCCL_NVLS_ENABLE": "0"}
    ar.apply_env_defaults(env)
    assert env == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def test_default_output_name() -> None:
    out = Path(ar.default_out("NVIDIA H200", 2, "bfloat16"))
    assert out.parent == ROOT / "evaluation" / "results"
    assert out.name == "bench_all_reduce_rmsnorm_h200x2_bfloat16"


def test_help_needs_no_gpu(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        ar.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--tokens", "--hidden", "--dtype", "--iters", "--world-size", "--quick", "--out", "--gemm"):
        assert option in out


def test_config_sweep_rows_and_lines() -> None:
    """--configs adds fo_<c>@<T>x<U> columns and a table of each config's best<=32 over the default's."""
    times = {"nccl_norm": 300.0, "fo_8": 120.0, "fo_16": 100.0, "fo_32": 110.0,
             "fo_8@256x2": 90.0, "fo_16@256x2": 80.0, "fo_32@256x2": 95.0}
    configs = [(256, 2), (512, 2)]
    row = ar.make_row(1024, 8192, "bfloat16", 2, 4, times, {"fo_16": 1e-3}, "", ar.FO_CTAS, ALL_CTAS, configs)
    assert row["fo_16@256x2_us"] == 80.0 and math.isnan(row["fo_16@512x2_us"])
    # Without configs the columns are absent: rows of one run share their keys.
    assert "fo_16@256x2_us" not in _row(1024)
    lines = ar.config_lines([row], configs, ar.FO_CTAS)
    assert "256x2" in lines[2] and "512x2" in lines[2]
    cells = lines[3].split()
    assert cells[:4] == ["1024", "100.0", "80.0", "0.800x"] and cells[4:] == ["n/a", "n/a"]
    assert ar.config_lines([row], [], ar.FO_CTAS) == []
    assert ar.parse_config("256X2") == (256, 2, 1, False, False)
    assert ar.parse_config("512x4s4") == (512, 4, 4, False, False)
    assert ar.parse_config("512x4s8r") == (512, 4, 8, False, True)
    assert ar.config_name((512, 4, 8, False, True)) == "512x4s8r"
    assert ar.config_name((512, 4, 4, False)) == "512x4s4" and ar.config_name((256, 2, 1, False)) == "256x2"
    for bad in ("256", "512x4s", "s4", "512x4x4"):
        with pytest.raises(argparse.ArgumentTypeError):
            ar.parse_config(bad)
