"""Environment variables (all prefixed FLASHOVERLAP_, documented in README.md)."""

from __future__ import annotations

import logging
import os
import re

_TRUE = {"1", "true", "yes", "on"}


def _int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {raw!r}") from None


def force_sequential() -> bool:
    """FLASHOVERLAP_FORCE_SEQUENTIAL=1: every op runs GEMM, then the collective."""
    return os.environ.get("FLASHOVERLAP_FORCE_SEQUENTIAL", "").strip().lower() in _TRUE


BACKENDS = ("auto", "nccl", "copy_engine")
# What the GEMM ops take beyond BACKENDS: "push", by argument only (the plain collectives have
# no GEMM to push from, so FLASHOVERLAP_BACKEND, which applies to every op, cannot name it).
GEMM_BACKENDS = (*BACKENDS, "push")


def reserved_sms() -> int | None:
    """FLASHOVERLAP_RESERVED_SMS: SMs left free of GEMM CTAs for the collectives. Unset: None,
    the planner's default per backend (NCCL: ``_core.NCCL_RESERVED_SMS``, 24, as its CTAs need
    them beside the GEMM; copy engines: 4 or 8 per shape for the reduction kernel (16 with a fused norm, the sum still on 8); none for All-to-All)."""
    v = _int("FLASHOVERLAP_RESERVED_SMS", None)
    if v is not None and v < 0:
        raise ValueError(f"FLASHOVERLAP_RESERVED_SMS: expected >= 0, got {v}")
    return v


def backend() -> str:
    """FLASHOVERLAP_BACKEND: what moves the bytes of the overlapped collectives when an op is not
    told: "auto" (default: per shape, whichever the predictor times fastest among NCCL, the copy
    engines and, for GEMM + AllReduce / ReduceScatter on 2 Hopper ranks, push; NCCL alone off one
    node), "nccl" or "copy_engine"."""
    v = os.environ.get("FLASHOVERLAP_BACKEND", "").strip().lower() or "auto"
    if v not in BACKENDS:
        raise ValueError(f"FLASHOVERLAP_BACKEND: expected one of {BACKENDS}, got {v!r}")
    return v


ORDERS = ("auto", "banded", "swizzled")


def order() -> str:
    """FLASHOVERLAP_ORDER: the overlapped plans' tile order and group layout (default "auto")."""
    v = os.environ.get("FLASHOVERLAP_ORDER", "auto")
    if v not in ORDERS:
        raise ValueError(f"FLASHOVERLAP_ORDER: expected one of {ORDERS}, got {v!r}")
    return v


CE_ALL_REDUCE = ("auto", "gather", "full")


def ce_all_reduce() -> str:
    """FLASHOVERLAP_CE_ALLREDUCE: how the copy engines' AllReduce shares its work: "auto" (default:
    ReduceScatter + AllGather beyond 2 ranks, one exchange of the whole group on 2), "gather"
    (ReduceScatter + AllGather on 2 ranks too) or "full" (one exchange, every rank summing
    everything). Read once per process by the core; every rank must set it alike."""
    v = os.environ.get("FLASHOVERLAP_CE_ALLREDUCE", "").strip().lower() or "auto"
    if v not in CE_ALL_REDUCE:
        raise ValueError(f"FLASHOVERLAP_CE_ALLREDUCE: expected one of {CE_ALL_REDUCE}, got {v!r}")
    return v


CE_SUMS_QUEUES = ("order", "own")


def ce_sums_queue() -> str:
    """FLASHOVERLAP_CE_SUMS_QUEUE: where the copy engines' gathered AllReduce (2 Hopper ranks) copies
    its sums into the peer: "order" (default: on the partials' stream, each copy where the GEMM
    finishes its part) or "own" (a stream of their own). Read once per process by the core; every
    rank must set it alike."""
    v = os.environ.get("FLASHOVERLAP_CE_SUMS_QUEUE", "").strip().lower() or "order"
    if v not in CE_SUMS_QUEUES:
        raise ValueError(f"FLASHOVERLAP_CE_SUMS_QUEUE: expected one of {CE_SUMS_QUEUES}, got {v!r}")
    return v


NORM_CONFIG_DEFAULT = (512, 4, 8, False, True)


def parse_norm_config(text: str) -> tuple:
    """'512x4' -> (512, 4, 1, False, False), '512x4s4' -> (512, 4, 4, False, False), '512x4s4o' ->
    (512, 4, 4, True, False), '512x4s8r' -> (512, 4, 8, False, True): the peer-memory AllReduce +
    RMSNorm kernel's threads per CTA, 16-byte vectors in flight per lane, the most parts each CTA
    pipelines its rows in, one-shot (o: on two ranks keeping the full residual, each rank sums and
    normalizes every row itself, one exchange instead of two) and the ring (r: rows move through
    shared memory in bulk copies, on Hopper where a row of each array fits twice; elsewhere the
    same shape on plain loads). ValueError for anything the kernel cannot be built as."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:s(\d+))?(o?)(r?)", text.strip().lower())
    if match is None:
        raise ValueError(f"expected THREADSxUNROLL[sSTAGES][o|r] such as 512x4, 512x4s4, 512x4s4o or 512x4s8r, "
                         f"got {text!r}")
    threads, unroll, stages, oneshot, ring = match.groups()
    config = (int(threads), int(unroll), int(stages or 1), oneshot == "o", ring == "r")
    from . import _core

    _core.allreduce_rmsnorm_stages(1, 1, 1, config)  # the core's range checks: ValueError
    return config


def format_norm_config(config) -> str:
    """(512, 4, 1, False, False) -> '512x4', (512, 4, 4, True) -> '512x4s4o', (512, 4, 8, False,
    True) -> '512x4s8r': parse_norm_config's inverse."""
    stages = config[2] if len(config) > 2 else 1
    oneshot = len(config) > 3 and config[3]
    ring = len(config) > 4 and config[4]
    return (f"{config[0]}x{config[1]}" + (f"s{stages}" if stages != 1 else "") + ("o" if oneshot else "")
            + ("r" if ring else ""))


def norm_config() -> tuple:
    """FLASHOVERLAP_NORM_CONFIG: the shape of the peer-memory AllReduce + RMSNorm kernel
    (all_reduce_rmsnorm, gemm_all_reduce_rmsnorm's backend="peer"),
    THREADSxUNROLL[sSTAGES][o|r]; default 512x4s8r (two-shot; a standalone call on 32 CTAs or more
    in up to 8 pipelined parts where at least 4 fit, else one; through the shared-memory ring on
    Hopper for the standalone calls, gemm_all_reduce_rmsnorm's calls on plain loads in one part;
    512x4s8: the same on plain loads everywhere; 512x4: one part always). Read when a peer group is
    made; every rank of a group must set it alike."""
    raw = os.environ.get("FLASHOVERLAP_NORM_CONFIG", "").strip()
    if not raw:
        return NORM_CONFIG_DEFAULT
    try:
        return parse_norm_config(raw)
    except ValueError as e:
        raise ValueError(f"FLASHOVERLAP_NORM_CONFIG: {e}") from None


# Where the copy engines take over by default: one-shot calls (the full residual) from 512 tokens
# (watched: 0.82x the kernel's time at 512 tokens, 0.76x at 1K, 1.26x at 128; 2x H200), two-shot
# ones (sharded) from 4K (at 2K they took 1.24x the kernel's time).
NORM_CE_MIN_TOKENS_FULL = 512
NORM_CE_MIN_TOKENS_SHARDED = 4096


def norm_copy_engines() -> tuple[int | None, int]:
    """(FLASHOVERLAP_NORM_CE_MIN_TOKENS, FLASHOVERLAP_NORM_CE_CHUNKS): all_reduce_rmsnorm on 2 ranks
    lets the copy engines move the rows (its CTAs only sum and normalize) from this many tokens on
    (unset: None, the library's NORM_CE_MIN_TOKENS_FULL for the full residual and
    NORM_CE_MIN_TOKENS_SHARDED for the sharded one; 0: never) on up to 32 CTAs, in this many row
    ranges (1-64; default 0: the library's way). Two-shot calls (the sharded residual) cut
    each slice, by default one range per 1024 rows, at most 6, the first and last half-size from
    5 on. One-shot calls (the full residual) by default send all the rows in one copy into a
    watch area whose values not yet landed hold a sentinel, which the kernel watches; a count
    (at most 16 used) cuts the rows into that many ranges instead, each 0.8 the size of the one
    before and followed by a flag the kernel waits for. Read when a peer group is made; every
    rank of a group must set them alike."""
    tokens = _int("FLASHOVERLAP_NORM_CE_MIN_TOKENS", None)
    chunks = _int("FLASHOVERLAP_NORM_CE_CHUNKS", 0)
    assert chunks is not None
    if tokens is not None and tokens < 0:
        raise ValueError(f"FLASHOVERLAP_NORM_CE_MIN_TOKENS: expected >= 0, got {tokens}")
    if not 0 <= chunks <= 64:
        raise ValueError(f"FLASHOVERLAP_NORM_CE_CHUNKS: expected 0 (by rows) or 1 to 64, got {chunks}")
    return tokens, chunks


def nccl_max_ctas() -> int | None:
    """FLASHOVERLAP_NCCL_MAX_CTAS: CTA cap of flashoverlap's NCCL communicators (default: the reserved SMs)."""
    v = _int("FLASHOVERLAP_NCCL_MAX_CTAS", None)
    if v is not None and v < 1:
        raise ValueError(f"FLASHOVERLAP_NCCL_MAX_CTAS: expected >= 1, got {v}")
    return v


def max_groups() -> int:
    """FLASHOVERLAP_MAX_GROUPS: most wave groups (collective calls) one op may issue (default 16)."""
    v = _int("FLASHOVERLAP_MAX_GROUPS", 16)
    assert v is not None
    if v < 1:
        raise ValueError(f"FLASHOVERLAP_MAX_GROUPS: expected >= 1, got {v}")
    return v


def configure_logging() -> logging.Logger:
    """FLASHOVERLAP_LOG_LEVEL: level of the 'flashoverlap' logger (default WARNING)."""
    logger = logging.getLogger("flashoverlap")
    level = os.environ.get("FLASHOVERLAP_LOG_LEVEL", "").strip().upper()
    if level:
        logger.setLevel(level)
    return logger
