"""Token weaving end to end: a tensor-parallel decoder layer's GEMMs and its two AllReduce +
residual + RMSNorm, run on the whole batch and woven over two halves (TokenWeave), one process
per GPU, all variants in the same run.

The layer (Llama-3-70B at tensor parallelism 2, per rank; attention itself left out, its
output taken as the first 4096 columns of the QKV projection): QKV 5120 x 8192, o_proj 8192 x 4096,
AllReduce + add + RMSNorm, gate_up 28672 x 8192, down 8192 x 14336 (on the first 14336 columns
of gate_up's output after a ReLU), AllReduce + add + RMSNorm; `--layers` of them in a row.

Variants, each the whole forward of every layer:
  compute      the GEMMs alone, no communication (what overlap could at best reach)
  nccl         whole batch: GEMMs, NCCL all_reduce, torch add-RMSNorm (the unfused composition)
  fused        whole batch: GEMMs, then flashoverlap.all_reduce_rmsnorm (16 CTAs) on the same stream
  weave        flashoverlap.weave over token_split(T, layer): all_reduce_rmsnorm on 8 CTAs on the
               side stream while the other half's GEMMs run
  weave_even   the same over the even halves T/2
  weave_shard  weave with residual_out="sharded": each rank keeps only its slice of each half's
               residual from one call to the next (TokenWeave's layout; less NVLink traffic)
Speedups are nccl / variant. Correctness first: every variant's output and residual against the
nccl variant's (relative error, max over ranks).

    python evaluation/bench_weave.py [--world-size 2] [--layers 2] [--iters 20]
        [--out evaluation/results/bench_weave_h200x2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

import flashoverlap
from flashoverlap import bench
from flashoverlap.peer_norm import torch_add_rms_norm

HIDDEN = 8192
GEMMS = {"qkv": (5120, 8192), "o_proj": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)}
TOKENS = [1024, 2048, 4096, 8192, 16384]
EPS = 1e-5
TOLERANCE = 1e-2
VARIANTS = ("compute", "nccl", "fused", "weave", "weave_even", "weave_shard")
SHORT = {"compute": "comp", "fused": "fused", "weave": "weave", "weave_even": "even", "weave_shard": "shard"}


class Layer:
    """One rank's shard of decoder layer `index` (random weights, scaled to keep activations
    O(1)): the GEMM weights are this rank's own, the RMSNorm weights the same on every rank, as
    in tensor parallelism (the fused kernel normalizes each rank's slice of the tokens with that
    rank's weight and shares the rows, so weights that differ by rank would not match NCCL)."""

    def __init__(self, device: torch.device, index: int, rank: int, gemms: dict = GEMMS, hidden: int = HIDDEN) -> None:
        gen = torch.Generator(device=device).manual_seed(100 * index + rank)
        self.w = {name: (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).bfloat16()
                  for name, (n, k) in gemms.items()}
        shared = torch.Generator(device=device).manual_seed(100 * index + 99)
        self.norms = [(torch.rand(hidden, generator=shared, device=device) + 0.5).bfloat16() for _ in range(2)]

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        return (h @ self.w["qkv"].T)[:, :self.w["o_proj"].shape[1]] @ self.w["o_proj"].T

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return torch.relu(h @ self.w["gate_up"].T)[:, :self.w["down"].shape[1]] @ self.w["down"].T


def _forward_whole(layers, h, res, reduce_norm):
    for layer in layers:
        h, res = reduce_norm(layer.attention(h), res, layer.norms[0])
        h, res = reduce_norm(layer.mlp(h), res, layer.norms[1])
    return h, res


def _woven_stages(layers, residual_out: str = "full"):
    stages = []
    for layer in layers:
        for part, norm in ((layer.attention, layer.norms[0]), (layer.mlp, layer.norms[1])):
            stages.append((lambda h, res, part=part: (part(h), res),
                           lambda y, res, norm=norm: flashoverlap.all_reduce_rmsnorm(
                               y, res, norm, EPS, ctas=8, residual_out=residual_out)))
    return stages


def _weave_sharded(stages, h, res, split):
    """Woven with the residual kept sharded (each rank holds its slice of each half's rows from
    the first call on): the hidden rows merged, the residual slices left as they are."""
    halves = flashoverlap.weave(stages, (h, res), split, merge=False)
    return torch.cat([half[0] for half in halves]), None


def _nccl_norm(y, res, norm):
    torch.distributed.all_reduce(y)
    return torch_add_rms_norm(y, res, norm, EPS)


def _fused_norm(y, res, norm):
    return flashoverlap.all_reduce_rmsnorm(y, res, norm, EPS, ctas=16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _max_over_ranks(v: float) -> float:
    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def measure(tokens: int, layers, iters: int, warmup: int, rank: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(1000 + tokens)  # the same on every rank
    sets = [(torch.randn(tokens, HIDDEN, generator=gen, device=device).bfloat16(),
             torch.randn(tokens, HIDDEN, generator=gen, device=device).bfloat16()) for _ in range(2)]
    layer_gemms = [GEMMS[name] for name in ("qkv", "o_proj", "gate_up", "down")]
    split = flashoverlap.token_split(tokens, layer_gemms)
    stages = _woven_stages(layers)
    sharded = _woven_stages(layers, "sharded")
    runs = {
        "compute": lambda h, res: _forward_whole(layers, h, res, lambda y, r, n: (y, r)),
        "nccl": lambda h, res: _forward_whole(layers, h, res, _nccl_norm),
        "fused": lambda h, res: _forward_whole(layers, h, res, _fused_norm),
        "weave": lambda h, res: flashoverlap.weave(stages, (h, res), split),
        "weave_even": lambda h, res: flashoverlap.weave(stages, (h, res), tokens // 2),
        "weave_shard": lambda h, res: _weave_sharded(sharded, h, res, split),
    }
    # Correctness first: every variant that communicates against the unfused composition.
    errors = {}
    want = runs["nccl"](*sets[0])
    for name in ("fused", "weave", "weave_even", "weave_shard"):
        got = runs[name](*sets[0])
        # weave_shard's residual stays in slices: its hidden rows (which the residual feeds) are compared.
        errors[name] = _max_over_ranks(max(_rel(g, w) for g, w in zip(got, want) if g is not None))
    del want
    times = bench.interleaved_times_us({name: (lambda i, fn=fn: fn(*sets[i % 2])) for name, fn in runs.items()},
                                       iters, warmup)
    row = {"tokens": tokens, "split": f"{split.first}+{split.second}", "waves": f"{split.unsplit_waves}/{split.waves}"}
    for name in VARIANTS:
        row[f"{name}_us"] = _max_over_ranks(statistics.median(times[name]))
    for name in VARIANTS:
        row[f"{name}_x"] = row["nccl_us"] / row[f"{name}_us"]
    row["max_err"] = max(errors.values())
    row["ok"] = all(e <= TOLERANCE for e in errors.values())
    return row


def _format(row: dict) -> str:
    return (f"{row['tokens']:>6} {row['split']:>11} {row['waves']:>9} "
            + " ".join(f"{row[f'{v}_us']:>11.1f}" for v in VARIANTS) + " "
            + " ".join(f"{row[f'{v}_x']:>7.3f}" for v in VARIANTS if v != "nccl")
            + f" {row['max_err']:>8.1e} {'ok' if row['ok'] else 'FAIL'}")


def _worker(rank: int, world: int, init_method: str, cfg: dict, result_path: str) -> None:
    bench.init_worker(rank, world, init_method)
    device = torch.device("cuda", rank)
    layers = [Layer(device, i, rank) for i in range(cfg["layers"])]
    rows = []
    for tokens in cfg["tokens"]:
        row = measure(tokens, layers, cfg["iters"], cfg["warmup"], rank)
        rows.append(row)
        if rank == 0:
            print(_format(row), flush=True)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(device),
                       "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f)
    flashoverlap.destroy_peer_groups()
    torch.distributed.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="*", default=TOKENS)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="write <out>.txt, <out>.csv and <out>.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_weave: needs CUDA GPUs", file=sys.stderr)
        return 2
    world = args.world_size or torch.cuda.device_count()
    cfg = {"layers": args.layers, "tokens": args.tokens, "iters": args.iters, "warmup": args.warmup}
    head = [f"# token weaving: {args.layers} Llama-3-70B TP={world} decoder layers (GEMMs + 2 x AllReduce + add + "
            f"RMSNorm each, attention left out), {world} x {torch.cuda.get_device_name(0)}, bf16, "
            f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}; command: python evaluation/bench_weave.py "
            f"{' '.join(sys.argv[1:] if argv is None else argv)}",
            "# us: median of interleaved iterations, max over ranks; x = nccl / variant; split = token_split(T, "
            "layer GEMMs); waves = the layer's GEMM waves whole/halves; err = max relative error vs nccl",
            f"{'tokens':>6} {'split':>11} {'waves':>9} " + " ".join(f"{v:>11}" for v in VARIANTS) + " "
            + " ".join(f"{'x ' + SHORT[v]:>7}" for v in VARIANTS if v != "nccl") + f" {'err':>8} verdict"]
    print("\n".join(head), flush=True)
    data = bench.spawn_ranks(_worker, world, cfg)
    rows = data["rows"]
    lines = head + [_format(r) for r in rows]
    for name in ("fused", "weave", "weave_even", "weave_shard", "compute"):
        xs = [r[f"{name}_x"] for r in rows]
        lines.append(f"# {name}: {statistics.geometric_mean(xs):.3f}x geometric mean over nccl, {min(xs):.3f}x worst")
    state = bench.gpu_state()
    warning = bench.slowdown_warning(state)
    if warning:
        lines.append(f"# {warning}")
    print("\n".join(lines[len(head) + len(rows):]), flush=True)
    if args.out:
        bench.write_outputs(args.out, lines, rows, {"device": data["device"], "nccl": data["nccl"],
                                                    "world": world, "gpu_state": state, **cfg})
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
