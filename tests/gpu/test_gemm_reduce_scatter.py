"""gemm_reduce_scatter across processes, one per GPU, against each rank's rows of the fp32 sum."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from test_gemm_all_reduce import BACKENDS, GRAPH_REPLAYS, run_workers, world_size

SEED = 4321
COMBOS = [("auto", None), ("overlap", None), ("sequential", None), ("overlap", 1), ("overlap", 3), ("auto", 2)]


def rs_cases(world: int, seed: int) -> list:
    rng = random.Random(seed)
    shapes = [(m * world, n, k) for m in (1, 77, 1000, 1500, 2048) for n, k in ((1024, 1024), (4096, 1024),
                                                                               (8192, 4096), (1032, 8192))]
    rng.shuffle(shapes)
    shapes = shapes[:14] + [(0, 1024, 1024), (130 * world, 8, 8), (4096 * world, 8192, 1024)]
    cases = []
    for i, (m, n, k) in enumerate(shapes):
        mode, bands = COMBOS[i % len(COMBOS)]
        cases.append(dict(seed=seed * 100 + i, m=m, n=n, k=k, dtype=("bf16", "fp16")[i % 2], mode=mode,
                          bands=bands))
    return cases


@pytest.mark.gpus(1)
def test_single_rank(tmp_path: Path) -> None:
    """One rank: the ReduceScatter is the identity; the row tables and stores must still be right."""
    (result,) = run_workers(tmp_path, "rs_cases", 1, cases=rs_cases(1, SEED), replays=20)
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in result["records"])


@pytest.mark.gpus(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(tmp_path: Path, backend: str) -> None:
    world = world_size()
    results = run_workers(tmp_path, "rs_cases", world, cases=rs_cases(world, SEED + 1 + BACKENDS[backend]),
                          replays=GRAPH_REPLAYS, backend=backend)
    records = results[0]["records"]
    assert sum(r["schedule"] == "overlap" and r["groups"] > 1 for r in records) >= 5, records
    assert any(r["schedule"] == "sequential" for r in records)
    for other in results[1:]:
        assert other["records"] == records


@pytest.mark.gpus(2)
def test_push_matches_reference(tmp_path: Path) -> None:
    # backend="push" (2 ranks exactly): the tiles of the other rank's shard cross NVLink from the GEMM.
    results = run_workers(tmp_path, "rs_cases", 2, cases=rs_cases(2, SEED + 71), replays=50, backend="push")
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert results[1]["records"] == records
