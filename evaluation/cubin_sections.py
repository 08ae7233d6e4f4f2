"""Per-kernel fingerprints of a csrc/ module's NVRTC cubin, without a GPU: whether a change to a
kernel's source changed the machine code of each entry (its .text section) and of its metadata
(.nv.info / .nv.shared / .nv.constant0 sections).

A refactor whose every fingerprint matches the measured code's needs no new measurement; one that
changes a kernel's machine code does. Compiles the way the library does (NVRTC, -std=c++17, csrc/ on
the include path) with the -D defines given, for each --arch.

    python evaluation/cubin_sections.py csrc/allreduce_rmsnorm.cu -D FO_BF16=1 FO_THREADS=512 \\
        FO_UNROLL=4 FO_RING=0 FO_RING_BYTES=196608 [--arch sm_90a] [--against OLD.cu]

Prints "section md5 bytes" per section; with --against, compiles that file alike and lists only the
sections that differ (exit 1 if any does).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import struct
import sys
from pathlib import Path
from typing import Optional, Sequence

KERNEL_SECTIONS = (".text.", ".nv.info.", ".nv.shared.", ".nv.constant0.")
CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _nvrtc() -> ctypes.CDLL:
    from flashoverlap._nvrtc import candidates  # where the library finds it

    paths = candidates()
    if not paths:
        raise RuntimeError("NVRTC was not found (see flashoverlap._nvrtc)")
    return ctypes.CDLL(str(paths[0]))


def compile_cubin(source: bytes, name: str, arch: str, defines: Sequence[str], nvrtc=None) -> bytes:
    """The cubin NVRTC makes of `source` for `arch` with -D `defines`."""
    lib = nvrtc or _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None) != 0:
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}", "-std=c++17", f"-I{CSRC}"] + [f"-D{d}" for d in defines]
    args = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        if lib.nvrtcCompileProgram(prog, len(opts), args) != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{name} did not compile:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def sections(elf: bytes) -> dict[str, bytes]:
    """Every named section of a 64-bit little-endian ELF, by name."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i: int) -> tuple[int, int, int, int]:
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        return name, kind, offset, size

    _, _, str_off, str_size = header(shstrndx)
    names = elf[str_off:str_off + str_size]
    out = {}
    for i in range(1, shnum):
        name, kind, offset, size = header(i)
        label = names[name:names.index(b"\0", name)].decode()
        # SHT_NOBITS (8: shared memory) holds no bytes in the file: its size stands for them.
        out[label] = f"nobits:{size}".encode() if kind == 8 else elf[offset:offset + size]
    return out


def fingerprints(elf: bytes) -> dict[str, tuple[str, int]]:
    """(md5, bytes) of each kernel section (KERNEL_SECTIONS) of a cubin."""
    return {name: (hashlib.md5(data).hexdigest(), len(data))
            for name, data in sections(elf).items() if name.startswith(KERNEL_SECTIONS)}


def module_fingerprints(path: Path, arch: str, defines: Sequence[str], nvrtc=None) -> dict[str, tuple[str, int]]:
    return fingerprints(compile_cubin(path.read_bytes(), path.name, arch, defines, nvrtc))


def differing(a: dict, b: dict) -> list[str]:
    """Sections whose fingerprints differ, or that only one side has."""
    return sorted(name for name in set(a) | set(b) if a.get(name) != b.get(name))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("-D", dest="defines", nargs="*", default=[], help="NAME=VALUE defines")
    ap.add_argument("--arch", nargs="*", default=["sm_90a"])
    ap.add_argument("--against", type=Path, help="another version of the source: list what differs")
    args = ap.parse_args(argv)
    lib = _nvrtc()
    changed = False
    for arch in args.arch:
        new = module_fingerprints(args.source, arch, args.defines, lib)
        if args.against is None:
            for name, (md5, size) in sorted(new.items()):
                print(f"{arch} {name} {md5} {size}")
            continue
        old = module_fingerprints(args.against, arch, args.defines, lib)
        diff = differing(old, new)
        changed = changed or bool(diff)
        for name in diff:
            print(f"{arch} {name}: {old.get(name, ('absent', 0))} -> {new.get(name, ('absent', 0))}")
        print(f"{arch}: {len(new)} sections, {len(diff)} differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
