"""Run-time compilation of every csrc kernel with NVRTC, and the on-disk cubin
cache. Needs NVRTC (the nvidia-cuda-nvrtc wheel or a CUDA toolkit), no GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flashoverlap
from flashoverlap import _core, _nvrtc

ARCHES = ["sm_80", "sm_90a"]
ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def nvrtc_path() -> str:
    try:
        return _nvrtc.ensure_loaded()
    except RuntimeError as e:
        pytest.skip(f"NVRTC cannot be found: {e}")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvrtc_path: str) -> Path:
    """A fresh FLASHOVERLAP_CACHE_DIR; returns the folder the cubins land in."""
    root = tmp_path / "cache-root"
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(root))
    return root / "cubin-v1"


def cubins(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every cached cubin."""
    if not folder.exists():
        return {}
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob("*.cubin")}


def check_result(result) -> None:
    assert isinstance(result, list) and len(result) >= 2
    kernels = {kernel for kernel, _, _ in result}
    for kernel, defines, size in result:
        assert isinstance(kernel, str) and ":" in kernel, kernel
        source, entry = kernel.split(":", 1)
        assert source.endswith(".cu") and entry
        assert isinstance(size, int) and size > 0
    # Both element types of the GEMM are compiled.
    gemm = [(k, d) for k, d, _ in result if "gemm" in k]
    defines = {d for _, d in gemm}
    flags = [set(d.split(",")) for d in defines]
    assert any("FO_BF16=1" in f for f in flags) and any("FO_BF16=0" in f for f in flags), defines
    assert len(set((k, d) for k, d, _ in result)) == len(result), "a variant is listed twice"
    assert kernels


def test_cache_dir_follows_the_environment(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Path(_core.cache_dir()) == cache
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(cache.parent / "elsewhere"))
    assert Path(_core.cache_dir()) == cache.parent / "elsewhere" / "cubin-v1"


@pytest.mark.parametrize("arch", ARCHES)
def test_compile_writes_the_cache_then_reuses_it(cache: Path, arch: str) -> None:
    assert cubins(cache) == {}
    first = flashoverlap.compile_kernels(arch)
    check_result(first)
    written = cubins(cache)
    assert len(written) == len(first)
    for name in written:
        assert re.fullmatch(r"[0-9a-f]{64}\.cubin", name), name
        assert (cache / name).read_bytes()[:4] == ELF_MAGIC
    assert sorted(size for size, _ in written.values()) == sorted(size for _, _, size in first)
    # No temporary files are left behind.
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".cubin")] == []

    second = flashoverlap.compile_kernels(arch)
    assert second == first
    assert cubins(cache) == written, "a cache hit must not add or rewrite files"


def test_both_arches_share_one_cache(cache: Path) -> None:
    results = {arch: flashoverlap.compile_kernels(arch) for arch in ARCHES}
    for result in results.values():
        check_result(result)
    files = cubins(cache)
    assert len(files) == sum(len(r) for r in results.values())
    for arch in ARCHES:
        assert flashoverlap.compile_kernels(arch) == results[arch]
    assert cubins(cache) == files


def test_cached_cubins_are_what_is_returned(cache: Path) -> None:
    first = flashoverlap.compile_kernels("sm_80")
    sizes = sorted(size for _, _, size in first)
    files = sorted(cache.glob("*.cubin"))
    victim = files[0]
    original = victim.read_bytes()
    # A valid-looking cubin of a size no real one has is read back, not recompiled.
    planted = ELF_MAGIC + b"\0" * (max(sizes) + 1000)
    victim.write_bytes(planted)
    reread = sorted(size for _, _, size in flashoverlap.compile_kernels("sm_80"))
    assert len(planted) in reread
    # A corrupt entry is recompiled and replaced.
    victim.write_bytes(b"not a cubin")
    again = flashoverlap.compile_kernels("sm_80")
    assert sorted(size for _, _, size in again) == sizes
    assert victim.read_bytes() == original


def test_unwritable_cache_still_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvrtc_path: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache root is a file, so no folder can be made under it")
    monkeypatch.setenv("FLASHOVERLAP_CACHE_DIR", str(blocker))
    result = flashoverlap.compile_kernels("sm_80")
    check_result(result)
    assert blocker.read_text().startswith("the cache root")


def test_cache_is_shared_across_processes(cache: Path) -> None:
    first = flashoverlap.compile_kernels("sm_80")
    files = cubins(cache)
    script = (
        "import json, flashoverlap, flashoverlap._nvrtc as n; n.ensure_loaded(); "
        "print(json.dumps(flashoverlap.compile_kernels('sm_80')))"
    )
    env = dict(os.environ, FLASHOVERLAP_CACHE_DIR=str(cache.parent))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    other = [tuple(entry) for entry in json.loads(done.stdout.strip().splitlines()[-1])]
    assert other == first
    assert cubins(cache) == files


def test_bad_arch_is_a_clear_error(cache: Path) -> None:
    with pytest.raises(ValueError, match="^arch: no kernel targets"):
        flashoverlap.compile_kernels("sm_bogus")
    with pytest.raises(ValueError, match="^arch: no kernel targets"):
        flashoverlap.compile_kernels("sm_75")
    assert cubins(cache) == {}
    # The compiler is still usable afterwards.
    check_result(flashoverlap.compile_kernels("sm_80"))


def test_nvrtc_is_found_where_torch_put_it(nvrtc_path: str) -> None:
    assert Path(nvrtc_path).exists()
    assert "libnvrtc" in Path(nvrtc_path).name
    assert _nvrtc.ensure_loaded() == nvrtc_path
    assert Path(nvrtc_path) in _nvrtc.candidates()
    major, minor = _core.nvrtc_version()
    assert major >= 11 and minor >= 0


def test_extra_nvrtc_options_reach_the_compiler(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASHOVERLAP_NVRTC_OPTIONS: -lineinfo makes each cubin larger (its line table) and keys it
    apart from the plain one, so both stay cached side by side; a bad option is NVRTC's error."""
    plain = {k + d: size for k, d, size in flashoverlap.compile_kernels("sm_80")}
    monkeypatch.setenv("FLASHOVERLAP_NVRTC_OPTIONS", " -lineinfo ")
    lined = {k + d: size for k, d, size in flashoverlap.compile_kernels("sm_80")}
    assert lined.keys() == plain.keys()
    assert all(lined[k] > plain[k] for k in plain), (plain, lined)
    assert len(cubins(cache)) == 2 * len(plain)
    monkeypatch.setenv("FLASHOVERLAP_NVRTC_OPTIONS", "--no-such-option")
    with pytest.raises(RuntimeError, match="no-such-option"):
        flashoverlap.compile_kernels("sm_80")


def test_hidden_size_kernels_are_built_for_the_sizes_asked(cache: Path) -> None:
    """compile_kernels(hidden=...) builds all_reduce_rmsnorm's hidden-size kernels for those sizes
    (the one-shot entries' module of the default shape, both dtypes) and refuses sizes the op
    refuses, before compiling anything."""
    built = flashoverlap.compile_kernels("sm_80", hidden=[4096])
    sized = [(k, d) for k, d, _ in built if "FO_HIDDEN=" in d]
    assert sized and all("FO_HIDDEN=4096" in d for _, d in sized), sized
    assert {k for k, _ in sized} == {"allreduce_rmsnorm.cu:fo_arn_oneshot_st_h"}
    assert {("FO_BF16=1" in d) for _, d in sized} == {True, False}
    assert not [d for _, d, _ in flashoverlap.compile_kernels("sm_80", hidden=[]) if "FO_HIDDEN=" in d]
    for bad in ([4100], [0], [16392], [-8], [2**40], [4096.0], [4100.5], ["4096"], [None]):
        with pytest.raises(ValueError, match="hidden"):
            flashoverlap.compile_kernels("sm_80", hidden=bad)
    # A lone size or a string is not a list of sizes.
    for bad in (4096, "4096"):
        with pytest.raises(TypeError, match="hidden"):
            flashoverlap.compile_kernels("sm_80", hidden=bad)


def test_the_compile_command_refuses_bad_hidden_sizes(capsys: pytest.CaptureFixture) -> None:
    from flashoverlap import cli

    assert cli.main(["compile", "--arch", "sm_80", "--hidden", "4096,4100"]) == 2
    assert "hidden" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["compile", "--hidden", "4x"])
