"""Machine profiles: what `flashoverlap tune` measured, stored as versioned JSON, and handed to
the planner (Rust) so that its predictions use measured collective curves and GEMM times
instead of built-in constants.

A profile file holds one (GPU model, SM count, world size, NCCL version, dtype) key:

    {"schema": 1,
     "key": {"gpu": "NVIDIA H200", "sms": 132, "world_size": 2, "nccl": "2.27.3", "dtype": "bfloat16"},
     "meta": {"date": ..., "torch": ..., "command": ..., "complete": true},
     "collectives": [{"collective": "all_reduce", "overlapped": true, "max_ctas": 24,
                      "bytes": [...], "us": [...]}, ...],
     "gemm": [{"kernel": "sm90_n128", "ctas": 108, "m": 4096, "n": 8192, "k": 4096, "us": 410.2}, ...]}

``overlapped``: the curve of the wave groups' collectives (this library's NCCL communicator,
capped to ``max_ctas``); else of the sequential schedule's collective (the ProcessGroup's own
communicator). An overlapped curve with ``"backend": "copy_engine"`` and ``"ctas": C`` is one
wave group's exchange on the copy engines with its sums on C CTAs (what backend "auto" weighs
against NCCL). GEMM kernel "cublas" is torch.matmul, the sequential schedule's GEMM.

Files live in ``<FLASHOVERLAP_CACHE_DIR>/profiles-v1/`` (written by `tune`) and in the package
(``flashoverlap/profiles/``, measured by the developers); a cache file wins over a bundled one of
the same key. A file that is corrupt, of another schema, or for another GPU is reported once
(logger "flashoverlap") and ignored; NCCL curves of another NCCL version are ignored the same way
(GEMM times and copy-engine curves do not depend on NCCL). Nothing here ever raises into an op.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional

from . import _core

SCHEMA = 1
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_to_all")
# Collectives whose wave groups the copy-engine backend sums (All-to-All only moves rows).
COPY_ENGINE_COLLECTIVES = ("all_reduce", "reduce_scatter")
DTYPES = ("bfloat16", "float16")
_log = logging.getLogger("flashoverlap")
_reported: set[str] = set()
_loaded: set[tuple[str, int]] = set()
_digest = hashlib.sha256()


def cache_dir() -> Path:
    root = os.environ.get("FLASHOVERLAP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "flashoverlap")
    return Path(root) / f"profiles-v{SCHEMA}"


def bundled_dir() -> Path:
    return Path(__file__).parent / "profiles"


def make_key(gpu: str, sms: int, world_size: int, nccl: str, dtype: str) -> dict[str, Any]:
    return {"gpu": gpu, "sms": int(sms), "world_size": int(world_size), "nccl": nccl, "dtype": dtype}


def file_name(key: dict[str, Any]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", key["gpu"].lower()).strip("-")
    return f"{slug}-{key['sms']}sm-w{key['world_size']}-nccl{key['nccl']}-{key['dtype']}.json"


def empty(key: dict[str, Any], meta: Optional[dict] = None) -> dict[str, Any]:
    return {"schema": SCHEMA, "key": key, "meta": dict(meta or {}, complete=False), "collectives": [], "gemm": []}


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def validate(data: Any) -> None:
    """Raises ValueError naming what is wrong with a profile's contents."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, this flashoverlap reads schema {SCHEMA}")
    key = data.get("key")
    if not isinstance(key, dict) or set(key) != {"gpu", "sms", "world_size", "nccl", "dtype"}:
        raise ValueError("key must have gpu, sms, world_size, nccl and dtype")
    if key["dtype"] not in DTYPES or not _positive(key["sms"]) or not _positive(key["world_size"]):
        raise ValueError(f"bad key {key}")
    for i, c in enumerate(data.get("collectives", [])):
        b, t = c.get("bytes"), c.get("us")
        if c.get("collective") not in COLLECTIVES or not isinstance(c.get("overlapped"), bool):
            raise ValueError(f"collectives[{i}]: collective must be one of {COLLECTIVES}, overlapped a bool")
        if not isinstance(b, list) or not isinstance(t, list) or len(b) != len(t) or len(b) < 2:
            raise ValueError(f"collectives[{i}]: bytes and us must be lists of equal length >= 2")
        if not all(_positive(v) for v in b + t) or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"collectives[{i}]: sizes must increase and times be > 0")
        if backend_of(c) not in ("nccl", "copy_engine"):
            raise ValueError(f"collectives[{i}]: backend must be 'nccl' or 'copy_engine'")
        if backend_of(c) == "copy_engine" and not (
                c["overlapped"] and c["collective"] in COPY_ENGINE_COLLECTIVES
                and isinstance(c.get("ctas"), int) and not isinstance(c["ctas"], bool) and c["ctas"] >= 1):
            raise ValueError(f"collectives[{i}]: a copy-engine curve is an overlapped "
                             f"{' or '.join(COPY_ENGINE_COLLECTIVES)} with ctas >= 1")
    for i, g in enumerate(data.get("gemm", [])):
        if not isinstance(g.get("kernel"), str) or not all(_positive(g.get(f)) for f in ("ctas", "m", "n", "k", "us")):
            raise ValueError(f"gemm[{i}]: needs kernel, ctas, m, n, k and us > 0")
        if g["ctas"] > key["sms"]:
            raise ValueError(f"gemm[{i}]: {g['ctas']} CTAs on a {key['sms']}-SM GPU")


def backend_of(curve: dict[str, Any]) -> str:
    """What moved a curve's bytes (files before copy-engine curves say nothing: NCCL)."""
    return curve.get("backend", "nccl")


def _report_once(path: Path, why: str) -> None:
    tag = f"{path}:{why}"
    if tag not in _reported:
        _reported.add(tag)
        _log.warning("flashoverlap profile %s ignored: %s", path, why)


def read(path: Path) -> Optional[dict[str, Any]]:
    """The profile in `path`, or None (reported once) where it is missing, unreadable or invalid."""
    try:
        with open(path) as f:
            data = json.load(f)
        validate(data)
        return data
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        _report_once(path, f"{type(e).__name__}: {e}")
        return None


def write(path: Path, data: dict[str, Any]) -> None:
    """Writes atomically (a reader sees the old file or the new one, never half of one)."""
    validate(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def candidates() -> Iterable[Path]:
    """Every profile file, cache first (it wins over a bundled one of the same key)."""
    for d in (cache_dir(), bundled_dir()):
        if d.is_dir():
            yield from sorted(d.glob("*.json"))


def register(data: dict[str, Any], nccl: Optional[str], max_ctas: Optional[int] = None,
             path: Optional[Path] = None) -> tuple[int, int]:
    """Hands a validated profile to the planner: its GEMM times, its copy-engine curves, and its
    NCCL curves where `nccl` (this process's NCCL version) is the one they were measured with. An
    overlapped NCCL curve measured under another CTA cap than `max_ctas` (the communicator's, when
    given) times another collective and is skipped (reported once). Returns (curves, GEMM
    samples) registered."""
    key = data["key"]
    curves = 0
    for c in data["collectives"]:
        copy_engine = backend_of(c) == "copy_engine"
        if not copy_engine and nccl != key["nccl"]:
            continue
        if (not copy_engine and c["overlapped"] and max_ctas is not None
                and c.get("max_ctas") not in (None, max_ctas)):
            _report_once(path or Path(file_name(key)),
                         f"its overlapped {c['collective']} curve was measured with NCCL capped to "
                         f"{c['max_ctas']} CTAs, this communicator caps to {max_ctas}; not used")
            continue
        _core.register_collective_curve(key["sms"], key["world_size"], c["collective"], c["overlapped"],
                                        [int(b) for b in c["bytes"]], [float(t) for t in c["us"]],
                                        c["ctas"] if copy_engine else None)
        curves += 1
    for g in data["gemm"]:
        _core.register_gemm_sample(g["kernel"], key["dtype"], key["sms"], int(g["ctas"]), int(g["m"]), int(g["n"]),
                                   int(g["k"]), float(g["us"]))
    return curves, len(data["gemm"])


def nccl_version() -> Optional[str]:
    try:
        code = _core.nccl_version()
    except Exception:
        return None
    # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch.
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def load_for_device(gpu: str, sms: int, nccl: Optional[str] = None, max_ctas: Optional[int] = None) -> list[Path]:
    """Registers every profile of this GPU model (once per process): the cache's and the bundled
    ones, a cache file shadowing a bundled file of the same name. `max_ctas`: the NCCL CTA cap of
    the communicator the overlapped curves are for (the first communicator's, as profiles load
    once). Returns the files used."""
    if (gpu, sms) in _loaded:
        return []
    _loaded.add((gpu, sms))
    nccl = nccl if nccl is not None else nccl_version()
    used, seen = [], set()
    for path in candidates():
        if path.name in seen:
            continue
        data = read(path)
        if data is None or data["key"]["gpu"] != gpu or data["key"]["sms"] != sms:
            continue
        seen.add(path.name)
        if any(backend_of(c) == "nccl" for c in data["collectives"]) and nccl != data["key"]["nccl"]:
            _report_once(path, f"its NCCL curves were measured with NCCL {data['key']['nccl']}, "
                               f"this process has {nccl}; using its GEMM times and copy-engine curves only")
        register(data, nccl, max_ctas, path)
        used.append(path)
        _digest.update(f"{path.name}:{nccl}:{max_ctas}:".encode())
        _digest.update(json.dumps(data, sort_keys=True).encode())
    if used:
        _log.info("flashoverlap profiles for %s: %s", gpu, ", ".join(str(p) for p in used))
    return used


def load_for_current_device() -> list[Path]:
    """load_for_device for torch's current CUDA device (no-op without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return load_for_device(props.name, props.multi_processor_count)


def fingerprint() -> str:
    """A digest of every profile registered in this process: ranks that plan a collective together
    must hold the same, or their plans (group counts, sizes) could differ and the collectives
    would not match."""
    return _digest.hexdigest()


def drop_all(why: str) -> None:
    """Unregisters every profile, for the rest of the process (plans use the built-in constants,
    which are the same on every rank), reported once."""
    global _digest
    _core.clear_profiles()
    _digest = hashlib.sha256(b"dropped")
    if why not in _reported:
        _reported.add(why)
        _log.warning("flashoverlap profiles dropped: %s", why)


def reset() -> None:
    """Forgets what was registered and loaded (tests; after `tune` wrote new files)."""
    global _digest
    _core.clear_profiles()
    _loaded.clear()
    _reported.clear()
    _digest = hashlib.sha256()
