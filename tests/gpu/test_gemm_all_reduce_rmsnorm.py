"""gemm_all_reduce_rmsnorm across processes, one per GPU, against the fp32 composition
(AllReduce of x @ w.T, plus the residual, RMSNorm times the weight)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from test_gemm_all_reduce import BACKENDS, GRAPH_REPLAYS, run_workers, world_size

SEED = 777
# The fused-norm op also runs on "peer": the GEMM's partials in peer buffers, one kernel per group.
NORM_BACKENDS = dict(BACKENDS, peer=53)
COMBOS = [("auto", None), ("overlap", None), ("sequential", None), ("overlap", 1), ("overlap", 3), ("auto", 2)]


def norm_cases(seed: int) -> list:
    rng = random.Random(seed)
    shapes = [([m], n, k) for m in (1, 77, 1000, 3000, 4096) for n, k in ((1024, 1024), (4096, 1024),
                                                                         (8192, 4096), (16384, 1024))]
    rng.shuffle(shapes)
    shapes = shapes[:12] + [([2, 300], 2056, 512), ([0], 1024, 1024), ([129], 8, 64), ([4096], 8192, 3584)]
    return [dict(seed=seed * 100 + i, lead=lead, n=n, k=k, dtype=("bf16", "fp16")[i % 2], eps=(1e-6, 1e-5)[i % 2],
                 mode=COMBOS[i % len(COMBOS)][0], bands=COMBOS[i % len(COMBOS)][1])
            for i, (lead, n, k) in enumerate(shapes)]


@pytest.mark.gpus(1)
@pytest.mark.parametrize("backend", NORM_BACKENDS)
def test_single_rank(tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHOVERLAP_PEER_TIMEOUT_S", "60")  # a lost barrier fails, never hangs
    (result,) = run_workers(tmp_path, "rmsnorm_cases", 1, cases=norm_cases(SEED + NORM_BACKENDS[backend]), replays=20,
                            backend=backend)
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in result["records"])


@pytest.mark.gpus(2)
@pytest.mark.parametrize("backend", NORM_BACKENDS)
def test_matches_reference(tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHOVERLAP_PEER_TIMEOUT_S", "60")  # a lost barrier fails, never hangs
    results = run_workers(tmp_path, "rmsnorm_cases", world_size(),
                          cases=norm_cases(SEED + 1 + NORM_BACKENDS[backend]),
                          replays=GRAPH_REPLAYS, backend=backend)
    records = results[0]["records"]
    assert sum(r["schedule"] == "overlap" and r["groups"] > 1 for r in records) >= 5, records
    assert any(r["schedule"] == "sequential" for r in records)


@pytest.mark.gpus(2)
def test_push_matches_reference(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "rmsnorm_cases", 2, cases=norm_cases(SEED + 81), replays=50, backend="push")
    records = results[0]["records"]
    assert sum(r["schedule"] == "overlap" and r["groups"] > 1 for r in records) >= 5, records
