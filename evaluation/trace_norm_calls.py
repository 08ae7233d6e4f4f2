"""What the GPU does during one all_reduce_rmsnorm call, stream by stream: the kernels and
copy-engine copies of a call (CUPTI through torch.profiler), on 2 GPUs, for a few token counts,
with SymmetricMemory's two_shot_all_reduce_ traced the same way for scale.

    python evaluation/trace_norm_calls.py [--tokens 1024 8192 16384] [--ctas 32] [--calls 3]

Each rank warms up, then profiles `calls` back-to-back calls of the registered op (full
residual) and prints, for the last call, every GPU activity from the first activity of the
call: stream, start and end (us), bytes or grid, name; a small kernel on the caller's stream
right before and after each call marks where the call begins and ends there. Stream memory operations (the copy
engines' flags and waits) are not activities: they show as gaps. Diagnosis only: no bar.
"""
import argparse
import sys

import torch

from flashoverlap import bench

HIDDEN = 8192
EPS = 1e-6


def _activities(prof, path: str) -> list:
    """(start us, end us, stream, name) of every GPU activity (kernels, copies, memsets), sorted
    by start, from the profiler's Chrome trace."""
    import json

    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        args = e.get("args", {})
        detail = e["name"]
        if "bytes" in args:
            detail += f" [{args['bytes'] / 2**20:.1f} MiB]"
        if "grid" in args:
            detail += f" grid {args['grid']}"
        out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(args.get("stream", -1)), detail))
    return sorted(out)


def _calls(acts: list, n: int, gap_us: float) -> list:
    """The activities split into calls: a new call where nothing ran for gap_us (the profiled calls
    are separated by a GPU sleep)."""
    calls, cur, end = [], [], None
    for a in acts:
        if end is not None and a[0] - end > gap_us:
            calls.append(cur)
            cur = []
        cur.append(a)
        end = a[1] if end is None else max(end, a[1])
    if cur:
        calls.append(cur)
    return calls[-n:]


def _worker(rank, world, init_method, cfg, result_path):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import flashoverlap

    bench.init_worker(rank, world, init_method)
    lines = []
    try:
        op = torch.ops.flashoverlap.all_reduce_rmsnorm
        from flashoverlap.peer_norm import _name

        op_name = _name(dist.group.WORLD, torch.device("cuda", rank))
        import torch.distributed._symmetric_memory as symm_mem

        for tokens in cfg["tokens"]:
            g = torch.Generator(device="cuda").manual_seed(1 + tokens + 1000 * rank)
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
            res = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(HIDDEN, device="cuda").to(torch.bfloat16)
            # The public function first: it makes or grows the peer buffers (a collective host step).
            flashoverlap.all_reduce_rmsnorm(x, res, w, EPS, ctas=cfg["ctas"])
            buf = symm_mem.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
            buf.copy_(x)
            variants = {
                "fo": lambda: op(x, res, w, EPS, op_name, "full", cfg["ctas"]),
                "symm": lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", dist.group.WORLD.group_name),
            }
            for name, fn in variants.items():
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                dist.barrier()
                mark = torch.zeros(1, device="cuda")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(cfg["calls"]):
                        torch.cuda._sleep(2_000_000)  # ~1 ms: separates the calls in the trace
                        mark.add_(1)  # marks on the caller's stream: the call lies between them
                        fn()
                        mark.add_(1)
                    torch.cuda.synchronize()
                acts = [a for a in _activities(prof, f"/tmp/trace_{rank}.json") if "spin" not in a[3] and "sleep" not in a[3]]
                calls = _calls(acts, cfg["calls"], 100.0)
                for k, call in enumerate(calls):
                    t0 = call[0][0]
                    span = max(a[1] for a in call) - t0
                    lines.append(f"rank {rank} {tokens} tokens {name} call {k}: {span:.1f} us, {len(call)} activities")
                    if k == len(calls) - 1:
                        for s, e, stream, act in call:
                            lines.append(f"    stream {stream:>3}  {s - t0:8.1f} {e - t0:8.1f}  ({e - s:7.1f})  {act[:70]}")
                dist.barrier()
            del buf
        allout = [None] * world
        dist.all_gather_object(allout, lines)
        if rank == 0:
            for r_lines in allout:
                print("\n".join(r_lines), flush=True)
            with open(result_path, "w") as f:
                f.write("{}")
    finally:
        flashoverlap.destroy_peer_groups()
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 16384])
    p.add_argument("--ctas", type=int, default=32)
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args()
    bench.spawn_ranks(_worker, 2, {"tokens": args.tokens, "ctas": args.ctas, "calls": args.calls})
    return 0


if __name__ == "__main__":
    sys.exit(main())
