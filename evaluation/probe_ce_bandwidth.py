"""Copy-engine peer bandwidth on 2 GPUs of one node: what bounds the copy
engines' AllReduce (issue 8) on the shapes where the links, not the GEMM,
set the time.

One process drives both GPUs; every copy is a driver cuMemcpyDtoDAsync
between the two GPUs' memory (peer access on), issued on a stream of the
GPU named by the pattern:

  uni        GPU 0 copies into GPU 1 only (its own stream: a push)
  push       both at once, each GPU's stream copies its buffer into the peer
  pull       both at once, each GPU's stream copies the peer's buffer into its own
  push xK    the same bytes split in K copies on K streams per GPU
  seq /C     push as C copies one after the other on one stream (the per-group pattern)
  rr /C xK   those C copies dealt round-robin over K streams

Every trial starts behind a GPU sleep on both GPUs, so that both directions
run together; time = the slower GPU's event time from the sleep's end to its
last copy; median of --trials. GB/s = bytes one GPU sends / time.

    python evaluation/probe_ce_bandwidth.py [--mib 4 16 64] [--trials 20]
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import torch

_cuda = ctypes.CDLL("libcuda.so.1")
_cuda.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]


def _copy(dst: int, src: int, nbytes: int, stream: torch.cuda.Stream) -> None:
    rc = _cuda.cuMemcpyDtoDAsync_v2(dst, src, nbytes, ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed: CUresult {rc}")


class Pair:
    """Buffers and streams of both GPUs for copies of `nbytes` each way."""

    def __init__(self, nbytes: int, max_streams: int):
        self.nbytes = nbytes
        self.src = [torch.randn(nbytes // 2, dtype=torch.bfloat16, device=d) for d in (0, 1)]
        self.dst = [torch.empty(nbytes // 2, dtype=torch.bfloat16, device=d) for d in (0, 1)]
        self.streams = [[torch.cuda.Stream(device=d) for _ in range(max_streams)] for d in (0, 1)]
        self.main = [torch.cuda.Stream(device=d) for d in (0, 1)]

    def trial(self, plan) -> float:
        """plan(d) -> [(stream index, dst, src, bytes)] issued on GPU d's streams (GPU d's
        push: dst on the peer). Returns the slower GPU's time in us."""
        starts, ends = [], []
        for d in (0, 1):
            with torch.cuda.device(d):
                torch.cuda.synchronize()
        for d in (0, 1):
            with torch.cuda.device(d), torch.cuda.stream(self.main[d]):
                torch.cuda._sleep(2_000_000)
                start = torch.cuda.Event(enable_timing=True)
                start.record(self.main[d])
                starts.append(start)
        for d in (0, 1):
            with torch.cuda.device(d):
                copies = plan(d)
                used = sorted({s for s, *_ in copies})
                for s in used:
                    self.streams[d][s].wait_event(starts[d])
                for s, dst, src, n in copies:
                    _copy(dst, src, n, self.streams[d][s])
                for s in used:
                    ev = torch.cuda.Event()
                    ev.record(self.streams[d][s])
                    self.main[d].wait_event(ev)
                end = torch.cuda.Event(enable_timing=True)
                end.record(self.main[d])
                ends.append((d, end))
        times = []
        for (d, end), start in zip(ends, starts):
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 if plan(d) else 0.0)
        return max(times)

    # Addresses: GPU d pushes its src into the peer's dst, or pulls the peer's src into its dst.
    def push(self, d: int, offset: int = 0) -> tuple[int, int]:
        return self.dst[1 - d].data_ptr() + offset, self.src[d].data_ptr() + offset

    def pull(self, d: int, offset: int = 0) -> tuple[int, int]:
        return self.dst[d].data_ptr() + offset, self.src[1 - d].data_ptr() + offset


def patterns(pair: Pair, max_streams: int):
    n = pair.nbytes

    def split(chunks: int, streams: int, pull: bool = False, only0: bool = False):
        def plan(d):
            if only0 and d == 1:
                return []
            size = n // chunks
            out = []
            for c in range(chunks):
                dst, src = (pair.pull if pull else pair.push)(d, c * size)
                out.append((c % streams, dst, src, size))
            return out
        return plan

    yield "uni", split(1, 1, only0=True)
    yield "push", split(1, 1)
    yield "pull", split(1, 1, pull=True)
    for k in (2, 4, 8):
        if k <= max_streams:
            yield f"push x{k}", split(k, k)
    for k in (2, 4):
        if k <= max_streams:
            yield f"pull x{k}", split(k, k, pull=True)
    for c in (4, 16):
        yield f"seq /{c}", split(c, 1)
        for k in (2, 4):
            if k <= max_streams:
                yield f"rr /{c} x{k}", split(c, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    for a, b in ((0, 1), (1, 0)):
        if not torch.cuda.can_device_access_peer(a, b):
            raise SystemExit(f"GPU {a} cannot access GPU {b}")
    # A torch copy each way turns peer access on.
    torch.ones(1, device=0).to(1)
    torch.ones(1, device=1).to(0)
    names = [torch.cuda.get_device_name(d) for d in (0, 1)]
    print(f"# {names[0]} x2; copy-engine copies between the GPUs; us = median of {args.trials} trials, "
          f"the slower GPU; GB/s = bytes one GPU sends / time")
    print(f"{'pattern':>12} " + " ".join(f"{m:>6}MiB {'GB/s':>6}" for m in args.mib))
    rows: dict[str, list[str]] = {}
    for mib in args.mib:
        pair = Pair(mib << 20, 8)
        for name, plan in patterns(pair, 8):
            pair.trial(plan)  # warm-up
            t = statistics.median(pair.trial(plan) for _ in range(args.trials))
            # Check the last copy's bytes landed (a push fills the peer's dst, a pull its own).
            rows.setdefault(name, []).append(f"{t:9.1f} {(mib << 20) / t / 1e3:6.0f}")
        for d in (0, 1):
            torch.cuda.synchronize(d)
        ok = all(torch.equal(pair.dst[d].cpu(), pair.src[1 - d].cpu()) for d in (0, 1))
        if not ok:
            raise SystemExit(f"copies at {mib} MiB did not land intact")
        del pair
    for name, cells in rows.items():
        print(f"{name:>12} " + " ".join(cells))


if __name__ == "__main__":
    main()
