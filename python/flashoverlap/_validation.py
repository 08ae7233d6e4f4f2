"""Checks on user tensors, done before anything is enqueued. Each error names
the argument, what was expected and what came."""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def check_eps(eps: object) -> None:
    """An RMSNorm epsilon: a number >= 0 (bools refused)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps: expected a number >= 0, got {eps!r}")


def check_tensor(name: str, t: object, ndim: "int | None" = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float16, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()} for shape {tuple(t.shape)}")
    return t


def check_device(name: str, t: torch.Tensor, expected: "torch.device | None" = None) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got a tensor on {t.device}")
    if expected is not None and t.device != expected:
        raise ValueError(f"{name}: expected a tensor on {expected}, got {t.device}")


def check_gemm_operands(x: object, weight: object, *, devices: bool = True) -> tuple[int, int, int]:
    """x [..., K] and weight [N, K] (nn.Linear layout); returns (M, N, K).

    Shapes and dtypes are checked before devices, so that every check but the
    device ones can be exercised without a GPU; ``devices=False`` leaves the
    device checks to the caller."""
    x = check_tensor("x", x)
    weight = check_tensor("weight", weight, ndim=2)
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension [..., K], got a 0-D tensor")
    if x.dtype != weight.dtype:
        raise TypeError(f"weight: expected the dtype of x ({x.dtype}), got {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k} (weight is [N={n}, K={k}]), got shape {tuple(x.shape)}")
    if k % 8 != 0:
        raise ValueError(f"weight: K must be a multiple of 8, got K={k}")
    if n % 8 != 0:
        raise ValueError(f"weight: N must be a multiple of 8, got N={n}")
    m = x.numel() // k if k else 0
    if m >= 2**31 or n >= 2**31 or k >= 2**31:
        raise ValueError(f"x: dimensions must be < 2**31, got M={m} N={n} K={k}")
    # The kernels load 16-byte vectors (cp.async, TMA): rows are 16-byte
    # multiples since K % 8 == 0, so only the start needs checking.
    for name, t in (("x", x), ("weight", weight)):
        if t.numel() and t.data_ptr() % 16:
            raise ValueError(f"{name}: expected a 16-byte aligned data pointer, got {t.data_ptr():#x} "
                             f"(a view starting mid-row?); pass a fresh tensor or .clone() it")
    if devices:
        check_device("x", x)
        check_device("weight", weight, x.device)
    return m, n, k


def check_splits(name: str, splits, world: int, total: "int | None" = None) -> list:
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, (list, tuple)):
        raise TypeError(f"{name}: expected a list of ints, got {type(splits).__name__}")
    if len(splits) != world:
        raise ValueError(f"{name}: expected one entry per rank ({world}), got {len(splits)}")
    for s in splits:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{name}: expected ints, got {s!r}")
        if s < 0:
            raise ValueError(f"{name}: entries must be >= 0, got {list(splits)}")
    if total is not None and sum(splits) != total:
        raise ValueError(f"{name}: must sum to the rows of x ({total}), got {sum(splits)}")
    return list(splits)


def check_groups(groups) -> None:
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"groups: expected an int, got {type(groups).__name__}")
    if not 1 <= groups <= 64:
        raise ValueError(f"groups: expected 1..64, got {groups}")


def check_split_matrix(matrix, world: "int | None" = None, rank: "int | None" = None,
                       sends: "list | None" = None, recvs: "list | None" = None) -> list:
    """A routing matrix (matrix[p][q]: rows rank p sends rank q) as a list of lists of ints; with
    `rank`, its row must be this rank's input splits and its column this rank's output splits."""
    if isinstance(matrix, torch.Tensor):
        if matrix.dim() != 2:
            raise ValueError(f"split_matrix: expected a 2-D [world, world] tensor, got shape {tuple(matrix.shape)}")
        matrix = matrix.tolist()
    if not isinstance(matrix, (list, tuple)) or not matrix:
        raise TypeError(f"split_matrix: expected a [world][world] list of ints, got {type(matrix).__name__}")
    size = len(matrix) if world is None else world
    if len(matrix) != size:
        raise ValueError(f"split_matrix: expected {size} rows (one per rank), got {len(matrix)}")
    rows = [check_splits(f"split_matrix[{p}]", row, size) for p, row in enumerate(matrix)]
    if rank is not None:
        if sends is not None and rows[rank] != list(sends):
            raise ValueError(f"split_matrix: row {rank} ({rows[rank]}) must equal input_split_sizes ({list(sends)})")
        column = [row[rank] for row in rows]
        if recvs is not None and column != list(recvs):
            raise ValueError(f"split_matrix: column {rank} ({column}) must equal output_split_sizes ({list(recvs)})")
    return rows
