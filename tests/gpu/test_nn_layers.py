"""flashoverlap.nn's layers with the real ops: outputs and gradients of RowParallelLinear (both
reductions) and RowParallelLinearAddRMSNorm against one whole linear layer in fp32
(tests/nn_checks.py), on one rank (NCCL), on 2 ranks sharing one GPU (gloo and the copy engines,
the backward's AllGather on gloo), and on 2 GPUs (NCCL)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_gemm_all_reduce import run_workers

SEED = 515


def _check(results: list) -> None:
    assert all(not r["failures"] for r in results), [r["failures"] for r in results]


@pytest.mark.gpus(1)
def test_one_rank(tmp_path: Path) -> None:
    _check(run_workers(tmp_path, "nn_layers", 1, seed=SEED))


@pytest.mark.gpus(1)
def test_two_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    _check(run_workers(tmp_path, "nn_layers", 2, seed=SEED + 1, backend="copy_engine", mode="overlap",
                       shared=True))


@pytest.mark.gpus(2)
@pytest.mark.parametrize("mode", ["auto", "overlap"])
def test_two_gpus(tmp_path: Path, mode: str) -> None:
    _check(run_workers(tmp_path, "nn_layers", 2, seed=SEED + 2, mode=mode))
