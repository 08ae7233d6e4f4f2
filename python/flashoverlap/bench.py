"""GEMM + AllReduce benchmark on all local GPUs, one process per GPU, with
the baselines measured in the same run.

Every number is the median of CUDA-event-timed runs after warm-up, on random
data, with inputs rotated across several buffers so that repeated runs do not
measure the L2 cache. Rank 0 reports the maximum over ranks of each median
(a collective finishes when its slowest rank does).
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch

# NVLink multicast stays off wherever this library starts processes.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

ROUNDS = 3
# torch.cuda._sleep's cycles per second, roughly (H100/H200 SM clocks run at ~2 GHz).
SLEEP_CYCLES_PER_S = 2e9
# GPU time of back-to-back load before a timed loop: a loaded H200 slows ~15% after 40-70 ms
# (evaluation/results/tune_timing_h200.txt). Ops inside a model run in that steady state, so
# benchmarks and tune's profiles time them there.
SETTLE_S = 0.15

DEFAULT_SHAPES = [(4096, 8192, 4096), (8192, 8192, 1024), (8192, 8192, 3584), (16384, 8192, 4096)]


@dataclass
class Row:
    m: int
    n: int
    k: int
    dtype: str
    world_size: int
    cublas_gemm_us: float
    flashoverlap_gemm_us: float
    nccl_all_reduce_us: float
    sequential_us: float
    flashoverlap_us: float
    speedup: float
    schedule: str
    groups: int
    predicted_us: float
    rel_error: float
    # The mechanism itself: forced overlap against flashoverlap's own GEMM
    # followed by NCCL (what overlap hides, whatever the GEMM's speed).
    forced_overlap_us: float
    forced_overlap_groups: int
    overlap_gain: float
    forced_overlap_rel_error: float
    # The naive reference: cuBLAS and an NCCL AllReduce of an unrelated
    # buffer of the output's size, launched together on two streams with no
    # dependency between them.
    concurrent_us: float
    concurrent_speedup: float
    # The same with the AllReduce enqueued first, so its CTAs are resident
    # before the GEMM's fill the GPU.
    concurrent_nccl_first_us: float
    concurrent_nccl_first_speedup: float
    # The backend "fo" and "forced" ran with (the default, "auto"), and the
    # same op with the NCCL backend.
    backend: str
    flashoverlap_nccl_us: float
    speedup_nccl: float
    schedule_nccl: str
    forced_overlap_nccl_us: float
    # The same op with the copy-engine backend (issue 8's bar is for it alone).
    flashoverlap_ce_us: float
    speedup_ce: float
    schedule_ce: str
    forced_overlap_ce_us: float
    # The same with backend="push" (2 Hopper ranks; NaN where it cannot run).
    flashoverlap_push_us: float = math.nan
    speedup_push: float = math.nan
    schedule_push: str = "n/a"
    forced_overlap_push_us: float = math.nan


def call_times_us(fn: Callable[[int], object], calls: int, *, first: int = 0, sleep_cycles: int = 0,
                  sync: bool = False) -> list[float]:
    """Each call's time of fn(first), fn(first + 1), ... with CUDA events, the calls queued back to
    back; sleep_cycles: a GPU sleep enqueued before each call; sync: wait for each call before
    enqueuing the next (the host's latency is then timed too)."""
    pairs = []
    for turn in range(first, first + calls):
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(turn)
        end.record()
        if sync:
            end.synchronize()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1000.0 for s, e in pairs]


_LOAD: dict = {}  # device index -> (operand, output, seconds per load GEMM)


def _load_gemm() -> tuple:
    dev = torch.cuda.current_device()
    if dev not in _LOAD:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(a)
        per_s = statistics.median(call_times_us(lambda i: torch.matmul(a, a, out=out), 5)) * 1e-6
        _LOAD[dev] = (a, out, max(per_s, 1e-5))
    return _LOAD[dev]


def keep_busy(calls: int) -> None:
    """Enqueues `calls` cuBLAS GEMMs (4096^3 bf16, ~0.2 ms each) on the current stream: every SM
    and the memory stay loaded, as under a model's stream of kernels, while the host gets ahead
    of the GPU by ~0.2 ms per few microseconds spent here."""
    a, out, _ = _load_gemm()
    for _ in range(calls):
        torch.matmul(a, a, out=out)


def _ranks_backend() -> Optional[str]:
    """The backend of the default process group where several ranks time together, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_backend()
    return None


def load_calls(*seconds: float) -> list[int]:
    """The number of load GEMMs for each duration; the same on every rank of an initialized
    process group (the largest), so that ranks reach their first collective together."""
    per_s = _load_gemm()[2]
    counts = [max(1, round(s / per_s)) for s in seconds]
    backend = _ranks_backend()
    if backend is not None:
        import torch.distributed as dist

        t = torch.tensor(counts, device="cuda" if backend == "nccl" else "cpu", dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        counts = [int(c) for c in t.tolist()]
    return counts


def _gpu_aligner() -> Optional[Callable[[], None]]:
    """Where ranks of an NCCL process group time together: a one-element AllReduce to enqueue after
    each head start, so that every rank's GPU starts the round together (the same load runs a little
    faster on one GPU than on another; without it the first collective of a round would time that
    skew on the faster rank, and the maximum over ranks would report it). It blocks no host. Not
    under gloo, which runs on the host: it would align the hosts, not the GPUs."""
    if _ranks_backend() != "nccl":
        return None
    import torch.distributed as dist

    token = torch.zeros(1, device="cuda")
    return lambda: dist.all_reduce(token)


def schedule_of(plan) -> tuple:
    """(schedule, group count, predicted us) of a GEMM + AllReduce plan as the call runs it:
    "gathered" where it runs the gathered AllReduce (plan.gathered) instead of the plan."""
    if plan.gathered is not None:
        return "gathered", plan.gathered["groups"], plan.gathered["predicted_us"]
    return plan.schedule, len(plan.groups), plan.predicted_us


def interleaved_times_us(fns: dict[str, Callable[[int], object]], iters: int, warmup: int) -> dict[str, list[float]]:
    """Per-iteration times of each function, their iterations interleaved (A B C A B C ...)
    so that clock and thermal drift over the run affects every variant alike. Each call
    gets the next operand-set index, so no call finds its inputs in L2 from the call before.
    The GPU is kept loaded throughout (SETTLE_S of load first, load between rounds), so the
    times are those of its steady state under load, where tune's GEMM profile is taken. Ranks
    of a process group must call it together, with the same variants: they agree on the load
    and, under NCCL, start each round together."""
    turn = 0
    enqueue_s = 0.0  # the host's time to enqueue a round: each variant's fastest warm-up call
    for name, fn in fns.items():
        fastest = math.inf
        for _ in range(warmup):
            t0 = time.perf_counter()
            fn(turn)
            fastest = min(fastest, time.perf_counter() - t0)
            turn += 1
        enqueue_s += fastest if math.isfinite(fastest) else 0.0
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    # A head start for the host before each round, as GPU load for 1.5x the host's time to
    # enqueue a round (1 to 20 ms): on tiny shapes the GPU then runs a queue of enqueued work
    # instead of waiting on the host between events (14 candidates of ~60 us each outran a fixed
    # 1 ms: the last ones timed the host). Load, not a sleep: a GPU that idles between rounds
    # leaves the steady state and times large GEMMs 5-12% fast (tune_timing_h200.txt, "mixed").
    settle, head_start = load_calls(SETTLE_S, min(20e-3, max(1e-3, 1.5 * enqueue_s)))
    align = _gpu_aligner()
    keep_busy(settle)
    for _ in range(iters):
        keep_busy(head_start)
        if align is not None:
            align()
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(turn)
            turn += 1
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) * 1000.0 for s, e in pairs] for name, pairs in events.items()}


def geo_min(rows: Sequence[dict], key: str) -> tuple[float, float]:
    """(geometric mean, min) of rows[i][key] over the rows where it is not NaN (a variant that
    could not run); (nan, nan) where none is."""
    vals = [r[key] for r in rows if not math.isnan(r[key])]
    return (statistics.geometric_mean(vals), min(vals)) if vals else (math.nan, math.nan)


def _max_over_ranks(v: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def input_sets(bytes_per_set: int) -> int:
    """How many operand sets a benchmark rotates through so that no call finds its inputs in the L2
    from the call before (60 MB on H200): enough to cover 256 MiB, 2 to 8."""
    return max(2, min(8, (256 << 20) // max(bytes_per_set, 1)))


def measure_round(m: int, n: int, k: int, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
    """One round of one shape: (per-iteration times of every variant, plan and error facts).
    Runs on every rank; all ranks must call it with the same arguments."""
    import torch.distributed as dist

    import flashoverlap

    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    sets = input_sets((m * k + n * k) * 2)
    xs = [torch.randn(m, k, device="cuda", dtype=dtype, generator=gen) for _ in range(sets)]
    ws = [torch.randn(n, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(sets)]
    buf = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)

    def cublas(i: int):
        return torch.matmul(xs[i % sets], ws[i % sets].t())

    def ours_gemm(i: int):
        return flashoverlap.gemm(xs[i % sets], ws[i % sets])

    side = torch.cuda.Stream(priority=-1)
    unrelated = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)

    def concurrent(nccl_first: bool) -> Callable[[int], torch.Tensor]:
        """cuBLAS on the current stream and an AllReduce of `unrelated` on the side stream, no
        dependency between them, the AllReduce enqueued first or second."""
        def run(i: int) -> torch.Tensor:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            if nccl_first:
                with torch.cuda.stream(side):
                    dist.all_reduce(unrelated)
            out = torch.matmul(xs[i % sets], ws[i % sets].t())
            if not nccl_first:
                with torch.cuda.stream(side):
                    dist.all_reduce(unrelated)
            main.wait_stream(side)
            return out
        return run

    def nccl(i: int):
        dist.all_reduce(buf)

    def sequential(i: int):
        out = torch.matmul(xs[i % sets], ws[i % sets].t())
        dist.all_reduce(out)
        return out

    def op(**kwargs) -> Callable[[int], torch.Tensor]:
        """flashoverlap.gemm_all_reduce on the i-th input set with these options."""
        def run(i: int) -> torch.Tensor:
            return flashoverlap.gemm_all_reduce(xs[i % sets], ws[i % sets], **kwargs)
        return run

    overlapped, forced = op(), op(mode="overlap")
    overlapped_nccl, forced_nccl = op(backend="nccl"), op(mode="overlap", backend="nccl")

    # Correctness of the exact calls being timed, against fp32.
    ref = xs[0].float() @ ws[0].float().t()
    dist.all_reduce(ref)
    def error(out: torch.Tensor) -> float:
        return float((out.float() - ref).norm() / ref.norm())

    def optional(backend: str, what: str) -> tuple[list, tuple]:
        """([error of the auto call], (auto call, forced call)) on a backend these ranks may be
        unable to run (their columns are then NaN): ([], ()) where it refuses."""
        auto = op(backend=backend)
        try:
            return [error(auto(0))], (auto, op(mode="overlap", backend=backend))
        except (ValueError, RuntimeError) as e:
            print(f"rank {rank}: no {what} columns ({e})", flush=True)
            return [], ()

    rel = error(overlapped(0))
    # The copy engines need every rank on one node with peer access; push, 2 Hopper ranks of one node.
    ce_errors, with_ce = optional("copy_engine", "copy-engine")
    push_errors, with_push = optional("push", "push")
    rel_forced = max([error(f(0)) for f in (forced, overlapped_nccl, forced_nccl, *with_ce[1:], *with_push[1:])]
                     + ce_errors + push_errors)
    plan = flashoverlap.plan_of(xs[0], ws[0])
    forced_plan = flashoverlap.plan_of(xs[0], ws[0], mode="overlap")
    nccl_plan = flashoverlap.plan_of(xs[0], ws[0], backend="nccl")
    ce_schedule = schedule_of(flashoverlap.plan_of(xs[0], ws[0], backend="copy_engine"))[0] if with_ce else "n/a"
    push_schedule = schedule_of(flashoverlap.plan_of(xs[0], ws[0], backend="push"))[0] if with_push else "n/a"

    dist.barrier()
    times = interleaved_times_us({"cublas": cublas, "ours_gemm": ours_gemm, "nccl": nccl, "seq": sequential,
                                   "fo": overlapped, "forced": forced, "fo_nccl": overlapped_nccl,
                                   "forced_nccl": forced_nccl,
                                   **dict(zip(("fo_ce", "forced_ce"), with_ce)),
                                   **dict(zip(("fo_push", "forced_push"), with_push)),
                                   "concurrent": concurrent(False),
                                   "concurrent_nccl_first": concurrent(True)}, iters, warmup)
    from . import ops

    comm = flashoverlap.get_communicator()
    schedule, groups, predicted = schedule_of(plan)
    facts = {"schedule": schedule, "groups": groups, "predicted_us": predicted,
             "rel": rel, "rel_forced": rel_forced, "forced_groups": schedule_of(forced_plan)[1],
             "backend": ops.backend_of(xs[0], ws[0], communicator=comm), "schedule_nccl": nccl_plan.schedule,
             "schedule_ce": ce_schedule, "schedule_push": push_schedule}
    return times, facts


def make_row(m: int, n: int, k: int, dtype: torch.dtype, raw: dict[str, list[float]], facts: dict) -> Row:
    """The row of a shape from its pooled per-iteration times (median per variant, max over ranks)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    times = {name: _max_over_ranks(statistics.median(v)) for name, v in raw.items()}
    times.setdefault("fo_ce", math.nan)
    times.setdefault("forced_ce", math.nan)
    times.setdefault("fo_push", math.nan)
    times.setdefault("forced_push", math.nan)
    return Row(m, n, k, str(dtype).replace("torch.", ""), world, times["cublas"], times["ours_gemm"], times["nccl"],
               times["seq"], times["fo"], times["seq"] / times["fo"], facts["schedule"], facts["groups"],
               facts["predicted_us"], _max_over_ranks(facts["rel"]), times["forced"], facts["forced_groups"],
               (times["ours_gemm"] + times["nccl"]) / times["forced"], _max_over_ranks(facts["rel_forced"]),
               times["concurrent"], times["seq"] / times["concurrent"], times["concurrent_nccl_first"],
               times["seq"] / times["concurrent_nccl_first"], facts["backend"], times["fo_nccl"],
               times["seq"] / times["fo_nccl"], facts["schedule_nccl"], times["forced_nccl"], times["fo_ce"],
               times["seq"] / times["fo_ce"], facts["schedule_ce"], times["forced_ce"], times["fo_push"],
               times["seq"] / times["fo_push"], facts.get("schedule_push", "n/a"), times["forced_push"])


def pooled_rounds(measure: Callable, shapes, dtype: torch.dtype, iters: int, warmup: int) -> tuple[dict, dict]:
    """Runs ``measure(m, n, k, dtype, iters, warmup) -> (times, facts)`` over all shapes: one
    discarded pass first, then ROUNDS passes whose per-iteration times are pooled per shape. On
    these machines a few-second transient once slowed every variant of whichever shape was being
    measured (up to 2x); spread over rounds it moves a third of a shape's runs, not all of them,
    and the median stays put. Returns ({shape: {variant: times}}, {shape: last facts})."""
    measure(*shapes[0], dtype, max(3, iters // 5), warmup)
    pooled, facts = {shape: {} for shape in shapes}, {}
    per_round = max(1, -(-iters // ROUNDS))
    for _ in range(ROUNDS):
        for shape in shapes:
            raw, facts[shape] = measure(*shape, dtype, per_round, warmup)
            for name, v in raw.items():
                pooled[shape].setdefault(name, []).extend(v)
    return pooled, facts


def init_worker(rank: int, world: int, init_method: str) -> None:
    """A benchmark rank: the safe environment, its GPU, the process group."""
    import torch.distributed as dist

    os.environ.update(SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def spawn_ranks(worker: Callable, world: int, *args) -> dict:
    """Runs ``worker(rank, world, init_method, *args, result_path)`` on `world` spawned ranks
    (a file rendezvous: no TCP port to race for) and returns what rank 0 wrote to result_path."""
    import tempfile

    import torch.multiprocessing as mp

    os.environ.update(SAFE_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(world, f"file://{tmp}/rendezvous", *args, result), nprocs=world, join=True,
                           start_method="spawn")
        with open(result) as f:
            return json.load(f)


def write_lines(path: str, lines: Sequence[str]) -> None:
    """A report's lines to a text file, its folder made if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_outputs(out: str, lines: list, rows: list, meta: dict) -> None:
    """<out>.txt (the printed table), <out>.csv (the rows) and <out>.json (the environment)."""
    write_lines(out + ".txt", lines)
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=2)


def _worker(rank: int, world: int, init_method: str, shapes, dtype_name: str, iters: int, warmup: int, result_path: str):
    import torch.distributed as dist

    import flashoverlap

    init_worker(rank, world, init_method)
    dtype = getattr(torch, dtype_name)
    rows = []
    try:
        pooled, facts = pooled_rounds(measure_round, shapes, dtype, iters, warmup)
        for shape in shapes:
            row = make_row(*shape, dtype, pooled[shape], facts[shape])
            rows.append(asdict(row))
            if rank == 0:
                print(format_row(row), flush=True)
        if rank == 0:
            meta = environment(world)
            with open(result_path, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f)
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


HEADER = (f"{'M x N x K':>18} {'cuBLAS':>8} {'NCCL AR':>8} {'seq':>8} {'fo':>8} {'speedup':>8} {'sched':>10} "
          f"{'conc':>8} {'conc x':>7} {'conc2 x':>7} {'fo GEMM':>8} {'forced':>8} {'gain':>6} "
          f"{'fo nccl':>8} {'nccl x':>7} {'forced nccl':>11} {'fo ce':>8} {'ce x':>7} {'forced ce':>9} "
          f"{'fo push':>8} {'push x':>7} {'forced push':>11} {'err':>8}")


def format_row(r: Row) -> str:
    return (f"{f'{r.m}x{r.n}x{r.k}':>18} {r.cublas_gemm_us:8.1f} {r.nccl_all_reduce_us:8.1f} {r.sequential_us:8.1f} "
            f"{r.flashoverlap_us:8.1f} {r.speedup:7.2f}x {r.schedule:>10} {r.concurrent_us:8.1f} "
            f"{r.concurrent_speedup:6.2f}x {r.concurrent_nccl_first_speedup:6.2f}x {r.flashoverlap_gemm_us:8.1f} "
            f"{r.forced_overlap_us:8.1f} {r.overlap_gain:5.2f}x {r.flashoverlap_nccl_us:8.1f} {r.speedup_nccl:6.2f}x "
            f"{r.forced_overlap_nccl_us:11.1f} {r.flashoverlap_ce_us:8.1f} {r.speedup_ce:6.2f}x "
            f"{r.forced_overlap_ce_us:9.1f} {r.flashoverlap_push_us:8.1f} {r.speedup_push:6.2f}x "
            f"{r.forced_overlap_push_us:11.1f} {max(r.rel_error, r.forced_overlap_rel_error):8.1e}")


LEGEND = ("speedup = seq / fo, where seq = cuBLAS then NCCL and fo = flashoverlap.gemm_all_reduce (mode and "
          "backend auto);\n"
          "conc = cuBLAS and NCCL of an unrelated buffer launched together (no dependency), conc x = seq / conc;\n"
          "conc2 x = the same with the NCCL call enqueued before the GEMM;\n"
          "fo GEMM = flashoverlap's GEMM alone; forced = mode='overlap'; gain = (fo GEMM + NCCL AR) / forced, "
          "what overlapping hides for flashoverlap's own GEMM; fo nccl, forced nccl = the same with backend='nccl', "
          "nccl x = seq / fo nccl; fo ce, forced ce, ce x = the same with backend='copy_engine'; fo push, forced push, "
          "push x = the same with backend='push' (the GEMM's epilogue stores into the peer; 2 Hopper ranks);\n"
          "err = max relative error vs fp32")


# nvidia-smi's reasons that cut the SM clock far below what a loaded GPU normally runs at (a
# power cap is normal under load and is only recorded). A 2x H100 host ran everything 4-9x slow
# on 2026-11-25 after its first minute: without this record such a run reads as a slow library.
SLOWDOWNS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
_STATE_FIELDS = ("index", "temperature.gpu", "power.draw", "clocks.sm", "clocks.max.sm")


def parse_gpu_state(text: str) -> list[dict]:
    """nvidia-smi's csv (noheader, nounits) of _STATE_FIELDS then the SLOWDOWNS reasons, one GPU
    per line, as dicts with the slowdowns active listed."""
    gpus = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(_STATE_FIELDS) + len(SLOWDOWNS):
            raise ValueError(f"nvidia-smi: unexpected line {line!r}")
        state = dict(zip(_STATE_FIELDS, cells))
        state["slowdowns"] = [s for s, v in zip(SLOWDOWNS, cells[len(_STATE_FIELDS):]) if v == "Active"]
        gpus.append(state)
    return gpus


def gpu_state(timeout_s: float = 10.0) -> Optional[list[dict]]:
    """Each GPU's temperature, power, SM clock and active slowdown reasons, from nvidia-smi (None
    where it is missing or fails: the record is evidence, never a reason to stop a run)."""
    # Drivers before 535 name the reasons clocks_throttle_reasons.
    for prefix in ("clocks_event_reasons", "clocks_throttle_reasons"):
        fields = _STATE_FIELDS + tuple(f"{prefix}.{s}" for s in SLOWDOWNS)
        try:
            done = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode == 0:
            try:
                return parse_gpu_state(done.stdout)
            except ValueError:
                return None
    return None


def slowdown_warning(gpus: Optional[Sequence[dict]]) -> Optional[str]:
    """One line naming every GPU with a clock slowdown active (None: none, or no record)."""
    hit = [f"GPU {g['index']} {'+'.join(g['slowdowns'])} ({g['temperature.gpu']} C, SM {g['clocks.sm']} of "
           f"{g['clocks.max.sm']} MHz)" for g in gpus or () if g["slowdowns"]]
    return ("WARNING: clock slowdown active at the end of the run, its times are not the hardware's: "
            + "; ".join(hit)) if hit else None


# A Hopper GPU runs a bf16 8192^3 matmul at 700-780 TFLOP/s (H100 and H200 on the device
# machines); below this floor its clocks are cut and no timing taken on it means anything.
HOPPER_MATMUL_FLOOR_TFLOPS = 400.0


def matmul_tflops(device: int, n: int = 8192, iters: int = 20) -> float:
    """cuBLAS's bf16 n^3 matmul rate on one GPU (median of `iters` CUDA-event timings after
    warm-up): a ten-second check that the GPU runs at its clocks before a benchmark spends minutes."""
    with torch.cuda.device(device):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        for _ in range(5):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return 2 * n**3 / (statistics.median(times) * 1e-3) / 1e12


def speed_warning(rates: Sequence[tuple[str, float]], floor: float = HOPPER_MATMUL_FLOOR_TFLOPS) -> Optional[str]:
    """One line naming every Hopper GPU ((name, TFLOP/s) from matmul_tflops) below `floor`
    (None: none; GPUs of other models are not judged, their rates unknown here)."""
    slow = [f"GPU {i} ({name}) {tflops:.0f} TFLOP/s" for i, (name, tflops) in enumerate(rates)
            if ("H100" in name or "H200" in name) and tflops < floor]
    return (f"WARNING: bf16 matmul below {floor:.0f} TFLOP/s, the clocks are cut: " + "; ".join(slow)) if slow else None


def check_gpus() -> Optional[str]:
    """Prints each visible GPU's matmul rate and returns speed_warning's line, or
    slowdown_warning's where nvidia-smi reports a slowdown the rate did not show."""
    rates = [(torch.cuda.get_device_name(d), matmul_tflops(d)) for d in range(torch.cuda.device_count())]
    for d, (name, tflops) in enumerate(rates):
        print(f"GPU {d} {name}: bf16 8192^3 matmul {tflops:.0f} TFLOP/s", flush=True)
    return speed_warning(rates) or slowdown_warning(gpu_state())


def environment(world: int) -> dict:
    import flashoverlap
    from flashoverlap import _core

    nccl = _core.nccl_version()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "world_size": world,
        "torch": torch.__version__,
        "nccl": f"{nccl // 10000}.{nccl // 100 % 100}.{nccl % 100}",
        "flashoverlap": flashoverlap.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "host": platform.node(),
        "env": {k: os.environ.get(k) for k in sorted(SAFE_ENV) + ["FLASHOVERLAP_RESERVED_SMS", "FLASHOVERLAP_NCCL_MAX_CTAS",
                                                             "FLASHOVERLAP_BACKEND", "FLASHOVERLAP_CE_ALLREDUCE"]},
        "method": f"median of CUDA-event-timed iterations after warm-up, variants interleaved, pooled over {ROUNDS} "
                  "rounds across all shapes, max over ranks; random inputs rotated across buffers",
        # Sampled when the results are written, right after the timed loops.
        "gpu_state": gpu_state(),
    }


def run(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, *, dtype: str = "bfloat16", iters: int = 30,
        warmup: int = 10, world_size: Optional[int] = None, csv_path: Optional[str] = None,
        timeout_s: float = 1800.0) -> list[dict]:
    """Benchmarks on ``world_size`` local GPUs (default: all) and returns the rows."""
    import tempfile

    import torch.multiprocessing as mp

    world = world_size or torch.cuda.device_count()
    if world < 2:
        raise RuntimeError(f"world_size: the GEMM + AllReduce benchmark needs >= 2 GPUs, found {world}")
    for k, v in SAFE_ENV.items():
        os.environ[k] = v
    print(f"flashoverlap GEMM+AllReduce, {world} x {torch.cuda.get_device_name(0)}, {dtype}; times in us "
          f"(median of {iters} interleaved runs, max over ranks); speedup = seq / fo", flush=True)
    print(LEGEND, flush=True)
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        # A file rendezvous: no TCP port to race for with other jobs.
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        ctx = mp.start_processes(_worker, args=(world, init_method, list(shapes), dtype, iters, warmup, result),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"benchmark did not finish within {timeout_s} s")
        with open(result) as f:
            data = json.load(f)
    rows = data["rows"]
    if rows:
        speedups = [r["speedup"] for r in rows]
        geo = statistics.geometric_mean(speedups)
        print(f"geometric mean speedup over sequential cuBLAS + NCCL: {geo:.3f}x (min {min(speedups):.3f}x)")
        conc = [r["concurrent_speedup"] for r in rows]
        print(f"independent-concurrency reference over sequential: {statistics.geometric_mean(conc):.3f}x "
              f"(min {min(conc):.3f}x); NCCL enqueued first: "
              f"{statistics.geometric_mean(r['concurrent_nccl_first_speedup'] for r in rows):.3f}x")
        nccl_x = [r["speedup_nccl"] for r in rows]
        print(f"with the NCCL backend: {statistics.geometric_mean(nccl_x):.3f}x (min {min(nccl_x):.3f}x)")
        ce_geo, ce_min = geo_min(rows, "speedup_ce")
        if math.isnan(ce_geo):
            print("with the copy-engine backend: not measured (no peer access between the ranks)")
        else:
            print(f"with the copy-engine backend: {ce_geo:.3f}x (min {ce_min:.3f}x); issue 8's bar (>= 1.30x, "
                  f"never below 0.98x): {'PASS' if ce_geo >= 1.30 and ce_min >= 0.98 else 'FAIL'}")
        push_geo, push_min = geo_min(rows, "speedup_push")
        if not math.isnan(push_geo):
            forced = [r["sequential_us"] / r["forced_overlap_push_us"] for r in rows]
            print(f"with the push backend: {push_geo:.3f}x (min {push_min:.3f}x); forced overlap "
                  f"{statistics.geometric_mean(forced):.3f}x (min {min(forced):.3f}x); issue 3's bar (>= 1.15x, "
                  f"never below 0.98x): {'PASS' if push_geo >= 1.15 and push_min >= 0.98 else 'FAIL'}")
        gains = [r["overlap_gain"] for r in rows]
        print(f"geometric mean gain of forced overlap over flashoverlap GEMM then NCCL: "
              f"{statistics.geometric_mean(gains):.3f}x (min {min(gains):.3f}x)")
    if csv_path:
        os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            writer.writeheader()
            writer.writerows(rows)
        with open(os.path.splitext(csv_path)[0] + ".json", "w") as f:
            json.dump(data["meta"], f, indent=2)
        print(f"wrote {csv_path}")
    return rows
