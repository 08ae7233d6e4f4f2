"""The copy-engine backend across processes that share one GPU: ranks in a gloo group, each
with a flashoverlap communicator made without NCCL (NCCL refuses two ranks on one device), so
that the peer buffers, the copies, the cross-process flags and the reductions of gemm_all_reduce,
gemm_reduce_scatter, gemm_all_to_all and gemm_all_reduce_rmsnorm (and the latter's own "peer" backend) are
checked against the fp32 composition on a machine with a single GPU. The ranks' kernels time-slice the device: correctness, not speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_gemm_all_reduce import main_cases, run_workers
from test_gemm_all_to_all import a2a_cases
from test_gemm_all_reduce_rmsnorm import norm_cases
from test_gemm_reduce_scatter import rs_cases

pytestmark = pytest.mark.gpus(1)

SEED = 4242
CE = dict(backend="copy_engine", shared=True)


def _some(cases: list, count: int) -> list:
    """Every few cases of a list, the empty ones kept: fewer calls, the same variety."""
    step = max(1, len(cases) // count)
    return [c for i, c in enumerate(cases) if i % step == 0 or 0 in c.get("lead", [c.get("m")])]


# World 3: the AllReduce runs as ReduceScatter + AllGather (each rank sums its share, the sums
# land from the peers' gather copies), and what follows a group (un-reorder) on the landing stream.
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("order", ["banded", "swizzled"])
def test_gemm_all_reduce(tmp_path: Path, order: str, world: int) -> None:
    count = 24 if world == 2 else 10
    results = run_workers(tmp_path, "cases", world, cases=_some(main_cases(SEED + world - 2), count), order=order,
                          **CE)
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert all(other["records"] == records for other in results[1:])


@pytest.mark.parametrize("world", [2, 3])
def test_gemm_all_reduce_graph(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "cuda_graph", world, m=1000, n=4096, k=1024, replays=30, seed=SEED + world - 1,
                          sequential_graph=False, **CE)
    assert all(r["replays"] == 30 for r in results)


# World 4: three peers per rank, so the copies run on three copy streams at once.
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemm_reduce_scatter(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "rs_cases", world, cases=_some(rs_cases(world, SEED + 2), 10), replays=20,
                          **CE)
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert all(other["records"] == records for other in results[1:])


# World 3: each group's norm runs on the landing stream, after the peers' sums landed.
@pytest.mark.parametrize("world", [2, 3])
def test_gemm_all_reduce_rmsnorm(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "rmsnorm_cases", world, cases=_some(norm_cases(SEED + 3 + 20 * (world - 2)), 10),
                          replays=20, **CE)
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in results[0]["records"])


# backend="peer" (the fused-norm op's own): the GEMM's partials in IPC peer buffers and one
# pull-mode kernel per group whose cross-process barriers time-slice the shared device.
@pytest.mark.parametrize("world", [2, 3])
def test_gemm_all_reduce_rmsnorm_peer(tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHOVERLAP_PEER_TIMEOUT_S", "60")  # a lost barrier fails, never hangs
    results = run_workers(tmp_path, "rmsnorm_cases", world, cases=_some(norm_cases(SEED + 12 + world), 10),
                          replays=20, backend="peer", shared=True)
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert any(r["schedule"] == "sequential" for r in records), records


# backend="push": each GEMM's epilogue stores every tile into the other rank's IPC-mapped slot too
# and counts it in that rank's ready flag; the sums wait for both ranks' tiles. On one GPU the
# "remote" stores stay on the device, but the protocol (slots, flags, free handshake, resets,
# graph replays) is the one that runs over NVLink.
@pytest.mark.parametrize("order", ["banded", "swizzled"])
def test_gemm_all_reduce_push(tmp_path: Path, order: str) -> None:
    results = run_workers(tmp_path, "cases", 2, cases=_some(main_cases(SEED + 30), 24), order=order,
                          backend="push", shared=True)
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert results[1]["records"] == records


def test_gemm_all_reduce_push_graph(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "cuda_graph", 2, m=1000, n=4096, k=1024, replays=30, seed=SEED + 31,
                          sequential_graph=False, backend="push", shared=True)
    assert all(r["replays"] == 30 for r in results)


def test_gemm_all_reduce_rmsnorm_push(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "rmsnorm_cases", 2, cases=_some(norm_cases(SEED + 32), 10), replays=20,
                          backend="push", shared=True)
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in results[0]["records"])


@pytest.mark.parametrize("world", [2, 3])
def test_push_refused(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "push_refused", world, seed=SEED + 33, shared=True)
    assert all("push" in r["seen"]["all_to_all"] for r in results)
    if world == 2:
        assert all("split_matrix" in r["seen"]["all_to_all"] for r in results)
    if world == 3:
        assert all("exactly 2 ranks" in r["seen"]["world"] and "exactly 2 ranks" in r["seen"]["world_rs"]
                   for r in results)


# ReduceScatter on "push": each GEMM stores the tiles of the other rank's shard into that rank's
# slot (through the negative rows of its row table) and its own shard's into its send buffer.
def test_gemm_reduce_scatter_push(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "rs_cases", 2, cases=_some(rs_cases(2, SEED + 34), 12), replays=20,
                          backend="push", shared=True)
    records = results[0]["records"]
    assert any(r["schedule"] == "overlap" and r["groups"] > 1 for r in records), records
    assert results[1]["records"] == records


# All-to-All on "push": each GEMM stores the tiles of the other rank's rows into that rank's slot,
# each group's segment in whole bands; skewed routings, an empty pair, a rank with no rows, graph
# replays.
def test_gemm_all_to_all_push(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "a2a_cases", 2, cases=a2a_cases(2, SEED + 35), backend="push", shared=True)
    assert all(r["cases"] == 6 for r in results)


# A rank that receives no push has no sign that its peer's call began: it must still not hand the
# slot back twice before the peer took the first grant (merged grants hang a later call; before
# the taken flags this test timed out).
def test_push_grants_are_taken_one_at_a_time(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "a2a_push_one_way", 2, timeout_s=90, seed=SEED + 36, shared=True)
    assert all(r["calls"] == 12 for r in results)


def test_without_nccl(tmp_path: Path) -> None:
    (result, _) = run_workers(tmp_path, "without_nccl", 2, seed=SEED + 4, shared=True)
    assert "without NCCL" in result["refused"]


# World 4: three peers per rank, so the copies run on three copy streams at once.
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plain_collectives(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "plain_collectives", world, seed=SEED + 5 + world, backend="copy_engine",
                          shared=True)
    assert all(r["replays"] == 20 for r in results)


# World 4: three peers per rank, so the copies run on three copy streams at once.
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemm_all_to_all(tmp_path: Path, world: int) -> None:
    results = run_workers(tmp_path, "a2a_cases", world, cases=a2a_cases(world, SEED + 6), **CE)
    assert all(r["cases"] == 6 for r in results)


def test_tune_measures_copy_engine_curves(tmp_path: Path) -> None:
    results = run_workers(tmp_path, "tune_copy_engine", 2, seed=SEED + 11, shared=True)
    assert all(len(curve) == 3 and min(curve) > 0 for curve in results[0]["curves"])
