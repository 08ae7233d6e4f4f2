"""The benchmarks' and tune's timing helpers on one GPU: the load they keep the GPU under, and
the interleaved loop's per-variant times."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from flashoverlap import bench
from test_gemm_all_reduce import run_workers

pytestmark = pytest.mark.gpus(1)


def _gpu_seconds(fn) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def test_load_calls_scale_with_the_duration_asked() -> None:
    short, long_, tiny = bench.load_calls(0.01, 0.04, 0.0)
    assert tiny == 1  # never zero: a head start always holds some load
    assert short >= 1 and abs(long_ - 4 * short) <= 4


def test_keep_busy_holds_the_gpu_for_about_the_time_asked() -> None:
    bench.keep_busy(bench.load_calls(0.05)[0])  # leave the idle boost first
    (calls,) = bench.load_calls(0.03)
    took = _gpu_seconds(lambda: bench.keep_busy(calls))
    # The calls' count is set from an unloaded GPU's speed; loaded, it runs somewhat slower.
    assert 0.02 <= took <= 0.06, took


def test_interleaved_times_are_each_variants_own() -> None:
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    times = bench.interleaved_times_us({"big": lambda i: a @ a, "small": lambda i: small @ small, "big_twice": lambda i:
                                        (a @ a, a @ a)}, iters=12, warmup=2)
    assert {k: len(v) for k, v in times.items()} == {"big": 12, "small": 12, "big_twice": 12}
    big, small_t, twice = (statistics.median(times[k]) for k in ("big", "small", "big_twice"))
    assert 0 < small_t < big
    assert 1.6 <= twice / big <= 2.4, (big, twice)


def test_ranks_agree_on_their_load(tmp_path: Path) -> None:
    # Two ranks of a gloo group on one GPU asking different head starts: both enqueue the
    # largest, so neither reaches its first collective a head-start difference early.
    results = run_workers(tmp_path, "load_calls", 2, shared=True)
    assert results[0]["counts"] == results[1]["counts"]
    assert results[0]["counts"][1] == 1
    assert results[0]["counts"][0] >= 1


@pytest.mark.gpus(2)
def test_two_ranks_time_rounds_together(tmp_path: Path) -> None:
    # Under NCCL each round starts with the ranks aligned: the AllReduce after a ~1 ms GEMM
    # times the transfer, not one rank waiting for the other's load to finish.
    results = run_workers(tmp_path, "timing_rounds", 2)
    for r in results:
        assert r["gemm"][0] == r["all_reduce"][0] == 10
        assert 0 < r["all_reduce"][1] < 500, r
