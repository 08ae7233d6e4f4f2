"""all_reduce_rmsnorm's argument checks: each bad input gets a clear error naming the argument,
before any process group or device is needed."""

from __future__ import annotations

import pytest
import torch

import flashoverlap

BF16 = torch.bfloat16


def args(tokens=16, hidden=64, dtype=BF16):
    return (torch.randn(tokens, hidden).to(dtype), torch.randn(tokens, hidden).to(dtype),
            torch.rand(hidden).to(dtype))


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda x, r, w: (x.float(), r, w), TypeError, ["x", "bfloat16"]),
    (lambda x, r, w: (x, r[:, :8], w), ValueError, ["residual", "shape"]),
    (lambda x, r, w: (x, r, w[:8]), ValueError, ["weight", "hidden"]),
    (lambda x, r, w: (x, r.half(), w), TypeError, ["residual", "torch.bfloat16"]),
    (lambda x, r, w: (x[:, :60].contiguous(), r[:, :60].contiguous(), w[:60]), ValueError, ["multiple of 8"]),
    (lambda x, r, w: (x.t(), r, w), ValueError, ["x", "contiguous"]),
    (lambda x, r, w: (x[0], r, w), ValueError, ["x", "2-D"]),
])
def test_bad_tensors_are_named(mutate, exc, words) -> None:
    with pytest.raises(exc) as info:
        flashoverlap.all_reduce_rmsnorm(*mutate(*args()))
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("kwargs,words", [
    (dict(eps=0.0), ["eps"]),
    (dict(eps=True), ["eps"]),
    (dict(residual_out="half"), ["residual_out", "sharded"]),
    (dict(ctas=0), ["ctas"]),
    (dict(ctas=1000), ["ctas"]),
])
def test_bad_options_are_named(kwargs, words) -> None:
    with pytest.raises(ValueError) as info:
        flashoverlap.all_reduce_rmsnorm(*args(), **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_residual_of_other_rows_is_refused() -> None:
    x, r, w = args()
    with pytest.raises(ValueError, match=r"^residual: expected the shape of x \(16, 64\), got \(8, 64\)$"):
        flashoverlap.all_reduce_rmsnorm(x, r[:8], w)
    # Sharded calls may take a slice; its rows are checked against the group's split.
    with pytest.raises(ValueError, match="or, with residual_out='sharded', this rank's slice"):
        flashoverlap.all_reduce_rmsnorm(x, r[:8, :32].contiguous(), w, residual_out="sharded")


def test_a_sharded_residual_must_be_this_ranks_slice(tmp_path) -> None:
    import torch.distributed as dist

    x, r, w = args()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        # One rank's slice is every row: 15 rows are neither the residual nor the slice.
        with pytest.raises(ValueError, match=r"^residual: .*rows 0\.\.15: \[16, 64\]; got \(15, 64\)"):
            flashoverlap.all_reduce_rmsnorm(x, r[:15], w, residual_out="sharded")
        # The full residual passes this check and meets the next one (a CPU tensor).
        with pytest.raises(ValueError, match="^x: expected a CUDA tensor"):
            flashoverlap.all_reduce_rmsnorm(x, r, w, residual_out="sharded")
    finally:
        dist.destroy_process_group()


def test_widest_hidden_size() -> None:
    with pytest.raises(ValueError, match="16384"):
        flashoverlap.all_reduce_rmsnorm(*args(2, 16392))


def test_valid_arguments_need_torch_distributed() -> None:
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        flashoverlap.all_reduce_rmsnorm(*args())


def test_partial_lies_in_this_ranks_x_area_and_needs_room() -> None:
    """Where backend='peer' stores a rank's partial: its own buffer's x area (after the header and
    the out and residual areas of the pull layout), refused where the buffers are too small."""
    from flashoverlap import _core

    rows, hidden = 100, 64
    need = _core.allreduce_rmsnorm_buffer_bytes(2, rows, hidden, "bfloat16", pull=True)
    area = rows * hidden * 2
    bases = [1 << 40, 2 << 40]
    config = (512, 4, 1, False)
    assert _core.allreduce_rmsnorm_partial((bases, need, 1, 0, config), rows, hidden, "bfloat16") == \
        bases[1] + need - area
    with pytest.raises(ValueError, match="peer buffers"):
        _core.allreduce_rmsnorm_partial((bases, need, 1, 0, config), rows + 1, hidden, "bfloat16")
    with pytest.raises(ValueError, match="rank"):
        _core.allreduce_rmsnorm_partial((bases, need, 2, 0, config), rows, hidden, "bfloat16")
    with pytest.raises(ValueError, match="config"):
        _core.allreduce_rmsnorm_partial((bases, need, 1, 0, (512, 3, 1, False)), rows, hidden, "bfloat16")


@pytest.mark.parametrize("text,config", [("512x4", (512, 4, 1, False, False)), (" 512X4S4 ", (512, 4, 4, False, False)),
                                         ("256x2s8", (256, 2, 8, False, False)),
                                         ("1024x1s1", (1024, 1, 1, False, False)),
                                         ("512x4s4o", (512, 4, 4, True, False)), ("512x4O", (512, 4, 1, True, False)),
                                         ("512x4s8r", (512, 4, 8, False, True)), ("256x2R", (256, 2, 1, False, True))])
def test_norm_config_parses(monkeypatch, text, config) -> None:
    from flashoverlap import _env

    assert _env.parse_norm_config(text) == config
    assert _env.parse_norm_config(_env.format_norm_config(config)) == config
    monkeypatch.setenv("FLASHOVERLAP_NORM_CONFIG", text)
    assert _env.norm_config() == config


@pytest.mark.parametrize("text,words", [("512", ["THREADSxUNROLL"]), ("512x4s", ["THREADSxUNROLL"]),
                                        ("384x4", ["power of two"]), ("512x3", ["unroll"]),
                                        ("512x4s17", ["stages"]), ("512x4s0", ["stages"]),
                                        ("512x4so", ["THREADSxUNROLL"]), ("512x4os4", ["THREADSxUNROLL"]),
                                        ("512x4s4or", ["exclude each other"]), ("512x4s4ro", ["THREADSxUNROLL"])])
def test_bad_norm_config_is_named(monkeypatch, text, words) -> None:
    from flashoverlap import _env

    monkeypatch.setenv("FLASHOVERLAP_NORM_CONFIG", text)
    with pytest.raises(ValueError) as info:
        _env.norm_config()
    for word in ["FLASHOVERLAP_NORM_CONFIG"] + words:
        assert word in str(info.value), str(info.value)


def _group_worker(rank: int, world: int, init_file: str, configs: list, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    from flashoverlap import peer_norm

    os.environ["FLASHOVERLAP_NORM_CONFIG"] = configs[rank]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = peer_norm.PeerGroup(dist.group.WORLD, torch.device("cpu"))
        verdict = f"ok {group.config}"
    except ValueError as e:
        verdict = f"ValueError {e}"
    with open(f"{out_dir}/{rank}.txt", "w") as f:
        f.write(verdict)
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("configs,agree,words", [(["512x4s4", "512x4s4"], True, ""),
                                                (["512x4s4", "512x4"], False, "FLASHOVERLAP_NORM_CONFIG differs"),
                                                (["512x4s4o", "512x4s4"], False, "FLASHOVERLAP_NORM_CONFIG differs"),
                                                (["512x4s4r", "512x4s4"], False, "FLASHOVERLAP_NORM_CONFIG differs"),
                                                (["512x4", "512x3"], False, "rank 1: FLASHOVERLAP_NORM_CONFIG")])
def test_ranks_must_agree_on_the_norm_config(tmp_path, configs, agree, words) -> None:
    """A peer group's ranks compare FLASHOVERLAP_NORM_CONFIG when the group is made (the kernel's
    parts must match across ranks): where they differ, or one rank's is invalid, every rank
    raises, so none waits for the others in a collective or a kernel."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_group_worker, args=(r, 2, str(tmp_path / "init"), configs, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank did not finish making its peer group")
    verdicts = [(tmp_path / f"{r}.txt").read_text() for r in range(2)]
    if agree:
        assert verdicts == ["ok (512, 4, 4, False, False)"] * 2
    else:
        for v in verdicts:
            assert v.startswith("ValueError") and words in v, v


@pytest.mark.parametrize("tokens,world", [(0, 2), (1, 2), (1001, 2), (777, 3), (5, 8), (16384, 8)])
def test_token_slices_are_the_kernels_split(tokens, world) -> None:
    """Each rank's rows, as Python asks the core for them, are the kernel's near-equal split
    (slice_start in csrc/allreduce_rmsnorm.cu): consecutive, covering every token once."""
    from flashoverlap import _core

    slices = [_core.allreduce_rmsnorm_slice(tokens, world, r) for r in range(world)]
    assert slices == [(tokens * r // world, tokens * (r + 1) // world) for r in range(world)]
    assert slices[0][0] == 0 and slices[-1][1] == tokens
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))


@pytest.mark.parametrize("world,rank", [(2, 2), (0, 0), (3, 7)])
def test_token_slice_of_a_rank_outside_the_world_is_refused(world, rank) -> None:
    from flashoverlap import _core

    with pytest.raises(ValueError, match="^rank: "):
        _core.allreduce_rmsnorm_slice(100, world, rank)


def _fallback_rank(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import json
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    from flashoverlap import peer_norm

    failures = []
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        tokens, hidden = 11, 64
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, hidden, generator=gen).to(BF16)
        residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(99)).to(BF16)
        weight = torch.rand(hidden, generator=torch.Generator().manual_seed(98)).to(BF16) + 0.5
        a, b = peer_norm._slice(tokens, world, rank)
        group = dist.group.WORLD
        full = peer_norm._torch_fallback(x, residual, weight, 1e-6, group, "sharded", world, rank)
        sliced = peer_norm._torch_fallback(x, residual[a:b].clone(), weight, 1e-6, group, "sharded", world, rank)
        for name, p, q in zip(("out", "residual"), full, sliced):
            if not torch.equal(p, q):
                failures.append(f"rank {rank}: {name} differs with a sliced residual")
        if tuple(sliced[1].shape) != (b - a, hidden):
            failures.append(f"rank {rank}: residual shape {tuple(sliced[1].shape)}")
        dist.destroy_process_group()
    except Exception:
        failures.append(traceback.format_exc())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(failures))


def test_fallback_rebuilds_a_sliced_residual(tmp_path) -> None:
    """The torch fallback (off-node groups) given each rank's slice of the residual returns what it
    returns given the whole residual: 11 tokens on 3 gloo ranks (slices of 3, 4 and 4 rows)."""
    import json

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_fallback_rank, args=(r, 3, f"file://{tmp_path / 'rdv'}", str(tmp_path)))
             for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    for r in range(3):
        path = tmp_path / f"rank{r}.json"
        failures += json.loads(path.read_text()) if path.exists() else [f"rank {r}: no result"]
    assert not failures, failures



@pytest.mark.parametrize("name,value,words", [("FLASHOVERLAP_NORM_CE_MIN_TOKENS", "-1", [">= 0"]),
                                              ("FLASHOVERLAP_NORM_CE_MIN_TOKENS", "many", ["integer"]),
                                              ("FLASHOVERLAP_NORM_CE_CHUNKS", "-1", ["1 to 64"]),
                                              ("FLASHOVERLAP_NORM_CE_CHUNKS", "65", ["1 to 64"])])
def test_bad_copy_engine_settings_are_named(monkeypatch, name, value, words) -> None:
    from flashoverlap import _env

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        _env.norm_copy_engines()
    for word in [name] + words:
        assert word in str(info.value), str(info.value)


def test_copy_engine_settings_default_and_parse(monkeypatch) -> None:
    from flashoverlap import _env

    monkeypatch.delenv("FLASHOVERLAP_NORM_CE_MIN_TOKENS", raising=False)
    monkeypatch.delenv("FLASHOVERLAP_NORM_CE_CHUNKS", raising=False)
    assert _env.norm_copy_engines() == (None, 0)
    monkeypatch.setenv("FLASHOVERLAP_NORM_CE_MIN_TOKENS", "0")
    monkeypatch.setenv("FLASHOVERLAP_NORM_CE_CHUNKS", "16")
    assert _env.norm_copy_engines() == (0, 16)


def test_copy_engines_serve_two_ranks_from_the_threshold() -> None:
    """The copy-engine mode only on 2 ranks from the threshold on, up to 32 CTAs (the row ranges
    are the core's: norm_copy_engines::auto_chunks, tested in Rust)."""
    from flashoverlap import _env, peer_norm

    group = peer_norm.PeerGroup.__new__(peer_norm.PeerGroup)
    group.world, group.ce_min_tokens, group.ce_chunks = 2, 4096, 0
    assert group.copy_engines(4096, 32) and not group.copy_engines(4095, 32)
    assert group.copy_engines(1 << 20, 1) and not group.copy_engines(1 << 20, peer_norm.CE_MAX_CTAS + 1)
    group.world = 3
    assert not group.copy_engines(1 << 20, 16)
    group.world, group.ce_min_tokens = 2, 0
    assert not group.copy_engines(1 << 20, 16)
    # Unset: one-shot (full residual) and two-shot (sharded) calls have thresholds of their own.
    group.ce_min_tokens = None
    full, sharded = _env.NORM_CE_MIN_TOKENS_FULL, _env.NORM_CE_MIN_TOKENS_SHARDED
    assert full < sharded
    assert group.copy_engines(full, 32) and not group.copy_engines(full - 1, 32)
    assert not group.copy_engines(full, 32, full=False) and group.copy_engines(sharded, 32, full=False)
