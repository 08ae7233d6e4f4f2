"""Token weaving on the CPU: the wave-aware split against a brute-force search over every cut, and
weave's semantics (each half through the same steps, in order; the halves merged back) and its
argument checks. The streams and events are tested on a GPU (tests/gpu/test_token_weave.py)."""

from __future__ import annotations

import random
import re

import pytest

torch = pytest.importorskip("torch")
import flashoverlap  # noqa: E402
from flashoverlap.weaving import DEFAULT_CTAS  # noqa: E402


def _waves(rows: int, n: int, tile: tuple[int, int], ctas: int) -> int:
    tiles = -(-rows // tile[0]) * -(-n // tile[1])
    return -(-tiles // ctas)


def _cost(rows: int, layer, tile, ctas) -> int:
    return sum(_waves(rows, n, tile, ctas) * k for n, k in layer)


def _brute_force(tokens: int, layer, tile: tuple[int, int], ctas: int, skew: float):
    """Every cut at a multiple of tile[0] within the skew (or the most even): the fewest K-weighted
    waves, then most even, then the larger first half."""
    cuts = range(tile[0], tokens, tile[0])
    if not cuts:
        return None
    limit = max(skew * tokens, min(abs(2 * a - tokens) for a in cuts))
    return min((a for a in cuts if abs(2 * a - tokens) <= limit),
               key=lambda a: (_cost(a, layer, tile, ctas) + _cost(tokens - a, layer, tile, ctas),
                              abs(2 * a - tokens), -a))


def test_split_is_the_best_band_cut() -> None:
    rng = random.Random(7)
    for _ in range(400):
        tokens = rng.randint(1, 20000)
        layer = [(rng.randint(1, 30000), rng.randint(1, 16384)) for _ in range(rng.randint(1, 3))]
        tile = rng.choice([(128, 256), (128, 128), (64, 256), (256, 128)])
        ctas = rng.choice([132, 116, 108, 78, 7])
        skew = rng.choice([0.0, 0.1, 0.25, 0.5, 1.0])
        s = flashoverlap.token_split(tokens, layer, tile=tile, ctas=ctas, skew=skew)
        assert s.first + s.second == tokens
        assert s.unsplit_waves == sum(_waves(tokens, n, tile, ctas) for n, _ in layer)
        best = _brute_force(tokens, layer, tile, ctas, skew)
        if best is None:
            assert s == (tokens, 0, s.unsplit_waves, s.unsplit_waves)
        else:
            assert s.first == best, (tokens, layer, tile, ctas, skew)
            assert s.waves == sum(_waves(h, n, tile, ctas) for h in (s.first, s.second) for n, _ in layer)


def test_one_n_is_one_gemm() -> None:
    assert flashoverlap.token_split(5000, 8192, ctas=132) == flashoverlap.token_split(5000, [(8192, 7)], ctas=132)


def test_wave_aware_cut_beats_halving() -> None:
    # 1536 tokens of an 8192-wide GEMM on 132 SMs: 384 tiles, 3 waves; halves of 768 take 2 each,
    # 1024 + 512 keep 3 (a skew of 1/3 allows it).
    s = flashoverlap.token_split(1536, 8192, ctas=132, skew=0.34)
    assert (s.first, s.second, s.waves, s.unsplit_waves) == (1024, 512, 3, 3)
    assert 2 * _waves(768, 8192, (128, 256), 132) == 4
    assert flashoverlap.token_split(1536, 8192, ctas=132)[:2] == (768, 768)


def test_the_whole_layer_decides() -> None:
    # Cut for gate_up alone, 3072 tokens go 1792 + 1280; o_proj and down then lose a wave each.
    gate_up, layer = (28672, 8192), [(8192, 4096), (28672, 8192), (8192, 14336)]
    assert flashoverlap.token_split(3072, [gate_up], ctas=132)[:2] == (1792, 1280)
    assert flashoverlap.token_split(3072, layer, ctas=132)[:2] == (1536, 1536)


def test_default_ctas_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flashoverlap.token_split(1536, 8192) == flashoverlap.token_split(1536, 8192, ctas=DEFAULT_CTAS)
    assert flashoverlap.token_split(1536, 8192, device="cpu") == flashoverlap.token_split(1536, 8192, ctas=132)


@pytest.mark.parametrize("kwargs,argument", [
    ({"tokens": 0}, "tokens"), ({"tokens": -5}, "tokens"), ({"tokens": True}, "tokens"), ({"tokens": 3.0}, "tokens"),
    ({"gemms": 0}, "gemms"), ({"gemms": []}, "gemms"), ({"gemms": "8192"}, "gemms"),
    ({"gemms": [(8192, 4096), (8192,)]}, "gemms[1]"), ({"gemms": [(8192, 0)]}, "gemms[0] K"),
    ({"gemms": [(-8, 4096)]}, "gemms[0] N"), ({"ctas": 0}, "ctas"), ({"tile": (128,)}, "tile"),
    ({"tile": (0, 256)}, "tile[0]"), ({"tile": (128, -1)}, "tile[1]"), ({"tokens": 2 ** 40}, "tokens"),
    ({"skew": -0.1}, "skew"), ({"skew": 1.5}, "skew"), ({"skew": float("nan")}, "skew"), ({"skew": "0.2"}, "skew"),
])
def test_split_arguments_are_checked(kwargs: dict, argument: str) -> None:
    args = {"tokens": 1024, "gemms": 8192, "ctas": 132, **kwargs}
    with pytest.raises(ValueError, match=f"^{re.escape(argument)}:"):
        flashoverlap.token_split(args.pop("tokens"), args.pop("gemms"), **args)


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


def test_an_empty_batch_is_one_empty_half() -> None:
    log: list = []
    x, r = torch.randn(0, 5), torch.randn(0, 5)
    out = flashoverlap.weave(_block(log), (x, r), 0)
    assert out.shape == (0, 3)
    assert log == [("compute0", 0), ("communicate0", 0), ("compute1", 0)]
    with pytest.raises(ValueError, match="^split:"):
        flashoverlap.weave(_block(log), (x, r), (1, -1))


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
