"""Tensor-parallel layers that drop into Megatron-LM and vLLM models, with their output
communication overlapped with their GEMM.

A row-parallel linear layer (the second linear of an MLP, the output projection of attention)
holds the columns of the weight that match this rank's share of the input features and ends in a
reduction of the partial outputs: an AllReduce (vLLM; Megatron without sequence parallelism) or a
ReduceScatter over the tokens (Megatron's sequence parallelism). Here that reduction is the
overlapped op (:func:`flashoverlap.gemm_all_reduce`, :func:`flashoverlap.gemm_reduce_scatter`),
and, for the decoder's "output projection, residual add, RMSNorm" step,
:func:`flashoverlap.gemm_all_reduce_rmsnorm`.

The layers are differentiable (the backward is the usual one, not overlapped: for the
ReduceScatter, an AllGather of the gradient over the tokens, then two GEMMs), so a training
step runs through them as it would through the framework's own layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import ops
from ._validation import SUPPORTED_DTYPES, check_eps
from .communicator import GroupLike, get_communicator
from .peer_norm import torch_add_rms_norm

_REDUCES = ("all_reduce", "reduce_scatter")
# Options each layer's op takes (RowParallelLinear's by its reduction).
_OP_OPTIONS = {
    "all_reduce": ("mode", "bands_per_group", "kernel", "backend", "order"),
    "reduce_scatter": ("mode", "bands_per_group", "kernel", "backend"),
    "all_reduce_rmsnorm": ("mode", "bands_per_group", "kernel", "backend"),
}


def _check_options(op: str, options: dict) -> None:
    unknown = sorted(set(options) - set(_OP_OPTIONS[op]))
    if unknown:
        raise TypeError(f"options: {', '.join(unknown)} not taken by {op} (it takes {', '.join(_OP_OPTIONS[op])})")


def _check_reduce(reduce: str, options: dict) -> None:
    if reduce not in _REDUCES:
        raise ValueError(f"reduce: expected one of {_REDUCES}, got {reduce!r}")
    _check_options(reduce, options)


class _RowParallel(torch.autograd.Function):
    """out = reduce(x @ weight.T) forward through the overlapped op; backward as Megatron's
    (the AllReduce's gradient is the output's, the ReduceScatter's is the AllGather of it)."""

    @staticmethod
    def forward(ctx, x, weight, reduce, communicator, options):
        ctx.save_for_backward(x, weight)
        ctx.reduce, ctx.communicator = reduce, communicator
        return _row_parallel(x, weight, reduce, communicator, options)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.reduce == "reduce_scatter":
            comm = ctx.communicator
            full = grad.new_empty((grad.shape[0] * comm.world_size, *grad.shape[1:]))
            dist.all_gather_into_tensor(full, grad, group=comm.group)
            grad = full
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w, None, None, None


def _row_parallel(x, weight, reduce, communicator, options):
    x = x.contiguous()  # the ops take contiguous operands; a layer takes any view, as nn.Linear does
    if reduce == "all_reduce":
        return ops.gemm_all_reduce(x, weight, communicator, **options)
    # The ReduceScatter splits the flattened tokens; with tokens first ([s, b, h], Megatron's
    # layout) that is the first dimension, as Megatron's sequence parallelism splits it.
    world = communicator.world_size
    if x.dim() < 2 or x.shape[0] % world:
        raise ValueError(f"x: expected [tokens, ..., K] with tokens divisible by the world size {world} "
                         f"(reduce='reduce_scatter' splits the first dimension), got shape {tuple(x.shape)}")
    out = ops.gemm_reduce_scatter(x.reshape(-1, x.shape[-1]), weight, communicator, **options)
    return out.view(x.shape[0] // world, *x.shape[1:-1], weight.shape[0])


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class RowParallelLinear(torch.nn.Module):
    """Row-parallel linear layer: ``reduce(x @ weight.T) + bias``, the reduction overlapped with the
    GEMM.

    in_features: the layer's whole input width; each rank holds in_features / world of it (the
      weight is [out_features, in_features / world], as in Megatron-LM and vLLM), and x is this
      rank's share of the input, [..., in_features / world].
    reduce: "all_reduce" (every rank gets [..., out_features]) or "reduce_scatter" (sequence
      parallelism: x's first dimension, the tokens, is split among the ranks, rank r getting
      [tokens / world, ..., out_features], the r-th block).
    bias: added once, after the reduction. With "reduce_scatter" its gradient holds this rank's
      tokens only and the parameter is marked ``sequence_parallel = True``, Megatron's sign that
      the gradient is to be summed over the group before the optimizer step.
    skip_bias_add: return (out, bias) with the bias not added (Megatron's and vLLM's option).
    options: passed to the op (mode, bands_per_group, kernel, backend, and order for the AllReduce).
    group: a ProcessGroup (default: world), a communicator name or a Communicator; its
      communicator is made (collectively) when the layer is.
    The weight is bfloat16 or float16 on the communicator's device (dtype default: bfloat16).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group: GroupLike = None, *,
                 reduce: str = "all_reduce", skip_bias_add: bool = False, dtype: Optional[torch.dtype] = None,
                 device=None, **options):
        super().__init__()
        _check_reduce(reduce, options)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        comm = get_communicator(group)
        world = comm.world_size
        if in_features % world:
            raise ValueError(f"in_features: {in_features} must be divisible by the world size {world}")
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected torch.bfloat16 or torch.float16, got {dtype}")
        device = comm.device if device is None else torch.device(device)
        weight = torch.nn.Parameter(torch.empty(out_features, in_features // world, dtype=dtype, device=device))
        self._set(comm, in_features, weight,
                  torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None,
                  reduce, skip_bias_add, options)
        self.reset_parameters()

    def _set(self, comm, in_features: int, weight, bias, reduce: str, skip_bias_add: bool, options: dict) -> None:
        """The layer's state, however made (a new layer or an existing nn.Linear's parameters)."""
        self.communicator = comm
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.reduce, self.skip_bias_add, self.options = reduce, skip_bias_add, dict(options)
        self.weight, self.bias = weight, bias
        if bias is not None and reduce == "reduce_scatter":
            bias.sequence_parallel = True

    def reset_parameters(self) -> None:
        # nn.Linear's initialization over the whole input width, each rank drawing its own columns.
        torch.nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: GroupLike = None, *, sharded: bool = True,
                    reduce: str = "all_reduce", skip_bias_add: bool = False, **options) -> "RowParallelLinear":
        """The layer for an existing nn.Linear. sharded=True: ``linear`` already holds this rank's
        columns ([out_features, in_features / world]); its parameters are shared, not copied, so
        whatever loads or trains them keeps doing so. sharded=False: ``linear`` is the whole
        layer ([out_features, in_features]) and this rank's columns are copied out of it."""
        _check_reduce(reduce, options)
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"linear: expected a torch.nn.Linear, got {type(linear).__name__}")
        comm = get_communicator(group)
        world, rank = comm.world_size, comm.rank
        width = linear.weight.shape[1]
        if sharded:
            weight, bias, in_features = linear.weight, linear.bias, width * world
        else:
            if width % world:
                raise ValueError(f"linear: in_features {width} must be divisible by the world size {world}")
            share = width // world
            columns = linear.weight.detach()[:, rank * share:(rank + 1) * share]
            weight = torch.nn.Parameter(columns.to(comm.device, copy=True).contiguous(),
                                        requires_grad=linear.weight.requires_grad)
            bias = None if linear.bias is None else torch.nn.Parameter(
                linear.bias.detach().to(comm.device, copy=True), requires_grad=linear.bias.requires_grad)
            in_features = width
        if weight.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"linear: expected a bfloat16 or float16 weight, got {weight.dtype}")
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._set(comm, in_features, weight, bias, reduce, skip_bias_add, options)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, reduce={self.reduce!r}, world={self.communicator.world_size}")

    def forward(self, x: torch.Tensor):
        if _needs_grad(x, self.weight):
            out = _RowParallel.apply(x, self.weight, self.reduce, self.communicator, self.options)
        else:
            out = _row_parallel(x, self.weight, self.reduce, self.communicator, self.options)
        if self.skip_bias_add:
            return out, self.bias
        return out if self.bias is None else out + self.bias


class RowParallelLinearAddRMSNorm(torch.nn.Module):
    """A row-parallel linear layer followed by vLLM's fused_add_rms_norm (the decoder's output
    projection, residual add and next RMSNorm), run as :func:`flashoverlap.gemm_all_reduce_rmsnorm`:
    ``residual_out = all_reduce(x @ weight.T) [+ bias] + residual``,
    ``out = rms_norm(residual_out) * norm_weight``; forward(x, residual) returns (out, residual_out).

    in_features, out_features, bias, group, dtype, device: as for :class:`RowParallelLinear`
    (reduce is the AllReduce). eps: the norm's epsilon. options: passed to the op (mode,
    bands_per_group, kernel, backend). With gradients enabled on any input or parameter, it runs
    the differentiable composition instead (the overlapped GEMM + AllReduce, then torch's add and
    RMSNorm in fp32), so training gets the same values and their gradients.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, group: GroupLike = None, *,
                 eps: float = 1e-6, dtype: Optional[torch.dtype] = None, device=None, **options):
        super().__init__()
        _check_options("all_reduce_rmsnorm", options)
        check_eps(eps)
        self.linear = RowParallelLinear(in_features, out_features, bias, group, dtype=dtype, device=device)
        self.eps, self.options = float(eps), dict(options)
        self.norm_weight = torch.nn.Parameter(torch.ones(out_features, dtype=self.linear.weight.dtype,
                                                         device=self.linear.weight.device))

    def extra_repr(self) -> str:
        return f"eps={self.eps}"

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        linear = self.linear
        if linear.bias is not None:
            residual = residual + linear.bias
        if _needs_grad(x, residual, linear.weight, self.norm_weight):
            options = {k: v for k, v in self.options.items() if k != "backend" or v != "peer"}
            reduced = _RowParallel.apply(x, linear.weight, "all_reduce", linear.communicator, options)
            return torch_add_rms_norm(reduced, residual, self.norm_weight, self.eps)
        return ops.gemm_all_reduce_rmsnorm(x.contiguous(), linear.weight, residual.contiguous(), self.norm_weight,
                                           self.eps, linear.communicator, **self.options)
