"""Would the copy engines make all_reduce_rmsnorm faster at large token
counts? A one-process model of the pipeline on 2 GPUs, existing kernels
standing in for a fused one:

  copy stream X:   x rows of the peer's slice, chunk by chunk -> peer's slot
  reduce stream R: [peer's chunk c landed] r = x + slot + residual; out = norm(r)
                   (a torch add, then flashoverlap's fused add + RMSNorm on --ctas CTAs)
  send stream G:   [chunk c reduced] r rows -> peer's slot
  land stream L:   [peer's r of chunk c landed] residual_out, out = r, norm(r)
                   (a torch copy, then the fused norm on --ctas CTAs)

Cross-GPU dependencies are CUDA events (one process drives both GPUs);
the real op would use flags in peer memory. Every trial starts behind a
GPU sleep on both GPUs long enough to hide the host's enqueue; time = the
slower GPU's from the sleep's end; median of --trials. The result is
checked against the fp32 torch composition.

    python evaluation/probe_ce_norm_pipeline.py [--tokens 4096 8192 16384] [--chunks 4 8 16]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import torch

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
HIDDEN = 8192
EPS = 1e-6


def copy_(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> None:
    assert dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()
    rc = _cuda.cuMemcpyDtoDAsync_v2(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(),
                                    ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed: CUresult {rc}")


CTAS = 16


def add_rmsnorm(x, residual_in, residual_out, w, stream, ctas):
    """flashoverlap's fused add + RMSNorm in place on x's rows, on `ctas` CTAs."""
    from flashoverlap import _core
    _core.add_rmsnorm(x.data_ptr(), residual_in.data_ptr(), residual_out.data_ptr(), w.data_ptr(), x.shape[0],
                      x.shape[1], EPS, "bfloat16", x.device.index, stream.cuda_stream, ctas)


class Rank:
    def __init__(self, d: int, tokens: int):
        g = torch.Generator(device=d).manual_seed(d)
        kw = dict(device=d, dtype=torch.bfloat16)
        self.d = d
        self.x = torch.randn(tokens, HIDDEN, generator=g, **kw)
        shared = torch.Generator(device=d).manual_seed(99)  # residual and weight alike on every rank
        self.residual = torch.randn(tokens, HIDDEN, generator=shared, **kw)
        self.w = torch.randn(HIDDEN, generator=shared, **kw)
        self.zeros = torch.zeros((tokens + 1) // 2, HIDDEN, **kw)
        self.out = torch.empty(tokens, HIDDEN, **kw)
        self.res_out = torch.empty(tokens, HIDDEN, **kw)
        half = (tokens + 1) // 2
        self.slot_x = torch.empty(half, HIDDEN, **kw)
        self.slot_r = torch.empty(half, HIDDEN, **kw)
        self.streams = {k: torch.cuda.Stream(device=d) for k in "XRGL"}
        self.main = torch.cuda.Stream(device=d)


def slice_rows(tokens: int, rank: int) -> tuple[int, int]:
    return tokens * rank // 2, tokens * (rank + 1) // 2


def chunks_of(first: int, last: int, n: int) -> list[tuple[int, int]]:
    rows = last - first
    return [(first + rows * c // n, first + rows * (c + 1) // n) for c in range(n)]


def trial(ranks: list[Rank], tokens: int, nchunks: int) -> float:
    for r in ranks:
        torch.cuda.synchronize(r.d)
    starts, ends = [], []
    for r in ranks:
        with torch.cuda.device(r.d), torch.cuda.stream(r.main):
            torch.cuda._sleep(40_000_000)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(r.main)
            starts.append(ev)
    ev_x = [[torch.cuda.Event() for _ in range(nchunks)] for _ in ranks]
    ev_r = [[torch.cuda.Event() for _ in range(nchunks)] for _ in ranks]
    ev_g = [[torch.cuda.Event() for _ in range(nchunks)] for _ in ranks]
    own = [chunks_of(*slice_rows(tokens, r.d), nchunks) for r in ranks]
    # Stage by stage over both ranks, so that an event is recorded before any wait on it is enqueued.
    for r in ranks:
        p = 1 - r.d
        with torch.cuda.device(r.d):
            for s in r.streams.values():
                s.wait_event(starts[r.d])
            base = own[p][0][0]
            for c, (a, b) in enumerate(own[p]):
                copy_(ranks[p].slot_x[a - base:b - base], r.x[a:b], r.streams["X"])
                ev_x[r.d][c].record(r.streams["X"])
    for r in ranks:
        p = 1 - r.d
        base = own[r.d][0][0]
        with torch.cuda.device(r.d), torch.cuda.stream(r.streams["R"]):
            for c, (a, b) in enumerate(own[r.d]):
                r.streams["R"].wait_event(ev_x[p][c])
                torch.add(r.x[a:b], r.slot_x[a - base:b - base], out=r.out[a:b])
                add_rmsnorm(r.out[a:b], r.residual[a:b], r.res_out[a:b], r.w, r.streams["R"], CTAS)
                ev_r[r.d][c].record(r.streams["R"])
    for r in ranks:
        p = 1 - r.d
        base = own[r.d][0][0]
        with torch.cuda.device(r.d):
            for c, (a, b) in enumerate(own[r.d]):
                r.streams["G"].wait_event(ev_r[r.d][c])
                copy_(ranks[p].slot_r[a - base:b - base], r.res_out[a:b], r.streams["G"])
                ev_g[r.d][c].record(r.streams["G"])
    for r in ranks:
        p = 1 - r.d
        base = own[p][0][0]
        with torch.cuda.device(r.d), torch.cuda.stream(r.streams["L"]):
            for c, (a, b) in enumerate(own[p]):
                r.streams["L"].wait_event(ev_g[p][c])
                r.out[a:b].copy_(r.slot_r[a - base:b - base])
                add_rmsnorm(r.out[a:b], r.zeros[:b - a], r.res_out[a:b], r.w, r.streams["L"], CTAS)
    for r in ranks:
        with torch.cuda.device(r.d):
            for s in r.streams.values():
                r.main.wait_stream(s)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(r.main)
            ends.append(ev)
    for e in ends:
        e.synchronize()
    return max(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def check(ranks: list[Rank]) -> float:
    s = sum(r.x.float().cpu() for r in ranks)
    worst = 0.0
    for r in ranks:
        rr = (s.to(torch.bfloat16).float() + r.residual.float().cpu())
        ref = rr * torch.rsqrt(rr.pow(2).mean(-1, keepdim=True) + EPS) * r.w.float().cpu()
        err = ((r.out.float().cpu() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--ctas", type=int, default=16, help="CTAs of each stream's norm")
    args = ap.parse_args()
    global CTAS
    CTAS = args.ctas
    torch.ones(1, device=0).to(1)
    torch.ones(1, device=1).to(0)
    print(f"# {torch.cuda.get_device_name(0)} x2, hidden {HIDDEN} bf16; us = median of {args.trials}, slower GPU")
    for tokens in args.tokens:
        ranks = [Rank(d, tokens) for d in (0, 1)]
        cells = []
        for n in args.chunks:
            for r in ranks:
                r.out.fill_(float("nan"))
            trial(ranks, tokens, n)
            err = check(ranks)
            t = statistics.median(trial(ranks, tokens, n) for _ in range(args.trials))
            cells.append(f"{n} chunks {t:8.1f} us (err {err:.1e})")
        print(f"tokens {tokens:6d}: " + "; ".join(cells), flush=True)
        del ranks


if __name__ == "__main__":
    main()
