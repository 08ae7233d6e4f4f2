"""flashoverlap.weave on a GPU: the events that order the two streams (a missing wait shows as
NaN read from a poisoned buffer a delayed step has not written yet), that the two streams do run
at once, CUDA-graph capture and replay, and a two-layer block of GEMMs and all_reduce_rmsnorm
woven over one rank (NCCL) and over 2 ranks sharing one GPU, against the fp32 composition."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_gemm_all_reduce import run_workers

torch = pytest.importorskip("torch")
import flashoverlap  # noqa: E402

SEED = 1407
SLEEP_CYCLES = 4_000_000  # ~2 ms at H200 clocks: far longer than any launch gap


def _layers(x, w, bufs, delay_compute: bool, delay_comm: bool):
    """Two stages: compute y = x @ w.T (after a delay), communicate buf = y / 8 + 1 (after a delay),
    into a NaN-poisoned buffer that the next step reads."""

    def compute(a, *rest):
        if delay_compute:
            torch.cuda._sleep(SLEEP_CYCLES)
        return (a @ w.T, *rest)

    def communicate(y, buf, *rest):
        if delay_comm:
            torch.cuda._sleep(SLEEP_CYCLES)
        buf.copy_(y / 8 + 1)
        return (buf, *rest)

    return [(compute, communicate), (compute, communicate)], (x, *bufs)


def _reference(x, w):
    ref = x.float()
    for _ in range(2):
        ref = (ref @ w.float().T) / 8 + 1
    return ref


def _fresh(tokens: int, hidden: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden ** 0.5)
    bufs = [torch.full((tokens, hidden), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    return x, w, bufs


def _rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpus(1)
@pytest.mark.parametrize("delay_compute,delay_comm", [(True, False), (False, True)])
def test_steps_wait_for_what_they_read(delay_compute: bool, delay_comm: bool) -> None:
    # The delayed side's result is read by the other stream: without the events it reads NaN.
    for tokens, split in ((1000, 512), (768, (384, 384)), (300, 300)):
        x, w, bufs = _fresh(tokens, 256, SEED + tokens)
        stages, inputs = _layers(x, w, bufs, delay_compute, delay_comm)
        out = flashoverlap.weave(stages, inputs, split)
        assert not torch.isnan(out).any(), (tokens, split)
        assert _rel(out, _reference(x, w)) < 1e-2


@pytest.mark.gpus(1)
def test_under_inference_mode() -> None:
    # vLLM runs its models under torch.inference_mode(): inference tensors cross the streams too.
    with torch.inference_mode():
        x, w, bufs = _fresh(1000, 256, SEED + 5)
        stages, inputs = _layers(x, w, bufs, False, True)
        out = flashoverlap.weave(stages, inputs, flashoverlap.token_split(1000, [(256, 256)] * 2))
        assert out.is_inference()
        assert not torch.isnan(out).any()
        assert _rel(out, _reference(x, w)) < 1e-2


@pytest.mark.gpus(1)
def test_streams_overlap() -> None:
    # Each step sleeps S on its stream: in order 8 S; woven, the communicate of one half runs
    # while the other half computes: 5 S.
    x, w, bufs = _fresh(512, 128, SEED)
    stages, inputs = _layers(x, w, bufs, True, True)
    flashoverlap.weave(stages, inputs, 256)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    alone = torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    alone.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(alone)
    start.record()
    flashoverlap.weave(stages, inputs, 256)
    end.record()
    torch.cuda.synchronize()
    woven_ms = start.elapsed_time(end)
    assert woven_ms < 6.5 * step_ms, f"woven {woven_ms:.2f} ms for steps of {step_ms:.2f} ms (in order: 8 steps)"


@pytest.mark.gpus(1)
def test_graph_capture_and_replay() -> None:
    tokens, hidden = 1000, 256
    x, w, bufs = _fresh(tokens, hidden, SEED + 1)
    stages, inputs = _layers(x, w, bufs, True, True)
    flashoverlap.weave(stages, inputs, 512)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashoverlap.weave(stages, inputs, 512)
    for replay in range(4):
        gen = torch.Generator(device="cuda").manual_seed(SEED + 10 + replay)
        x.copy_(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen))
        for b in bufs:
            b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), replay
        assert _rel(out, _reference(x, w)) < 1e-2, replay


@pytest.mark.gpus(1)
def test_comm_stream_must_differ() -> None:
    x, w, bufs = _fresh(256, 128, SEED)
    stages, inputs = _layers(x, w, bufs, False, False)
    with pytest.raises(ValueError, match="^comm_stream:"):
        flashoverlap.weave(stages, inputs, 128, comm_stream=torch.cuda.current_stream())
    # Still usable, on a stream of the caller's choosing.
    out = flashoverlap.weave(stages, inputs, 128, comm_stream=torch.cuda.Stream())
    assert _rel(out, _reference(x, w)) < 1e-2


@pytest.mark.gpus(1)
def test_a_step_that_raises_leaves_the_streams_ordered() -> None:
    # The communicate enqueues a delayed write, then raises: the caller's stream must still come
    # after the write, and weave must stay usable.
    x, w, bufs = _fresh(512, 128, SEED + 2)

    def failing(y, buf, *rest):
        torch.cuda._sleep(SLEEP_CYCLES)
        buf.copy_(y)
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        flashoverlap.weave([(lambda a, *rest: (a @ w.T, *rest), failing)], (x, *bufs), 256)
    assert not torch.isnan(bufs[0][:256]).any(), "the caller's stream ran before the side stream's write"
    x, w, bufs = _fresh(512, 128, SEED + 4)
    stages, inputs = _layers(x, w, bufs, False, True)
    assert _rel(flashoverlap.weave(stages, inputs, 256), _reference(x, w)) < 1e-2


def _check(results: list) -> None:
    assert all(not r["failures"] for r in results), [r["failures"] for r in results]


@pytest.mark.gpus(1)
def test_block_one_rank(tmp_path: Path) -> None:
    _check(run_workers(tmp_path, "weave_block", 1, seed=SEED))


@pytest.mark.gpus(1)
def test_block_two_ranks_sharing_a_gpu(tmp_path: Path) -> None:
    _check(run_workers(tmp_path, "weave_block", 2, seed=SEED + 1, shared=True))


@pytest.mark.gpus(2)
def test_block_two_gpus(tmp_path: Path) -> None:
    _check(run_workers(tmp_path, "weave_block", 2, seed=SEED + 2))
