"""plan_gemm_all_to_all: the group count gemm_all_to_all picks from the whole routing, without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

import flashoverlap
from flashoverlap import plan_gemm_all_to_all
from flashoverlap._validation import check_split_matrix


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHOVERLAP_RESERVED_SMS", raising=False)


def skewed(world: int, seed: int, heavy: int = 8192) -> list[list[int]]:
    """MoE-like routing: one hot destination, a rank that sends nothing to one peer."""
    rng = random.Random(seed)
    matrix = [[rng.randint(64, heavy // 4) for _ in range(world)] for _ in range(world)]
    for p in range(world):
        matrix[p][world - 1] = heavy
    if world > 1:
        matrix[0][1] = 0
    return matrix


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_candidate_is_predicted_and_the_best_is_chosen(world) -> None:
    pred = plan_gemm_all_to_all(skewed(world, world), 8192, 4096)
    assert sorted(pred.predicted_us) == list(range(1, 65))
    assert all(t > 0 for t in pred.predicted_us.values()) and pred.sequential_us > 0
    assert pred.predicted_us[pred.groups] == min(pred.predicted_us.values())
    assert pred.schedule in ("overlap", "sequential")


def test_large_routings_overlap_and_tiny_ones_do_not() -> None:
    big = plan_gemm_all_to_all([[8192, 8192], [8192, 8192]], 8192, 8192)
    assert big.groups > 1
    assert big.predicted_us[big.groups] < big.predicted_us[1]
    # A few rows: every extra group only adds an exchange's fixed latency.
    tiny = plan_gemm_all_to_all([[8, 8], [8, 8]], 1024, 1024)
    assert tiny.groups == 1


@pytest.mark.parametrize("backend,margin", [("nccl", 0.96), ("copy_engine", 1.0), ("push", 1.0)])
def test_the_schedule_falls_back_where_overlap_cannot_win(backend: str, margin: float) -> None:
    """Sequential exactly where the best group count, with the overlapped call's fixed cost, is
    predicted no faster than cuBLAS + one exchange; on NCCL, as for its AllReduce and
    ReduceScatter, overlap must be predicted 4% faster (the model's error)."""
    seen = set()
    for matrix, n, k in (([[8, 8], [8, 8]], 1024, 1024), ([[8192, 8192], [8192, 8192]], 8192, 8192),
                         ([[4096, 0], [0, 4096]], 8192, 14336), ([[2048, 6144], [2048, 6144]], 8192, 1024),
                         ([[10923, 5461], [10923, 5461]], 8192, 14336), ([[16384, 16384]] * 2, 8192, 4096)):
        pred = plan_gemm_all_to_all(matrix, n, k, backend=backend)
        best = pred.predicted_us[pred.groups] + (pred.overlap_fixed_us if pred.groups > 1 else 0.0)
        assert pred.overlap_fixed_us >= 0.0
        assert pred.schedule == ("overlap" if best < margin * pred.sequential_us else "sequential"), pred
        seen.add(pred.schedule)
    assert seen == {"overlap", "sequential"}  # both sides of the rule are exercised
    # No link traffic at all: nothing to hide, the faster library GEMM wins.
    assert plan_gemm_all_to_all([[4096, 0], [0, 4096]], 8192, 14336).schedule == "sequential"


def test_the_choice_depends_on_the_matrix_not_the_rank() -> None:
    """Every rank passes the same matrix, so the choice is one value; a transposed routing (other
    ranks heavy) is another call, not another rank's view."""
    matrix = skewed(4, 3)
    picks = {plan_gemm_all_to_all([row[:] for row in matrix], 8192, 4096).groups for _ in range(4)}
    assert len(picks) == 1


def test_the_slowest_rank_bounds_the_prediction() -> None:
    """Making one rank's GEMM heavier never makes any candidate faster."""
    light = [[2048, 2048], [2048, 2048]]
    heavy = [[2048, 2048], [8192, 8192]]
    a = plan_gemm_all_to_all(light, 8192, 4096)
    b = plan_gemm_all_to_all(heavy, 8192, 4096)
    assert all(b.predicted_us[g] >= a.predicted_us[g] for g in a.predicted_us)
    assert b.sequential_us > a.sequential_us


def test_reserved_sms_and_dtype_are_honoured() -> None:
    matrix = [[4096, 4096], [4096, 4096]]
    few = plan_gemm_all_to_all(matrix, 8192, 4096, reserved_sms=4)
    many = plan_gemm_all_to_all(matrix, 8192, 4096, reserved_sms=64)
    assert many.predicted_us[1] > few.predicted_us[1]
    assert plan_gemm_all_to_all(matrix, 8192, 4096, dtype=torch.float16).groups >= 1


@pytest.mark.parametrize("matrix,exc,words", [
    ([], TypeError, ["split_matrix"]),
    ([[1, 2], [3]], ValueError, ["split_matrix[1]", "one entry per rank"]),
    ([[1, -2], [3, 4]], ValueError, ["split_matrix[0]", ">= 0"]),
    ([[1, 2.5], [3, 4]], TypeError, ["split_matrix[0]", "ints"]),
    ("12", TypeError, ["split_matrix"]),
    (torch.ones(2, 2, 2, dtype=torch.int64), ValueError, ["split_matrix", "2-D"]),
])
def test_bad_matrices_are_named(matrix, exc, words) -> None:
    with pytest.raises(exc) as info:
        plan_gemm_all_to_all(matrix, 64, 64)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="n: expected"):
        plan_gemm_all_to_all([[1]], 0, 64)
    with pytest.raises(TypeError, match="dtype"):
        plan_gemm_all_to_all([[1]], 64, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="kernel"):
        plan_gemm_all_to_all([[1]], 64, 64, kernel="sm70")


def test_a_tensor_matrix_is_accepted() -> None:
    matrix = torch.tensor([[100, 200], [300, 0]])
    assert plan_gemm_all_to_all(matrix, 512, 512) == plan_gemm_all_to_all(matrix.tolist(), 512, 512)


def test_the_matrix_must_agree_with_this_rank_s_splits() -> None:
    matrix = [[5, 6], [7, 8]]
    assert check_split_matrix(matrix, 2, 1, [7, 8], [6, 8]) == matrix
    with pytest.raises(ValueError, match="row 1 .* input_split_sizes"):
        check_split_matrix(matrix, 2, 1, [8, 7], [6, 8])
    with pytest.raises(ValueError, match="column 1 .* output_split_sizes"):
        check_split_matrix(matrix, 2, 1, [7, 8], [8, 6])
    with pytest.raises(ValueError, match="expected 3 rows"):
        check_split_matrix(matrix, 3)


def test_the_op_schema_takes_a_flat_matrix_on_meta_tensors() -> None:
    x = torch.empty(77, 64, dtype=torch.bfloat16, device="meta")
    w = torch.empty(48, 64, dtype=torch.bfloat16, device="meta")
    out = torch.ops.flashoverlap.gemm_all_to_all(x, w, [70, 7], [3, 100], "any-name", None, None, [70, 7, 3, 100])
    assert tuple(out.shape) == (103, 48)
    assert flashoverlap.ops.DEFAULT_A2A_GROUPS == 4


def test_push_is_planned_on_two_ranks_only() -> None:
    # Pushed, the rows cross NVLink inside the GEMM: a big skewed routing overlaps, and no group
    # pays the NCCL exchange's per-group cost.
    matrix = [[3 * 8192 // 5, 2 * 8192 // 5], [3 * 8192 // 5, 2 * 8192 // 5]]
    push = plan_gemm_all_to_all(matrix, 8192, 4096, backend="push")
    nccl = plan_gemm_all_to_all(matrix, 8192, 4096, backend="nccl")
    assert push.schedule == "overlap" and push.groups > 1
    assert push.predicted_us[push.groups] < nccl.predicted_us[nccl.groups]
    with pytest.raises(ValueError, match="backend: 'push' runs on exactly 2 ranks"):
        plan_gemm_all_to_all(skewed(4, 4), 8192, 4096, backend="push")
    with pytest.raises(ValueError, match="backend: expected"):
        plan_gemm_all_to_all(matrix, 8192, 4096, backend="peer")


def test_groups_split_rows_in_whole_bands_so_more_groups_add_no_gemm_tiles() -> None:
    from flashoverlap import _core, planning

    assert _core.A2A_SEGMENT_ROWS == 128
    # A 60% skew of 2048 rows: 819 + 1229 = 7 + 10 bands. Split near-equally (the op before,
    # replayed with _segment_rows=1) 16 groups pad every segment to a band: 32 bands, twice the
    # tiles, and on a GEMM-bound shape the model's time at 16 groups grows by over half the
    # one-group time; in whole bands the tiles stay 17 bands' whatever the count.
    matrix = [[819, 1229], [819, 1229]]
    bands = planning.plan_gemm_all_to_all(matrix, 8192, 14336, _segment_rows=128)
    rows = planning.plan_gemm_all_to_all(matrix, 8192, 14336, _segment_rows=1)
    assert bands.sequential_us == rows.sequential_us
    assert bands.predicted_us[1] == rows.predicted_us[1]
    assert rows.predicted_us[16] - bands.predicted_us[16] > 0.5 * bands.predicted_us[1]
    assert all(bands.predicted_us[g] < rows.predicted_us[g] for g in (8, 16, 32))
    with pytest.raises(ValueError, match="segment_rows"):
        _core.plan_all_to_all_groups(8192, 4096, matrix, segment_rows=0)
