"""flashoverlap's GEMM kernel (both Hopper tile widths) against cuBLAS at small M, on one GPU: the
GEMMs of a Llama-3-70B TP=2 layer (QKV 5120 x 8192, o_proj 8192 x 4096, gate_up 28672 x 8192,
down 8192 x 14336; N x K) at M = 256 .. 2048 rows, where a data-parallel tiling has too few tiles to
fill the SMs evenly (it has no split-K or stream-K; cuBLAS does). Random bf16 data, four operand
sets rotated, variants interleaved (flashoverlap.bench.interleaved_times_us), median of 20.
x = cuBLAS time / ours (> 1: faster than cuBLAS).

    python evaluation/gemm_small_m.py > evaluation/results/gemm_small_m_h200.txt
"""
import statistics, torch, flashoverlap
from flashoverlap.bench import interleaved_times_us
GEMMS = {"qkv": (5120, 8192), "o_proj": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)}
print("M gemm cublas_us n256_x n128_x default_x (x = cuBLAS time / ours; default: flashoverlap.gemm's own choice)")
for m in (256, 512, 768, 1024, 1536, 2048):
    for name, (n, k) in GEMMS.items():
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        fns = {"cublas": lambda i: torch.matmul(xs[i % 4], ws[i % 4].T),
               "n256": lambda i: flashoverlap.gemm(xs[i % 4], ws[i % 4], kernel="sm90_n256"),
               "n128": lambda i: flashoverlap.gemm(xs[i % 4], ws[i % 4], kernel="sm90_n128"),
               "default": lambda i: flashoverlap.gemm(xs[i % 4], ws[i % 4])}
        t = {k2: statistics.median(v) for k2, v in interleaved_times_us(fns, 20, 3).items()}
        print(f"{m:>5} {name:>8} {t['cublas']:>8.1f} {t['cublas']/t['n256']:>6.3f} {t['cublas']/t['n128']:>6.3f} "
              f"{t['cublas']/t['default']:>6.3f}", flush=True)
