"""The pipelined all_reduce_rmsnorm kernel against the unpipelined one on ONE GPU: two emulated
ranks, each with its own peer buffer on the same device and its own stream, run the kernel
concurrently (as tests/gpu/test_allreduce_rmsnorm_kernel.py does). Every "peer" store and load is
local HBM traffic, so this does not time NVLink and says nothing of the 2-GPU bar; it measures
what the extra steps cost (a fence, flags and a wait per part) and whether cutting each CTA's
rows into parts changes the kernel's own speed. Times are of both ranks' kernels together (the
stream fork before and the join after each call), median of CUDA-event-timed interleaved
iterations under load (flashoverlap.bench.interleaved_times_us); the default config is the
baseline, in the same run. Each config is first checked against the fp32 composition.

    python evaluation/norm_stages_one_gpu.py [--tokens 2048 4096 8192 16384] [--ctas 32]
        [--configs 512x4s2 512x4s4 512x2s4] [--iters 30] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_all_reduce_rmsnorm import config_name, parse_config  # noqa: E402

from flashoverlap import _core  # noqa: E402
from flashoverlap.bench import interleaved_times_us  # noqa: E402

WORLD, HIDDEN, EPS, SETS = 2, 8192, 1e-6, 2
TIMEOUT_NS = 10_000_000_000


class Ranks:
    """WORLD emulated ranks on one device: zeroed buffers, a stream each."""

    def __init__(self, max_tokens: int):
        self.nbytes = _core.allreduce_rmsnorm_buffer_bytes(WORLD, max_tokens, HIDDEN, "bfloat16")
        self.buffers = [torch.zeros(self.nbytes, dtype=torch.uint8, device="cuda") for _ in range(WORLD)]
        self.bases = [b.data_ptr() for b in self.buffers]
        self.streams = [torch.cuda.Stream() for _ in range(WORLD)]

    def launch(self, xs, residual, weight, outs, res_outs, ctas: int, config) -> None:
        main = torch.cuda.current_stream()
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            _core.allreduce_rmsnorm_launch(0, (xs[r].data_ptr(), residual.data_ptr(), weight.data_ptr(),
                                               outs[r].data_ptr(), res_outs[r].data_ptr()),
                                           self.bases, self.nbytes, r, xs[r].shape[0], HIDDEN, EPS, True,
                                           "bfloat16", ctas, TIMEOUT_NS, s.cuda_stream, config=config)
        for s in self.streams:
            main.wait_stream(s)

    def errors(self) -> list[int]:
        return [int(b[8:12].view(torch.int32).item()) for b in self.buffers]


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def check(ranks: Ranks, tokens: int, ctas: int, config) -> float:
    """Max relative error over ranks and outputs against the fp32 composition (fresh inputs)."""
    xs = [torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(WORLD)]
    residual = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
    outs = [torch.full_like(xs[0], float("nan")) for _ in range(WORLD)]
    res_outs = [torch.full_like(xs[0], float("nan")) for _ in range(WORLD)]
    ranks.launch(xs, residual, weight, outs, res_outs, ctas, config)
    torch.cuda.synchronize()
    if any(ranks.errors()):
        raise RuntimeError(f"a wait timed out: {tokens} tokens, config {config}")
    s = torch.stack([x.float() for x in xs]).sum(0).to(torch.bfloat16)
    r = (s.float() + residual.float()).to(torch.bfloat16).float()
    out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return max(max(rel(o, out), rel(q, r)) for o, q in zip(outs, res_outs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--ctas", type=int, default=32, help="CTAs per emulated rank")
    p.add_argument("--configs", type=parse_config, nargs="+", default=[parse_config(c) for c in
                                                                       ("512x4s2", "512x4s4", "512x2s4")])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="path without extension: writes .txt and .json")
    args = p.parse_args()

    configs = [None] + list(args.configs)
    names = ["default"] + [config_name(c) for c in args.configs]
    ranks = Ranks(max(args.tokens))
    rows = []
    for tokens in args.tokens:
        errors = {n: check(ranks, tokens, args.ctas, c) for n, c in zip(names, configs)}
        sets = [([torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(WORLD)],
                 torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)) for _ in range(SETS)]
        weight = (torch.rand(HIDDEN, device="cuda") + 0.5).to(torch.bfloat16)
        outs = [torch.empty(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2 * WORLD)]

        def call(config):
            def run(i):
                xs, residual = sets[i % SETS]
                ranks.launch(xs, residual, weight, outs[:WORLD], outs[WORLD:], args.ctas, config)
            return run

        times = interleaved_times_us({n: call(c) for n, c in zip(names, configs)}, args.iters, args.warmup)
        if any(ranks.errors()):
            raise RuntimeError(f"a wait timed out while timing {tokens} tokens")
        med = {n: statistics.median(v) for n, v in times.items()}
        stages = {n: _core.allreduce_rmsnorm_stages(tokens, WORLD, args.ctas, c) for n, c in zip(names, configs)}
        rows.append({"tokens": tokens, "us": med, "stages": stages, "max_rel_err": errors})
        del sets, outs

    header = (f"# all_reduce_rmsnorm, {WORLD} ranks emulated on ONE {torch.cuda.get_device_name()} (no NVLink: "
              f"every peer access is local), hidden {HIDDEN}, bf16, residual full, {args.ctas} CTAs per rank; "
              f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; command: "
              f"python {' '.join(sys.argv)}")
    lines = [header, "# us: median over both ranks' kernels per call; x = default / config (> 1: the config is "
             "faster); [s] = parts per CTA the call ran",
             f"{'tokens':>6} {'default':>9} " + " ".join(f"{n:>20}" for n in names[1:]) + "  max err"]
    for r in rows:
        cells = [f"{r['us'][n]:>9.1f} {r['us']['default'] / r['us'][n]:>6.3f}x [{r['stages'][n]}]"
                 for n in names[1:]]
        lines.append(f"{r['tokens']:>6} {r['us']['default']:>9.1f} " + " ".join(f"{c:>20}" for c in cells)
                     + f"  {max(r['max_rel_err'].values()):.1e}")
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".txt", "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(args.out + ".json", "w") as f:
            json.dump({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "ctas": args.ctas,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
