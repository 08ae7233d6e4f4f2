"""What cutting a batch in two costs the GEMMs (TokenWeave's token splitting), on one GPU.

Token weaving runs each layer's GEMMs on two halves of the batch instead of once on all of it. An
even cut can cost a wave: each half's GEMM ends in a partial wave of its own. `token_split` cuts
on a row band near the middle where the halves run the layer's GEMMs in the fewest waves. This
script times, for a Llama-3-70B layer at tensor parallelism 2 (o_proj 8192 x 4096, gate_up
28672 x 8192, down 8192 x 14336; N x K per rank), the layer's three GEMMs on the whole batch and
on two halves cut three ways: even (T/2), `token_split(T, layer)` (the default), and the first
rule this library tried, the cut that keeps gate_up's waves alone with no bound on how uneven the
halves get (`token_split(T, [gate_up], skew=1)`), with cuBLAS (torch.matmul) and with
flashoverlap's kernel (flashoverlap.gemm, whose 128 x 256 tiles the cut assumes). Ratio = halves /
whole: 1.000 means the split costs the GEMMs nothing.

Correctness first: each variant's output rows against the fp32 product (relative error).
Timing: random bf16 data, every call on the next of four operand sets, CUDA events, variants
interleaved (flashoverlap.bench.interleaved_times_us), median of --iters after warm-up.

    python evaluation/bench_token_split.py [--iters 30] [--out evaluation/results/token_split_h200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import flashoverlap
from flashoverlap.bench import interleaved_times_us, write_lines
from flashoverlap.weaving import gemm_waves

GEMMS = {"o_proj": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)}
TOKENS = [1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384]
BUFFERS = 4
TOLERANCE = 1e-2


CUTS = ("whole", "even", "layer", "gate_up")


def _halves(split: flashoverlap.TokenSplit) -> tuple[int, ...]:
    return (split.first, split.second) if split.second else (split.first,)


def _cuts(tokens: int) -> dict[str, tuple[int, ...]]:
    return {"whole": (tokens,), "even": (tokens // 2, tokens - tokens // 2),
            "layer": _halves(flashoverlap.token_split(tokens, list(GEMMS.values()))),
            "gate_up": _halves(flashoverlap.token_split(tokens, [GEMMS["gate_up"]], skew=1.0))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    parser.add_argument("--out", default=None, help="write <out>.txt and <out>.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_token_split: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    dtype = torch.bfloat16
    weights = {name: [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(BUFFERS)]
               for name, (n, k) in GEMMS.items()}
    matmuls = {"cublas": lambda x, w: torch.matmul(x, w.T), "fo": flashoverlap.gemm}

    split_cuts = CUTS[1:]
    lines = [f"# token splitting: a Llama-3-70B TP=2 layer's GEMMs on the whole batch vs two halves, "
             f"1 x {props.name} ({sms} SMs), bf16, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; "
             f"command: python evaluation/bench_token_split.py {' '.join(sys.argv[1:])}",
             f"# us: median of {args.iters} interleaved iterations of the three GEMMs (o_proj, gate_up, down) "
             f"on the whole batch and on the halves of each cut (even: T/2; layer: token_split(T, layer), the "
             f"default; gate_up: token_split(T, [gate_up], skew=1), the first rule); x = halves / whole "
             f"(1.000: the split is free); waves: the layer's waves at 128 x 256 tiles on {sms} CTAs "
             f"(whole/even/layer/gate_up)",
             f"{'tokens':>6} {'layer cut':>11} {'gate_up cut':>11} {'waves':>15} {'lib':>6} {'whole':>9} "
             + " ".join(f"{c:>9} {'x':>6}" for c in split_cuts) + f" {'max err':>8}"]
    print("\n".join(lines), flush=True)
    rows, failures = [], []
    for tokens in args.tokens:
        cuts = _cuts(tokens)
        xs = {name: [torch.randn(tokens, k, device=dev, dtype=dtype) for _ in range(BUFFERS)]
              for name, (_, k) in GEMMS.items()}
        # Halves are views of the batch: the woven layer reads its halves in place.
        parts = {cut: [(sum(sizes[:i]), size) for i, size in enumerate(sizes)] for cut, sizes in cuts.items()}
        worst = 0.0
        for name in GEMMS:
            x, w = xs[name][0], weights[name][0]
            ref = x.float() @ w.float().T
            for lib, mm in matmuls.items():
                for cut, pieces in parts.items():
                    got = torch.cat([mm(x.narrow(0, at, size), w) for at, size in pieces])
                    err = ((got.float() - ref).norm() / ref.norm()).item()
                    worst = max(worst, err)
                    if not err <= TOLERANCE:
                        failures.append(f"{tokens} tokens {lib} {cut} {name}: relative error {err:.2e}")
            del ref
        fns = {}
        for lib, mm in matmuls.items():
            for cut, pieces in parts.items():
                def run(i: int, mm=mm, pieces=pieces) -> None:
                    b = i % BUFFERS
                    for name in GEMMS:
                        x, w = xs[name][b], weights[name][b]
                        for at, size in pieces:
                            mm(x.narrow(0, at, size), w)
                fns[f"{lib}_{cut}"] = run
        times = {name: statistics.median(v) for name, v in interleaved_times_us(fns, args.iters, args.warmup).items()}
        waves = "/".join(str(sum(gemm_waves(h, n, ctas=sms) for h in cuts[c] for n, _ in GEMMS.values()))
                         for c in CUTS)
        for lib in matmuls:
            row = {"tokens": tokens, "lib": lib, "waves": waves, "max_err": worst}
            for c in CUTS:
                row[f"{c}_cut"] = "+".join(map(str, cuts[c]))
                row[f"{c}_us"] = times[f"{lib}_{c}"]
                row[f"{c}_ratio"] = times[f"{lib}_{c}"] / times[f"{lib}_whole"]
            rows.append(row)
            line = (f"{tokens:>6} {row['layer_cut']:>11} {row['gate_up_cut']:>11} {waves:>15} {lib:>6} "
                    f"{row['whole_us']:>9.1f} "
                    + " ".join(f"{row[f'{c}_us']:>9.1f} {row[f'{c}_ratio']:>6.3f}" for c in split_cuts)
                    + f" {worst:>8.1e}")
            lines.append(line)
            print(line, flush=True)
        del xs
    for lib in matmuls:
        mine = [r for r in rows if r["lib"] == lib]
        lines.append(f"# {lib}: halves / whole, geometric mean over token counts (worst): " + ", ".join(
            f"{c} {statistics.geometric_mean([r[f'{c}_ratio'] for r in mine]):.3f} "
            f"({max(r[f'{c}_ratio'] for r in mine):.3f})" for c in split_cuts))
    lines += [f"FAIL {f}" for f in failures] or ["correctness: every variant within "
                                                 f"{TOLERANCE} of the fp32 product"]
    print("\n".join(lines[-3:]), flush=True)
    if args.out:
        write_lines(args.out + ".txt", lines)
        with open(args.out + ".json", "w") as f:
            json.dump({"device": props.name, "sms": sms, "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
