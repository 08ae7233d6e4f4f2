"""plan_gemm_all_reduce: the GEMM + AllReduce plan, computed without a GPU."""

from __future__ import annotations

import os

import itertools
import math
import re

import pytest
import torch

import flashoverlap
from flashoverlap import plan_gemm_all_reduce

H200_SMS = 132
DEFAULT_RESERVED = 24
DEFAULT_MAX_GROUPS = 16

M_VALUES = [1, 77, 1000, 3000, 16384]
NK_VALUES = [(8, 8), (136, 1024), (1024, 4096), (4096, 1024), (8192, 8192), (14336, 4096)]
WORLDS = [2, 4, 8]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLASHOVERLAP_RESERVED_SMS", "FLASHOVERLAP_MAX_GROUPS", "FLASHOVERLAP_FORCE_SEQUENTIAL"):
        monkeypatch.delenv(name, raising=False)


def check_plan(plan, m: int, n: int, k: int, world: int, *, sms: int = H200_SMS,
               reserved: int = DEFAULT_RESERVED) -> None:
    """Every invariant a plan must satisfy, whatever its schedule and order."""
    assert plan.shape == (m, n, k)
    assert plan.world_size == world
    bm, bn, bk = plan.tile
    assert bm == 128, "tiles are 128-row"
    assert bn >= 1 and bk >= 1
    tiles_m, tiles_n = plan.tiles
    assert (tiles_m, tiles_n) == (math.ceil(m / bm), math.ceil(n / bn))
    total_tiles = tiles_m * tiles_n

    assert plan.schedule in ("overlap", "sequential")
    if plan.schedule == "overlap":
        assert plan.ctas == sms - reserved
    else:
        assert plan.ctas == sms
        assert len(plan.groups) == 1
    assert plan.waves == math.ceil(total_tiles / plan.ctas)

    groups = plan.groups
    assert len(groups) >= 1
    if plan.order == "swizzled":
        check_swizzled(plan, groups, total_tiles)
    else:
        check_banded(plan, groups, m, n, tiles_m, tiles_n, total_tiles)
    check_timeline(plan, groups, world)
    text = plan.describe()
    assert isinstance(text, str)
    assert f"{m} x {n}" in text
    assert f"schedule: {plan.schedule}" in text
    assert f"{len(groups)} group(s)" in text
    assert str(m) in repr(plan) and plan.schedule in repr(plan)


def check_swizzled(plan, groups, total_tiles: int) -> None:
    """Staged groups: runs of whole waves of one raster over the output, each a contiguous
    block of the staging buffer (whole tiles, tails included)."""
    bm, bn, _ = plan.tile
    assert plan.schedule == "overlap"
    assert plan.staging_elems == total_tiles * bm * bn
    position = 0
    for gi, g in enumerate(groups):
        p0, p1 = g["positions"]
        assert g["bands"] is None and g["rows"] is None
        assert p0 == position and p1 > p0 and p0 % plan.ctas == 0
        assert p1 % plan.ctas == 0 or p1 == total_tiles
        assert g["tiles"] == p1 - p0
        assert (g["offset"], g["count"]) == (p0 * bm * bn, (p1 - p0) * bm * bn)
        assert set(plan.tile_group[p0:p1]) == {gi}
        position = p1
    assert position == total_tiles
    assert sorted(plan.tile_order) == list(range(total_tiles))
    assert plan.raster_bands >= 1


def check_banded(plan, groups, m: int, n: int, tiles_m: int, tiles_n: int, total_tiles: int) -> None:
    bm = plan.tile[0]
    assert plan.staging_elems == 0
    band, row, position, offset = 0, 0, 0, 0
    for g in groups:
        b0, b1 = g["bands"]
        r0, r1 = g["rows"]
        p0, p1 = g["positions"]
        # Whole bands, in order, with nothing skipped.
        assert b0 == band and b1 > b0
        assert (r0, r1) == (b0 * bm, min(b1 * bm, m))
        assert r0 == row
        assert (p0, p1) == (b0 * tiles_n, b1 * tiles_n)
        assert p0 == position
        assert g["tiles"] == (b1 - b0) * tiles_n
        # One contiguous slice of out, in elements.
        assert g["offset"] == offset == r0 * n
        assert g["count"] == (r1 - r0) * n
        band, row, position, offset = b1, r1, p1, offset + g["count"]
    assert band == tiles_m
    assert row == m
    assert position == total_tiles
    assert offset == sum(g["count"] for g in groups) == m * n

    # The tables the kernel reads: the tile at every position (a permutation that visits each
    # group's bands, and only those, in the group's positions) and the group of every position.
    order, table = plan.tile_order, plan.tile_group
    assert len(table) == total_tiles
    assert sorted(order) == list(range(total_tiles))
    assert plan.raster_bands >= 1
    for gi, g in enumerate(groups):
        p0, p1 = g["positions"]
        b0, b1 = g["bands"]
        assert set(table[p0:p1]) == {gi}
        assert {t // tiles_n for t in order[p0:p1]} == set(range(b0, b1))


def check_timeline(plan, groups, world: int) -> None:
    # Timeline: collectives run one after another, each once its group is stored.
    previous_end = 0.0
    previous_done = 0.0
    for g in groups:
        assert g["gemm_done_us"] > 0
        assert g["gemm_done_us"] >= previous_done
        assert g["comm_start_us"] == pytest.approx(max(g["gemm_done_us"], previous_end))
        assert g["comm_end_us"] >= g["comm_start_us"]
        if world > 1:
            assert g["comm_end_us"] > g["comm_start_us"]
        previous_end, previous_done = g["comm_end_us"], g["gemm_done_us"]
    # The overlapped call pays the backend's per-call cost after its last group, and each group's
    # cost that the pipeline does not hide (NCCL at world >= 2: NCCL_GROUP_US per group).
    assert plan.overlap_groups_us >= 0
    if world == 1:
        assert plan.overlap_groups_us == 0
    assert plan.predicted_overlap_us == pytest.approx(groups[-1]["comm_end_us"] + plan.overlap_groups_us
                                                      + plan.overlap_fixed_us)
    if plan.gathered is not None:
        # The call runs the gathered AllReduce instead (2 Hopper ranks): its prediction.
        assert plan.predicted_us == plan.gathered["predicted_us"]
    elif plan.schedule == "overlap":
        assert plan.predicted_us == plan.predicted_overlap_us
    else:
        assert plan.predicted_us == plan.predicted_sequential_us
    assert plan.predicted_sequential_us > 0


SHAPES = [(m, n, k) for m in M_VALUES for (n, k) in NK_VALUES]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_auto_plan_invariants(m: int, n: int, k: int, world: int) -> None:
    plan = plan_gemm_all_reduce(m, n, k, world)
    check_plan(plan, m, n, k, world)
    assert plan.predicted_us <= plan.predicted_sequential_us
    assert len(plan.groups) <= DEFAULT_MAX_GROUPS


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_auto_overlaps_exactly_when_overlap_is_predicted_faster(m: int, n: int, k: int, world: int) -> None:
    auto = plan_gemm_all_reduce(m, n, k, world)
    overlap = plan_gemm_all_reduce(m, n, k, world, mode="overlap")
    sequential = plan_gemm_all_reduce(m, n, k, world, mode="sequential")
    check_plan(overlap, m, n, k, world)
    check_plan(sequential, m, n, k, world)
    assert overlap.schedule == "overlap"
    assert sequential.schedule == "sequential"
    # The sequential baseline does not depend on the mode asked for.
    assert overlap.predicted_sequential_us == pytest.approx(sequential.predicted_us)
    assert auto.predicted_sequential_us == pytest.approx(sequential.predicted_us)
    # Auto searches the same layouts as "overlap" and keeps them only if they win by the
    # planner's 4% margin (AUTO_OVERLAP_MARGIN in rust/plan/gemm_all_reduce).
    pays = overlap.predicted_us < 0.96 * sequential.predicted_us
    assert auto.schedule == ("overlap" if pays else "sequential")
    assert auto.predicted_us == pytest.approx(overlap.predicted_us if pays else sequential.predicted_us)
    if auto.schedule == "overlap":
        assert auto.groups == overlap.groups


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_both_dtypes_plan_alike(dtype: torch.dtype) -> None:
    plan = plan_gemm_all_reduce(3000, 8192, 4096, 8, dtype=dtype)
    check_plan(plan, 3000, 8192, 4096, 8)
    reference = plan_gemm_all_reduce(3000, 8192, 4096, 8, dtype=torch.bfloat16)
    # Both are 2-byte types: the plan is the same.
    assert plan.groups == reference.groups
    assert plan.predicted_us == reference.predicted_us


def test_tiny_shape_does_not_overlap() -> None:
    # One row band: nothing to overlap the collective with, so auto runs GEMM then AllReduce.
    for world in WORLDS:
        tiny = plan_gemm_all_reduce(1, 1024, 1024, world)
        assert tiny.schedule == "sequential"
        assert len(tiny.groups) == 1
        assert tiny.predicted_us == tiny.predicted_sequential_us


BANDS_CASES = list(itertools.product([1, 77, 1000, 3000, 16384], [1, 2, 3, 5, 200], [2, 8]))


@pytest.mark.parametrize("m,bands,world", BANDS_CASES)
@pytest.mark.parametrize("mode", ["auto", "overlap"])
def test_forced_bands_per_group_gives_that_grouping(m: int, bands: int, world: int, mode: str) -> None:
    n, k = 4096, 1024
    plan = plan_gemm_all_reduce(m, n, k, world, mode=mode, bands_per_group=bands)
    check_plan(plan, m, n, k, world)
    # A forced grouping always overlaps (also under auto, where it may not pay).
    assert plan.schedule == "overlap"
    tiles_m = plan.tiles[0]
    counts = [g["bands"][1] - g["bands"][0] for g in plan.groups]
    assert len(counts) == math.ceil(tiles_m / bands)
    assert all(c == bands for c in counts[:-1])
    assert counts[-1] == tiles_m - bands * (len(counts) - 1)
    assert 1 <= counts[-1] <= bands


def test_forced_bands_are_not_capped_by_max_groups() -> None:
    plan = plan_gemm_all_reduce(16384, 1024, 1024, 8, bands_per_group=1, max_groups=4)
    assert plan.schedule == "overlap"
    assert len(plan.groups) == 128


@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("bands", [None, 1, 3])
@pytest.mark.parametrize("world", WORLDS)
def test_sequential_mode_is_one_group_on_every_sm(m: int, bands, world: int) -> None:
    plan = plan_gemm_all_reduce(m, 8192, 4096, world, mode="sequential", bands_per_group=bands)
    check_plan(plan, m, 8192, 4096, world)
    assert plan.schedule == "sequential"
    assert plan.ctas == H200_SMS
    assert len(plan.groups) == 1
    (group,) = plan.groups
    assert group["offset"] == 0 and group["count"] == m * 8192
    assert set(plan.tile_group) == {0}
    assert plan.predicted_overlap_us == plan.predicted_sequential_us == plan.predicted_us


@pytest.mark.parametrize("m", [1000, 16384])
def test_overlap_mode_uses_the_unreserved_sms(m: int) -> None:
    plan = plan_gemm_all_reduce(m, 8192, 4096, 8, mode="overlap")
    assert plan.schedule == "overlap"
    assert plan.ctas == H200_SMS - DEFAULT_RESERVED
    plan = plan_gemm_all_reduce(m, 8192, 4096, 8, mode="overlap", reserved_sms=40)
    check_plan(plan, m, 8192, 4096, 8, reserved=40)
    assert plan.ctas == H200_SMS - 40
    plan = plan_gemm_all_reduce(m, 8192, 4096, 8, mode="overlap", reserved_sms=0)
    assert plan.ctas == H200_SMS


@pytest.mark.parametrize("max_groups", [1, 2, 5])
def test_max_groups_caps_the_searched_layout(max_groups: int) -> None:
    for mode in ("auto", "overlap"):
        plan = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode=mode, max_groups=max_groups)
        check_plan(plan, 16384, 8192, 4096, 8)
        assert len(plan.groups) <= max_groups
    overlap = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap", max_groups=1)
    assert len(overlap.groups) == 1


def test_more_groups_allowed_never_predicts_slower() -> None:
    predicted = [plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap", max_groups=g).predicted_us
                 for g in (1, 2, 4, 8, 16, 32)]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(predicted, predicted[1:]))
    assert predicted[-1] < predicted[0]


@pytest.mark.parametrize("sms,cc", [(108, (8, 0)), (132, (9, 0)), (78, (8, 9)), (114, (9, 0))])
def test_other_devices(sms: int, cc: tuple) -> None:
    for mode in ("auto", "overlap", "sequential"):
        plan = plan_gemm_all_reduce(4096, 8192, 8192, 4, sms=sms, compute_capability=cc, mode=mode)
        check_plan(plan, 4096, 8192, 8192, 4, sms=sms)
        if mode == "overlap":
            assert plan.ctas == sms - DEFAULT_RESERVED
        if mode == "sequential":
            assert plan.ctas == sms


def test_world_of_one_plans() -> None:
    plan = plan_gemm_all_reduce(1000, 4096, 4096, 1, mode="overlap", bands_per_group=2)
    check_plan(plan, 1000, 4096, 4096, 1)


# Environment variables read when the argument is left out.

def test_reserved_sms_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHOVERLAP_RESERVED_SMS", "20")
    plan = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap")
    assert plan.ctas == H200_SMS - 20
    # An explicit argument wins over the variable.
    plan = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap", reserved_sms=8)
    assert plan.ctas == H200_SMS - 8
    monkeypatch.setenv("FLASHOVERLAP_RESERVED_SMS", "  ")
    assert plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap").ctas == H200_SMS - DEFAULT_RESERVED


def test_max_groups_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHOVERLAP_MAX_GROUPS", "2")
    plan = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap")
    assert len(plan.groups) <= 2
    plan = plan_gemm_all_reduce(16384, 8192, 4096, 8, mode="overlap", max_groups=1)
    assert len(plan.groups) == 1


@pytest.mark.parametrize("name,value", [
    ("FLASHOVERLAP_RESERVED_SMS", "many"),
    ("FLASHOVERLAP_RESERVED_SMS", "1.5"),
    ("FLASHOVERLAP_RESERVED_SMS", "-1"),
    ("FLASHOVERLAP_MAX_GROUPS", "lots"),
    ("FLASHOVERLAP_MAX_GROUPS", "0"),
    ("FLASHOVERLAP_MAX_GROUPS", "-4"),
])
def test_bad_environment_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        plan_gemm_all_reduce(4096, 4096, 4096, 2)
    monkeypatch.delenv(name)
    check_plan(plan_gemm_all_reduce(4096, 4096, 4096, 2), 4096, 4096, 4096, 2)


# Bad arguments.

BAD_VALUES = [
    (dict(m=0), r"\bm\b"),
    (dict(n=0), r"\bn\b"),
    (dict(k=0), r"\bk\b"),
    (dict(world_size=0), r"world"),
    (dict(sms=0), r"sms"),
    (dict(reserved_sms=132), r"reserved_sms"),
    (dict(reserved_sms=500), r"reserved_sms"),
    (dict(sms=16, reserved_sms=16), r"reserved_sms"),
    (dict(max_groups=0), r"max_groups"),
    (dict(bands_per_group=0), r"bands_per_group"),
    (dict(mode="fast"), r"mode"),
    (dict(mode="Overlap"), r"mode"),
    (dict(m=-1), r"\bm\b"),
    (dict(k=-8), r"\bk\b"),
    (dict(world_size=-2), r"world"),
    (dict(bands_per_group=-1), r"bands_per_group"),
    (dict(max_groups=-1), r"max_groups"),
    (dict(reserved_sms=-1), r"reserved_sms"),
    (dict(m=2**32), r"\bm\b"),
    (dict(n=2**40), r"\bn\b"),
]


@pytest.mark.parametrize("override,field", BAD_VALUES, ids=[repr(o) for o, _ in BAD_VALUES])
def test_bad_arguments_raise_value_error(override: dict, field: str) -> None:
    kwargs = dict(m=1000, n=4096, k=4096, world_size=2)
    kwargs.update(override)
    m, n, k, world = kwargs.pop("m"), kwargs.pop("n"), kwargs.pop("k"), kwargs.pop("world_size")
    with pytest.raises(ValueError) as info:
        plan_gemm_all_reduce(m, n, k, world, **kwargs)
    assert re.search(field, str(info.value)), str(info.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
def test_unsupported_dtype_is_a_type_error(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="dtype"):
        plan_gemm_all_reduce(1000, 4096, 4096, 2, dtype=dtype)


@pytest.mark.parametrize("bands", [1.5, "2", True])
def test_non_integer_bands_per_group_is_a_type_error(bands) -> None:
    with pytest.raises(TypeError, match="bands_per_group"):
        plan_gemm_all_reduce(1000, 4096, 4096, 2, bands_per_group=bands)


@pytest.mark.parametrize("field,value", [("m", 2.5), ("k", "4096"), ("world_size", 2.0)])
def test_non_integer_sizes_are_type_errors(field: str, value) -> None:
    kwargs = dict(m=1000, n=4096, k=4096, world_size=2)
    kwargs[field] = value
    with pytest.raises(TypeError, match=field):
        plan_gemm_all_reduce(kwargs["m"], kwargs["n"], kwargs["k"], kwargs["world_size"])


def test_planning_still_works_after_errors() -> None:
    for bad in (dict(mode="x"), dict(bands_per_group=0), dict(max_groups=0)):
        with pytest.raises(ValueError):
            plan_gemm_all_reduce(3000, 4096, 4096, 2, **bad)
    check_plan(plan_gemm_all_reduce(3000, 4096, 4096, 2), 3000, 4096, 4096, 2)


def test_plan_class_is_exported() -> None:
    plan = plan_gemm_all_reduce(77, 1024, 1024, 2)
    assert isinstance(plan, flashoverlap.Plan)


@pytest.mark.parametrize(
    "kernel, capability, tile",
    [
        (None, (9, 0), (128, 256, 64)),
        (None, (8, 0), (128, 128, 64)),
        ("sm80", (9, 0), (128, 128, 64)),
        ("sm90_n128", (9, 0), (128, 128, 64)),
        ("sm90_n256", (9, 0), (128, 256, 64)),
    ],
)
def test_the_plan_tiles_with_the_kernel_that_runs(kernel, capability, tile) -> None:
    plan = plan_gemm_all_reduce(3000, 8192, 4096, 2, compute_capability=capability, kernel=kernel, mode="overlap")
    assert plan.tile == tile
    bm, bn, _ = tile
    assert plan.tiles == (math.ceil(3000 / bm), math.ceil(8192 / bn))
    assert sum(g["tiles"] for g in plan.groups) == plan.tiles[0] * plan.tiles[1]


def test_unknown_kernel_in_a_plan_is_named() -> None:
    with pytest.raises(ValueError, match="^kernel: "):
        plan_gemm_all_reduce(3000, 8192, 4096, 2, kernel="sm70")


def test_raster_bands_set_the_tile_order() -> None:
    rows = plan_gemm_all_reduce(4096, 8192, 4096, 2, mode="overlap", raster_bands=1)
    assert rows.raster_bands == 1
    assert rows.tile_order == list(range(len(rows.tile_order)))
    blocks = plan_gemm_all_reduce(4096, 8192, 4096, 2, mode="overlap", bands_per_group=32, raster_bands=4)
    tiles_n = blocks.tiles[1]
    # Column by column over blocks of 4 bands: (0,0) (1,0) (2,0) (3,0) (0,1) ...
    assert blocks.tile_order[:6] == [0, tiles_n, 2 * tiles_n, 3 * tiles_n, 1, tiles_n + 1]
    check_plan(blocks, 4096, 8192, 4096, 2)


def test_default_raster_is_chosen_by_the_planner() -> None:
    # 132 - 32 CTAs over 32 tile columns of 128 x 256: blocks of several bands read less.
    assert plan_gemm_all_reduce(8192, 8192, 4096, 2, mode="overlap").raster_bands > 1
    # A single band has nothing to raster.
    assert plan_gemm_all_reduce(100, 8192, 4096, 2).raster_bands == 1


@pytest.mark.parametrize("value,error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError)])
def test_bad_raster_bands(value, error) -> None:
    with pytest.raises(error, match="raster_bands"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, raster_bands=value)


@pytest.mark.parametrize("m, reserved", [(3000, 32), (6144, 32), (6144, 0), (16384, 0)])
def test_hopper_tiles_are_256_wide_on_every_shape(m: int, reserved: int) -> None:
    # 128-wide tiles won 1-5% on H200 at large M and lost up to 37% on H100.
    plan = plan_gemm_all_reduce(m, 8192, 4096, 2, reserved_sms=reserved, mode="overlap")
    assert plan.tile == (128, 256, 64)


def test_backends_reserve_their_own_sms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHOVERLAP_RESERVED_SMS", raising=False)
    nccl = plan_gemm_all_reduce(8192, 8192, 4096, 2, mode="overlap", backend="nccl")
    ce = plan_gemm_all_reduce(8192, 8192, 4096, 2, mode="overlap", backend="copy_engine")
    assert nccl.ctas == H200_SMS - DEFAULT_RESERVED
    # The copy engines need SMs only for the reduction: the planner picks 4 or 8 per shape (8
    # sum as fast as the copies deliver; more would only slow the GEMM).
    assert H200_SMS - ce.ctas in (4, 8)
    # A GEMM-bound shape keeps 128 CTAs (its sums hide behind the long GEMM on 4 SMs); a
    # communication-bound one gives its sums 8.
    assert plan_gemm_all_reduce(4096, 8192, 14336, 2, mode="overlap", backend="copy_engine").ctas == H200_SMS - 4
    assert plan_gemm_all_reduce(16384, 8192, 1024, 2, mode="overlap", backend="copy_engine").ctas == H200_SMS - 8
    # "auto" plans the copy engines on one node (<= 8 GPUs), NCCL beyond.
    ce8 = plan_gemm_all_reduce(8192, 8192, 4096, 8, mode="overlap", backend="copy_engine")
    assert plan_gemm_all_reduce(8192, 8192, 4096, 8, mode="overlap", backend="auto").ctas == ce8.ctas
    assert plan_gemm_all_reduce(8192, 8192, 4096, 16, mode="overlap", backend="auto").ctas == nccl.ctas
    monkeypatch.setenv("FLASHOVERLAP_RESERVED_SMS", "12")
    assert plan_gemm_all_reduce(8192, 8192, 4096, 2, mode="overlap", backend="copy_engine").ctas == H200_SMS - 12


def test_copy_engine_groups_cost_less_than_nccl_ones() -> None:
    """With the same SMs left to them (enough for the reduction), the copy engines pay a smaller
    fixed cost per group, so the predicted overlap is no slower."""
    for m in (2048, 4096, 16384):
        nccl = plan_gemm_all_reduce(m, 8192, 4096, 2, mode="overlap", backend="nccl", reserved_sms=16)
        ce = plan_gemm_all_reduce(m, 8192, 4096, 2, mode="overlap", backend="copy_engine", reserved_sms=16)
        assert ce.predicted_overlap_us <= nccl.predicted_overlap_us
        # Each backend's per-call cost is part of its overlapped prediction (NCCL's: the fork and
        # join of a call, fitted to world-1 measurements; the copy engines' is larger).
        assert (nccl.overlap_fixed_us, ce.overlap_fixed_us) == (5.0, 40.0)
        # Each group also pays what the pipeline does not hide at world >= 2: NCCL_GROUP_US (3) per
        # NCCL group, COPY_ENGINE_ALL_REDUCE_GROUP_US (3) per copy-engine one.
        assert nccl.overlap_groups_us == pytest.approx(3.0 * len(nccl.groups))
        assert ce.overlap_groups_us == pytest.approx(3.0 * len(ce.groups))
        assert nccl.predicted_overlap_us == pytest.approx(nccl.groups[-1]["comm_end_us"] + 3.0 * len(nccl.groups)
                                                          + 5.0)
        assert ce.predicted_overlap_us == pytest.approx(ce.groups[-1]["comm_end_us"] + 3.0 * len(ce.groups) + 40.0)
        # The sequential schedule is the same cuBLAS + NCCL for both.
        assert ce.predicted_sequential_us == pytest.approx(nccl.predicted_sequential_us)


def test_unknown_backend_in_the_planner() -> None:
    with pytest.raises(ValueError, match="backend"):
        plan_gemm_all_reduce(8192, 8192, 4096, 2, backend="nvlink")


ORDER_SHAPES = [(3000, 8192, 8192, 8), (16384, 8192, 8192, 4), (8192, 8192, 4096, 2), (1000, 4096, 1024, 2)]


@pytest.mark.parametrize("m,n,k,world", ORDER_SHAPES)
@pytest.mark.parametrize("backend", ["nccl", "copy_engine"])
def test_auto_order_is_the_faster_prediction(m: int, n: int, k: int, world: int, backend: str) -> None:
    plans = {order: plan_gemm_all_reduce(m, n, k, world, mode="overlap", order=order, backend=backend)
             for order in ("auto", "banded", "swizzled")}
    for order, plan in plans.items():
        # The copy engines' SM reservation is chosen per plan.
        check_plan(plan, m, n, k, world, reserved=H200_SMS - plan.ctas)
        if order != "auto":
            assert plan.order == order
    # Swizzled only where it is predicted 3% faster (AUTO_SWIZZLED_MARGIN in rust/plan/gemm_all_reduce).
    swizzled = plans["swizzled"].predicted_overlap_us < 0.97 * plans["banded"].predicted_overlap_us
    assert plans["auto"].order == ("swizzled" if swizzled else "banded")
    assert plans["auto"].predicted_overlap_us == plans[plans["auto"].order].predicted_overlap_us
    # On 2 ranks with the copy engines and an even M, the call runs the gathered AllReduce
    # instead (whole-row groups only: never with the swizzled order), and predicts its time.
    gathers = backend == "copy_engine" and world == 2 and m % 2 == 0
    assert plans["swizzled"].gathered is None
    for order in ("auto", "banded"):
        plan = plans[order]
        assert (plan.gathered is not None) == gathers, order
        if gathers:
            assert plan.predicted_us == plan.gathered["predicted_us"]
            assert plan.gathered["groups"] >= 1 and plan.gathered["reserved_sms"] == 0
    text = plans["swizzled"].describe()
    assert "Swizzled" in text and "staged" in text


def test_swizzled_order_refuses_forced_bands() -> None:
    with pytest.raises(ValueError, match="bands_per_group"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, bands_per_group=2, order="swizzled")
    with pytest.raises(ValueError, match="order"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, order="diagonal")
    # Sequential plans are in place whatever the order asked for.
    plan = plan_gemm_all_reduce(4096, 8192, 4096, 2, mode="sequential", order="swizzled")
    assert plan.order == "banded" and plan.staging_elems == 0


@pytest.mark.parametrize("backend", ["nccl", "copy_engine", "peer"])
def test_fused_norm_plans_charge_the_norm(backend: str) -> None:
    """plan_gemm_all_reduce(fused_norm=True) is gemm_all_reduce_rmsnorm's plan: banded, the norm
    charged to the sequential schedule and to each group, and the backend 'peer' is allowed."""
    m, n, k = 4096, 8192, 1024
    normed = plan_gemm_all_reduce(m, n, k, 2, mode="overlap", backend=backend, fused_norm=True)
    assert normed.order == "banded" and normed.staging_elems == 0
    if backend != "peer":
        plain = plan_gemm_all_reduce(m, n, k, 2, mode="overlap", backend=backend, bands_per_group=None)
        assert normed.predicted_sequential_us > plain.predicted_sequential_us
    # Small groups run on one CTA per 16 rows: one band per group costs more than a few bands per group.
    few = plan_gemm_all_reduce(m, n, k, 2, mode="overlap", backend=backend, fused_norm=True, bands_per_group=4)
    one = plan_gemm_all_reduce(m, n, k, 2, mode="overlap", backend=backend, fused_norm=True, bands_per_group=1)
    assert one.predicted_overlap_us > few.predicted_overlap_us


@pytest.mark.parametrize("fused_norm", [False, True])
def test_push_plans_two_hopper_ranks_alone(fused_norm: bool) -> None:
    """backend='push' plans like the copy engines (4 or 8 SMs left to the sums), on exactly 2
    ranks of sm_90 (the GEMM's epilogue pushes); anything else is refused by name."""
    plan = plan_gemm_all_reduce(8192, 8192, 4096, 2, mode="overlap", backend="push", fused_norm=fused_norm)
    assert plan.schedule == "overlap" and len(plan.groups) > 1
    assert plan.ctas in (132 - 4, 132 - 8, 132 - 16)
    for world in (1, 3, 8):
        with pytest.raises(ValueError, match="exactly 2 ranks"):
            plan_gemm_all_reduce(8192, 8192, 4096, world, backend="push", fused_norm=fused_norm)
    with pytest.raises(ValueError, match="sm_90"):
        plan_gemm_all_reduce(8192, 8192, 4096, 2, backend="push", compute_capability=(8, 0), sms=108)
    with pytest.raises(ValueError, match="sm_90"):
        plan_gemm_all_reduce(8192, 8192, 4096, 2, backend="push", kernel="sm80")


def test_fused_norm_option_errors() -> None:
    with pytest.raises(ValueError, match="peer"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, backend="peer")
    with pytest.raises(ValueError, match="swizzled"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, order="swizzled", fused_norm=True)
    with pytest.raises(TypeError, match="fused_norm"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, fused_norm=1)


def test_one_rank_never_overlaps_on_auto() -> None:
    """World size 1 has nothing to communicate: auto runs sequentially even where the model
    predicts that hiding the fused norm behind the GEMM pays (it measured slower on H200)."""
    m, n, k = 16384, 8192, 1024
    forced = plan_gemm_all_reduce(m, n, k, 1, mode="overlap", fused_norm=True)
    assert forced.predicted_overlap_us < forced.predicted_sequential_us  # what the model says
    assert plan_gemm_all_reduce(m, n, k, 1, fused_norm=True).schedule == "sequential"
    assert plan_gemm_all_reduce(m, n, k, 2, fused_norm=True).schedule == "overlap"


def test_copy_engine_all_reduce_mode_changes_the_two_rank_model() -> None:
    """FLASHOVERLAP_CE_ALLREDUCE is read once per process by the core: in fresh processes, "gather"
    models the 2-rank copy-engine AllReduce as ReduceScatter + AllGather (half the sums on each
    rank, a second exchange's latency per group), "full" and "auto" as the one measured exchange;
    beyond 2 ranks "auto" gathers too."""
    import subprocess
    import sys

    probe = ("from flashoverlap.planning import plan_gemm_all_reduce as p; "
             "print(p(8192, 8192, 4096, 2, mode='overlap', backend='copy_engine', reserved_sms=8).predicted_overlap_us, "
             "p(8192, 8192, 4096, 4, mode='overlap', backend='copy_engine', reserved_sms=8).predicted_overlap_us)")

    def predicted(mode: str) -> tuple[float, float]:
        env = {**os.environ, "FLASHOVERLAP_CE_ALLREDUCE": mode}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        two, four = map(float, out.stdout.split())
        return two, four

    auto, full, gather = predicted("auto"), predicted("full"), predicted("gather")
    assert auto[0] == full[0] and gather[0] != auto[0]  # 2 ranks: auto is the one exchange
    # 4 ranks: auto gathers; one exchange would move twice the bytes, so it is predicted slower.
    assert auto[1] == gather[1] and full[1] > auto[1]


def test_auto_takes_push_only_where_it_can_run() -> None:
    """"push" joins auto's candidates for the GEMM ops (with or without the fused norm) on 2 Hopper
    ranks of one node (not with the sm80 kernel, other world sizes or GPUs)."""
    from flashoverlap.planning import auto_backends

    for op in ("gemm_all_reduce", "gemm_reduce_scatter", "gemm_all_to_all"):
        assert auto_backends(op, 2) == ["nccl", "copy_engine", "push"], op
    assert auto_backends("gemm_reduce_scatter", 2, kernel="sm90_n128") == ["nccl", "copy_engine", "push"]
    for op, kw in (("gemm_all_reduce", {"kernel": "sm80"}), ("gemm_all_reduce", {"major": 8}),
                   ("gemm_all_to_all", {"major": 8}), ("", {})):
        assert auto_backends(op, 2, **kw) == ["nccl", "copy_engine"], (op, kw)
    assert auto_backends("gemm_all_reduce", 4) == ["nccl", "copy_engine"]
    assert auto_backends("gemm_all_to_all", 2, one_node=False) == ["nccl"]
    assert auto_backends("gemm_all_reduce", 16) == ["nccl"]
    assert auto_backends("gemm_reduce_scatter", 2, nccl=False) == ["copy_engine", "push"]


def test_auto_fused_norm_plan_is_the_fastest_named_backend() -> None:
    """plan_gemm_all_reduce(fused_norm=True, backend="auto") on 2 Hopper GPUs predicts the least of
    NCCL, the copy engines and push (push's model is fitted; "peer" stays by argument only)."""
    from flashoverlap import plan_gemm_all_reduce

    for m, k in ((8192, 4096), (16384, 14336), (2048, 14336)):
        t = {b: plan_gemm_all_reduce(m, 8192, k, 2, backend=b, fused_norm=True).predicted_us
             for b in ("nccl", "copy_engine", "push")}
        auto = plan_gemm_all_reduce(m, 8192, k, 2, backend="auto", fused_norm=True).predicted_us
        assert auto == pytest.approx(min(t.values())), (m, k, t)


@pytest.mark.parametrize("m,k", [(16384, 1024), (8192, 4096), (2048, 14336)])
def test_auto_reduce_scatter_plan_is_the_fastest_named_backend(m: int, k: int) -> None:
    """plan_gemm_reduce_scatter(backend="auto") on 2 Hopper GPUs predicts the least of NCCL, the
    copy engines and push (test_profiles checks the same of GEMM + AllReduce)."""
    from flashoverlap import plan_gemm_reduce_scatter

    rs = {b: plan_gemm_reduce_scatter(m, 8192, k, 2, backend=b)["predicted_us"] for b in ("nccl", "copy_engine", "push")}
    assert plan_gemm_reduce_scatter(m, 8192, k, 2, backend="auto")["predicted_us"] == pytest.approx(min(rs.values()))
