"""Checks of flashoverlap.nn's layers, run on every rank of a group: each rank's layer holds its
columns of one whole linear layer, and its outputs and gradients must be those of the whole layer
computed in fp32 (outputs: the whole output, or this rank's block of tokens; gradients: this rank's
columns). tests/test_nn.py runs them on the CPU with stand-in ops (the layers' own logic: shapes,
bias, the backward's AllGather); tests/gpu/test_nn_layers.py with the real ops. Returns the failures.
"""

from __future__ import annotations

import torch

TOLERANCE = 1e-2


def _error(got: torch.Tensor, ref: torch.Tensor, what: str):
    if tuple(got.shape) != tuple(ref.shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    got = got.float()
    if not torch.isfinite(got).all():
        return f"{what}: non-finite values"
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    return None if err <= TOLERANCE else f"{what}: relative error {err:.3e} > {TOLERANCE}"


def _problem(seed: int, world: int, s: int, b: int, n: int, k_share: int, dtype, device):
    """The whole layer's inputs, the same on every rank: x [s, b, K], weight [n, K], bias, two
    probes (the loss is sum(out * probe) [+ sum(residual_out * probe2)]), rounded to dtype."""
    gen = torch.Generator().manual_seed(seed)
    k = k_share * world
    x = torch.randn(s, b, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    bias, residual, norm_weight = (torch.randn(n, generator=gen), torch.randn(s, b, n, generator=gen),
                                   1 + 0.1 * torch.randn(n, generator=gen))
    probe, probe2 = torch.randn(s, b, n, generator=gen), torch.randn(s, b, n, generator=gen)
    return [t.to(dtype).to(device) for t in (x, w, bias, residual, norm_weight)] + [probe.to(device),
                                                                                   probe2.to(device)]


def _whole_layer(w: torch.Tensor, bias: torch.Tensor) -> torch.nn.Linear:
    """The whole layer as an nn.Linear holding w and bias (which the layers under test slice)."""
    whole = torch.nn.Linear(w.shape[1], w.shape[0], dtype=w.dtype, device=w.device)
    with torch.no_grad():
        whole.weight.copy_(w)
        whole.bias.copy_(bias)
    return whole


def row_parallel_checks(rank: int, world: int, device, seed: int, dtype=torch.bfloat16, s: int = 192, b: int = 2,
                        n: int = 512, k_share: int = 256, **options) -> list:
    """RowParallelLinear (both reductions, with grads and without) and RowParallelLinearAddRMSNorm
    (the fused op without grads, the composition with them) against the whole layer."""
    from flashoverlap import nn as fnn

    failures = []

    def expect(got, ref, what):
        err = _error(got, ref, f"rank {rank} {what}")
        if err:
            failures.append(err)

    x, w, bias, residual, norm_weight, probe, probe2 = _problem(seed, world, s, b, n, k_share, dtype, device)
    cols = slice(rank * k_share, (rank + 1) * k_share)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    # The whole layer in fp32, on the rounded values.
    xf = x.float().requires_grad_(True)
    wf = w.float().requires_grad_(True)
    bf = bias.float().requires_grad_(True)
    y = xf @ wf.t() + bf
    (y * probe).sum().backward()

    whole = _whole_layer(w, bias)
    for reduce in ("all_reduce", "reduce_scatter"):
        layer = fnn.RowParallelLinear.from_linear(whole, sharded=False, reduce=reduce, **options)
        if layer.weight.shape != (n, k_share):
            failures.append(f"{reduce}: weight shape {tuple(layer.weight.shape)}")
        part = (slice(None),) if reduce == "all_reduce" else (rows,)
        x_r = x[..., cols].clone().requires_grad_(True)
        out = layer(x_r)
        expect(out, y.detach()[part], f"{reduce} output")
        (out.float() * probe[part]).sum().backward()
        expect(x_r.grad, xf.grad[..., cols], f"{reduce} x grad")
        expect(layer.weight.grad, wf.grad[:, cols], f"{reduce} weight grad")
        expect(layer.bias.grad, probe[part].sum((0, 1)), f"{reduce} bias grad (this rank's tokens)")
        if (reduce == "reduce_scatter") != bool(getattr(layer.bias, "sequence_parallel", False)):
            failures.append(f"{reduce}: bias.sequence_parallel is {getattr(layer.bias, 'sequence_parallel', None)}")
        with torch.no_grad():
            plain, skipped = fnn.RowParallelLinear.from_linear(whole, sharded=False, reduce=reduce,
                                                               skip_bias_add=True, **options)(x[..., cols])
        expect(plain + skipped, y.detach()[part], f"{reduce} skip_bias_add")

    # Output projection + residual add + RMSNorm, with vLLM's rounding: r = round(round(y) + res).
    eps = 1e-5
    fused = fnn.RowParallelLinearAddRMSNorm(k_share * world, n, bias=False, eps=eps, dtype=dtype, device=device,
                                            **options)
    with torch.no_grad():
        fused.linear.weight.copy_(w[:, cols])
        fused.norm_weight.copy_(norm_weight)
    xf2 = x.float().requires_grad_(True)
    r = (xf2 @ w.float().t()).to(dtype).float() + residual.float()
    r = r + (r.to(dtype).float() - r).detach()  # rounded as the op rounds it, gradient unchanged
    ref_out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    ((ref_out * probe).sum() + (r * probe2).sum()).backward()
    with torch.no_grad():
        out, res = fused(x[..., cols], residual)
    expect(out, ref_out.detach(), "add_rmsnorm out (fused op)")
    expect(res, r.detach(), "add_rmsnorm residual (fused op)")
    x_r = x[..., cols].clone().requires_grad_(True)
    out, res = fused(x_r, residual)
    expect(out, ref_out.detach(), "add_rmsnorm out (with grad)")
    expect(res, r.detach(), "add_rmsnorm residual (with grad)")
    ((out.float() * probe).sum() + (res.float() * probe2).sum()).backward()
    expect(x_r.grad, xf2.grad[..., cols], "add_rmsnorm x grad")
    return failures


def graph_checks(rank: int, world: int, device, seed: int, replays: int = 4, dtype=torch.bfloat16, s: int = 192,
                 b: int = 2, n: int = 512, k_share: int = 256, **options) -> list:
    """The layers captured in a CUDA graph after one eager call (as vLLM captures its decode
    steps), replayed on fresh inputs copied into the captured ones, against the whole layer."""
    from flashoverlap import nn as fnn

    failures = []
    cols = slice(rank * k_share, (rank + 1) * k_share)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    x, w, bias, residual, norm_weight, _, _ = _problem(seed, world, s, b, n, k_share, dtype, device)
    whole = _whole_layer(w, bias)
    layers = {reduce: fnn.RowParallelLinear.from_linear(whole, sharded=False, reduce=reduce, **options)
              for reduce in ("all_reduce", "reduce_scatter")}
    fused = fnn.RowParallelLinearAddRMSNorm(k_share * world, n, eps=1e-5, dtype=dtype, device=device, **options)
    with torch.no_grad():
        fused.linear.weight.copy_(w[:, cols])
        fused.norm_weight.copy_(norm_weight)
    static_x, static_res = x[..., cols].clone(), residual.clone()

    def step():
        return [layers["all_reduce"](static_x), layers["reduce_scatter"](static_x), *fused(static_x, static_res)]

    with torch.no_grad():
        step()  # the ops' first call of each shape makes their plans and tables, outside capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for i in range(replays):
            x, _, _, residual, _, _, _ = _problem(seed + 1 + i, world, s, b, n, k_share, dtype, device)
            static_x.copy_(x[..., cols])
            static_res.copy_(residual)
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            y = x.float() @ w.float().t()
            r = (y.to(dtype).float() + residual.float()).to(dtype).float()
            norm = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()
            for got, ref, what in zip(outs, (y + bias.float(), (y + bias.float())[rows], norm, r),
                                      ("all_reduce", "reduce_scatter", "add_rmsnorm out", "add_rmsnorm residual")):
                err = _error(got, ref, f"rank {rank} replay {i} {what}")
                if err:
                    failures.append(err)
    return failures


def compiled_checks(rank: int, world: int, device, seed: int, dtype=torch.bfloat16, s: int = 128, b: int = 2,
                    n: int = 512, k_share: int = 256, **options) -> list:
    """The layers under torch.compile: the same outputs as eager (the same op runs), and with
    gradients the same gradients."""
    from flashoverlap import nn as fnn

    failures = []
    cols = slice(rank * k_share, (rank + 1) * k_share)
    x, w, bias, residual, _, _, _ = _problem(seed, world, s, b, n, k_share, dtype, device)
    whole = _whole_layer(w, bias)
    fused = fnn.RowParallelLinearAddRMSNorm(k_share * world, n, eps=1e-5, dtype=dtype, device=device, **options)
    for what, module, args in (
            [(reduce, fnn.RowParallelLinear.from_linear(whole, sharded=False, reduce=reduce, **options), ())
             for reduce in ("all_reduce", "reduce_scatter")] + [("add_rmsnorm", fused, (residual,))]):
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=False)
        with torch.no_grad():
            eager, got = module(x[..., cols], *args), compiled(x[..., cols], *args)
        for e, g in zip(eager if isinstance(eager, tuple) else (eager,), got if isinstance(got, tuple) else (got,)):
            if not torch.equal(e, g):
                failures.append(f"rank {rank} {what}: compiled output differs from eager")
        if what == "add_rmsnorm":
            continue
        grads = []
        for fn in (module, compiled):
            x_r = x[..., cols].clone().requires_grad_(True)
            module.weight.grad = None
            fn(x_r).float().square().sum().backward()
            grads.append((x_r.grad, module.weight.grad))
        for (e, g), name in zip(zip(*grads), ("x", "weight")):
            err = _error(g, e.float(), f"rank {rank} {what} compiled {name} grad")
            if err:
                failures.append(err)
    return failures
