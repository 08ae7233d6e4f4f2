"""flashoverlap.nn on the CPU: argument checks before anything is made, and the layers' own logic
(shapes, the bias after the reduction, sequence-parallel token blocks, the backward's AllGather)
on a 2-process gloo group whose ops are stand-ins computing the unfused composition. The real ops
run under the same checks in tests/gpu/test_nn_layers.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashoverlap import nn as fnn
from nn_checks import row_parallel_checks


def _stand_in_ops(world: int, rank: int):
    """The unfused compositions, over the default (gloo) group, in place of the overlapped ops."""

    def partial(x, w):
        if not x.is_contiguous():  # as the real ops refuse it
            raise ValueError(f"x: expected a contiguous tensor, got strides {x.stride()}")
        y = x.float() @ w.float().t()
        dist.all_reduce(y)
        return y

    def gemm_all_reduce(x, w, comm, **options):
        return partial(x, w).to(x.dtype)

    def gemm_reduce_scatter(x, w, comm, **options):
        rows = x.shape[0] // world
        return partial(x, w)[rank * rows:(rank + 1) * rows].to(x.dtype).contiguous()

    def gemm_all_reduce_rmsnorm(x, w, residual, norm_weight, eps, comm, **options):
        r = (partial(x, w).to(x.dtype).float() + residual.float()).to(x.dtype)
        rf = r.float()
        return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()).to(x.dtype), r

    return types.SimpleNamespace(gemm_all_reduce=gemm_all_reduce, gemm_reduce_scatter=gemm_reduce_scatter,
                                 gemm_all_reduce_rmsnorm=gemm_all_reduce_rmsnorm)


def _fake_communicator(world: int, rank: int):
    return types.SimpleNamespace(world_size=world, rank=rank, device=torch.device("cpu"), group=None, name="fake")


def _worker(rank: int, world: int, init_method: str, queue) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        comm = _fake_communicator(world, rank)
        fnn.get_communicator = lambda group=None: comm
        fnn.ops = _stand_in_ops(world, rank)
        torch.manual_seed(rank)
        queue.put((rank, row_parallel_checks(rank, world, torch.device("cpu"), seed=11, s=8, b=2, n=48,
                                             k_share=32)))
    except BaseException as e:  # reported, never left hanging
        queue.put((rank, [f"rank {rank}: {type(e).__name__}: {e}"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_layers_match_the_whole_layer(world: int, tmp_path) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_worker, args=(r, world, init_method, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert sorted(results) == list(range(world))
    assert all(not failures for failures in results.values()), results


def test_stand_ins_would_be_caught(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The checks fail a layer whose reduction is wrong (here: an offset added to every output)."""
    comm = _fake_communicator(1, 0)
    monkeypatch.setattr(fnn, "get_communicator", lambda group=None: comm)
    ops = _stand_in_ops(1, 0)
    ops.gemm_all_reduce = lambda x, w, c, **o: (x.float() @ w.float().t()).to(x.dtype) + 0.5
    monkeypatch.setattr(fnn, "ops", ops)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        failures = row_parallel_checks(0, 1, torch.device("cpu"), seed=3, s=4, b=2, n=16, k_share=16)
    finally:
        dist.destroy_process_group()
    assert any("all_reduce output" in f for f in failures), failures


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):
    comm = _fake_communicator(2, 0)
    monkeypatch.setattr(fnn, "get_communicator", lambda group=None: comm)
    return comm


@pytest.mark.parametrize("make, argument, exc", [
    (lambda: fnn.RowParallelLinear(64, 32, reduce="all_gather"), "reduce", ValueError),
    (lambda: fnn.RowParallelLinear(64, 32, reduce="reduce_scatter", order="banded"), "options", TypeError),
    (lambda: fnn.RowParallelLinear(63, 32), "in_features", ValueError),
    (lambda: fnn.RowParallelLinear(0, 32), "in_features", ValueError),
    (lambda: fnn.RowParallelLinear(64, 32, dtype=torch.float32), "dtype", ValueError),
    (lambda: fnn.RowParallelLinear.from_linear(torch.nn.Conv1d(4, 4, 1)), "linear", TypeError),
    (lambda: fnn.RowParallelLinear.from_linear(torch.nn.Linear(8, 4)), "linear", ValueError),
    (lambda: fnn.RowParallelLinear.from_linear(torch.nn.Linear(7, 4, dtype=torch.bfloat16), sharded=False),
     "linear", ValueError),
    (lambda: fnn.RowParallelLinearAddRMSNorm(64, 32, order="banded"), "options", TypeError),
    (lambda: fnn.RowParallelLinearAddRMSNorm(64, 32, eps=-1.0), "eps", ValueError),
])
def test_bad_arguments(one_rank, make, argument: str, exc) -> None:
    with pytest.raises(exc, match=f"^{argument}:"):
        make()


def test_reduce_scatter_needs_whole_token_blocks(one_rank) -> None:
    layer = fnn.RowParallelLinear(64, 32, reduce="reduce_scatter", device="cpu")
    with pytest.raises(ValueError, match="^x: .*divisible by the world size 2"):
        layer(torch.randn(3, 4, 32, dtype=torch.bfloat16))


def test_from_linear_shares_the_parameters(one_rank) -> None:
    linear = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
    layer = fnn.RowParallelLinear.from_linear(linear, reduce="reduce_scatter", mode="sequential")
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert layer.in_features == 32 and layer.out_features == 8
    assert layer.bias.sequence_parallel is True
    assert "reduce='reduce_scatter'" in repr(layer) and "world=2" in repr(layer)
    assert layer.options == {"mode": "sequential"}


def test_from_whole_linear_takes_this_ranks_columns(one_rank) -> None:
    one_rank.rank = 1
    linear = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
    layer = fnn.RowParallelLinear.from_linear(linear, sharded=False)
    assert torch.equal(layer.weight, linear.weight[:, 8:])
    assert layer.weight.data_ptr() != linear.weight.data_ptr()
    assert torch.equal(layer.bias, linear.bias) and layer.bias is not linear.bias
    assert not hasattr(layer.bias, "sequence_parallel")
