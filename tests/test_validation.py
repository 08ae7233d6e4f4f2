"""Argument checking of the public ops, reachable without a GPU, and the
custom ops' fake implementations (what torch.compile traces with)."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import flashoverlap
from flashoverlap import gemm, gemm_all_reduce, plan_of

BF16 = torch.bfloat16
F16 = torch.float16


def operands(m: int = 16, n: int = 24, k: int = 32, dtype: torch.dtype = BF16):
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    return x, w


def raises_naming(exc: type, argument: str, *more: str):
    """pytest.raises for `exc` whose message starts with '<argument>:' and holds every `more`."""

    class _Check:
        def __enter__(self):
            self._ctx = pytest.raises(exc)
            self._info = self._ctx.__enter__()
            return self._info

        def __exit__(self, *exc_info):
            handled = self._ctx.__exit__(*exc_info)
            message = str(self._info.value)
            assert message.startswith(f"{argument}:"), message
            for word in more:
                assert word in message, f"{word!r} not in {message!r}"
            return handled

    return _Check()


@pytest.fixture
def no_distributed():
    assert not dist.is_initialized(), "a test left torch.distributed initialised"
    yield
    assert not dist.is_initialized()


@pytest.fixture
def gloo_world():
    """A one-rank gloo process group, torn down afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()


def valid_plan_still_works() -> None:
    plan = flashoverlap.plan_gemm_all_reduce(1000, 4096, 4096, 2)
    assert plan.shape == (1000, 4096, 4096)
    assert sum(g["count"] for g in plan.groups) == 1000 * 4096


# Checks shared by gemm and gemm_all_reduce: types, dtypes, shapes, layout.
# Each case: (x, weight) builder, exception type, argument named, words in the message.

def _float32_x():
    x, w = operands()
    return x.float(), w


def _float32_w():
    x, w = operands()
    return x, w.float()


def _mixed():
    x, w = operands()
    return x, w.to(F16)


def _mixed_other_way():
    x, w = operands(dtype=F16)
    return x, w.to(BF16)


def _int_x():
    x, w = operands()
    return x.to(torch.int32), w


def _x_not_tensor():
    x, w = operands()
    return x.tolist(), w


def _w_not_tensor():
    x, w = operands()
    return x, "weight"


def _x_0d():
    _, w = operands()
    return torch.tensor(1.0, dtype=BF16), w


def _w_1d():
    x, _ = operands()
    return x, torch.randn(32).to(BF16)


def _w_3d():
    x, _ = operands()
    return x, torch.randn(2, 24, 32).to(BF16)


def _k_mismatch():
    x, _ = operands()
    return x, torch.randn(24, 40).to(BF16)


def _k_not_multiple_of_8():
    return torch.randn(16, 12).to(BF16), torch.randn(24, 12).to(BF16)


def _n_not_multiple_of_8():
    return torch.randn(16, 32).to(BF16), torch.randn(20, 32).to(BF16)


def _n_not_multiple_of_8_3d():
    return torch.randn(2, 3, 32).to(BF16), torch.randn(13, 32).to(BF16)


def _x_transposed():
    # Shape [16, 32] but column-major.
    return torch.randn(32, 16).to(BF16).t(), torch.randn(24, 32).to(BF16)


def _x_strided():
    return torch.randn(16, 64).to(BF16)[:, ::2], torch.randn(24, 32).to(BF16)


def _w_transposed():
    return torch.randn(16, 32).to(BF16), torch.randn(32, 24).to(BF16).t()


SHAPE_DTYPE_CASES = [
    ("float32 x", _float32_x, TypeError, "x", ["float32"]),
    ("float32 weight", _float32_w, TypeError, "weight", ["float32"]),
    ("mixed dtypes", _mixed, TypeError, "weight", ["bfloat16", "float16"]),
    ("mixed dtypes (fp16 x)", _mixed_other_way, TypeError, "weight", ["bfloat16", "float16"]),
    ("int x", _int_x, TypeError, "x", ["int32"]),
    ("x not a tensor", _x_not_tensor, TypeError, "x", ["Tensor"]),
    ("weight not a tensor", _w_not_tensor, TypeError, "weight", ["Tensor"]),
    ("0-D x", _x_0d, ValueError, "x", []),
    ("1-D weight", _w_1d, ValueError, "weight", ["2-D"]),
    ("3-D weight", _w_3d, ValueError, "weight", ["2-D"]),
    ("K mismatch", _k_mismatch, ValueError, "x", ["K=40"]),
    ("K not a multiple of 8", _k_not_multiple_of_8, ValueError, "weight", ["K", "8"]),
    ("N not a multiple of 8", _n_not_multiple_of_8, ValueError, "weight", ["N", "8"]),
    ("N not a multiple of 8, 3-D x", _n_not_multiple_of_8_3d, ValueError, "weight", ["N", "8"]),
    ("transposed x", _x_transposed, ValueError, "x", ["contiguous"]),
    ("strided x", _x_strided, ValueError, "x", ["contiguous"]),
    ("transposed weight", _w_transposed, ValueError, "weight", ["contiguous"]),
]
CASE_IDS = [c[0] for c in SHAPE_DTYPE_CASES]


@pytest.mark.parametrize("name,build,exc,argument,words", SHAPE_DTYPE_CASES, ids=CASE_IDS)
def test_gemm_all_reduce_rejects_operands(no_distributed, name, build, exc, argument, words) -> None:
    x, w = build()
    with raises_naming(exc, argument, *words):
        gemm_all_reduce(x, w)
    valid_plan_still_works()


@pytest.mark.parametrize("name,build,exc,argument,words", SHAPE_DTYPE_CASES, ids=CASE_IDS)
def test_gemm_rejects_operands(name, build, exc, argument, words) -> None:
    x, w = build()
    with raises_naming(exc, argument, *words):
        gemm(x, w)
    valid_plan_still_works()


@pytest.mark.parametrize("name,build,exc,argument,words", SHAPE_DTYPE_CASES, ids=CASE_IDS)
def test_plan_of_rejects_operands(no_distributed, name, build, exc, argument, words) -> None:
    x, w = build()
    with raises_naming(exc, argument, *words):
        plan_of(x, w)


@pytest.mark.parametrize("name,build,exc,argument,words",
                         [c for c in SHAPE_DTYPE_CASES if c[0] not in ("x not a tensor", "weight not a tensor")],
                         ids=[i for i in CASE_IDS if i not in ("x not a tensor", "weight not a tensor")])
def test_custom_ops_check_operands_too(name, build, exc, argument, words) -> None:
    """The torch ops check their operands themselves (callers may bypass the Python wrappers)."""
    x, w = build()
    with raises_naming(exc, argument, *words):
        torch.ops.flashoverlap.gemm(x, w)
    with raises_naming(exc, argument, *words):
        torch.ops.flashoverlap.gemm_all_reduce(x, w, "no-such-communicator", "auto", None)


def test_shape_errors_come_before_the_distributed_check(no_distributed) -> None:
    # Both wrong: dtype and uninitialised torch.distributed; the operands are reported.
    x, w = _float32_x()
    with raises_naming(TypeError, "x"):
        gemm_all_reduce(x, w)
    x, w = _k_mismatch()
    with raises_naming(ValueError, "x"):
        gemm_all_reduce(x, w, mode="auto")


@pytest.mark.parametrize("mode", ["fast", "", "AUTO", "overlapped", None, 1])
def test_bad_mode(no_distributed, mode) -> None:
    x, w = operands()
    with raises_naming(ValueError, "mode"):
        gemm_all_reduce(x, w, mode=mode)
    valid_plan_still_works()


@pytest.mark.parametrize("bands", [0, -1, -128])
def test_bands_per_group_below_one(no_distributed, bands) -> None:
    x, w = operands()
    with raises_naming(ValueError, "bands_per_group", str(bands)):
        gemm_all_reduce(x, w, bands_per_group=bands)
    valid_plan_still_works()


@pytest.mark.parametrize("bands", [1.0, 2.5, "2", True, False, [2]])
def test_bands_per_group_not_an_int(no_distributed, bands) -> None:
    x, w = operands()
    with raises_naming(TypeError, "bands_per_group"):
        gemm_all_reduce(x, w, bands_per_group=bands)
    valid_plan_still_works()


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("x_shape", [(16, 32), (2, 8, 32), (32,)])
def test_uninitialised_distributed_is_reported(no_distributed, dtype, x_shape) -> None:
    x = torch.randn(*x_shape).to(dtype)
    w = torch.randn(24, 32).to(dtype)
    with raises_naming(ValueError, "group", "init_process_group"):
        gemm_all_reduce(x, w)
    for kwargs in (dict(mode="overlap"), dict(mode="sequential"), dict(bands_per_group=2)):
        with raises_naming(ValueError, "group", "init_process_group"):
            gemm_all_reduce(x, w, **kwargs)
    with raises_naming(ValueError, "group", "init_process_group"):
        flashoverlap.get_communicator()
    with raises_naming(ValueError, "group", "init_process_group"):
        flashoverlap.Communicator()
    valid_plan_still_works()


def test_cpu_tensors_for_gemm() -> None:
    x, w = operands()
    with raises_naming(ValueError, "x", "CUDA"):
        gemm(x, w)
    with raises_naming(ValueError, "x", "CUDA"):
        torch.ops.flashoverlap.gemm(x, w)
    valid_plan_still_works()


def test_cpu_tensors_with_initialised_group(gloo_world) -> None:
    for dtype in (BF16, F16):
        x, w = operands(dtype=dtype)
        with raises_naming(ValueError, "x", "CUDA"):
            gemm_all_reduce(x, w)
        with raises_naming(ValueError, "x", "CUDA"):
            gemm_all_reduce(x, w, group=gloo_world)
        with raises_naming(ValueError, "x", "CUDA"):
            gemm_all_reduce(x.reshape(2, 8, 32), w, mode="overlap", bands_per_group=1)
        with raises_naming(ValueError, "x", "CUDA"):
            plan_of(x, w)
        with raises_naming(ValueError, "x", "CUDA"):
            torch.ops.flashoverlap.gemm_all_reduce(x, w, "no-such-communicator", "auto", None)
    # Checks before the device one still come first.
    x, w = _k_not_multiple_of_8()
    with raises_naming(ValueError, "weight"):
        gemm_all_reduce(x, w)
    x, w = operands()
    with raises_naming(ValueError, "mode"):
        gemm_all_reduce(x, w, mode="nope")
    valid_plan_still_works()


@pytest.mark.parametrize("group", [42, object(), 1.5, [0]])
def test_group_of_the_wrong_type(gloo_world, group) -> None:
    with raises_naming(TypeError, "group"):
        flashoverlap.get_communicator(group)
    with raises_naming(TypeError, "group"):
        flashoverlap.Communicator(group)


def test_communicator_device_must_be_an_indexed_cuda_device(gloo_world) -> None:
    for device in ("cpu", torch.device("cpu"), "cuda", "meta"):
        with raises_naming(ValueError, "device", str(torch.device(device))):
            flashoverlap.Communicator(device=device, name=f"bad-{device}")
    # Nothing was registered by the failed constructions.
    with raises_naming(ValueError, "communicator", "bad-cpu"):
        flashoverlap.get_communicator(communicator="bad-cpu")


def test_communicator_lookups_without_gpu() -> None:
    with raises_naming(ValueError, "communicator", "nope"):
        flashoverlap.get_communicator(communicator="nope")
    with raises_naming(ValueError, "communicator", "nope"):
        flashoverlap.get_communicator("nope")
    with raises_naming(ValueError, "group", "not both"):
        flashoverlap.get_communicator("a", communicator="b")
    with raises_naming(TypeError, "communicator", "int"):
        flashoverlap.get_communicator(communicator=3)
    # Destroying what does not exist is a no-op.
    flashoverlap.destroy_communicators()
    flashoverlap.destroy_communicators(["nope"])
    valid_plan_still_works()


# Fake implementations: shapes and dtypes without running anything.

FAKE_SHAPES = [
    ((16, 32), 24),
    ((1, 4096), 14336),
    ((77, 1024), 8),
    ((2, 3, 32), 24),
    ((4, 5, 6, 64), 128),
    ((32,), 8),
    ((0, 32), 24),
]


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("x_shape,n", FAKE_SHAPES)
def test_fake_shapes_under_fake_tensor_mode(dtype, x_shape, n) -> None:
    k = x_shape[-1]
    with FakeTensorMode():
        x = torch.empty(x_shape, dtype=dtype, device="cuda")
        w = torch.empty(n, k, dtype=dtype, device="cuda")
        out = torch.ops.flashoverlap.gemm(x, w)
        assert tuple(out.shape) == (*x_shape[:-1], n)
        assert out.dtype == dtype
        assert out.device.type == "cuda"
        for mode, bands in (("auto", None), ("overlap", 2), ("sequential", None)):
            out = torch.ops.flashoverlap.gemm_all_reduce(x, w, "any-name", mode, bands)
            assert tuple(out.shape) == (*x_shape[:-1], n)
            assert out.dtype == dtype
            assert out.device.type == "cuda"


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("x_shape,n", FAKE_SHAPES)
def test_fake_shapes_on_meta_tensors(dtype, x_shape, n) -> None:
    k = x_shape[-1]
    x = torch.empty(x_shape, dtype=dtype, device="meta")
    w = torch.empty(n, k, dtype=dtype, device="meta")
    for out in (torch.ops.flashoverlap.gemm(x, w),
                torch.ops.flashoverlap.gemm_all_reduce(x, w, "any-name", "auto", None)):
        assert out.device.type == "meta"
        assert tuple(out.shape) == (*x_shape[:-1], n)
        assert out.dtype == dtype


def test_ops_trace_into_graphs_without_running() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        y = torch.ops.flashoverlap.gemm_all_reduce(x, w, "tp", "overlap", 2)
        return torch.ops.flashoverlap.gemm(y, w.t().contiguous()) * 2

    x = torch.randn(2, 3, 32).to(BF16)
    w = torch.randn(24, 32).to(BF16)
    graph = make_fx(f, tracing_mode="fake")(x, w)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.flashoverlap.gemm_all_reduce.default in targets
    assert torch.ops.flashoverlap.gemm.default in targets
    (output,) = [node for node in graph.graph.nodes if node.op == "output"]
    value = output.args[0]
    value = value[0] if isinstance(value, (tuple, list)) else value
    assert tuple(value.meta["val"].shape) == (2, 3, 32)


def test_ops_are_registered() -> None:
    assert hasattr(torch.ops.flashoverlap, "gemm")
    assert hasattr(torch.ops.flashoverlap, "gemm_all_reduce")
    assert hasattr(torch.ops.flashoverlap, "gemm_reduce_scatter")
    assert hasattr(torch.ops.flashoverlap, "gemm_all_reduce_rmsnorm")
    assert hasattr(torch.ops.flashoverlap, "gemm_all_to_all")
    gar = torch.ops.flashoverlap.gemm_all_reduce.default
    gemm_op = torch.ops.flashoverlap.gemm.default
    assert isinstance(gar, torch._ops.OpOverload)
    assert isinstance(gemm_op, torch._ops.OpOverload)
    names = [a.name for a in gar._schema.arguments]
    assert names == ["x", "weight", "group_name", "mode", "bands_per_group", "gemm_kernel", "backend", "order"]
    assert [a.name for a in gemm_op._schema.arguments] == ["x", "weight", "gemm_kernel", "raster_bands", "sms"]
    # Functional ops: nothing is mutated, one tensor comes back.
    assert not gar._schema.is_mutable and not gemm_op._schema.is_mutable
    assert len(gar._schema.returns) == 1 and len(gemm_op._schema.returns) == 1


@pytest.mark.parametrize("call", [gemm, gemm_all_reduce, plan_of], ids=lambda f: f.__name__)
def test_unknown_kernel_is_named(call) -> None:
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with raises_naming(ValueError, "kernel", "sm90_n128"):
        call(x, w, kernel="sm70")


@pytest.mark.parametrize("call", [gemm_all_reduce, plan_of], ids=lambda f: f.__name__)
def test_unknown_order_is_named(call) -> None:
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with raises_naming(ValueError, "order", "swizzled"):
        call(x, w, order="zigzag")


@pytest.mark.parametrize("call", [gemm, gemm_all_reduce, plan_of], ids=lambda f: f.__name__)
def test_misaligned_operand_is_named(call) -> None:
    # A contiguous view that starts 2 bytes into its storage: the kernels'
    # 16-byte loads cannot start there.
    base = torch.randn(16 * 64 + 1, dtype=torch.bfloat16)
    x = base[1:].view(16, 64)
    assert x.is_contiguous() and x.data_ptr() % 16
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    with raises_naming(ValueError, "x", "16-byte aligned"):
        call(x, w)


@pytest.mark.parametrize("backend", ["nvlink", "", "NCCL", 1])
@pytest.mark.parametrize("call", [gemm_all_reduce, plan_of], ids=lambda f: f.__name__)
def test_unknown_backend_is_named(no_distributed, call, backend) -> None:
    x, w = operands()
    with raises_naming(ValueError, "backend", "copy_engine"):
        call(x, w, backend=backend)
    valid_plan_still_works()


# Backends only some ops run: every other op refuses them before any process group is needed,
# naming an op that does take them (peer: the fused norm's; push: a GEMM's epilogue pushes).
BACKEND_REFUSERS = {
    "peer-gemm_all_reduce": (lambda x, w: gemm_all_reduce(x, w, backend="peer"), "gemm_all_reduce_rmsnorm"),
    "peer-plan_of": (lambda x, w: plan_of(x, w, backend="peer"), "gemm_all_reduce_rmsnorm"),
    "peer-backend_of": (lambda x, w: flashoverlap.backend_of(x, w, backend="peer"), "gemm_all_reduce_rmsnorm"),
    "peer-gemm_reduce_scatter": (lambda x, w: flashoverlap.gemm_reduce_scatter(x, w, backend="peer"),
                                 "gemm_all_reduce_rmsnorm"),
    "peer-gemm_all_to_all": (lambda x, w: flashoverlap.gemm_all_to_all(x, w, [16], [16], backend="peer"),
                             "gemm_all_reduce_rmsnorm"),
    "push-all_reduce": (lambda x, w: flashoverlap.all_reduce(x, backend="push"), "gemm_all_to_all"),
    "push-reduce_scatter": (lambda x, w: flashoverlap.reduce_scatter(x, backend="push"), "gemm_all_to_all"),
}


@pytest.mark.parametrize("case", BACKEND_REFUSERS)
def test_op_specific_backends_are_refused_elsewhere(no_distributed, case) -> None:
    call, taker = BACKEND_REFUSERS[case]
    x, w = operands()
    with raises_naming(ValueError, "backend", taker):
        call(x, w)
    valid_plan_still_works()


@pytest.mark.parametrize("call", [
    lambda x, w: flashoverlap.gemm_all_reduce_rmsnorm(x, w, *_norm_args(x, w), backend="peer"),
    lambda x, w: plan_of(x, w, backend="peer", fused_norm=True),
], ids=["gemm_all_reduce_rmsnorm", "plan_of_fused_norm"])
def test_peer_backend_passes_the_fused_norms_checks(no_distributed, call) -> None:
    # The backend check lets it through: the next check (an initialised process group) fails.
    x, w = operands()
    with pytest.raises((ValueError, RuntimeError)) as info:
        call(x, w)
    assert not str(info.value).startswith("backend:"), info.value


@pytest.mark.parametrize("call", [
    lambda x, w: gemm_all_reduce(x, w, backend="push"),
    lambda x, w: plan_of(x, w, backend="push"),
    lambda x, w: flashoverlap.backend_of(x, w, backend="push"),
    lambda x, w: flashoverlap.gemm_all_reduce_rmsnorm(x, w, *_norm_args(x, w), backend="push"),
    lambda x, w: flashoverlap.gemm_reduce_scatter(x, w, backend="push"),
    lambda x, w: flashoverlap.backend_of(x, w, op="gemm_reduce_scatter", backend="push"),
    lambda x, w: flashoverlap.gemm_all_to_all(x, w, [16], [16], backend="push"),
], ids=["gemm_all_reduce", "plan_of", "backend_of", "gemm_all_reduce_rmsnorm", "gemm_reduce_scatter",
        "backend_of_reduce_scatter", "gemm_all_to_all"])
def test_push_backend_passes_the_gemm_ops_checks(no_distributed, call) -> None:
    x, w = operands()
    with pytest.raises((ValueError, RuntimeError)) as info:
        call(x, w)
    assert not str(info.value).startswith("backend:"), info.value


def test_push_backend_is_not_an_environment_default(no_distributed, monkeypatch: pytest.MonkeyPatch) -> None:
    # FLASHOVERLAP_BACKEND applies to every op, and only the GEMM ops push.
    from flashoverlap import _env

    monkeypatch.setenv("FLASHOVERLAP_BACKEND", "push")
    with pytest.raises(ValueError, match="FLASHOVERLAP_BACKEND"):
        _env.backend()


def test_bad_backend_in_the_environment(no_distributed, monkeypatch: pytest.MonkeyPatch) -> None:
    from flashoverlap import _env

    monkeypatch.setenv("FLASHOVERLAP_BACKEND", "infiniband")
    with pytest.raises(ValueError, match="FLASHOVERLAP_BACKEND"):
        _env.backend()
    monkeypatch.setenv("FLASHOVERLAP_BACKEND", " Copy_Engine ")
    assert _env.backend() == "copy_engine"
    monkeypatch.delenv("FLASHOVERLAP_BACKEND")
    assert _env.backend() == "auto"


@pytest.mark.parametrize("var,read,bad,spaced,value,default", [
    ("FLASHOVERLAP_CE_ALLREDUCE", "ce_all_reduce", "halves", " Gather ", "gather", "auto"),
    ("FLASHOVERLAP_CE_SUMS_QUEUE", "ce_sums_queue", "after", " Own ", "own", "order"),
])
def test_copy_engine_choices_in_the_environment(monkeypatch: pytest.MonkeyPatch, var: str, read: str, bad: str,
                                                spaced: str, value: str, default: str) -> None:
    """A value outside the choices is refused by name; case and spaces do not matter; unset is the default."""
    from flashoverlap import _env

    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=var):
        getattr(_env, read)()
    monkeypatch.setenv(var, spaced)
    assert getattr(_env, read)() == value
    monkeypatch.delenv(var)
    assert getattr(_env, read)() == default


def test_planning_refuses_a_bad_copy_engine_all_reduce_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashoverlap.planning import plan_gemm_all_reduce

    monkeypatch.setenv("FLASHOVERLAP_CE_ALLREDUCE", "halves")
    with pytest.raises(ValueError, match="FLASHOVERLAP_CE_ALLREDUCE"):
        plan_gemm_all_reduce(4096, 8192, 4096, 2, backend="copy_engine")


# The ops added with ReduceScatter, AllReduce + RMSNorm and All-to-All: the same operand checks
# run first, before any process group or device is needed.

def _norm_args(x, w):
    n = w.shape[0] if isinstance(w, torch.Tensor) and w.dim() == 2 else 24
    lead = x.shape[:-1] if isinstance(x, torch.Tensor) and x.dim() >= 1 else (16,)
    return torch.randn(*lead, n).to(BF16), torch.rand(n).to(BF16)


NEW_OPS = {
    "gemm_reduce_scatter": lambda x, w: flashoverlap.gemm_reduce_scatter(x, w),
    "gemm_all_reduce_rmsnorm": lambda x, w: flashoverlap.gemm_all_reduce_rmsnorm(x, w, *_norm_args(x, w)),
    "gemm_all_to_all": lambda x, w: flashoverlap.gemm_all_to_all(x, w, [16], [16]),
}


@pytest.mark.parametrize("op", NEW_OPS)
@pytest.mark.parametrize("name,build,exc,argument,words", SHAPE_DTYPE_CASES, ids=CASE_IDS)
def test_new_ops_reject_operands(no_distributed, op, name, build, exc, argument, words) -> None:
    x, w = build()
    with raises_naming(exc, argument, *words):
        NEW_OPS[op](x, w)
    valid_plan_still_works()


def _residual(shape=(16, 24), dtype=BF16):
    return torch.randn(*shape).to(dtype)


NORM_CASES = [
    ("residual of another shape", lambda: (_residual((16, 25)), torch.rand(24).to(BF16), 1e-6), ValueError,
     "residual", ["shape"]),
    ("residual float32", lambda: (_residual(dtype=torch.float32), torch.rand(24).to(BF16), 1e-6), TypeError,
     "residual", []),
    ("residual of another 16-bit dtype", lambda: (_residual(dtype=F16), torch.rand(24).to(BF16), 1e-6),
     TypeError, "residual", ["dtype"]),
    ("norm weight of another length", lambda: (_residual(), torch.rand(23).to(BF16), 1e-6), ValueError,
     "norm_weight", ["(24,)"]),
    ("norm weight 2-D", lambda: (_residual(), torch.rand(1, 24).to(BF16), 1e-6), ValueError, "norm_weight", []),
    ("negative eps", lambda: (_residual(), torch.rand(24).to(BF16), -1.0), ValueError, "eps", []),
    ("eps not a number", lambda: (_residual(), torch.rand(24).to(BF16), "small"), ValueError, "eps", []),
    ("non-contiguous residual", lambda: (_residual((24, 16)).t(), torch.rand(24).to(BF16), 1e-6), ValueError,
     "residual", ["contiguous"]),
]


@pytest.mark.parametrize("name,build,exc,argument,words", NORM_CASES, ids=[c[0] for c in NORM_CASES])
def test_rmsnorm_arguments_are_checked_first(no_distributed, name, build, exc, argument, words) -> None:
    x, w = operands()
    residual, norm_weight, eps = build()
    with raises_naming(exc, argument, *words):
        flashoverlap.gemm_all_reduce_rmsnorm(x, w, residual, norm_weight, eps)


def test_rmsnorm_hidden_size_is_bounded(no_distributed) -> None:
    x, w = operands(n=16392)
    with raises_naming(ValueError, "weight", "16384"):
        flashoverlap.gemm_all_reduce_rmsnorm(x, w, _residual((16, 16392)), torch.rand(16392).to(BF16))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_new_ops_fake_shapes_on_meta_tensors(dtype) -> None:
    x = torch.empty(77, 64, dtype=dtype, device="meta")
    w = torch.empty(48, 64, dtype=dtype, device="meta")
    residual = torch.empty(77, 48, dtype=dtype, device="meta")
    norm_weight = torch.empty(48, dtype=dtype, device="meta")
    out, res = torch.ops.flashoverlap.gemm_all_reduce_rmsnorm(x, w, residual, norm_weight, 1e-6, "any-name")
    assert tuple(out.shape) == tuple(res.shape) == (77, 48)
    assert out.device.type == res.device.type == "meta" and out.dtype == dtype
    out = torch.ops.flashoverlap.gemm_all_to_all(x, w, [70, 7], [3, 100], "any-name")
    assert tuple(out.shape) == (103, 48) and out.device.type == "meta"


def test_all_to_all_table_cache() -> None:
    """Tables are reused per routing, the most recent few kept, the captured ones kept for good,
    and new routings refused during capture."""
    from flashoverlap.ops import _TableCache

    made = []

    def maker(key):
        return lambda: made.append(key) or (f"tables{key}", key)

    cache = _TableCache(size=2)
    assert cache.get(1, maker(1), False) == ("tables1", 1)
    assert cache.get(1, maker(1), False) == ("tables1", 1) and made == [1]
    cache.get(2, maker(2), False)
    # Captured: kept however many routings follow.
    assert cache.get(2, maker(2), True) == ("tables2", 2) and made == [1, 2]
    for key in (3, 4, 5):
        cache.get(key, maker(key), False)
    assert cache.get(2, maker(2), False) == ("tables2", 2) and made == [1, 2, 3, 4, 5]
    # 1 was evicted (size 2): made again outside capture, refused inside.
    with raises_naming(ValueError, "gemm_all_to_all", "capture"):
        cache.get(1, maker(1), True)
    cache.get(1, maker(1), False)
    assert made == [1, 2, 3, 4, 5, 1]


def _compiled_op_calls():
    x, w = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    r, nw = torch.randn(16, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    ops = torch.ops.flashoverlap
    return {
        "gemm": lambda: ops.gemm(x, w, None),
        "gemm_all_reduce": lambda: ops.gemm_all_reduce(x, w, "g", "auto", None, None, None, None),
        "gemm_all_reduce_rmsnorm": lambda: ops.gemm_all_reduce_rmsnorm(x, w, r, nw, 1e-6, "g", "auto", None, None,
                                                                        None)[0],
        "gemm_all_to_all": lambda: ops.gemm_all_to_all(x, w, [16], [16], "g", None, None, None, None),
    }


@pytest.mark.parametrize("op", sorted(_compiled_op_calls()))
def test_ops_lower_under_torch_compile(op: str) -> None:
    """Inductor lowers each op to a fallback call (an argument named `kernel` in a schema once made
    that fail: FallbackKernel.create takes `kernel` itself), so the compiled call reaches the op and
    its argument checks: CPU tensors then get the op's own error."""
    call = _compiled_op_calls()[op]
    torch._dynamo.reset()
    with pytest.raises((ValueError, TypeError), match=r"^(x|group_name): "):
        torch.compile(lambda: call() * 2, fullgraph=True)()


def test_every_core_function_has_a_stub() -> None:
    """_core.pyi (what type checkers and editors see) names every function, class and constant the
    extension exports."""
    import ast
    from pathlib import Path

    from flashoverlap import _core

    stub = ast.parse((Path(__file__).resolve().parent.parent / "python" / "flashoverlap" / "_core.pyi").read_text())
    named = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    named |= {t.id for n in stub.body if isinstance(n, (ast.AnnAssign, ast.Assign))
              for t in ([n.target] if isinstance(n, ast.AnnAssign) else n.targets) if isinstance(t, ast.Name)}
    exported = {name for name in dir(_core) if not name.startswith("_")}
    assert exported - named == set(), f"exported but not in _core.pyi: {sorted(exported - named)}"
