"""all_reduce_rmsnorm at small sizes, call by call: the GPU time per call in chains of 50 back-to-back calls
(events around the chain, behind ~10 ms of GPU sleep so that the host enqueues ahead), the host's time to
enqueue a call, SymmetricMemory's two_shot_all_reduce_ the same way, and CTA 0's timeline of the last call.

The timeline needs a trace build of the plain kernel: apply evaluation/norm_trace.patch (CTA 0's thread 0
stamps the low 32 bits of %globaltimer into header words 3..12 of its rank's peer buffer: entry, after the
push, after raising ready, ready seen, reduced, after raising done, done seen, gathered, before and after
the epoch advance), build the wheel, then on 2 GPUs:

    torchrun --nproc-per-node 2 evaluation/norm_trace_calls.py

Results: evaluation/results/norm_small_tokens_h200x2.txt (its second part)."""
import gc, statistics, torch, torch.distributed as dist
import flashoverlap
from flashoverlap import peer_norm
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
hidden = 8192
symm_ok = True
for tokens, ctas in [(2, 8), (2, 16), (2, 32), (128, 32)]:
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    call = lambda: torch.ops.flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, f"pg:{dist.group.WORLD.group_name}:{rank}", "full", ctas)
    flashoverlap.all_reduce_rmsnorm(x, res, w, 1e-6, ctas=ctas)
    for _ in range(20): call()
    torch.cuda.synchronize(); dist.barrier()
    chain, host = [], []
    import time
    for rep in range(5):
        torch.cuda._sleep(20_000_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        t0 = time.perf_counter()
        for _ in range(50): call()
        host.append((time.perf_counter() - t0) / 50 * 1e6)
        e.record(); torch.cuda.synchronize(); dist.barrier()
        chain.append(s.elapsed_time(e) * 1e3 / 50)
    print(f"rank {rank} tokens {tokens} ctas {ctas}: host enqueue per call {statistics.median(host):.1f} us", flush=True)
    m = [o for o in gc.get_objects() if isinstance(o, peer_norm.PeerGroup) and o.memory is not None][0].memory
    words = [m.header_word(i) for i in range(3, 13)]
    d = [(words[i] - words[0]) % 2**32 / 1e3 for i in range(10)]
    print(f"rank {rank} tokens {tokens} ctas {ctas}: per call in a chain of 50 {statistics.median(chain):.1f} us; "
          f"CTA 0 marks of the last call (us from entry): " + " ".join(f"{v:.1f}" for v in d), flush=True)
    # symm two-shot the same way
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(tokens * hidden, device="cuda", dtype=torch.bfloat16)
        symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        for _ in range(20): torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", dist.group.WORLD.group_name)
        torch.cuda.synchronize(); dist.barrier()
        chain = []
        for rep in range(5):
            torch.cuda._sleep(2_000_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(50): torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", dist.group.WORLD.group_name)
            e.record(); torch.cuda.synchronize(); dist.barrier()
            chain.append(s.elapsed_time(e) * 1e3 / 50)
        print(f"rank {rank} tokens {tokens}: symm two_shot per call in a chain of 50 {statistics.median(chain):.1f} us", flush=True)
    except Exception as ex:
        print("symm failed", ex)
dist.destroy_process_group()
