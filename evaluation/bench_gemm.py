"""flashoverlap's GEMM kernel against cuBLAS (torch.matmul) on one GPU.

First correctness: relative error against the fp32 product on shapes with M, N
and K tails, both dtypes, output memory poisoned with NaN first, for every
kernel variant, tile order and signaling configuration measured below. Then
speed over the 17 shapes of issue 3 (M in 2048..16384 x (N, K) in
{(8192, 4096), (8192, 14336), (8192, 1024), (8192, 3584)}, plus 8192^3):

  - the default launch (planner's kernel and raster) vs cuBLAS, bf16 and fp16;
  - each tile order (row-band = raster 1, and raster blocks of 4, 8, 16 bands)
    at each SM count the overlapped ops use (132, 116, 100 SMs);
  - the signaling epilogue (one counter per group of 4 row bands, row-band
    order) vs the same launch without signals, in a loop of their own;
  - each tile width (sm90_n128, sm90_n256) at the default raster;
  - the swizzled schedule's pieces, in a loop of their own: the GEMM storing
    staged tiles (position-major, into a staging buffer) vs the same launch
    storing into the output, at 132, 116 and 100 SMs, and the un-reorder copy
    of the whole output on 4, 8, 16 and 24 CTAs (its rate per SM is the
    predictor's `unreorder_bytes_per_us_per_sm`).

Every configuration of a shape is timed in the same interleaved loop as
cuBLAS: random data, every launch on the next of four operand sets (so none
finds its inputs in L2 from the launch before), CUDA events, median
of `--iters` runs after warm-up. Ratios are cuBLAS time / our time.

    python evaluation/bench_gemm.py [--quick] [--iters 30] [--out evaluation/results/gemm_kernel_h200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Callable

import torch

import flashoverlap
from flashoverlap import _core
from flashoverlap.bench import interleaved_times_us, write_lines

SHAPES = [(m, n, k) for m in (2048, 4096, 8192, 16384) for (n, k) in ((8192, 4096), (8192, 14336), (8192, 1024),
                                                                    (8192, 3584))] + [(8192, 8192, 8192)]
CHECK_SHAPES = [(128, 128, 64), (1, 8, 8), (77, 1024, 1024), (1000, 4096, 1024), (3000, 136, 4104),
                (4096, 8192, 4096), (300, 264, 72), (2100, 8192, 1000)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BUFFERS = 4


def dtype_name(dt: torch.dtype) -> str:
    return "bfloat16" if dt == torch.bfloat16 else "float16"


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: dict, staging=None) -> None:
    """One GEMM launch through the core API (signal_bands and staging are measurement hooks there)."""
    m, k = x.shape
    _core.gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, w.shape[0], k, dtype_name(x.dtype), x.device.index,
               torch.cuda.current_stream().cuda_stream, cfg.get("kernel"), cfg.get("raster"), cfg.get("sms"),
               cfg.get("signal"), 0 if staging is None else staging.data_ptr())


def unreorder(out: torch.Tensor, staging: torch.Tensor, cfg: dict, ctas: int) -> None:
    m, n = out.shape
    _core.unreorder(out.data_ptr(), staging.data_ptr(), m, n, dtype_name(out.dtype), out.device.index,
                    torch.cuda.current_stream().cuda_stream, ctas, cfg.get("kernel"), cfg.get("raster"),
                    cfg.get("sms"))


def staging_for(m: int, n: int, dt: torch.dtype) -> torch.Tensor:
    """A staging buffer for the widest tile (whole 128 x 256 tiles hold any narrower tiling)."""
    return torch.empty(-(-m // 128) * -(-n // 128) * 128 * 128 + 128 * 256, device="cuda", dtype=dt)


UNREORDER_CTAS = (4, 8, 16, 24)


def check_staged(sms: int) -> bool:
    """Staged stores then the un-reorder copy give the product, for every SM count measured."""
    ok = True
    for (m, n, k) in CHECK_SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().T
        for s in (sms, sms - 16, sms - 32):
            staging = staging_for(m, n, x.dtype).fill_(float("nan"))
            out = torch.full((m, n), float("nan"), device="cuda", dtype=x.dtype)
            launch(x, w, out, {"sms": s}, staging)
            unreorder(out, staging, {"sms": s}, 8)
            torch.cuda.synchronize()
            e, nan = rel(out, ref), bool(out.isnan().any())
            if not (e < 1e-2 and not nan):
                ok = False
                print(f"FAIL staged {m}x{n}x{k} sms {s}: err {e:.1e} nan {nan}", flush=True)
    return ok


def time_staged(m: int, n: int, k: int, sms: int, iters: int) -> dict:
    """Median microseconds of cuBLAS, of the GEMM storing in place and staged at each SM count,
    and of the un-reorder copy at each CTA count, interleaved run by run."""
    dt = torch.bfloat16
    xs = [torch.randn(m, k, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    ws = [torch.randn(n, k, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    outs = [torch.empty(m, n, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    stagings = [staging_for(m, n, dt) for _ in range(BUFFERS)]
    runs = {"cublas": lambda t: torch.matmul(xs[t % BUFFERS], ws[t % BUFFERS].t(), out=outs[t % BUFFERS])}
    for s in (sms, sms - 16, sms - 32):
        cfg = {"sms": s}
        runs[f"inplace{s}"] = (lambda c: lambda t: launch(xs[t % BUFFERS], ws[t % BUFFERS], outs[t % BUFFERS], c))(cfg)
        runs[f"staged{s}"] = (lambda c: lambda t: launch(xs[t % BUFFERS], ws[t % BUFFERS], outs[t % BUFFERS], c,
                                                         stagings[t % BUFFERS]))(cfg)
    for ctas in UNREORDER_CTAS:
        runs[f"unreorder{ctas}"] = (lambda c: lambda t: unreorder(outs[t % BUFFERS], stagings[t % BUFFERS],
                                                                  {"sms": sms - 32}, c))(ctas)
    times = interleaved_times_us(runs, iters, warmup=BUFFERS)
    return {name: statistics.median(v) for name, v in times.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def check(configs: dict) -> bool:
    ok = True
    for dname, dt in DTYPES.items():
        for (m, n, k) in CHECK_SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            w = torch.randn(n, k, device="cuda", dtype=dt)
            ref = x.float() @ w.float().T
            for name, cfg in configs.items():
                out = torch.full((m, n), float("nan"), device="cuda", dtype=dt)
                launch(x, w, out, cfg)
                torch.cuda.synchronize()
                e, nan = rel(out, ref), bool(out.isnan().any())
                if not (e < 1e-2 and not nan):
                    ok = False
                    print(f"FAIL {dname} {m}x{n}x{k} {name}: err {e:.1e} nan {nan}", flush=True)
    # The public wrapper too (default launch, batched leading dims).
    x = torch.randn(3, 50, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(136, 256, device="cuda", dtype=torch.bfloat16)
    ok &= rel(flashoverlap.gemm(x, w), x.float() @ w.float().T) < 1e-2
    print(f"correctness over {len(CHECK_SHAPES)} shapes x 2 dtypes x {len(configs)} configurations: "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def time_shape(m: int, n: int, k: int, dt: torch.dtype, configs: dict, iters: int) -> dict:
    """Median microseconds of cuBLAS and of each configuration, interleaved run by run."""
    # Every launch takes the next of BUFFERS operand sets, so no launch finds its inputs in L2
    # from the launch before (sets of the smallest shape are larger than the 60 MB L2).
    xs = [torch.randn(m, k, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    ws = [torch.randn(n, k, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    outs = [torch.empty(m, n, device="cuda", dtype=dt) for _ in range(BUFFERS)]
    runs = {"cublas": lambda t: torch.matmul(xs[t % BUFFERS], ws[t % BUFFERS].t(), out=outs[t % BUFFERS])}
    for name, cfg in configs.items():
        runs[name] = (lambda c: lambda t: launch(xs[t % BUFFERS], ws[t % BUFFERS], outs[t % BUFFERS], c))(cfg)
    times = interleaved_times_us(runs, iters, warmup=BUFFERS)
    return {name: statistics.median(v) for name, v in times.items()}

def report(props) -> tuple[list, Callable[[str], None]]:
    """A report's lines and the function that prints a line and keeps it, headed by the date,
    the GPU and the command."""
    lines = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {props.name}, {props.multi_processor_count} SMs, "
        f"torch {torch.__version__}; command: python {' '.join(sys.argv)}")
    return lines, say


def geomean(values) -> float:
    return statistics.geometric_mean(list(values))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="default launch only, bf16 and fp16")
    ap.add_argument("--out", default=None, help="write <out>.txt and <out>.json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    lines, say = report(props)
    say(f"# ratio = cuBLAS time / flashoverlap time (>1: faster than cuBLAS); median of {args.iters} interleaved runs")

    # Configurations: default launch, orders x SM counts, signaling, other tile width.
    reserved = [0] if args.quick else [0, 16, 32]
    configs = {"default": {}}
    if not args.quick:
        for r in reserved:
            for raster in (1, 4, 8, 16):
                configs[f"sms{sms - r}_r{raster}"] = {"sms": sms - r, "raster": raster}
        if props.major == 9:
            configs["n128"] = {"kernel": "sm90_n128"}
            configs["n256"] = {"kernel": "sm90_n256"}
    ok = check({**configs, "signal_r1": {"raster": 1, "signal": 4}, "signal_default": {"signal": 4}})
    ok &= check_staged(sms)
    print(f"staged stores + un-reorder correctness: {'ok' if ok else 'FAILED'}", flush=True)

    results = []
    for dname, dt in DTYPES.items():
        cfgs = configs if dname == "bf16" else {"default": {}}
        for (m, n, k) in SHAPES:
            t = time_shape(m, n, k, dt, cfgs, args.iters)
            flops = 2 * m * n * k / 1e6
            row = {"dtype": dname, "m": m, "n": n, "k": k, "us": t,
                   "tflops": {name: flops / us for name, us in t.items()}}
            results.append(row)
            extra = ""
            if not args.quick and dname == "bf16":
                # Signaling overhead in its own loop of the two launches alone, in the order
                # A B B A so that neither always follows the other.
                pair = {"plain_a": {"raster": 1}, "signal_a": {"raster": 1, "signal": 4},
                        "signal_b": {"raster": 1, "signal": 4}, "plain_b": {"raster": 1}}
                p = time_shape(m, n, k, dt, pair, 2 * args.iters)
                row["signal_overhead"] = (p["signal_a"] + p["signal_b"]) / (p["plain_a"] + p["plain_b"]) - 1
                extra = (f"  r1 {t['cublas'] / t['sms%d_r1' % sms]:.3f}  r16 {t['cublas'] / t['sms%d_r16' % sms]:.3f}"
                         f"  signal overhead {row['signal_overhead']:+.2%}")
            say(f"{dname} {m:>5}x{n}x{k:<5} cuBLAS {flops / t['cublas']:4.0f} TF  ours {flops / t['default']:4.0f} TF  "
                f"ratio {t['cublas'] / t['default']:.3f}{extra}")

    say("")
    for dname in DTYPES:
        rows = [r for r in results if r["dtype"] == dname]
        ratios = [r["us"]["cublas"] / r["us"]["default"] for r in rows]
        say(f"{dname} default launch vs cuBLAS: geomean {geomean(ratios):.3f}, min {min(ratios):.3f} over {len(rows)} shapes")
    bf = [r for r in results if r["dtype"] == "bf16"]
    if not args.quick:
        say("")
        say("bf16 TFLOP/s ratio vs cuBLAS (all SMs for cuBLAS), geomean over shapes, per SM count and tile order:")
        say("  SMs   " + "  ".join(f"raster {r:>2}" for r in (1, 4, 8, 16)))
        for r in reserved:
            cells = [geomean(x["us"]["cublas"] / x["us"][f"sms{sms - r}_r{raster}"] for x in bf)
                     for raster in (1, 4, 8, 16)]
            say(f"  {sms - r:>3}   " + "  ".join(f"{c:9.3f}" for c in cells))
        over = geomean(1 + x["signal_overhead"] for x in bf) - 1
        say(f"signaling overhead (geomean time ratio, row-band order, one counter per 4 bands vs no signals, "
            f"own A B B A loop of {2 * args.iters} runs): {over:+.2%} (max {max(x['signal_overhead'] for x in bf):+.2%})")
        for name in ("n128", "n256"):
            if name in configs:
                cells = " ".join(f"{x['us']['cublas'] / x['us'][name]:.3f}" for x in bf)
                say(f"sm90_{name} vs cuBLAS: geomean {geomean(x['us']['cublas'] / x['us'][name] for x in bf):.3f}; "
                    f"per shape {cells}")
    staged = []
    if not args.quick:
        say("")
        say("swizzled schedule pieces, bf16, own interleaved loop: staged-store GEMM time / in-place GEMM time "
            "per SM count; un-reorder copy of the whole output (us, and output bytes per us per CTA)")
        for (m, n, k) in SHAPES:
            t = time_staged(m, n, k, sms, args.iters)
            row = {"m": m, "n": n, "k": k, "us": t}
            staged.append(row)
            cells = "  ".join(f"{s}: {t[f'staged{s}'] / t[f'inplace{s}']:.3f}" for s in (sms, sms - 16, sms - 32))
            copies = "  ".join(f"{c}: {t[f'unreorder{c}']:6.1f} us {2 * m * n / t[f'unreorder{c}'] / c:6.0f}"
                               for c in UNREORDER_CTAS)
            say(f"  {m:>5}x{n}x{k:<5} staged/in place {cells}   un-reorder {copies}")
        for s in (sms, sms - 16, sms - 32):
            say(f"staged-store GEMM / in-place GEMM at {s} SMs: geomean "
                f"{geomean(r['us'][f'staged{s}'] / r['us'][f'inplace{s}'] for r in staged):.3f}")
        for c in UNREORDER_CTAS:
            rates = [2 * r["m"] * r["n"] / r["us"][f"unreorder{c}"] / c for r in staged]
            say(f"un-reorder on {c} CTAs: median {statistics.median(rates):.0f} output bytes per us per CTA "
                f"(min {min(rates):.0f}, max {max(rates):.0f})")
    say(f"correct={ok}")
    if args.out:
        write_lines(args.out + ".txt", lines)
        with open(args.out + ".json", "w") as f:
            json.dump({"device": props.name, "sms": sms, "configs": configs, "results": results, "staged": staged},
                      f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
