"""Shared test setup.

* Environment defaults every process of the suite runs with: NVLink multicast
  stays off (it can take a shared host's GPUs out of service), and
  CUDA_MODULE_LOADING is removed so that CUDA's default, lazy module loading,
  is what the GPU tests exercise. This runs before any test initialises CUDA.
* The ``gpus(n)`` marker: a test marked ``@pytest.mark.gpus(2)`` is skipped,
  with a reason, where fewer than ``n`` CUDA devices are visible.
* ``--multi-gpu-only``: deselects every test not marked ``gpus(n)`` with
  n >= 2, so that scarce multi-GPU machine time goes to the tests that one
  GPU cannot run.
"""

from __future__ import annotations

import os

import pytest

ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
os.environ.pop("CUDA_MODULE_LOADING", None)


def _cuda_devices() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a torch without CUDA support
        return 0


def _needed_gpus(item: pytest.Item) -> int:
    marker = item.get_closest_marker("gpus")
    if marker is None:
        return 0
    return int(marker.args[0]) if marker.args else 1


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--multi-gpu-only",
        action="store_true",
        help="run only the tests marked gpus(n) with n >= 2",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs at least n CUDA devices; skipped otherwise")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--multi-gpu-only"):
        return
    keep, dropped = [], []
    for item in items:
        (keep if _needed_gpus(item) >= 2 else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    needed = _needed_gpus(item)
    if needed == 0:
        return
    have = _cuda_devices()
    if have < needed:
        pytest.skip(f"needs {needed} CUDA device(s), {have} visible")
