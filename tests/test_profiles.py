"""Machine profiles on the CPU: the file format and its checks, what a bad file does (reported
once, ignored), that a registered profile changes the plans, and the tuner's resumable loop."""

from __future__ import annotations

import json
import logging

import pytest

import flashoverlap
from flashoverlap import _core, cli, profiles, tune

GPU = "Test GPU 9000"
SMS = 132


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(tmp_path))
    profiles.reset()
    yield
    profiles.reset()


def make(world=2, nccl="2.99.1", us_scale=1.0, gemm_us=None, copy_engine_scale=None):
    key = profiles.make_key(GPU, SMS, world, nccl, "bfloat16")
    data = profiles.empty(key)
    sizes = [1 << e for e in range(16, 31)]
    for overlapped in (True, False):
        data["collectives"].append({"collective": "all_reduce", "overlapped": overlapped, "max_ctas": 24,
                                    "bytes": sizes, "us": [us_scale * (20 + b / 150e3) for b in sizes]})
    if copy_engine_scale is not None:
        for ctas in tune.COPY_ENGINE_CTAS:
            data["collectives"].append({"collective": "all_reduce", "overlapped": True, "backend": "copy_engine",
                                        "ctas": ctas, "bytes": sizes,
                                        "us": [copy_engine_scale * (8 + b / 100e3) for b in sizes]})
    if gemm_us is not None:
        data["gemm"].append({"kernel": "cublas", "ctas": SMS, "m": 4096, "n": 8192, "k": 4096, "us": gemm_us})
    return data


def save(data) -> None:
    profiles.write(profiles.cache_dir() / profiles.file_name(data["key"]), data)


def test_round_trip_and_file_name():
    data = make(gemm_us=400.0)
    save(data)
    path = profiles.cache_dir() / profiles.file_name(data["key"])
    assert path.name == "test-gpu-9000-132sm-w2-nccl2.99.1-bfloat16.json"
    assert profiles.read(path) == data
    assert not list(path.parent.glob(".tmp-*"))


@pytest.mark.parametrize("mutate,why", [
    (lambda d: d.update(schema=2), "schema"),
    (lambda d: d["key"].pop("nccl"), "key"),
    (lambda d: d["key"].update(dtype="float32"), "bad key"),
    (lambda d: d["collectives"][0].update(collective="broadcast"), "collectives[0]"),
    (lambda d: d["collectives"][0]["us"].pop(), "equal length"),
    (lambda d: d["collectives"][1]["bytes"].reverse(), "sizes must increase"),
    (lambda d: d["collectives"][0]["us"].__setitem__(3, -1.0), "times be > 0"),
    (lambda d: d["gemm"][0].update(us=0), "gemm[0]"),
    (lambda d: d["gemm"][0].update(ctas=SMS + 1), "CTAs"),
    (lambda d: d["collectives"][0].update(backend="rdma"), "backend must be"),
    (lambda d: d["collectives"][0].update(backend="copy_engine"), "copy-engine curve"),
    (lambda d: d["collectives"][1].update(backend="copy_engine", ctas=8), "copy-engine curve"),
    (lambda d: d["collectives"][0].update(backend="copy_engine", ctas=0), "copy-engine curve"),
])
def test_invalid_contents_are_named(mutate, why):
    data = make(gemm_us=400.0)
    mutate(data)
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        profiles.validate(data)


def test_bad_files_are_reported_once_and_ignored(caplog):
    d = profiles.cache_dir()
    d.mkdir(parents=True)
    (d / "corrupt.json").write_text("{not json")
    (d / "old.json").write_text(json.dumps(dict(make(), schema=0)))
    save(make())
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        used = profiles.load_for_device(GPU, SMS, "2.99.1")
        assert [p.name for p in used] == [profiles.file_name(make()["key"])]
        profiles._loaded.clear()
        profiles.load_for_device(GPU, SMS, "2.99.1")
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("corrupt.json" in w for w in warnings) == 1
    assert sum("old.json" in w and "schema 0" in w for w in warnings) == 1
    assert _core.profile_counts()[0] == 2


def test_other_gpus_and_other_nccl_versions(caplog):
    save(make(gemm_us=400.0))
    assert profiles.load_for_device("Another GPU", SMS, "2.99.1") == []
    assert _core.profile_counts() == (0, 0)
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        assert len(profiles.load_for_device(GPU, SMS, "2.18.0")) == 1
    # GEMM times do not depend on NCCL; the curves do.
    assert _core.profile_counts() == (0, 1)
    assert any("NCCL 2.99.1" in r.getMessage() for r in caplog.records)


def test_a_profile_changes_the_plan():
    shape = (8192, 8192, 1024)

    def plan():
        return flashoverlap.plan_gemm_all_reduce(*shape, 2, sms=SMS)

    before = plan()
    # A collective 50x slower than the constants: overlapping a communication-bound shape
    # cannot hide it, and the predicted times follow the curve.
    save(make(us_scale=50.0))
    profiles.load_for_device(GPU, SMS, "2.99.1")
    after = plan()
    assert after.predicted_sequential_us > 10 * before.predicted_sequential_us
    profiles.reset()
    assert plan().predicted_sequential_us == before.predicted_sequential_us


def test_a_measured_cublas_time_is_the_sequential_gemm():
    base = flashoverlap.plan_gemm_all_reduce(4096, 8192, 4096, 2, sms=SMS, mode="sequential")
    save(make(gemm_us=10_000.0))
    profiles.load_for_device(GPU, SMS, "2.99.1")
    slow = flashoverlap.plan_gemm_all_reduce(4096, 8192, 4096, 2, sms=SMS, mode="sequential")
    assert slow.predicted_sequential_us > base.predicted_sequential_us + 9_000


def test_presets():
    world, shapes = tune.preset_shapes("llama-3-70b-tp2")
    assert world == 2
    assert (4096, 8192, 4096) in shapes and (16384, 8192, 14336) in shapes
    assert len(shapes) == 2 * len(tune.PRESET_TOKENS)
    with pytest.raises(ValueError, match="preset"):
        tune.preset_shapes("gpt-5-tp2")
    with pytest.raises(ValueError, match="split"):
        tune.preset_shapes("llama-3-70b-tp3")


def test_tuning_resumes_where_it_stopped(tmp_path):
    key = profiles.make_key(GPU, SMS, 2, "2.99.1", "bfloat16")
    items = tune.collective_items(["all_reduce", "gemm"], 2) + tune.gemm_items([(4096, 8192, 4096)], ["sm90_n128"], SMS)
    ce = len(tune.COPY_ENGINE_CTAS)
    assert len(items) == 2 + ce + 1 + len(tune.RESERVATIONS)
    path = tmp_path / "p.json"
    measured = []

    class Interrupted(Exception):
        pass

    stop_at = [4 + ce]

    def measure(item):
        measured.append(item)
        if len(measured) == stop_at[0]:
            raise Interrupted
        if item["kind"] == "gemm":
            return 100.0 + len(measured)
        if item.get("backend") == "copy_engine":
            return {"bytes": [1 << 16, 1 << 20], "us": [5.0 + item["ctas"], 9.0]}
        return {"max_ctas": 24, "bytes": [1 << 16, 1 << 20], "us": [20.0, 30.0]}

    profile = tune._start_profile(path, key, fresh=False)
    with pytest.raises(Interrupted):
        tune.run_items(profile, items, measure, lambda p: profiles.write(path, p), None)
    resumed = tune._start_profile(path, key, fresh=False)
    assert len(resumed["collectives"]) == 2 + ce and len(resumed["gemm"]) == 1
    # Each copy-engine curve is kept apart by its reduction CTAs.
    assert sorted(c["ctas"] for c in resumed["collectives"] if c.get("backend") == "copy_engine") == sorted(
        tune.COPY_ENGINE_CTAS)
    measured.clear()
    stop_at[0] = 0
    progress = tune.Progress(len(items), sum(tune.item_done(resumed, i) for i in items), stream=open(tmp_path / "log", "w"))
    tune.run_items(resumed, items, measure, lambda p: profiles.write(path, p), progress)
    # Only what the interrupted run had not saved: the item it was measuring and the rest.
    assert len(measured) == len(items) - 3 - ce
    final = profiles.read(path)
    assert all(tune.item_done(final, i) for i in items)
    assert "ETA" in progress.line("x") and f"{len(items)}/{len(items)}" in progress.line("x")
    assert tune._start_profile(path, key, fresh=True)["gemm"] == []
    assert "sm90_n128" in tune.summary(final) and "copy engines (sums on 8 CTAs)" in tune.summary(final)
    # Off one node there is nothing to measure on the copy engines.
    assert all("backend" not in i for i in tune.collective_items(["all_reduce"], 2, copy_engine=False))


def test_show_prints_the_plan_and_its_profile(capsys):
    save(make())
    assert cli.main(["show", "4096x8192x4096", "--gpu", GPU, "--nccl", "2.99.1"]) == 0
    out = capsys.readouterr().out
    assert "profile: " in out and "test-gpu-9000" in out
    profiles.reset()
    assert cli.main(["show", "4096x8192x4096", "--gpu", ""]) == 0
    assert "built-in constants" in capsys.readouterr().out


def test_plan_shows_the_push_backend_on_two_ranks_only(capsys):
    # Its sums take up to 16 SMs on a short K (the estimate the CLI shows until 2 GPUs time it).
    assert cli.main(["plan", "8192x8192x1024", "--backend", "push"]) == 0
    assert "16 SMs left to the collective" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "8192x8192x1024", "--backend", "push", "--world-size", "4"])
    assert "exactly 2 ranks" in capsys.readouterr().err


def test_show_draws_the_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "t.png"
    assert cli.main(["show", "4096x8192x4096", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ranks_with_different_profiles_all_drop_them():
    """The fingerprint changes with what was loaded; drop_all leaves the built-in constants
    (the same on every rank) and is reported once."""
    empty_fp = profiles.fingerprint()
    save(make(gemm_us=400.0))
    profiles.load_for_device(GPU, SMS, "2.99.1")
    assert profiles.fingerprint() != empty_fp
    assert _core.profile_counts() != (0, 0)
    profiles.drop_all("test: ranks differ")
    assert _core.profile_counts() == (0, 0)
    dropped = profiles.fingerprint()
    profiles.drop_all("test: ranks differ")
    assert profiles.fingerprint() == dropped


def test_all_to_all_curves_change_the_all_to_all_prediction():
    matrix = [[8192, 8192], [8192, 8192]]
    before = flashoverlap.plan_gemm_all_to_all(matrix, 8192, 4096, sms=SMS)
    data = make()
    sizes = [1 << e for e in range(16, 31)]
    for overlapped in (True, False):
        data["collectives"].append({"collective": "all_to_all", "overlapped": overlapped, "max_ctas": 24,
                                    "bytes": sizes, "us": [200 + b / 20e3 for b in sizes]})
    save(data)
    profiles.load_for_device(GPU, SMS, "2.99.1")
    after = flashoverlap.plan_gemm_all_to_all(matrix, 8192, 4096, sms=SMS)
    # A much slower link: every candidate takes longer.
    assert all(after.predicted_us[g] > before.predicted_us[g] for g in before.predicted_us)


def test_overlapped_curves_of_another_cta_cap_are_skipped(caplog):
    """make() measures the overlapped curve with NCCL capped to 24 CTAs; a communicator capped to
    16 gets only the sequential curve, reported once."""
    save(make())
    with caplog.at_level(logging.WARNING, logger="flashoverlap"):
        profiles.load_for_device(GPU, SMS, "2.99.1", max_ctas=16)
    assert _core.profile_counts()[0] == 1
    assert sum("capped to 24 CTAs" in r.getMessage() for r in caplog.records) == 1
    profiles.reset()
    profiles.load_for_device(GPU, SMS, "2.99.1", max_ctas=24)
    assert _core.profile_counts()[0] == 2


def test_copy_engine_curves_do_not_depend_on_nccl():
    save(make(copy_engine_scale=1.0))
    profiles.load_for_device(GPU, SMS, "2.18.0")
    # The NCCL curves are another version's; the copy-engine ones still hold.
    assert _core.profile_counts() == (len(tune.COPY_ENGINE_CTAS), 0)


@pytest.mark.parametrize("op", ["gemm_all_reduce", "gemm_reduce_scatter"])
def test_auto_backend_follows_the_measured_curves(op):
    """Backend "auto" is the backend whose plan the predictor times faster: NCCL curves 50x slower
    than the copy engines' model make it the copy engines, 50x faster make it NCCL. The copy
    engines' own curves (one exchange timed alone) stay out of the overlapped model: even 50x
    faster ones do not change the answer."""
    shape, both = (8192, 8192, 3584), ["nccl", "copy_engine"]
    if op == "gemm_all_reduce":
        options = ("auto", None, None, 16, None, None, "auto", "auto", False)
    else:
        options = ("auto", None, None, 16, None, "auto")

    def choose(allowed=both):
        return _core.choose_backend(op, *shape, 2, "bfloat16", SMS, 9, options, allowed)

    for scale, expected in ((50.0, "copy_engine"), (1 / 50.0, "nccl")):
        profiles.reset()
        data = make(us_scale=scale, copy_engine_scale=1 / 50.0)
        for c in list(data["collectives"]):
            data["collectives"].append(dict(c, collective="reduce_scatter"))
        save(data)
        profiles.load_for_device(GPU, SMS, "2.99.1")
        assert choose() == expected, scale
    # Only one backend allowed: that one, whatever the curves say.
    assert choose(["nccl"]) == "nccl"
    with pytest.raises(ValueError, match="backend"):
        choose(["rdma"])
    with pytest.raises(ValueError, match="no backend"):
        choose([])
    with pytest.raises(ValueError, match="op"):
        _core.choose_backend("gemm", *shape, 2, "bfloat16", SMS, 9, options, both)


def test_plain_collectives_auto_follows_the_measured_curves():
    """flashoverlap.all_reduce(backend="auto") runs the backend tune measured faster at the size:
    with copy-engine curves 8 + b/100e3 us against NCCL's 20 + b/150e3, the copy engines below
    3.6 MB and NCCL above; no answer without both curves."""
    from flashoverlap.collectives import measured_faster

    assert measured_faster("all_reduce", 1 << 20, 2, SMS, 8) is None
    save(make(copy_engine_scale=1.0))
    profiles.load_for_device(GPU, SMS, "2.99.1")
    assert measured_faster("all_reduce", 1 << 20, 2, SMS, 8) == "copy_engine"
    assert measured_faster("all_reduce", 64 << 20, 2, SMS, 8) == "nccl"
    # No copy-engine curve on as few CTAs, none for ReduceScatter, none at another world size.
    assert measured_faster("all_reduce", 1 << 20, 2, SMS, 2) is None
    assert measured_faster("reduce_scatter", 1 << 20, 2, SMS, 8) is None
    assert measured_faster("all_reduce", 1 << 20, 4, SMS, 8) is None
    profiles.reset()
    save(make(copy_engine_scale=50.0))
    profiles.load_for_device(GPU, SMS, "2.99.1")
    assert measured_faster("all_reduce", 1 << 20, 2, SMS, 8) == "nccl"


def test_auto_backend_of_all_to_all_needs_the_matrix():
    options = (1, None, None, "auto")
    matrix = [[4096, 4096], [4096, 4096]]
    chosen = _core.choose_backend("gemm_all_to_all", 0, 8192, 4096, 2, "bfloat16", SMS, 9, options,
                                  ["nccl", "copy_engine"], matrix)
    assert chosen in ("nccl", "copy_engine")
    with pytest.raises(ValueError, match="matrix"):
        _core.choose_backend("gemm_all_to_all", 0, 8192, 4096, 2, "bfloat16", SMS, 9, options,
                             ["nccl", "copy_engine"])


def test_planning_without_a_gpu_resolves_auto_by_prediction():
    """plan_gemm_all_reduce(backend="auto") is the plan of the backend predicted fastest (push
    among them on 2 Hopper GPUs): the same as asking for that backend by name."""
    for shape in ((4096, 8192, 4096), (16384, 8192, 1024), (2048, 8192, 14336)):
        auto = flashoverlap.plan_gemm_all_reduce(*shape, 2, backend="auto")
        named = [flashoverlap.plan_gemm_all_reduce(*shape, 2, backend=b) for b in ("nccl", "copy_engine", "push")]
        assert auto.predicted_us in {p.predicted_us for p in named}
        assert auto.predicted_us <= 1.1 * min(p.predicted_us for p in named)
    # Beyond one node (more than 8 GPUs) only NCCL is a choice.
    big = flashoverlap.plan_gemm_all_reduce(4096, 8192, 4096, 16, backend="auto")
    assert big.predicted_us == flashoverlap.plan_gemm_all_reduce(4096, 8192, 4096, 16, backend="nccl").predicted_us


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_bundled_gemm_profiles_load_for_their_gpu(gpu):
    paths = profiles.load_for_device(gpu, SMS, "2.28.9")
    # One bundled file with GEMM times per GPU (one GPU's run); others hold collective curves.
    bundled = [p for p in paths if p.parent == profiles.bundled_dir() and profiles.read(p)["gemm"]]
    assert len(bundled) == 1, paths
    data = profiles.read(bundled[0])
    assert bundled[0].name == profiles.file_name(data["key"]) and data["meta"]["complete"]
    # Every kernel the planner may pick, on every CTA count it gives the GEMM, for each shape.
    entries = {(g["kernel"], g["ctas"], g["m"], g["n"], g["k"]) for g in data["gemm"]}
    shapes = {(m, n, k) for (_, _, m, n, k) in entries}
    # The 16 benchmark shapes; on H200 also the All-to-All bar's three N 4096 x K 14336 shapes.
    assert {s for s in shapes if s[1] == 8192} == {(m, 8192, k) for m in (2048, 4096, 8192, 16384)
                                                   for k in (1024, 3584, 4096, 14336)}
    assert len(shapes) == (19 if gpu == "NVIDIA H200" else 16)
    for shape in shapes:
        assert ("cublas", SMS, *shape) in entries
        for kernel in ("sm90_n128", "sm90_n256"):
            assert {c for (kern, c, *s) in entries if kern == kernel and tuple(s) == shape} == {108, 116, 124, 128}
    assert _core.profile_counts()[1] == len(data["gemm"])


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_bundled_two_gpu_curves_for_their_gpu(gpu):
    """Each GPU with a bundled 2-GPU profile has every curve the planner reads at world 2: NCCL's
    three collectives overlapped (capped at the reserved SMs' 24 CTAs) and alone, and the copy
    engines' AllReduce and ReduceScatter with sums on 4 and 8 CTAs."""
    name = profiles.file_name(profiles.make_key(gpu, SMS, 2, "2.28.9", "bfloat16"))
    data = profiles.read(profiles.bundled_dir() / name)
    assert data is not None and data["meta"]["complete"], name
    nccl = {(c["collective"], c["overlapped"]) for c in data["collectives"] if profiles.backend_of(c) == "nccl"}
    assert nccl == {(c, o) for c in ("all_reduce", "reduce_scatter", "all_to_all") for o in (True, False)}
    assert all(c["max_ctas"] == 24 for c in data["collectives"] if profiles.backend_of(c) == "nccl" and c["overlapped"])
    ce = sorted((c["collective"], c["ctas"]) for c in data["collectives"] if profiles.backend_of(c) == "copy_engine")
    assert ce == [("all_reduce", 4), ("all_reduce", 8), ("reduce_scatter", 4), ("reduce_scatter", 8)]


def _widths(n128_us, n256_us, mode="overlap", shape=(4096, 8192, 3584), **kw):
    """The tile width the planner takes for `shape` at world 2 (NCCL's 108 CTAs) once the profile
    times each width there (None: not timed)."""
    data = make()
    m, n, k = shape
    for kernel, us in (("sm90_n128", n128_us), ("sm90_n256", n256_us)):
        if us is not None:
            data["gemm"].append({"kernel": kernel, "ctas": 108, "m": m, "n": n, "k": k, "us": us})
    save(data)
    profiles.load_for_device(GPU, SMS, "2.99.1")
    plan = flashoverlap.plan_gemm_all_reduce(*shape, 2, sms=SMS, mode=mode, **kw)
    return plan.tile[1], plan


def test_a_clearly_faster_measured_width_is_taken():
    width, plan = _widths(400.0, 480.0)
    assert width == 128 and plan.schedule == "overlap"
    profiles.reset()
    assert _widths(480.0, 400.0)[0] == 256


@pytest.mark.parametrize("n128_us, n256_us", [(395.0, 400.0), (400.0, None), (None, 400.0)])
def test_the_default_width_stays_unless_both_are_timed_and_the_other_clearly_wins(n128_us, n256_us):
    # 1% faster is within run-to-run noise; a width timed alone has nothing to be compared with.
    assert _widths(n128_us, n256_us)[0] == 256


def test_the_width_never_turns_a_sequential_call_into_an_overlapped_one():
    # cuBLAS fast, the default width slow on the GEMM's CTAs: auto runs cuBLAS then NCCL. The
    # other width, timed as fast as cuBLAS, would make overlap pay on paper; it is not taken.
    shape = (4096, 8192, 4096)
    data = make(gemm_us=100.0)
    for kernel, us in (("sm90_n128", 100.0), ("sm90_n256", 1000.0)):
        data["gemm"].append({"kernel": kernel, "ctas": 108, "m": 4096, "n": 8192, "k": 4096, "us": us})
    save(data)
    profiles.load_for_device(GPU, SMS, "2.99.1")
    auto = flashoverlap.plan_gemm_all_reduce(*shape, 2, sms=SMS)
    assert auto.schedule == "sequential" and auto.tile[1] == 256
    forced = flashoverlap.plan_gemm_all_reduce(*shape, 2, sms=SMS, mode="overlap")
    assert forced.tile[1] == 128 and forced.predicted_us < auto.predicted_us


def test_a_named_kernel_is_kept_whatever_was_measured():
    assert _widths(100.0, 400.0, kernel="sm90_n256")[0] == 256


def test_plan_arguments_the_planner_refuses_are_named_without_a_traceback(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "4096x8192x4096", "--bands-per-group", "0"])
    assert exit_info.value.code == 2
    assert "plan: bands_per_group: expected an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["show", "4096x8192x4096", "--fused-norm", "--order", "swizzled", "--gpu", ""])
    assert "show: order: the fused norm needs whole rows" in capsys.readouterr().err


def test_plan_of_the_fused_norm_op(capsys):
    assert cli.main(["plan", "8192x8192x4096", "--mode", "overlap"]) == 0
    plain = capsys.readouterr().out
    assert cli.main(["plan", "8192x8192x4096", "--mode", "overlap", "--fused-norm"]) == 0
    normed = capsys.readouterr().out
    assert plain != normed  # the norm after each group is charged
