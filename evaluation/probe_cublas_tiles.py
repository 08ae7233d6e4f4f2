"""Which kernel cuBLAS (torch.matmul) runs for the GEMMs of a Llama-3-70B TP=2 layer at several
token counts: its name (nvjet kernels carry their tile size) and grid, from a torch.profiler trace.
token_split assumes 128 x 256 tiles on one wave of SMs; this shows what cuBLAS actually tiles.

    python evaluation/probe_cublas_tiles.py > evaluation/results/cublas_tiles_h200.txt
"""
import json, os, tempfile, torch
from torch.profiler import profile, ProfilerActivity
GEMMS = {"qkv": (5120, 8192), "o_proj": (8192, 4096), "gate_up": (28672, 8192), "down": (8192, 14336)}
res = {}
for m in (512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096, 8192):
    for name, (n, k) in GEMMS.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for _ in range(2): torch.matmul(x, w.T)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.matmul(x, w.T); torch.cuda.synchronize()
        path = tempfile.mktemp(suffix=".json"); prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        os.remove(path)
        for e in ev:
            a = e.get("args", {})
            print(f"M={m:>5} {name:>8} grid={a.get('grid')} block={a.get('block')} regs={a.get('registers per thread')} smem={a.get('shared memory')} {e['name'][:150]}", flush=True)
