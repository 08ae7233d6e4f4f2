"""The GPU timeline of gemm_all_reduce calls on 2 ranks, stream by stream:
what each stream's kernels and copies did and when, relative to the call's
first GPU activity (torch.profiler / CUPTI; stream memory operations do
not show, the gaps between activities do).

    python evaluation/trace_gemm_ar.py --shapes 16384x8192x1024 --backends copy_engine push
    python evaluation/trace_gemm_ar.py --no-trace --max-groups 2 4 8 16 --backends copy_engine

Prints, per shape and backend, the median call time of --iters untraced
calls and one traced call's activities on rank 0 (streams numbered by
first use): start and end in us, what ran (a kernel's name, a copy's kind
and MiB) and each stream's busy time. Caveat (2x H200, torch 2.11): the
peer-to-peer copies (no device in the trace) came back with timestamps on
another time base than the kernels', hundreds of ms apart: compare their
durations and their order among themselves only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def timeline(trace_path: str, device: int) -> list[str]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    # Every GPU's activities: a peer copy may be filed under the other GPU.
    acts = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not acts:
        return ["  (no GPU activity recorded)"]
    acts.sort(key=lambda e: e["ts"])
    t0 = acts[0]["ts"]
    streams: dict[int, int] = {}
    busy: dict[int, float] = {}
    lines = []
    for e in acts:
        s = streams.setdefault((e["args"].get("device"), e["args"].get("stream")), len(streams))
        busy[s] = busy.get(s, 0.0) + e["dur"]
        what = e["name"][:60]
        if e["cat"] == "gpu_memcpy":
            what = f"{e['name'][:24]} {e['args'].get('bytes', 0) / 2**20:.1f} MiB"
        lines.append(f"  d{e['args'].get('device')} s{s} {e['ts'] - t0:9.1f} {e['ts'] - t0 + e['dur']:9.1f}  {what}")
    end = max(e["ts"] + e["dur"] for e in acts) - t0
    lines.append(f"  span {end:.1f} us; busy per stream: " +
                 ", ".join(f"s{s} {b:.1f}" for s, b in sorted(busy.items())))
    return lines


def worker(rank: int, world: int, init: str, args: argparse.Namespace, outdir: str) -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=torch.device("cuda", rank))
    import flashoverlap

    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g) / k ** 0.5
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        for backend, groups in [(b, g) for b in args.backends for g in args.max_groups or [None]]:
            if groups is not None:
                os.environ["FLASHOVERLAP_MAX_GROUPS"] = str(groups)
            call = lambda: flashoverlap.gemm_all_reduce(x, w, backend=backend, mode="overlap")
            for _ in range(3):
                call()
            times = []
            for _ in range(args.iters):
                dist.barrier()
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(1_000_000)
                a.record()
                call()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            if args.no_trace:
                dist.barrier()
                if rank == 0:
                    plan = flashoverlap.plan_of(x, w, backend=backend, mode="overlap")
                    gathered = plan.gathered or {}
                    count = gathered.get("groups", len(plan.groups))
                    print(f"{shape} {backend} max_groups {groups}: median {statistics.median(times):.1f} us, "
                          f"{count} groups, predicted {plan.predicted_us:.1f} us {gathered}", flush=True)
                continue
            dist.barrier()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.cuda._sleep(1_000_000)
                call()
                torch.cuda.synchronize()
            path = os.path.join(outdir, f"{shape}_{backend}_{rank}.json")
            prof.export_chrome_trace(path)
            dist.barrier()
            if rank == 0:
                med = statistics.median(times)
                ts = sorted(times)
                print(f"{shape} {backend}: median {med:.1f} us (min {ts[0]:.1f}, max {ts[-1]:.1f}) over {len(times)}",
                      flush=True)
                print(str(flashoverlap.plan_of(x, w, backend=backend, mode="overlap"))[:2500], flush=True)
                lines = timeline(path, 0)
                # Drop the sleep kernel that opens the traced call.
                print("\n".join(l for l in lines if "sleep" not in l), flush=True)
    flashoverlap.destroy_communicators()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["16384x8192x1024", "8192x8192x4096"])
    ap.add_argument("--backends", nargs="+", default=["copy_engine", "push"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-groups", type=int, nargs="*", default=None,
                    help="time each shape under each FLASHOVERLAP_MAX_GROUPS (default: unset)")
    ap.add_argument("--no-trace", action="store_true", help="only the untraced calls' times, one line each")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(2, f"file://{d}/init", args, d), nprocs=2)


if __name__ == "__main__":
    main()
