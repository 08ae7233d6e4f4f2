"""flashoverlap.gemm on one GPU against an fp32 reference."""

from __future__ import annotations

import random

import pytest
import torch

import flashoverlap

pytestmark = pytest.mark.gpus(1)

BIG = [1024, 4096, 8192, 14336]
TOLERANCE = 1e-2
SEED = 20240611


def _shapes() -> list[tuple[int, int, int]]:
    rng = random.Random(SEED)
    shapes = []
    for m in (1, 77, 1000, 3000):
        for _ in range(4):
            shapes.append((m, rng.choice(BIG), rng.choice(BIG)))
    # Small and ragged: one partial tile column, K of one 8-element step, ...
    shapes += [
        (1, 8, 8),
        (77, 136, 8),
        (130, 8, 1024),
        (1000, 136, 24),
        (129, 264, 40),
        (3000, 8, 8),
        (255, 1032, 4104),
        (rng.randrange(1, 4000), 8 * rng.randrange(1, 600), 8 * rng.randrange(1, 600)),
        (rng.randrange(1, 4000), 8 * rng.randrange(1, 600), 8 * rng.randrange(1, 600)),
    ]
    return shapes


SHAPES = _shapes()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().T


def poison(shape, dtype, device) -> None:
    """Leaves a NaN-filled block in the caching allocator for the next allocation of this size."""
    block = torch.full(shape, float("nan"), dtype=dtype, device=device)
    torch.cuda.current_stream(device).synchronize()
    del block


def check_gemm(x: torch.Tensor, w: torch.Tensor, **launch) -> torch.Tensor:
    n = w.shape[0]
    poison((*x.shape[:-1], n), x.dtype, x.device)
    out = flashoverlap.gemm(x, w, **launch)
    assert out.shape == (*x.shape[:-1], n)
    assert out.dtype == x.dtype and out.device == x.device
    assert not out.isnan().any(), "unwritten (NaN) outputs"
    assert out.isfinite().all()
    ref = reference(x.reshape(-1, x.shape[-1]), w).reshape(out.shape)
    err = relative_error(out, ref)
    assert err <= TOLERANCE, f"relative error {err:.3e} for x{tuple(x.shape)} w{tuple(w.shape)} {x.dtype}"
    return out


@pytest.fixture(autouse=True)
def _no_tf32():
    # The fp32 reference must be a real fp32 product.
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_gemm_matches_fp32_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    check_gemm(x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_repeated_calls_on_fresh_data(dtype: torch.dtype) -> None:
    for _ in range(10):
        x = torch.randn(1000, 4096, device="cuda", dtype=dtype)
        w = torch.randn(1024, 4096, device="cuda", dtype=dtype)
        check_gemm(x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lead", [(2, 77), (3, 1, 500), (1, 1), (4, 256)])
def test_gemm_with_leading_dimensions(dtype: torch.dtype, lead: tuple) -> None:
    x = torch.randn(*lead, 1024, device="cuda", dtype=dtype)
    w = torch.randn(4096, 1024, device="cuda", dtype=dtype)
    check_gemm(x, w)


def test_gemm_of_a_vector_and_of_nothing() -> None:
    w = torch.randn(136, 64, device="cuda", dtype=torch.bfloat16)
    check_gemm(torch.randn(64, device="cuda", dtype=torch.bfloat16), w)
    empty = flashoverlap.gemm(torch.randn(0, 64, device="cuda", dtype=torch.bfloat16), w)
    assert empty.shape == (0, 136)
    empty = flashoverlap.gemm(torch.randn(2, 0, 64, device="cuda", dtype=torch.bfloat16), w)
    assert empty.shape == (2, 0, 136)


def test_gemm_on_a_side_stream() -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.randn(3000, 4096, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        out = flashoverlap.gemm(x, w)
        ref = reference(x, w)
    side.synchronize()
    assert relative_error(out, ref) <= TOLERANCE


def test_gemm_in_a_cuda_graph() -> None:
    static_x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    static_w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashoverlap.gemm(static_x, static_w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashoverlap.gemm(static_x, static_w)
    for _ in range(20):
        static_x.copy_(torch.randn_like(static_x))
        static_w.copy_(torch.randn_like(static_w))
        out.fill_(float("nan"))
        graph.replay()
        assert not out.isnan().any()
        assert relative_error(out, reference(static_x, static_w)) <= TOLERANCE


def test_gemm_under_torch_compile() -> None:
    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(x, w):
        return torch.ops.flashoverlap.gemm(x, w) * 2

    x = torch.randn(2, 77, 1024, device="cuda", dtype=torch.float16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
    out = f(x, w)
    assert out.shape == (2, 77, 1024)
    assert relative_error(out, 2 * reference(x.reshape(-1, 1024), w).reshape(2, 77, 1024)) <= TOLERANCE


def test_device_errors_then_a_good_call() -> None:
    x = torch.randn(77, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^weight:.*CUDA"):
        flashoverlap.gemm(x, w.cpu())
    with pytest.raises(ValueError, match=r"^x:.*CUDA"):
        flashoverlap.gemm(x.cpu(), w)
    with pytest.raises(ValueError, match=r"^x:"):
        flashoverlap.gemm(x.t(), w)
    with pytest.raises(TypeError, match=r"^x:"):
        flashoverlap.gemm(x.float(), w)
    check_gemm(x, w)


@pytest.mark.gpus(2)
def test_operands_on_another_device() -> None:
    x = torch.randn(1000, 4096, device="cuda:1", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda:1", dtype=torch.bfloat16)
    assert torch.cuda.current_device() == 0
    out = check_gemm(x, w)
    assert out.device == torch.device("cuda", 1)
    # The call binds device 1 for its launch and must leave the caller's current device as it was.
    assert torch.cuda.current_device() == 0
    assert torch.empty(1, device="cuda").device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"^weight:.*cuda:0"):
        flashoverlap.gemm(x, w.to("cuda:0"))


def _kernels() -> list[str]:
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
    return ["sm80", "sm90_n128", "sm90_n256"] if major == 9 else ["sm80"]


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("raster", [1, 3, 16])
@pytest.mark.parametrize("sms", [None, 1, 100])
@pytest.mark.parametrize("m,n,k", [(2100, 8192, 1000), (77, 1032, 4104), (1000, 136, 24)])
def test_every_kernel_order_and_sm_count(kernel: str, raster: int, sms, m: int, n: int, k: int) -> None:
    # Fewer CTAs than tiles (each CTA walks many positions) and raster blocks that do not divide
    # the bands must still write every output exactly once.
    dtype = random.Random(f"{kernel}{raster}{sms}{m}").choice([torch.bfloat16, torch.float16])
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    check_gemm(x, w, kernel=kernel, raster_bands=raster, sms=sms)


@pytest.mark.parametrize("name,value,error", [("raster_bands", 0, ValueError), ("raster_bands", 2.0, TypeError),
                                              ("sms", 0, ValueError), ("sms", 100000, ValueError),
                                              ("sms", True, TypeError)])
def test_bad_launch_options_raise_then_a_good_call(name: str, value, error) -> None:
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(264, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(error, match=name):
        flashoverlap.gemm(x, w, **{name: value})
    check_gemm(x, w)


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("raster", [1, 3, 16])
@pytest.mark.parametrize("ctas", [1, 8, 132])
@pytest.mark.parametrize("m,n,k", [(2100, 8192, 1000), (77, 1032, 4104), (1000, 136, 24)])
def test_staged_stores_then_unreorder(kernel: str, raster: int, ctas: int, m: int, n: int, k: int) -> None:
    """The swizzled schedule's path without communication: the GEMM stores each tile at its
    position in a staging buffer (tails included), the un-reorder copy puts it in place."""
    from flashoverlap import _core

    dtype = random.Random(f"staged{kernel}{raster}{ctas}{m}").choice([torch.bfloat16, torch.float16])
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    bn = 256 if kernel == "sm90_n256" else 128
    tiles = -(-m // 128) * -(-n // bn)
    staging = torch.full((tiles * 128, bn), float("nan"), device="cuda", dtype=dtype)
    # A canary row past the end of the output: the copy must drop rows and columns past M and N.
    fence = torch.full((m + 1, n), float("nan"), device="cuda", dtype=dtype)
    fence[m] = 7.0
    out = fence[:m]
    stream = torch.cuda.current_stream().cuda_stream
    sms = 100
    _core.gemm(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k, name, 0, stream, kernel, raster, sms, None,
               staging.data_ptr())
    assert out.isnan().all(), "a staged launch wrote into out"
    assert not staging.isnan().any(), "a staged tile was not stored"
    _core.unreorder(out.data_ptr(), staging.data_ptr(), m, n, name, 0, stream, ctas, kernel, raster, sms)
    assert (fence[m] == 7.0).all(), "the copy wrote past the output"
    assert not out.isnan().any(), "unwritten outputs"
    err = relative_error(out, reference(x, w))
    assert err <= TOLERANCE, f"relative error {err:.3e}"
