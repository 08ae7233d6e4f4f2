"""The peer-memory AllReduce + add + RMSNorm kernel's protocol on one GPU: `world` emulated ranks,
each with its own "peer" buffer on the same device and its own stream, run concurrently (the
barriers are between the CTAs of the ranks, so every rank's kernel must be resident: few CTAs).
Stores to "peers" are plain stores to other buffers, with the same system-scope fences and
flags as over NVLink. Checked against the fp32 composition on fresh random inputs, over calls
that change the token count and the CTA count (the epochs must stay in step), in both residual
modes, with each CTA's rows pipelined in several parts, one-shot (2 ranks: every rank reduces every
row, with its own residual and weight) mixed with two-shot calls on the same buffers, in the pull
layout, and in a CUDA graph replayed with fresh inputs."""

from __future__ import annotations

import pytest
import torch

from flashoverlap import _core

pytestmark = pytest.mark.gpus(1)

TIMEOUT_NS = 5_000_000_000
EPS = 1e-6
# The ring variant (Hopper: rows through shared memory in bulk copies; elsewhere it runs as the
# same shape on plain loads), in up to 8 and 4 parts.
RING, RING4 = (512, 4, 8, False, True), (512, 4, 4, False, True)


class Ranks:
    """`world` emulated ranks sharing one device: zeroed buffers, a stream each."""

    def __init__(self, world: int, max_tokens: int, hidden: int, dtype: torch.dtype, config=None,
                 pull: bool = False):
        self.world, self.hidden, self.dtype, self.config, self.pull = world, hidden, dtype, config, pull
        self.name = "bfloat16" if dtype == torch.bfloat16 else "float16"
        self.nbytes = _core.allreduce_rmsnorm_buffer_bytes(world, max_tokens, hidden, self.name, pull=pull)
        self.buffers = [torch.zeros(self.nbytes, dtype=torch.uint8, device="cuda") for _ in range(world)]
        self.bases = [b.data_ptr() for b in self.buffers]
        self.streams = [torch.cuda.Stream() for _ in range(world)]

    def launch(self, xs, residual, weight, outs, residual_outs, full: bool, ctas: int,
               residual_sliced: bool = False) -> None:
        """residual, weight: one for every rank, or a list of each rank's (residual_sliced: each
        rank's slice rows)."""
        tokens = xs[0].shape[0]
        main = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            res = residual[r] if isinstance(residual, list) else residual
            w = weight[r] if isinstance(weight, list) else weight
            _core.allreduce_rmsnorm_launch(0, (xs[r].data_ptr(), res.data_ptr(), w.data_ptr(),
                                               outs[r].data_ptr(), residual_outs[r].data_ptr()),
                                           self.bases, self.nbytes, r, tokens, self.hidden, EPS, full, self.name,
                                           ctas, TIMEOUT_NS, s.cuda_stream, pull=self.pull, config=self.config,
                                           residual_sliced=residual_sliced)
        for s in self.streams:
            main.wait_stream(s)

    def errors(self) -> list[int]:
        return [int(b[8:12].view(torch.int32).item()) for b in self.buffers]


def reference(xs, residual, weight):
    dtype = xs[0].dtype
    s = torch.stack([x.float() for x in xs]).sum(0).to(dtype)
    r = (s.float() + residual.float()).to(dtype)
    rf = r.float()
    return rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float(), r


def fresh(world, tokens, hidden, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen) for _ in range(world)]
    residual = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dtype)
    return xs, residual, weight


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def slice_of(tokens, world, rank):
    return tokens * rank // world, tokens * (rank + 1) // world


def launch_fresh(ranks, tokens, ctas, seed, full=True):
    """One call on fresh inputs, its outputs poisoned first (sharded: each rank's residual_out holds
    its slice): (inputs, outs, res_outs)."""
    world, hidden, dtype = ranks.world, ranks.hidden, ranks.dtype
    xs, residual, weight = fresh(world, tokens, hidden, dtype, seed)
    outs = [torch.full((tokens, hidden), float("nan"), device="cuda", dtype=dtype) for _ in range(world)]
    res_outs = [torch.full((tokens if full else max(1, slice_of(tokens, world, r)[1] - slice_of(tokens, world, r)[0]),
                            hidden), float("nan"), device="cuda", dtype=dtype) for r in range(world)]
    ranks.launch(xs, residual, weight, outs, res_outs, full, ctas)
    torch.cuda.synchronize()
    assert ranks.errors() == [0] * world, "a wait timed out"
    return (xs, residual, weight), outs, res_outs


def run_and_check(ranks, tokens, full, ctas, seed):
    world, hidden, dtype = ranks.world, ranks.hidden, ranks.dtype
    (xs, residual, weight), outs, res_outs = launch_fresh(ranks, tokens, ctas, seed, full)
    out_ref, r_ref = reference(xs, residual, weight)
    for r in range(world):
        where = f"world {world} tokens {tokens} hidden {hidden} {dtype} ctas {ctas} full {full} rank {r}"
        assert rel(outs[r], out_ref) <= 1e-2, where
        a, b = slice_of(tokens, world, r)
        assert rel(res_outs[r] if full else res_outs[r][:b - a], r_ref if full else r_ref[a:b]) <= 1e-2, where
        # Every rank holds the same rows, bit for bit: with the full residual, a rank normalizes
        # the rows it receives (as r) with the owner's arithmetic, in the owner's order.
        assert torch.equal(outs[r], outs[0]), where
        if full:
            assert torch.equal(res_outs[r], res_outs[0]), where


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [None, RING])
def test_calls_with_changing_tokens_and_ctas(world, dtype, config) -> None:
    hidden = 1032 if dtype == torch.float16 else 8192
    ranks = Ranks(world, 1031, hidden, dtype, config=config)
    # Epochs advance once per call whatever the CTA count; tokens not divisible by the world
    # size, fewer tokens than CTAs, a single token.
    # Parts of fewer rows than warps share each row among 2-16 warps (128 tokens on 32 CTAs: 8).
    for i, (tokens, ctas, full) in enumerate([(1031, 8, True), (517, 3, False), (5, 16, True), (1, 2, False),
                                              (1024, 32, True), (999, 1, False), (128 * world, 32, True),
                                              (200, 16, True), (60, 8, False), (61, 8, True)]):
        run_and_check(ranks, tokens, full, ctas, seed=world * 100 + i)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("config", [None, (512, 4, 4, False), RING4])
def test_sharded_calls_take_a_residual_slice(world, config) -> None:
    """residual_out='sharded' with each rank passing only its slice of the residual: the same
    rows, bit for bit, as with the whole residual (the kernel reads only the slice's rows)."""
    hidden, dtype = 2048, torch.bfloat16
    ranks = Ranks(world, 1031, hidden, dtype, config=config)
    for i, (tokens, ctas) in enumerate([(1031, 8), (7, 4), (1, 2), (512, 32)]):
        xs, residual, weight = fresh(world, tokens, hidden, dtype, seed=700 + 10 * world + i)
        cuts = [slice_of(tokens, world, r) for r in range(world)]
        runs = []
        for sliced in (False, True):
            outs = [torch.full((tokens, hidden), float("nan"), device="cuda", dtype=dtype) for _ in range(world)]
            res_outs = [torch.full((max(1, b - a), hidden), float("nan"), device="cuda", dtype=dtype)
                        for a, b in cuts]
            res = [residual[a:b].clone() for a, b in cuts] if sliced else residual
            ranks.launch(xs, res, weight, outs, res_outs, False, ctas, residual_sliced=sliced)
            torch.cuda.synchronize()
            assert ranks.errors() == [0] * world, "a wait timed out"
            runs.append((outs, res_outs))
        out_ref, r_ref = reference(xs, residual, weight)
        for r, (a, b) in enumerate(cuts):
            where = f"world {world} tokens {tokens} ctas {ctas} config {config} rank {r}"
            assert torch.equal(runs[1][0][r], runs[0][0][r]), where
            assert torch.equal(runs[1][1][r][:b - a], runs[0][1][r][:b - a]), where
            assert rel(runs[1][0][r], out_ref) <= 1e-2, where
            if b > a:
                assert rel(runs[1][1][r][:b - a], r_ref[a:b]) <= 1e-2, where


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("config", [(512, 4, 4, False), (256, 2, 8, False), (1024, 4, 2, False), (512, 8, 2, False),
                                    RING4, (256, 2, 8, False, True)])
def test_pipelined_parts(world, config) -> None:
    """Each CTA cuts its rows into several parts whose push, reduce and gather steps overlap: the
    same results, epochs in step with unpipelined calls on the same buffers, slices and parts of
    uneven rows."""
    hidden = 2048
    ranks = Ranks(world, 4099, hidden, torch.bfloat16, config=config)
    calls = [(4099, 4, True), (4099, 3, False), (2500, 1, True), (24, 2, False), (1777, 5, True)]
    engaged = [_core.allreduce_rmsnorm_stages(t, world, c, config) for t, c, _ in calls]
    assert max(engaged) == config[2] and min(engaged) == 1, engaged
    for i, (tokens, ctas, full) in enumerate(calls):
        run_and_check(ranks, tokens, full, ctas, seed=world * 1000 + i)
    ranks.config = None
    run_and_check(ranks, 1031, True, 8, seed=world * 1000 + 99)


@pytest.mark.parametrize("config", [None, (512, 4, 4, False), RING4])
def test_pull_layout(config) -> None:
    """The layout gemm_all_reduce_rmsnorm(backend="peer") uses: each rank's partial copied into its
    own x area, every owner reading its rows there from each peer (loads, not pushes); both
    residual modes, one after the other on the same buffers."""
    world, tokens, hidden = 2, 3001, 1024
    ranks = Ranks(world, tokens, hidden, torch.float16, config=config, pull=True)
    if config is not None:
        assert _core.allreduce_rmsnorm_stages(tokens, world, 4, config) == 4
    for i, (ctas, full) in enumerate([(4, True), (7, False), (5, True), (3, False)]):
        run_and_check(ranks, tokens, full, ctas, seed=50 + i)


ONESHOT = (512, 4, 4, True)


def test_oneshot_uses_each_ranks_own_residual_and_weight() -> None:
    """One-shot: every rank sums every row itself and adds its own residual and weight, as the
    torch composition on that rank does (two-shot takes the owner's: tensor parallelism's
    replicated residual)."""
    world, tokens, hidden, dtype = 2, 1001, 2048, torch.bfloat16
    ranks = Ranks(world, tokens, hidden, dtype, config=ONESHOT)
    for i, ctas in enumerate([8, 3]):
        xs, _, _ = fresh(world, tokens, hidden, dtype, 70 + i)
        per_rank = [fresh(1, tokens, hidden, dtype, 80 + 10 * i + r) for r in range(world)]
        residuals, weights = [p[1] for p in per_rank], [p[2] for p in per_rank]
        outs = [torch.full((tokens, hidden), float("nan"), device="cuda", dtype=dtype) for _ in range(world)]
        res_outs = [torch.full((tokens, hidden), float("nan"), device="cuda", dtype=dtype) for _ in range(world)]
        ranks.launch(xs, residuals, weights, outs, res_outs, True, ctas)
        torch.cuda.synchronize()
        assert ranks.errors() == [0] * world
        for r in range(world):
            out_ref, r_ref = reference(xs, residuals[r], weights[r])
            assert rel(outs[r], out_ref) <= 1e-2 and rel(res_outs[r], r_ref) <= 1e-2, f"ctas {ctas} rank {r}"


def test_oneshot_and_twoshot_calls_share_the_buffers() -> None:
    """One-shot and two-shot calls of growing and shrinking sizes, back to back on the same
    buffers (a push lands before any wait, so areas must not move with the call's size), and
    one-shot configs where it does not apply (sharded residual) running two-shot."""
    world, hidden = 2, 4096
    ranks = Ranks(world, 3001, hidden, torch.bfloat16)
    calls = [(ONESHOT, 64, 8, True), (None, 3001, 8, True), (ONESHOT, 3001, 8, True), (ONESHOT, 5, 4, True),
             ((512, 4, 1, True), 2999, 16, True), (ONESHOT, 700, 8, False), (None, 1, 2, True),
             ((512, 4, 2, False), 3000, 6, True), (ONESHOT, 3001, 32, True)]
    for i, (config, tokens, ctas, full) in enumerate(calls):
        ranks.config = config
        run_and_check(ranks, tokens, full, ctas, seed=300 + i)


def test_oneshot_applies_to_two_ranks_only() -> None:
    """With 3 ranks a one-shot config runs two-shot (one-shot would move more bytes): still right."""
    ranks = Ranks(3, 1000, 1024, torch.float16, config=ONESHOT)
    for i, (tokens, ctas, full) in enumerate([(1000, 8, True), (99, 4, False)]):
        run_and_check(ranks, tokens, full, ctas, seed=400 + i)


def replay_with_fresh_inputs(ranks, tokens, ctas, replays, seed) -> None:
    """One full-residual call captured in a CUDA graph (after a warm call that loads the kernel),
    replayed `replays` times, each with fresh inputs copied in and the outputs poisoned first."""
    world, hidden, dtype = ranks.world, ranks.hidden, ranks.dtype
    xs, residual, weight = fresh(world, tokens, hidden, dtype, seed)
    outs = [torch.empty(tokens, hidden, device="cuda", dtype=dtype) for _ in range(world)]
    res_outs = [torch.empty(tokens, hidden, device="cuda", dtype=dtype) for _ in range(world)]
    ranks.launch(xs, residual, weight, outs, res_outs, True, ctas)  # warm: the kernel is loaded
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ranks.launch(xs, residual, weight, outs, res_outs, True, ctas)
    for i in range(replays):
        new_xs, new_res, new_w = fresh(world, tokens, hidden, dtype, seed + 1000 + i)
        for x, n in zip(xs, new_xs):
            x.copy_(n)
        residual.copy_(new_res)
        weight.copy_(new_w)
        for o in outs + res_outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out_ref, r_ref = reference(xs, residual, weight)
        for r in range(world):
            assert rel(outs[r], out_ref) <= 1e-2 and rel(res_outs[r], r_ref) <= 1e-2, f"replay {i} rank {r}"
    assert ranks.errors() == [0] * world


@pytest.mark.parametrize("hidden,dtype", [(8192, torch.bfloat16), (4096, torch.float16), (8200, torch.bfloat16),
                                          (2048, torch.bfloat16), (16384, torch.float16)])
def test_hidden_size_entries_match_the_general_ones(hidden, dtype, monkeypatch) -> None:
    """One-shot calls with at least 3 rows a CTA (hidden 8192) take the entries compiled for their
    hidden size (fo_arn_oneshot_st_h up to 256 tokens, fo_arn_oneshot_h beyond): right against the
    fp32 composition, and bit for bit the rows of the general entries
    (FLASHOVERLAP_NORM_HIDDEN_KERNELS=0), calls of both kinds alternating on the same buffers."""
    ranks = Ranks(2, 384, hidden, dtype)
    for i, (tokens, ctas) in enumerate([(128, 32), (128, 8), (96, 32), (95, 32), (256, 16), (384, 32), (7, 2)]):
        runs = []
        for setting in ("1", "0", "1"):
            monkeypatch.setenv("FLASHOVERLAP_NORM_HIDDEN_KERNELS", setting)
            runs.append(launch_fresh(ranks, tokens, ctas, seed=500 + i))
        (xs, residual, weight), outs, res_outs = runs[0]
        out_ref, r_ref = reference(xs, residual, weight)
        for r in range(2):
            where = f"tokens {tokens} ctas {ctas} rank {r}"
            assert rel(outs[r], out_ref) <= 1e-2 and rel(res_outs[r], r_ref) <= 1e-2, where
            for other in runs[1:]:
                assert torch.equal(other[1][r], outs[r]) and torch.equal(other[2][r], res_outs[r]), where


def test_hidden_size_entry_in_graph_replays() -> None:
    """The 128-token call of the hidden-size entry captured once, replayed with fresh inputs."""
    replay_with_fresh_inputs(Ranks(2, 128, 8192, torch.bfloat16), 128, 32, 100, seed=11)


@pytest.mark.parametrize("config", [(1024, 2, 1, False), (1024, 2, 1, True)])
def test_rows_of_two_warps_on_32_warps(config) -> None:
    """1024 threads with rows of 2 warps' vectors (hidden 4096), two-shot and one-shot: the row
    groups stop at 15 (a named barrier each; 16 groups of 2 would need barrier 16, which does not
    exist)."""
    ranks = Ranks(2, 1000, 4096, torch.bfloat16, config=config)
    for i, (tokens, ctas) in enumerate([(1000, 4), (200, 8), (7, 2)]):
        run_and_check(ranks, tokens, True, ctas, seed=600 + i)


@pytest.mark.parametrize("config", [None, RING])
def test_widest_rows(config) -> None:
    ranks = Ranks(2, 300, 16384, torch.bfloat16, config=config)
    run_and_check(ranks, 300, True, 4, seed=7)
    run_and_check(ranks, 129, False, 8, seed=8)


@pytest.mark.parametrize("config", [None, (512, 4, 4, False), (512, 4, 4, True), RING4])
def test_graph_replays_with_fresh_inputs(config) -> None:
    world, tokens, hidden, dtype = 2, 777, 4096, torch.bfloat16
    ranks = Ranks(world, tokens, hidden, dtype, config=config)
    # One-shot parts cut every row, not a rank's slice: 97 rows a CTA, 4 parts of 16 warps' rows.
    parts = 1 if config is None else 4 if config[3] else 3
    assert _core.allreduce_rmsnorm_stages(tokens, world, 8, config) == parts
    replay_with_fresh_inputs(ranks, tokens, 8, 1000, seed=1)  # issue 6 asks for 1000 replays


@pytest.mark.parametrize("config", [(512, 4, 8, False), RING])
def test_a_missing_peer_times_out_instead_of_hanging(config) -> None:
    """Rank 1 never runs: rank 0's wait gives up after the timeout and records it (the ring's
    producer keeps completing its slots' phases, so no thread of the CTA waits forever)."""
    world, tokens, hidden, dtype = 2, 64, 512, torch.bfloat16
    ranks = Ranks(world, tokens, hidden, dtype)
    xs, residual, weight = fresh(world, tokens, hidden, dtype, 3)
    out = torch.empty(tokens, hidden, device="cuda", dtype=dtype)
    _core.allreduce_rmsnorm_launch(0, (xs[0].data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                       out.data_ptr()), ranks.bases, ranks.nbytes, 0, tokens, hidden, EPS, True,
                                   "bfloat16", 2, 200_000_000, torch.cuda.current_stream().cuda_stream,
                                   config=config)
    torch.cuda.synchronize()
    assert ranks.errors()[0] != 0
