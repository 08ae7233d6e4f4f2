"""The evaluation scripts that need no GPU: E1's speedup tables from benchmark CSVs."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from evaluation_scripts import ROOT, load as _load


def test_e1_tables_from_the_committed_results() -> None:
    e1 = _load("e1_speedup")
    lines = e1.tables(str(ROOT / "evaluation" / "results"))
    text = "\n".join(lines)
    # The committed 2x H200 AllReduce CSV: 16 shapes, its geometric mean as the README states.
    assert "2 x h200, bfloat16, bench_gemm_ar_h200x2_bfloat16.csv" in text
    h200 = lines[lines.index("  2 x h200, bfloat16, bench_gemm_ar_h200x2_bfloat16.csv:"):]
    ar = next(line for line in h200 if "flashoverlap vs sequential cuBLAS + NCCL " in line)
    assert "16 shapes" in ar and "1.302x" in ar
    # Each machine's CSV is a table of its own (2x H100 sorts before 2x H200).
    assert "2 x h100, bfloat16, bench_gemm_ar_h100x2_bfloat16.csv" in text
    assert "AllReduce+RMSNorm:" in text
    arn = lines[lines.index("  2 x h200, bfloat16, bench_gemm_ar_rmsnorm_h200x2_bfloat16.csv:"):]
    peer = next(line for line in arn if "(peer backend) vs sequential + one-kernel" in line)
    assert "16 shapes" in peer and "1.162x" in peer
    fused = next(line for line in arn if "flashoverlap vs sequential cuBLAS + NCCL + one-kernel" in line)
    assert "1.242x" in fused
    # The 2x H200 ReduceScatter run with combined stores (sums in the GEMM's epilogue).
    rs = lines[lines.index("  2 x h200, bfloat16, bench_gemm_rs_h200x2_bfloat16.csv:"):]
    assert "1.294x" in next(line for line in rs if "flashoverlap vs sequential cuBLAS + NCCL " in line)
    assert "1.169x" in next(line for line in rs if "flashoverlap vs torch Async-TP" in line)


def test_e1_reads_each_primitive_and_keeps_prefixes_apart(tmp_path: Path) -> None:
    e1 = _load("e1_speedup")
    rows = [dict(m=2048 * i, n=8192, k=4096, fo_vs_seq=s, fo_vs_decomp=1.1, fo_vs_async_tp=2.0, concurrent_vs_seq=1.0)
            for i, s in enumerate((1.2, 1.5, 0.99), start=1)]
    with open(tmp_path / "bench_gemm_rs_h200x4_bfloat16.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = "\n".join(e1.tables(str(tmp_path)))
    assert "ReduceScatter:\n  4 x h200, bfloat16" in text
    expected = (1.2 * 1.5 * 0.99) ** (1 / 3)
    line = next(x for x in text.splitlines() if "flashoverlap vs sequential cuBLAS + NCCL" in x)
    assert f"{expected:.3f}x  (min 0.990x, max 1.500x, 3 shapes)" in line
    # No AllReduce CSV here (and the RS file must not be read as one).
    assert "AllReduce:\n  not measured (no CSV)" in text


def test_pooled_rounds_discard_a_pass_then_pool_every_round() -> None:
    from flashoverlap import bench

    calls = []

    def measure(m, n, k, dtype, iters, warmup):
        calls.append(((m, n, k), iters))
        return {"a": [float(len(calls))] * iters}, {"call": len(calls)}

    shapes = [(1, 2, 3), (4, 5, 6)]
    pooled, facts = bench.pooled_rounds(measure, shapes, None, iters=7, warmup=1)
    per_round = -(-7 // bench.ROUNDS)
    # One discarded pass on the first shape, then every shape once per round.
    assert calls[0] == ((1, 2, 3), 3)
    assert len(calls) == 1 + bench.ROUNDS * len(shapes)
    for shape in shapes:
        assert len(pooled[shape]["a"]) == bench.ROUNDS * per_round
        assert 1.0 not in pooled[shape]["a"], "the discarded pass leaked into the pool"
    assert facts[(4, 5, 6)]["call"] == len(calls)


def test_write_outputs(tmp_path) -> None:
    import json

    from flashoverlap import bench

    rows = [{"m": 1, "x": 2.5}, {"m": 2, "x": 3.5}]
    bench.write_outputs(str(tmp_path / "sub" / "table"), ["# header", "line"], rows, {"gpu": "test"})
    assert (tmp_path / "sub" / "table.txt").read_text() == "# header\nline\n"
    with open(tmp_path / "sub" / "table.csv", newline="") as f:
        assert list(csv.DictReader(f)) == [{"m": "1", "x": "2.5"}, {"m": "2", "x": "3.5"}]
    assert json.loads((tmp_path / "sub" / "table.json").read_text()) == {"gpu": "test"}


def test_gpu_scripts_import_and_document_their_command() -> None:
    """The GPU-only scripts at least load on a CPU machine and say how they are run."""
    for name in ("bench_gemm", "bench_gemm_ar", "bench_gemm_rs", "bench_gemm_ar_rmsnorm", "bench_add_rmsnorm",
                 "e1_correctness", "e3_overhead", "norm_stages_one_gpu", "bench_token_split", "bench_weave",
                 "ab_gemm_ar_ce"):
        module = _load(name)
        assert f"evaluation/{name}.py" in module.__doc__, name
        assert callable(module.main)


def test_weave_benchmark_replicates_norm_weights_across_ranks() -> None:
    """bench_weave's tensor-parallel layer: GEMM weights of each rank's own, RMSNorm weights the
    same on every rank (weights drawn per rank made every fused variant miss NCCL by 36% on 2
    GPUs: the fused kernel normalizes each rank's token slice with that rank's weight)."""
    torch = pytest.importorskip("torch")
    weave = _load("bench_weave")
    cpu = torch.device("cpu")
    small = {"qkv": (24, 16), "o_proj": (16, 8), "gate_up": (32, 16), "down": (16, 8)}
    r0, r1, next_layer = (weave.Layer(cpu, i, r, small, 16) for i, r in ((0, 0), (0, 1), (1, 0)))
    assert all(torch.equal(a, b) for a, b in zip(r0.norms, r1.norms))
    assert not torch.equal(r0.w["down"], r1.w["down"])
    assert not torch.equal(r0.norms[0], next_layer.norms[0])
    # The layer's own shapes drive its forward (attention's and the MLP's slices included).
    h = torch.randn(3, 16).bfloat16()
    assert r0.attention(h).shape == (3, 16) and r0.mlp(h).shape == (3, 16)


def test_two_gpu_runner_names_its_parts(tmp_path: Path) -> None:
    """evaluation/run_two_gpu.sh: usage without parts, an unknown part refused before anything
    runs (exit 2), and every part it lists in its usage has a command."""
    script = ROOT / "evaluation" / "run_two_gpu.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "Parts" in usage.stdout
    listed = usage.stdout.split("# Parts")[1].split("# Each part")[0].splitlines()[1:]
    parts = [line.split()[1] for line in listed]
    assert {"tests", "ar", "rs", "norm", "coll", "e2", "tune", "first"} <= set(parts)
    unknown = subprocess.run(["bash", str(script), str(tmp_path), "nope"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown part: nope" in unknown.stderr
    text = script.read_text()
    for part in parts:
        assert f"    {part}) echo " in text, part


def test_two_gpu_test_halves_cover_the_suite_once() -> None:
    """run_two_gpu.sh's testsa and testsb parts: every GPU test file in exactly one of them."""
    script = ROOT / "evaluation" / "run_two_gpu.sh"
    body = script.read_text().split("gemm_tests() {")[1].split("\n}\n")[0]
    halves = []
    for flag in ("", "--others"):
        run = subprocess.run(["bash", "-c", f'here="$1"; gemm_tests() {{{body}\n}}; gemm_tests {flag}', "_",
                              str(ROOT / "evaluation")], capture_output=True, text=True, check=True)
        halves.append({Path(p).name for p in run.stdout.split()})
    every = {p.name for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert halves[0] and halves[1] and not halves[0] & halves[1]
    assert halves[0] | halves[1] == every


def test_multi_gpu_only_selects_the_tests_that_need_two_gpus() -> None:
    """`pytest --multi-gpu-only` (run_two_gpu.sh part tests2) keeps exactly the tests marked
    gpus(n >= 2), so that a short 2-GPU lease runs nothing one GPU could run."""
    pytest.importorskip("torch")

    def collect(*extra: str) -> set[str]:
        run = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu/test_token_weave.py", "tests/gpu/test_nn_layers.py",
                              "--collect-only", "-q", "-p", "no:cacheprovider", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout + run.stderr
        return {line.split("::", 1)[1] for line in run.stdout.splitlines() if "::" in line}

    every, multi = collect(), collect("--multi-gpu-only")
    assert multi == {"test_block_two_gpus", "test_two_gpus[auto]", "test_two_gpus[overlap]"}
    assert multi < every


def test_gpu_state_names_only_real_slowdowns(monkeypatch) -> None:
    """A throttled GPU is named with its reasons (a power cap alone is normal under load and is
    not among them); a missing nvidia-smi gives no record, not an error."""
    from flashoverlap import bench

    text = ("0, 84, 690.5, 345, 1980, Active, Active, Not Active, Not Active\n"
            "1, 45, 120.0, 1980, 1980, Not Active, Not Active, Not Active, Not Active\n")
    gpus = bench.parse_gpu_state(text)
    assert [g["slowdowns"] for g in gpus] == [["hw_slowdown", "hw_thermal_slowdown"], []]
    warning = bench.slowdown_warning(gpus)
    assert warning and "GPU 0 hw_slowdown+hw_thermal_slowdown (84 C, SM 345 of 1980 MHz)" in warning
    assert "GPU 1" not in warning
    assert bench.slowdown_warning(gpus[1:]) is None and bench.slowdown_warning(None) is None
    with pytest.raises(ValueError, match="unexpected line"):
        bench.parse_gpu_state("0, 84, 690.5\n")

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(bench.subprocess, "run", missing)
    assert bench.gpu_state() is None


def test_speed_warning_names_slow_hopper_gpus_only() -> None:
    """The pre-benchmark check flags a Hopper GPU whose bf16 matmul runs below the floor (the
    throttled 2x H100 host ran its GEMMs at ~170 TFLOP/s) and judges no other model."""
    from flashoverlap import bench

    rates = [("NVIDIA H100 80GB HBM3", 731.0), ("NVIDIA H200", 190.0), ("NVIDIA A100-SXM4-80GB", 150.0)]
    warning = bench.speed_warning(rates)
    assert warning and "GPU 1 (NVIDIA H200) 190 TFLOP/s" in warning
    assert "GPU 0" not in warning and "A100" not in warning
    assert bench.speed_warning(rates[:1]) is None and bench.speed_warning([]) is None


def test_two_gpu_script_skips_timing_parts_on_a_slow_gpu(tmp_path) -> None:
    """run_two_gpu.sh: where the GPU check warns, the timing parts are skipped (exit 3) and the
    tests still run; FLASHOVERLAP_RUN_SLOW=1 runs them anyway. A stub `python` stands in for the
    check and every part."""
    import os
    import stat

    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nif [[ "$*" == *check_gpus* ]]; then echo "WARNING: slow"; fi\nexit 0\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    script = str(ROOT / "evaluation" / "run_two_gpu.sh")
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", script, str(tmp_path / "out"), "ar", "e1"], capture_output=True, text=True, env=env)
    assert run.returncode == 3, run.stdout + run.stderr
    assert "ar skipped: GPU clocks cut" in run.stdout and "e1 rc=0" in run.stdout
    env["FLASHOVERLAP_RUN_SLOW"] = "1"
    run = subprocess.run(["bash", script, str(tmp_path / "out2"), "ar"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and "ar rc=0" in run.stdout, run.stdout + run.stderr
