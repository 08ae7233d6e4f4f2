"""planning.plan_gemm_reduce_scatter on the CPU: the plan gemm_reduce_scatter would run for a shape
on a described device, without a GPU (as plan_gemm_all_reduce does for the AllReduce)."""

from __future__ import annotations

import pytest
import torch

import flashoverlap
from flashoverlap import plan_gemm_reduce_scatter


@pytest.mark.parametrize("m, world", [(4096, 2), (8192, 4), (3000, 8)])
def test_groups_cover_every_band_of_a_shard(m: int, world: int) -> None:
    plan = plan_gemm_reduce_scatter(m, 8192, 4096, world, mode="overlap")
    assert plan["schedule"] == "overlap"
    assert plan["tile"] == (128, 256, 64)
    bands = [g["bands"] for g in plan["groups"]]
    assert bands[0][0] == 0 and bands[-1][1] == plan["bands"]
    assert all(a[1] == b[0] for a, b in zip(bands, bands[1:]))
    # Each group receives straight into the (band-padded) output, its rows after the previous one's.
    rows = [(g["recv_row"], g["recv_count"] // 8192) for g in plan["groups"]]
    assert all(r + c == nxt for (r, c), (nxt, _) in zip(rows, rows[1:])) and rows[0][0] == 0
    assert sum(c for _, c in rows) == plan["out_rows"] == plan["bands"] * 128 >= m // world
    assert plan["predicted_us"] == pytest.approx(plan["predicted_overlap_us"])


def test_sequential_mode_is_one_group_and_costs_what_it_predicts() -> None:
    plan = plan_gemm_reduce_scatter(4096, 8192, 4096, 2, mode="sequential")
    assert plan["schedule"] == "sequential" and len(plan["groups"]) == 1
    assert plan["predicted_us"] == plan["predicted_sequential_us"] == plan["predicted_overlap_us"]


def test_options_reach_the_plan() -> None:
    four = plan_gemm_reduce_scatter(8192, 8192, 4096, 2, mode="overlap", bands_per_group=4)
    assert {g["bands"][1] - g["bands"][0] for g in four["groups"][:-1]} == {4}
    assert plan_gemm_reduce_scatter(8192, 8192, 4096, 2, kernel="sm90_n128")["tile"] == (128, 128, 64)
    assert plan_gemm_reduce_scatter(8192, 8192, 4096, 2, compute_capability=(8, 0))["tile"] == (128, 128, 64)
    fewer = plan_gemm_reduce_scatter(8192, 8192, 4096, 2, mode="overlap", reserved_sms=32)
    assert fewer["ctas"] == 100
    assert plan_gemm_reduce_scatter(8192, 8192, 4096, 2, backend="auto")["schedule"] in ("overlap", "sequential")
    assert plan_gemm_reduce_scatter(8192, 8192, 4096, 2, dtype=torch.float16)["schedule"]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(m=4097), ValueError, "m: 4097 must be divisible by the world size 2"),
    (dict(m=0), ValueError, "m: expected an integer"),
    (dict(world_size=1.5), TypeError, "world_size: expected an int"),
    (dict(bands_per_group=0), ValueError, "bands_per_group"),
    (dict(reserved_sms=-1), ValueError, "reserved_sms"),
    (dict(backend="peer"), ValueError, "backend: expected one of"),
    (dict(dtype=torch.float32), TypeError, "dtype"),
    (dict(mode="sometimes"), ValueError, "mode"),
    (dict(kernel="sm70"), ValueError, "kernel"),
])
def test_bad_arguments_are_named(kwargs, error, words) -> None:
    args = dict(m=4096, n=8192, k=4096, world_size=2)
    args.update(kwargs)
    m, n, k, world = (args.pop(name) for name in ("m", "n", "k", "world_size"))
    with pytest.raises(error, match=words.replace("(", r"\(")):
        plan_gemm_reduce_scatter(m, n, k, world, **args)


def test_exported() -> None:
    assert "plan_gemm_reduce_scatter" in flashoverlap.__all__
