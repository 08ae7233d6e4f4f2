"""gemm_all_to_all across processes, one per GPU, against the fp32 all_to_all_single of x @ w.T."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from test_gemm_all_reduce import GRAPH_REPLAYS, run_workers, world_size

SEED = 99


def matrices(world: int, seed: int) -> list:
    """Split matrices (rows rank p sends rank r): skewed (rank 0 receives ~60%), a rank that sends
    nothing to a peer, a rank with no rows at all, ragged sizes."""
    rng = random.Random(seed)
    out = []
    for total in (2048, 4096, 777):
        out.append([[int(total * (0.6 if r == 0 else 0.4 / max(world - 1, 1))) for r in range(world)]
                    for _ in range(world)])
    out.append([[0 if (p + 1) % world == r and world > 1 else rng.randrange(1, 900) for r in range(world)]
                for p in range(world)])
    out.append([[0] * world] + [[rng.randrange(0, 500) for _ in range(world)] for _ in range(world - 1)])
    out.append([[rng.randrange(0, 3000) for _ in range(world)] for _ in range(world)])
    return out


def a2a_cases(world: int, seed: int) -> list:
    """groups: a count, "auto" (the whole split matrix given: the predictor picks) or None (the default)."""
    shapes = [(4096, 1024), (8192, 512), (1032, 4104), (4096, 1024), (2056, 256), (8192, 1024)]
    return [dict(seed=seed * 10 + i, matrix=m, n=n, k=k, dtype=("bf16", "fp16")[i % 2], groups=(4, 1, "auto", 8, None, "auto")[i])
            for i, (m, (n, k)) in enumerate(zip(matrices(world, seed), shapes))]


BACKENDS = {"nccl": 0, "copy_engine": 17}


@pytest.mark.gpus(1)
@pytest.mark.parametrize("backend", BACKENDS)
def test_single_rank(tmp_path: Path, backend: str) -> None:
    (result,) = run_workers(tmp_path, "a2a_cases", 1, cases=a2a_cases(1, SEED + BACKENDS[backend]), backend=backend)
    assert result["cases"] == 6


@pytest.mark.gpus(2)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference(tmp_path: Path, backend: str) -> None:
    world = world_size()
    results = run_workers(tmp_path, "a2a_cases", world, cases=a2a_cases(world, SEED + 1 + BACKENDS[backend]),
                          backend=backend, replays=GRAPH_REPLAYS)
    assert all(r["cases"] == 6 for r in results)


# backend="push" (2 ranks exactly, Hopper): the tiles of the other rank's rows cross NVLink from
# the GEMM.
@pytest.mark.gpus(2)
def test_push_matches_reference(tmp_path: Path) -> None:
    import torch

    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("backend='push' stores from the sm_90 GEMM")
    results = run_workers(tmp_path, "a2a_cases", 2, cases=a2a_cases(2, SEED + 40), backend="push")
    assert all(r["cases"] == 6 for r in results)
