"""flashoverlap: GEMM kernels that signal finished waves of tiles, so that the
collective on each finished group overlaps the rest of the GEMM."""

from ._core import Plan, version as _version
from ._env import configure_logging as _configure_logging
from . import nn
from .collectives import all_reduce, reduce_scatter
from .communicator import Communicator, destroy_communicators, get_communicator
from .ops import (backend_of, compile_kernels, gemm, gemm_all_reduce, gemm_all_reduce_rmsnorm, gemm_all_to_all,
                  gemm_reduce_scatter, plan_of, reduce_scatter_plan_of)
from .peer_norm import all_reduce_rmsnorm, destroy_peer_groups
from .planning import AllToAllPrediction, plan_gemm_all_reduce, plan_gemm_all_to_all, plan_gemm_reduce_scatter
from .weaving import TokenSplit, token_split, weave

__version__ = _version()
_configure_logging()

__all__ = [
    "AllToAllPrediction",
    "Communicator",
    "Plan",
    "TokenSplit",
    "all_reduce",
    "all_reduce_rmsnorm",
    "backend_of",
    "compile_kernels",
    "destroy_communicators",
    "destroy_peer_groups",
    "gemm",
    "gemm_all_reduce",
    "gemm_all_reduce_rmsnorm",
    "gemm_all_to_all",
    "gemm_reduce_scatter",
    "nn",
    "get_communicator",
    "plan_gemm_all_reduce",
    "plan_gemm_all_to_all",
    "plan_gemm_reduce_scatter",
    "plan_of",
    "reduce_scatter",
    "reduce_scatter_plan_of",
    "token_split",
    "weave",
]
