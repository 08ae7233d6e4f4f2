"""Finding NVRTC: the nvidia-* wheels torch installs, else CUDA_HOME."""

from __future__ import annotations

import glob
import logging
import os
import sys
from pathlib import Path

from . import _core

_loaded: str | None = None


def candidates() -> list[Path]:
    """Where libnvrtc may be, best first."""
    found: list[Path] = []
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        # CUDA 13 wheels put every library under nvidia/cu13; CUDA 12 wheels
        # have one folder per component.
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            found.extend(Path(p) for p in sorted(glob.glob(str(base / pattern))))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            for sub in ("lib64", "lib"):
                found.extend(Path(p) for p in sorted(glob.glob(os.path.join(home, sub, "libnvrtc.so*"))))
    return [p for p in found if ".alt." not in p.name and "builtins" not in p.name]


def ensure_loaded() -> str:
    """Loads NVRTC once and returns its path; a clear error if there is none."""
    global _loaded
    if _loaded is not None:
        return _loaded
    paths = candidates()
    if not paths:
        raise RuntimeError(
            "NVRTC was not found: flashoverlap compiles its kernels at run time with NVRTC. "
            "Install a CUDA build of torch (it brings the nvidia-cuda-nvrtc wheel), "
            "`pip install nvidia-cuda-nvrtc`, or set CUDA_HOME to a CUDA toolkit."
        )
    _core.load_nvrtc(str(paths[0]))
    _loaded = str(paths[0])
    logging.getLogger("flashoverlap").info("NVRTC %s from %s", ".".join(map(str, _core.nvrtc_version())), _loaded)
    return _loaded
