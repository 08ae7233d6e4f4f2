"""all_reduce_rmsnorm at small sizes, call by call: the GPU time per call in chains of 50 back-to-back calls
(events around the chain, behind ~10 ms of GPU sleep so that the host enqueues ahead), the host's time to
enqueue a call, SymmetricMemory's two_shot_all_reduce_ the same way, and CTA 0's timeline of the last call.

The timeline needs a trace build of the plain kernel: apply evaluation/norm_trace.patch (CTA 0's thread 0
stamps the low 32 bits of %globaltimer into header words 3..12 of its rank's peer buffer: entry, after the
push, after raising ready, ready seen, reduced, after raising done, done seen, gathered, before and after
the epoch advance), build the wheel, then on 2 GPUs:

    torchrun --nproc-per-node 2 evaluation/norm_trace_calls.py

Results: evaluation/results/norm_small_tokens_h200x2.txt (its second part)."""

import statistics
import time

import torch
import torch.distributed as dist

import flashoverlap
from flashoverlap import peer_norm


CHAIN = 50
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep before each chain: the host enqueues ahead


def chain_us(fn) -> tuple[float, float]:
    """(GPU us per call, host us to enqueue a call): medians over 5 chains of CHAIN back-to-back calls."""
    gpu, host = [], []
    for _ in range(5):
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(CHAIN):
            fn()
        host.append((time.perf_counter() - t0) / CHAIN * 1e6)
        end.record()
        torch.cuda.synchronize()
        dist.barrier()
        gpu.append(start.elapsed_time(end) * 1e3 / CHAIN)
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    group = dist.group.WORLD.group_name
    name = peer_norm._name(dist.group.WORLD, torch.device("cuda", rank))
    hidden = 8192
    for tokens, ctas in [(2, 8), (2, 16), (2, 32), (128, 32)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
        flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, ctas=ctas)  # makes the peer group

        def fo():
            torch.ops.flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, name, "full", ctas)

        for _ in range(20):
            fo()
        torch.cuda.synchronize()
        dist.barrier()
        gpu, host = chain_us(fo)
        memory = peer_norm._GROUPS[name].memory
        words = [memory.header_word(i) for i in range(3, 13)]
        marks = " ".join(f"{(w - words[0]) % 2**32 / 1e3:.1f}" for w in words)
        print(f"rank {rank} tokens {tokens} ctas {ctas}: fo {gpu:.1f} us per call (host {host:.1f} us); "
              f"CTA 0 marks of the last call (us from entry): {marks}", flush=True)
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(tokens * hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, group)

        def symm():
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group)

        for _ in range(20):
            symm()
        torch.cuda.synchronize()
        dist.barrier()
        gpu, host = chain_us(symm)
        print(f"rank {rank} tokens {tokens}: symm two_shot {gpu:.1f} us per call (host {host:.1f} us)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
