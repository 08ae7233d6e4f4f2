"""How fast the copy engines move bytes into the peer while a GEMM computes:
what the copy-engine GEMM + AllReduce (issue 8) can overlap at all.

One process drives both GPUs. Per trial each GPU runs `--gemms` cuBLAS GEMMs
of the shape back to back on its compute stream while its copy stream,
started a little after the GEMMs, pushes `--copies` copies of `--mib` MiB
into the peer (driver cuMemcpyDtoDAsync, peer access on), one after the
other, as the gathered AllReduce's groups do. Patterns (who runs a GEMM,
who copies):

  both/both    GEMMs and copies on both GPUs (what an overlapped call does)
  src/0->1     a GEMM on GPU 0 only, GPU 0 copies into GPU 1 (the sender computes)
  dst/0->1     a GEMM on GPU 1 only, GPU 0 copies into GPU 1 (the receiver computes)
  none/both    no GEMM, copies both ways (the copies alone)

Reported per shape and pattern (median of --trials): the copies' time and
GB/s (bytes one GPU sends / time, the slower GPU), the copies' rate against
their rate alone, and the GEMMs' time against alone (the interference the
other way). The GEMMs outlast the copies by construction (checked: a row
whose copies ended after the GEMMs is marked *).

    python evaluation/probe_ce_beside_gemm.py [--shapes 16384x8192x1024 ...]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from probe_ce_bandwidth import _copy  # a driver copy on a stream (evaluation/ is on sys.path)


def _shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.lower().split("x"))
    return m, n, k


class Rig:
    def __init__(self, shape, mib: int, copies: int, gemms: int, kernel: str = "cublas", src: str = "own"):
        m, n, k = shape
        self.gemms, self.copies, self.nbytes = gemms, copies, mib << 20
        self.a = [torch.randn(m, k, device=d, dtype=torch.bfloat16) for d in (0, 1)]
        self.b = [torch.randn(n, k, device=d, dtype=torch.bfloat16) for d in (0, 1)]
        self.c = [torch.empty(m, n, device=d, dtype=torch.bfloat16) for d in (0, 1)]
        self.src = [torch.randn(copies * self.nbytes // 2, device=d, dtype=torch.bfloat16) for d in (0, 1)]
        self.dst = [torch.empty(copies * self.nbytes // 2, device=d, dtype=torch.bfloat16) for d in (0, 1)]
        self.compute = [torch.cuda.Stream(device=d) for d in (0, 1)]
        self.kernel, self.from_c = kernel, src == "c"
        if self.from_c and copies * self.nbytes > self.c[0].numel() * 2:
            raise SystemExit("--src c: the copies need more bytes than the GEMM's output holds")
        self.side = [torch.cuda.Stream(device=d) for d in (0, 1)]

    def trial(self, gemm_on, copy_from) -> tuple[float, float, bool]:
        """(copies' us, GEMMs' us, copies ended after the GEMMs on some GPU): the slower GPU's."""
        for d in (0, 1):
            torch.cuda.synchronize(d)
        marks = []
        for d in (0, 1):
            with torch.cuda.device(d):
                c, s = self.compute[d], self.side[d]
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                with torch.cuda.stream(c):
                    torch.cuda._sleep(1_000_000)  # both GPUs start together
                    ev[0].record(c)
                    if d in gemm_on:
                        for _ in range(self.gemms):
                            if self.kernel == "fo":
                                import flashoverlap

                                self.c[d] = flashoverlap.gemm(self.a[d], self.b[d])
                            else:
                                torch.matmul(self.a[d], self.b[d].t(), out=self.c[d])
                    ev[1].record(c)
                s.wait_event(ev[0])
                with torch.cuda.stream(s):
                    torch.cuda._sleep(20_000)  # the copies start once the GEMM runs
                    ev[2].record(s)
                    if d in copy_from:
                        dst = self.dst[1 - d].data_ptr()
                        # From the GEMM's output (rows it rewrites meanwhile) or a buffer of its own.
                        src = self.c[d].data_ptr() if self.from_c else self.src[d].data_ptr()
                        for i in range(self.copies):
                            _copy(dst + i * self.nbytes, src + i * self.nbytes, self.nbytes, s)
                    ev[3].record(s)
                marks.append((d, ev))
        copy_us, gemm_us, late = 0.0, 0.0, False
        for d, ev in marks:
            ev[3].synchronize()
            ev[1].synchronize()
            if d in copy_from:
                copy_us = max(copy_us, ev[2].elapsed_time(ev[3]) * 1e3)
            if d in gemm_on:
                gemm_us = max(gemm_us, ev[0].elapsed_time(ev[1]) * 1e3)
                late = late or (d in copy_from and ev[0].elapsed_time(ev[3]) > ev[0].elapsed_time(ev[1]))
        return copy_us, gemm_us, late


PATTERNS = {
    "both/both": ((0, 1), (0, 1)),
    "src/0->1": ((0,), (0,)),
    "dst/0->1": ((1,), (0,)),
    "none/both": ((), (0, 1)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=_shape, nargs="+",
                    default=[(16384, 8192, 1024), (8192, 8192, 4096), (4096, 8192, 14336)])
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--kernel", choices=["cublas", "fo"], default="cublas",
                    help="the GEMM: torch.matmul, or flashoverlap.gemm (the overlapped ops' kernel, no signals)")
    ap.add_argument("--src", choices=["own", "c"], default="own",
                    help="what the copies read: a buffer of their own, or the GEMM's output as it is rewritten")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    torch.ones(1, device=0).to(1)  # peer access on, both ways
    torch.ones(1, device=1).to(0)
    print(f"# {torch.cuda.get_device_name(0)} x2; GEMM {args.kernel}, copies from {args.src}; {args.copies} copies of {args.mib} MiB into the peer on one "
          f"stream beside back-to-back cuBLAS GEMMs; median of {args.trials}; GB/s = bytes one GPU sends / time; "
          f"copy x = copies' time / alone; gemm x = GEMMs' time / alone; * = copies outlasted the GEMMs")
    print(f"{'shape':>18} {'gemms':>5} {'pattern':>10} {'copies us':>10} {'GB/s':>6} {'copy x':>7} "
          f"{'gemms us':>9} {'gemm x':>7}")
    for shape in args.shapes:
        # Enough GEMMs to outlast the copies at a quarter of their rate alone.
        probe = Rig(shape, args.mib, args.copies, 1, args.kernel, args.src)
        probe.trial((0, 1), ())
        one = statistics.median(probe.trial((0, 1), ())[1] for _ in range(3))
        bytes_us = args.copies * (args.mib << 20) / 360e3  # us at ~360 GB/s
        gemms = max(1, int(4 * bytes_us / one) + 1)
        del probe
        rig = Rig(shape, args.mib, args.copies, gemms, args.kernel, args.src)
        rig.trial((0, 1), (0, 1))
        alone_gemm = statistics.median(rig.trial((0, 1), ())[1] for _ in range(args.trials))
        alone_copy = None
        for name in ("none/both", "both/both", "src/0->1", "dst/0->1"):
            gemm_on, copy_from = PATTERNS[name]
            runs = [rig.trial(gemm_on, copy_from) for _ in range(args.trials)]
            cu = statistics.median(r[0] for r in runs)
            gu = statistics.median(r[1] for r in runs)
            late = any(r[2] for r in runs)
            if name == "none/both":
                alone_copy = cu
            gb = args.copies * (args.mib << 20) / cu / 1e3
            gx = f"{gu / alone_gemm:6.3f}x" if gemm_on else "      -"
            gs = f"{gu:9.1f}" if gemm_on else "        -"
            print(f"{'x'.join(map(str, shape)):>18} {gemms:>5} {name:>10} {cu:10.1f} {gb:6.0f} "
                  f"{cu / alone_copy:6.2f}x {gs} {gx}{' *' if late else ''}")
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if not args.src == "c" and not torch.equal(rig.dst[1].cpu(), rig.src[0].cpu()):
            raise SystemExit("copies did not land intact")
        del rig


if __name__ == "__main__":
    main()
