"""`flashoverlap tune`: measures this machine's profile (see flashoverlap.profiles) and writes it
to the cache dir, where every later process on this GPU model finds it.

What it measures, each item timed with CUDA events after warm-up (median; the maximum over
ranks for collectives):

* per collective (AllReduce, ReduceScatter) at the world size, the time vs input size from
  64 KiB to 512 MiB (two samples per octave), twice: on flashoverlap's capped NCCL
  communicator (what each wave group's collective costs) and on the ProcessGroup's own
  (what the sequential schedule's one collective costs); where every rank is on one node, also
  one wave group's exchange on the copy engines with its sums on 4 and 8 CTAs (what backend
  "auto" weighs against NCCL);
* per shape, flashoverlap's GEMM kernels on the CTA counts the planner may give them (every SM
  minus 24, 16, 8 or 4 reserved), and torch.matmul on all SMs.

The file is rewritten after every item, so an interrupted run resumes where it stopped (run
the same command again; --fresh starts over). Collectives need --world-size >= 2 (spawned
processes, one per GPU); with 1 only the GEMM part is measured.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import _core, profiles

# Row-parallel layers of Llama-3-70B (hidden 8192, MLP 28672) under tensor parallelism: the
# attention output projection (K = 8192 / TP) and the MLP down projection (K = 28672 / TP).
PRESET_MODELS = {"llama-3-70b": (8192, 28672), "llama-3-8b": (4096, 14336)}
PRESET_TOKENS = (2048, 4096, 8192, 16384)
SIZES = sorted({int(f * (1 << e)) for e in range(16, 30) for f in (1.0, 1.5)})
RESERVATIONS = (24, 16, 8, 4)
# Reduction CTAs of the copy-engine curves: the SM reservations that backend may plan with.
COPY_ENGINE_CTAS = tuple(_core.COPY_ENGINE_RESERVED_SMS)


def preset_shapes(name: str) -> tuple[int, list[tuple[int, int, int]]]:
    """'llama-3-70b-tp2' -> (2, [(M, N, K), ...])."""
    model, _, tp = name.rpartition("-tp")
    if model not in PRESET_MODELS or not tp.isdigit() or int(tp) < 1:
        choices = ", ".join(f"{m}-tp<N>" for m in PRESET_MODELS)
        raise ValueError(f"preset: expected one of {choices}, got {name!r}")
    hidden, mlp = PRESET_MODELS[model]
    world = int(tp)
    if hidden % world or mlp % world:
        raise ValueError(f"preset: {model} does not split over {world} ranks")
    return world, [(m, hidden, k) for m in PRESET_TOKENS for k in (hidden // world, mlp // world)]


def gemm_items(shapes: Sequence[tuple[int, int, int]], kernels: Sequence[str], sms: int) -> list[dict]:
    items = []
    for m, n, k in shapes:
        items.append({"kind": "gemm", "kernel": "cublas", "ctas": sms, "m": m, "n": n, "k": k})
        for kernel in kernels:
            for r in RESERVATIONS:
                items.append({"kind": "gemm", "kernel": kernel, "ctas": sms - r, "m": m, "n": n, "k": k})
    return items


def collective_items(ops: Sequence[str], world: int, copy_engine: bool = True) -> list[dict]:
    """NCCL curves of each collective in `ops` (overlapped and sequential), then the copy-engine
    curves of those the copy engines sum (where `copy_engine`: every rank on one node)."""
    if world < 2:
        return []
    items = [{"kind": "collective", "collective": op, "overlapped": o} for op in ops if op in profiles.COLLECTIVES
             for o in (True, False)]
    if copy_engine:
        items += [{"kind": "collective", "collective": op, "overlapped": True, "backend": "copy_engine", "ctas": c}
                  for op in ops if op in profiles.COPY_ENGINE_COLLECTIVES for c in COPY_ENGINE_CTAS]
    return items


_CURVE_FIELDS = ("collective", "overlapped", "backend", "ctas")


def _curve_id(c: dict) -> tuple:
    return (c["collective"], c["overlapped"], profiles.backend_of(c), c.get("ctas"))


def item_done(profile: dict, item: dict) -> bool:
    if item["kind"] == "gemm":
        return any(all(g[f] == item[f] for f in ("kernel", "ctas", "m", "n", "k")) for g in profile["gemm"])
    return any(_curve_id(c) == _curve_id(item) for c in profile["collectives"])


def record(profile: dict, item: dict, value: Any) -> None:
    if item["kind"] == "gemm":
        profile["gemm"].append({f: item[f] for f in ("kernel", "ctas", "m", "n", "k")} | {"us": value})
    else:
        profile["collectives"].append({f: item[f] for f in _CURVE_FIELDS if f in item} | value)


class Progress:
    """One line on stderr: a bar, the count, the item and an ETA from the mean time per item so far."""

    def __init__(self, total: int, done: int, stream=sys.stderr):
        self.total, self.done, self.start_done = total, done, done
        self.t0 = time.monotonic()
        self.stream = stream

    def line(self, label: str) -> str:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        elapsed = time.monotonic() - self.t0
        measured = self.done - self.start_done
        eta = elapsed / measured * (self.total - self.done) if measured else float("nan")
        eta_text = "?" if eta != eta else f"{int(eta) // 60}:{int(eta) % 60:02d}"
        return (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{label[:48]:48} elapsed {int(elapsed) // 60}:{int(elapsed) % 60:02d} ETA {eta_text}")

    def step(self, label: str) -> None:
        self.done += 1
        end = "\n" if self.done == self.total else ""
        print("\r" + self.line(label), end=end, file=self.stream, flush=True)


def run_items(profile: dict, items: list[dict], measure: Callable[[dict], Any], save: Callable[[dict], None],
              progress: Optional[Progress]) -> None:
    """Measures every item not yet in `profile`, saving after each (resumable). `measure` is
    collective across ranks where items are; every rank runs the same items in the same order."""
    for item in items:
        if item_done(profile, item):
            continue
        value = measure(item)
        record(profile, item, value)
        save(profile)
        if progress is not None:
            progress.step(label(item))


def label(item: dict) -> str:
    if item["kind"] == "gemm":
        return f"gemm {item['kernel']} {item['m']}x{item['n']}x{item['k']} @{item['ctas']} CTAs"
    if profiles.backend_of(item) == "copy_engine":
        return f"{item['collective']} (copy engines, sums on {item['ctas']} CTAs)"
    return f"{item['collective']} ({'overlapped' if item['overlapped'] else 'sequential'})"


def summary(profile: dict) -> str:
    lines = [f"# profile {profiles.file_name(profile['key'])}"]
    for c in profile["collectives"]:
        which = "overlapped (flashoverlap's communicator)" if c["overlapped"] else "sequential (the group's own)"
        if profiles.backend_of(c) == "copy_engine":
            which = f"one group on the copy engines (sums on {c['ctas']} CTAs)"
        lines.append(f"{c['collective']} {which}:")
        for b, t in zip(c["bytes"], c["us"]):
            if b & (b - 1) == 0 and b >= 1 << 20:
                lines.append(f"  {b / 2**20:8.0f} MiB {t:9.1f} us {b / t / 1e3:7.1f} GB/s (input per rank / time)")
    if profile["gemm"]:
        lines.append(f"{'GEMM':>28} {'CTAs':>5} {'us':>9} {'TFLOP/s':>8}")
        for g in profile["gemm"]:
            tf = 2 * g["m"] * g["n"] * g["k"] / g["us"] / 1e6
            lines.append(f"{g['kernel']:>10} {g['m']:>5}x{g['n']}x{g['k']:<6} {g['ctas']:>5} {g['us']:9.1f} {tf:8.1f}")
    return "\n".join(lines)


# ---- measurement (GPU) ----


def _median_us(fn: Callable[[int], object], iters: int, warmup: int = 3) -> float:
    """Median device time of fn(i) over `iters` calls after `warmup`, timed as the benchmarks time
    ops (bench.interleaved_times_us): the calls queued behind GPU load, so that neither the host's
    launch latency (synchronizing after every call, as this did first, timed 2048x8192x1024 GEMMs
    on H200 at 92 us instead of 62) nor an idle GPU's boost (a loaded H200 runs large GEMMs ~15%
    slower after 40-70 ms) is in the profile: ops inside a model run in that loaded steady state.
    evaluation/tune_timing.py compares the ways."""
    from .bench import interleaved_times_us

    return statistics.median(interleaved_times_us({"fn": fn}, iters, warmup)["fn"])


def _measure_gemm(item: dict, dtype, iters: int) -> float:
    import torch

    import flashoverlap

    m, n, k = item["m"], item["n"], item["k"]
    sets = max(2, min(4, (256 << 20) // ((m * k + n * k) * 2)))
    xs = [torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(sets)]
    if item["kernel"] == "cublas":
        return _median_us(lambda i: torch.matmul(xs[i % sets], ws[i % sets].t()), iters)
    return _median_us(lambda i: flashoverlap.gemm(xs[i % sets], ws[i % sets], kernel=item["kernel"],
                                                  sms=item["ctas"]), iters)


def _curve_us(fn_at: Callable[[int], Callable[[int], object]], iters: int) -> list[float]:
    """The time of fn_at(size) at every size of SIZES (fewer calls above 64 MiB), the maximum over
    ranks: a collective ends when its slowest rank does."""
    from .bench import _max_over_ranks

    return [_max_over_ranks(_median_us(fn_at(size), iters if size <= 64 << 20 else max(5, iters // 3)))
            for size in SIZES]


def _measure_collective(item: dict, dtype, iters: int, comm) -> dict:
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    elem = torch.finfo(dtype).bits // 8
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    buf = torch.randn(SIZES[-1] // elem, device="cuda", dtype=dtype) * 1e-3
    stream = torch.cuda.current_stream().cuda_stream
    if profiles.backend_of(item) == "copy_engine":
        return _measure_copy_engine(item, buf, name, stream, iters, comm)
    out = torch.empty(SIZES[-1] // elem // world, device="cuda", dtype=dtype)
    full = torch.empty(SIZES[-1] // elem, device="cuda", dtype=dtype) if item["collective"] == "all_to_all" else None

    def fn_at(size: int) -> Callable[[int], object]:
        count = size // elem
        x = buf[:count]
        if item["collective"] == "all_reduce":
            return ((lambda i: _core.all_reduce(comm.name, x.data_ptr(), count, name, stream)) if item["overlapped"]
                    else (lambda i: dist.all_reduce(x)))
        if item["collective"] == "reduce_scatter":
            recv = out[:count // world]
            return ((lambda i: _core.reduce_scatter(comm.name, x.data_ptr(), recv.data_ptr(), count // world, name,
                                                    stream)) if item["overlapped"]
                    else (lambda i: dist.reduce_scatter_tensor(recv, x)))
        # Uniform splits: count / world elements to every rank, received into a buffer as large.
        recv = full[:count // world * world]
        return ((lambda i: _core.all_to_all(comm.name, x.data_ptr(), recv.data_ptr(), count // world, name,
                                            stream)) if item["overlapped"]
                else (lambda i: dist.all_to_all_single(recv, x[:recv.numel()])))

    return {"max_ctas": comm.max_ctas, "bytes": SIZES, "us": _curve_us(fn_at, iters)}


def _measure_copy_engine(item: dict, buf, name: str, stream: int, iters: int, comm) -> dict:
    """One wave group's exchange on the copy engines (a single chunk, as an overlapped op moves
    each group), its sums on item["ctas"] CTAs, vs the input bytes per rank."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    kind = item["collective"]
    # What each rank receives: the whole input (AllReduce) or its shard (ReduceScatter).
    per_slot = SIZES[-1] if kind == "all_reduce" else SIZES[-1] // world
    comm.ensure_peer_buffers(per_slot)
    dst = torch.empty(per_slot // buf.element_size(), device=buf.device, dtype=buf.dtype)

    def fn_at(size: int) -> Callable[[int], object]:
        return lambda i: _core.copy_engine_collective(comm.name, kind, buf.data_ptr(), dst.data_ptr(), size, name,
                                                      item["ctas"], stream, 1)

    return {"bytes": SIZES, "us": _curve_us(fn_at, iters)}


def _target(key: dict, out: Optional[str]) -> Path:
    return Path(out) if out else profiles.cache_dir() / profiles.file_name(key)


def _start_profile(path: Path, key: dict, fresh: bool) -> dict:
    existing = None if fresh else profiles.read(path)
    if existing is not None and existing["key"] == key:
        return existing
    return profiles.empty(key, {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                "command": " ".join(["flashoverlap"] + sys.argv[1:])})


def _worker(rank, world, init_method, items, dtype_name, iters, out, fresh, result_path):
    import torch
    import torch.distributed as dist

    import flashoverlap
    from . import bench

    bench.init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    try:
        comm = flashoverlap.get_communicator()
        key = machine_key(world, dtype_name)
        path = _target(key, out)
        profile = _start_profile(path, key, fresh)
        if not comm.one_node:
            # Off one node the copy engines cannot reach the peers: NCCL only.
            items = [i for i in items if profiles.backend_of(i) != "copy_engine"]
        # Every rank runs the items rank 0's file still lacks, in the same order.
        box = [[i for i in items if not item_done(profile, i)]]
        dist.broadcast_object_list(box, src=0)
        pending = box[0]
        progress = Progress(len(items), len(items) - len(pending)) if rank == 0 else None

        def measure(item):
            if item["kind"] == "gemm":
                return _measure_gemm(item, dtype, iters)
            return _measure_collective(item, dtype, iters, comm)

        save = (lambda p: profiles.write(path, p)) if rank == 0 else (lambda p: None)
        run_items(profile, pending, measure, save, progress)
        if rank == 0:
            profile["meta"]["complete"] = True
            profiles.write(path, profile)
            with open(result_path, "w") as f:
                json.dump({"path": str(path), "profile": profile}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def machine_key(world: int, dtype_name: str) -> dict:
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return profiles.make_key(props.name, props.multi_processor_count, world, profiles.nccl_version() or "none",
                             dtype_name)


def tune(shapes: Sequence[tuple[int, int, int]], world: int, ops: Sequence[str], dtype_name: str = "bfloat16",
         iters: int = 20, out: Optional[str] = None, fresh: bool = False) -> tuple[Path, dict]:
    import torch

    from . import bench

    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        raise RuntimeError(f"tune: needs {world} CUDA device(s), found "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    props = torch.cuda.get_device_properties(0)
    kernels = ["sm90_n128", "sm90_n256"] if props.major == 9 else ["sm80"]
    items = (collective_items(ops, world) + (gemm_items(shapes, kernels, props.multi_processor_count)
                                            if "gemm" in ops else []))
    os.environ.update(bench.SAFE_ENV)
    data = bench.spawn_ranks(_worker, world, items, dtype_name, iters, out, fresh)
    profiles.reset()
    return Path(data["path"]), data["profile"]
