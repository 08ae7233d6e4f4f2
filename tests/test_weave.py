"""Token weaving on the CPU: the wave-aware split against a brute-force search over every cut, and
weave's semantics (each half through the same steps, in order; the halves merged back) and its
argument checks. The streams and events are tested on a GPU (tests/gpu/test_token_weave.py)."""

from __future__ import annotations

import random
import re

import pytest

torch = pytest.importorskip("torch")
import flashoverlap  # noqa: E402
from flashoverlap.weave import DEFAULT_CTAS  # noqa: E402


def _waves(rows: int, n: int, tile: tuple[int, int], ctas: int) -> int:
    tiles = -(-rows // tile[0]) * -(-n // tile[1])
    return -(-tiles // ctas)


def _brute_force(tokens: int, n: int, tile: tuple[int, int], ctas: int):
    """Every cut at a multiple of tile[0]: fewest waves, then most even, then larger first half."""
    cuts = range(tile[0], tokens, tile[0])
    if not cuts:
        return None
    return min(cuts, key=lambda a: (_waves(a, n, tile, ctas) + _waves(tokens - a, n, tile, ctas),
                                    abs(2 * a - tokens), -a))


def test_split_is_the_best_band_cut() -> None:
    rng = random.Random(7)
    for _ in range(400):
        tokens, n = rng.randint(1, 20000), rng.randint(1, 30000)
        tile = rng.choice([(128, 256), (128, 128), (64, 256), (256, 128)])
        ctas = rng.choice([132, 116, 108, 78, 7])
        s = flashoverlap.token_split(tokens, n, tile=tile, ctas=ctas)
        assert s.first + s.second == tokens
        assert s.unsplit_waves == _waves(tokens, n, tile, ctas)
        best = _brute_force(tokens, n, tile, ctas)
        if best is None:
            assert s == (tokens, 0, s.unsplit_waves, s.unsplit_waves)
        else:
            assert s.first == best, (tokens, n, tile, ctas)
            assert s.waves == _waves(s.first, n, tile, ctas) + _waves(s.second, n, tile, ctas)


def test_wave_aware_cut_beats_halving() -> None:
    # 1536 tokens of an 8192-wide GEMM on 132 SMs: 384 tiles, 3 waves; halves of 768 take 2 each.
    s = flashoverlap.token_split(1536, 8192, ctas=132)
    assert (s.first, s.second, s.waves, s.unsplit_waves) == (1024, 512, 3, 3)
    assert 2 * _waves(768, 8192, (128, 256), 132) == 4


def test_default_ctas_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flashoverlap.token_split(1536, 8192) == flashoverlap.token_split(1536, 8192, ctas=DEFAULT_CTAS)
    assert flashoverlap.token_split(1536, 8192, device="cpu") == flashoverlap.token_split(1536, 8192, ctas=132)


@pytest.mark.parametrize("kwargs,argument", [
    ({"tokens": 0}, "tokens"), ({"tokens": -5}, "tokens"), ({"tokens": True}, "tokens"), ({"tokens": 3.0}, "tokens"),
    ({"n": 0}, "n"), ({"ctas": 0}, "ctas"), ({"tile": (128,)}, "tile"), ({"tile": (0, 256)}, "tile[0]"),
    ({"tile": (128, -1)}, "tile[1]"), ({"tokens": 2 ** 40}, "tokens"),
])
def test_split_arguments_are_checked(kwargs: dict, argument: str) -> None:
    args = {"tokens": 1024, "n": 8192, "ctas": 132, **kwargs}
    with pytest.raises(ValueError, match=f"^{re.escape(argument)}:"):
        flashoverlap.token_split(args.pop("tokens"), args.pop("n"), **args)


def _block(log: list):
    """Two stages of row-wise steps (so halves compose to the whole), logging what each saw."""

    def compute0(x, r):
        log.append(("compute0", x.shape[0]))
        return x * 2 + 1, r

    def communicate0(y, r):
        log.append(("communicate0", y.shape[0]))
        return torch.tanh(y) + r, r * 3

    def compute1(x, r):
        log.append(("compute1", x.shape[0]))
        return (x @ torch.ones(x.shape[1], 3),)

    return [(compute0, communicate0), (compute1, None)]


def _whole(x, r):
    y = torch.tanh(x * 2 + 1) + r
    return y @ torch.ones(x.shape[1], 3)


@pytest.mark.parametrize("split", [6, (6, 4), flashoverlap.TokenSplit(3, 7, 0, 0), 10, (10, 0)])
def test_halves_compose_to_the_whole(split) -> None:
    x, r = torch.randn(10, 5), torch.randn(10, 5)
    log: list = []
    out = flashoverlap.weave(_block(log), (x, r), split)
    assert torch.allclose(out, _whole(x, r), atol=1e-6)
    first = split if isinstance(split, int) else split[0]
    halves = [first] + ([10 - first] if first < 10 else [])
    # Stage by stage, each half's compute then its communicate, first half first.
    expect = []
    for name in (("compute0", "communicate0"), ("compute1",)):
        for tokens in halves:
            expect += [(step, tokens) for step in name]
    assert log == expect


def test_unmerged_halves_and_single_tensor_inputs() -> None:
    x = torch.randn(9, 4)
    halves = flashoverlap.weave([(lambda a: a + 1, lambda a: (a * 2, a.sum(1)))], x, (5, 4), merge=False)
    assert [len(h) for h in halves] == [2, 2]
    assert torch.equal(halves[0][0], (x[:5] + 1) * 2) and torch.equal(halves[1][1], (x[5:] + 1).sum(1))
    merged = flashoverlap.weave([(lambda a: a + 1, lambda a: (a * 2, a.sum(1)))], x, (5, 4))
    assert torch.equal(merged[0], (x + 1) * 2) and torch.equal(merged[1], (x + 1).sum(1))


def test_halves_are_views_not_copies() -> None:
    x = torch.zeros(6, 2)

    def write(a):
        a += 1
        return a

    flashoverlap.weave([(write, None)], x, 4)
    assert torch.equal(x, torch.ones(6, 2))


def _noop(*state):
    return state


@pytest.mark.parametrize("stages,argument", [
    ([], "stages"), ("ab", "stages"), (_noop, "stages"), ([(_noop,)], r"stages\[0\]"),
    ([(_noop, _noop), (1, _noop)], r"stages\[1\]"), ([(_noop, 5)], r"stages\[0\]"),
])
def test_bad_stages(stages, argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument}:"):
        flashoverlap.weave(stages, torch.zeros(4, 2), 2)


@pytest.mark.parametrize("inputs,argument", [
    ((), "inputs"), ([torch.zeros(4, 2), "x"], r"inputs\[1\]"), (torch.tensor(1.0), r"inputs\[0\]"),
    ((torch.zeros(4, 2), torch.zeros(5, 2)), r"inputs\[1\]"), (None, "inputs"),
])
def test_bad_inputs(inputs, argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{argument}:"):
        flashoverlap.weave([(_noop, None)], inputs, 2)


@pytest.mark.parametrize("split", [0, 5, (2, 1), (3, 2), (-1, 5), (4, -0.5), True, "2", (2.0, 2.0), None])
def test_bad_split(split) -> None:
    called = []
    with pytest.raises(ValueError, match="^split:"):
        flashoverlap.weave([(lambda *s: called.append(1) or s, None)], torch.zeros(4, 2), split)
    assert not called, "nothing runs before the arguments are checked"


def test_step_results_are_checked() -> None:
    with pytest.raises(TypeError, match=r"^stages\[0\] communicate:"):
        flashoverlap.weave([(_noop, lambda x: [x])], torch.zeros(4, 2), 2)
    with pytest.raises(ValueError, match="^merge:.*merge=False"):
        flashoverlap.weave([(lambda x: x.sum(), None)], torch.zeros(4, 2), 2)
    with pytest.raises(ValueError, match="^merge:"):
        flashoverlap.weave([(lambda x: x if x.shape[0] == 2 else (x, x), None)], torch.zeros(5, 2), 2)
