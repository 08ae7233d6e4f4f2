"""Host time to enqueue one all_reduce_rmsnorm call, piece by piece, on 2 GPUs: the registered op
(torch.ops.flashoverlap.all_reduce_rmsnorm, what the public function and vLLM-style callers reach),
its Python body alone (peer_norm._impl), the core launch alone (PeerGroup.launch into preallocated
outputs), the public function, and SymmetricMemory's two_shot_all_reduce_ for scale; then cProfile's
top entries of the registered op on rank 0. The GPU is kept far behind (a long sleep first), so every
number is the host's.

    torchrun --nproc-per-node 2 evaluation/norm_host_overhead.py [--tokens 128] [--ctas 32] [--calls 500]
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import peer_norm


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host's time per call, the GPU held back by a sleep."""
    rounds = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)  # ~100 ms: the GPU never catches up with the host
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
        dist.barrier()
    return statistics.median(rounds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--ctas", type=int, default=32)
    p.add_argument("--calls", type=int, default=500)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD.group_name
    x = torch.randn(a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(a.hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, ctas=a.ctas)  # makes the peer group
    name = peer_norm._name(dist.group.WORLD, x.device)
    state = peer_norm._GROUPS[name]
    out, r = torch.empty_like(x), torch.empty_like(x)
    variants = {
        "registered op": lambda: torch.ops.flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, name, "full", a.ctas),
        "_impl (Python body)": lambda: peer_norm._impl(x, res, w, 1e-6, name, "full", a.ctas),
        "PeerGroup.launch (core)": lambda: state.launch(x, res, w, out, r, 1e-6, a.ctas),
        "public function": lambda: flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, ctas=a.ctas),
    }
    try:
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(a.tokens * a.hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group)
        variants["symm two_shot_all_reduce_"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)
    except Exception as e:  # reported, not fatal: the others still measure
        print(f"symm unavailable: {e}")
    for label, fn in variants.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        us = host_us(fn, a.calls)
        print(f"rank {rank}: {label:28s} {us:7.1f} us per call on the host", flush=True)
    prof = cProfile.Profile()
    torch.cuda._sleep(200_000_000)
    prof.enable()
    for _ in range(a.calls):
        variants["registered op"]()
    prof.disable()
    torch.cuda.synchronize()
    if rank == 0:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
