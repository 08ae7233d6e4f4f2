"""evaluation/cubin_sections.py without a GPU: per-kernel fingerprints of an NVRTC cubin tell a
change that leaves a kernel's machine code alone from one that does not. Needs NVRTC."""

from __future__ import annotations

import pytest

from evaluation_scripts import ROOT, load

sections_script = load("cubin_sections")

TWO_KERNELS = b"""
extern "C" __global__ void fo_probe_a(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 2.0f + 1.0f;
}
extern "C" __global__ void fo_probe_b(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] - 3.0f;
}
"""


@pytest.fixture(scope="module")
def nvrtc():
    try:
        return sections_script._nvrtc()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"NVRTC cannot be found: {e}")


def fingerprints(source: bytes, nvrtc, defines=()) -> dict:
    return sections_script.fingerprints(sections_script.compile_cubin(source, "probe.cu", "sm_90a", defines, nvrtc))


def test_each_kernel_has_its_own_sections(nvrtc):
    prints = fingerprints(TWO_KERNELS, nvrtc)
    for kernel in ("fo_probe_a", "fo_probe_b"):
        md5, size = prints[f".text.{kernel}"]
        assert size > 0 and len(md5) == 32
        assert f".nv.info.{kernel}" in prints
    assert prints[".text.fo_probe_a"] != prints[".text.fo_probe_b"]


def test_a_comment_changes_nothing_and_a_kernel_change_only_that_kernel(nvrtc):
    before = fingerprints(TWO_KERNELS, nvrtc)
    commented = TWO_KERNELS.replace(b"extern \"C\" __global__ void fo_probe_b",
                                    b"// b subtracts three\nextern \"C\" __global__ void fo_probe_b")
    assert sections_script.differing(before, fingerprints(commented, nvrtc)) == []
    changed = fingerprints(TWO_KERNELS.replace(b"x[i] - 3.0f", b"x[i] - 4.0f"), nvrtc)
    assert sections_script.differing(before, changed) == [".text.fo_probe_b"]


def test_a_define_reaches_the_compiler(nvrtc):
    source = b"""
#ifndef FO_SCALE
#define FO_SCALE 2
#endif
extern "C" __global__ void fo_probe_c(int* x) { x[threadIdx.x] *= FO_SCALE; }
"""
    assert fingerprints(source, nvrtc) == fingerprints(source, nvrtc, ["FO_SCALE=2"])
    assert fingerprints(source, nvrtc)[".text.fo_probe_c"] != fingerprints(source, nvrtc, ["FO_SCALE=3"])[".text.fo_probe_c"]


def test_the_norm_module_compares_with_itself(nvrtc, capsys):
    source = ROOT / "csrc" / "allreduce_rmsnorm.cu"
    defines = ["FO_BF16=1", "FO_THREADS=512", "FO_UNROLL=4", "FO_RING=0", "FO_RING_BYTES=196608"]
    assert sections_script.main([str(source), "-D", *defines, "--against", str(source)]) == 0
    assert "0 differ" in capsys.readouterr().out


def test_sections_rejects_what_is_not_a_64_bit_elf():
    with pytest.raises(ValueError):
        sections_script.sections(b"not an elf at all, just bytes" * 4)
