"""Bodies of the multi-process tests of gemm_all_reduce.

test_gemm_all_reduce.py spawns one process per GPU (torch.multiprocessing,
start method "spawn") with ``entry`` as target. Each process joins an NCCL
process group (or, with ``shared=True``, a gloo group with the ranks sharing
the GPUs round-robin and a flashoverlap communicator made without NCCL: the
copy-engine backend across processes on one device), runs one of the TARGETS below and writes its outcome to
``<outdir>/rank<r>.json`` (success) or ``<outdir>/rank<r>.error`` (the
traceback), which the parent reads. Each rank draws its own inputs from a
per-rank seed; the reference, the fp32 sum over ranks of x_r @ w_r^T, is
computed on every rank by regenerating every rank's inputs from their seeds.
"""

from __future__ import annotations

import json
import math
import os
import traceback
from datetime import timedelta
from pathlib import Path

ENV_DEFAULTS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
TOLERANCE = 1e-2
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def entry(target: str, rank: int, world: int, init_method: str, outdir: str, params: dict) -> None:
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    # Lazy module loading (CUDA's default) is what must work.
    os.environ.pop("CUDA_MODULE_LOADING", None)
    out = Path(outdir)
    try:
        import torch
        import torch.distributed as dist

        import flashoverlap

        shared = params.pop("shared", False)
        device = device_of(rank)
        torch.cuda.set_device(device)
        if shared:
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=240))
            # NCCL refuses two ranks on one GPU; the copy engines do not need it.
            flashoverlap.Communicator(nccl=False)
        else:
            dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=240), device_id=device)
        result = TARGETS[target](rank, world, **params)
        torch.cuda.synchronize()
        flashoverlap.destroy_communicators()
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        # Peers may be stuck in a collective with this rank; the parent ends them.
        os._exit(1)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


# Helpers (torch is imported inside: the module is imported by the parent too).

def device_of(rank: int):
    """The GPU of a rank: its own where there are enough, else shared round-robin."""
    import torch

    return torch.device("cuda", rank % torch.cuda.device_count())


def dtype_of(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def make_inputs(seed: int, rank: int, lead, n: int, k: int, dtype, device):
    """Rank `rank`'s operands for case `seed`: the same on whichever GPU they are drawn."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 7919 + rank * 104729 + 1)
    x = torch.randn(*lead, k, generator=gen, device=device, dtype=dtype)
    w = torch.randn(n, k, generator=gen, device=device, dtype=dtype)
    return x, w


def reference(seed: int, world: int, lead, n: int, k: int, dtype, device, ranks=None):
    """fp32 sum over `ranks` (default: all) of x_r @ w_r^T, shaped [*lead, n]."""
    import torch

    ref = torch.zeros(math.prod(lead), n, dtype=torch.float32, device=device)
    for r in (range(world) if ranks is None else ranks):
        x, w = make_inputs(seed, r, lead, n, k, dtype, device)
        ref += x.reshape(-1, k).float() @ w.float().T
        del x, w
    return ref.reshape(*lead, n)


def poison(shape, dtype, device) -> None:
    """Leaves a NaN-filled block in the caching allocator for the op's output to reuse."""
    import torch

    block = torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    torch.cuda.current_stream(device).synchronize()
    del block


def mismatch(out, ref, what: str):
    """None if `out` matches `ref`, else why not."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if torch.isnan(out).any():
        return f"{what}: {int(torch.isnan(out).sum())} NaN outputs (unwritten or unreduced)"
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    if not err <= TOLERANCE:
        return f"{what}: relative Frobenius error {err:.3e} > {TOLERANCE}"
    return None


def expect_error(exc_types, argument: str, fn, *words: str) -> str:
    """Calls fn, which must raise one of exc_types with a message starting '<argument>:'."""
    try:
        fn()
    except exc_types as e:
        message = str(e)
        assert message.startswith(f"{argument}:"), f"message does not name {argument!r}: {message!r}"
        for word in words:
            assert word in message, f"{word!r} not in {message!r}"
        return f"{type(e).__name__}: {message}"
    raise AssertionError(f"no {exc_types} raised (expected one naming {argument!r})")


def run_case(rank: int, world: int, case: dict, **call) -> dict:
    """One gemm_all_reduce call on fresh inputs, checked against the reference."""
    import flashoverlap

    device = device_of(rank)
    dtype = dtype_of(case["dtype"])
    lead, n, k, seed = tuple(case["lead"]), case["n"], case["k"], case["seed"]
    mode, bands = case.get("mode", "auto"), case.get("bands")
    x, w = make_inputs(seed, rank, lead, n, k, dtype, device)
    poison((*lead, n), dtype, device)
    out = flashoverlap.gemm_all_reduce(x, w, mode=mode, bands_per_group=bands, **call)
    ref = reference(seed, world, lead, n, k, dtype, device)
    what = f"rank {rank} x{(*lead, k)} w{(n, k)} {case['dtype']} mode={mode} bands={bands} {call or ''}"
    return {"error": mismatch(out, ref, what), "what": what}


# Targets.

def cases(rank: int, world: int, cases: list, backend=None, order=None) -> dict:
    """Every case of the list, each with fresh inputs; plans are checked too. With
    order="swizzled", cases that force bands_per_group (whole-band groups) force overlap instead."""
    import torch
    import torch.distributed as dist

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    # The regenerated inputs of other ranks must be the ones they used.
    first = cases[0]
    x0, _ = make_inputs(first["seed"], rank, tuple(first["lead"]), first["n"], first["k"],
                        dtype_of(first["dtype"]), device)
    sums = [None] * world
    dist.all_gather_object(sums, float(x0.float().sum()))
    for r in range(world):
        xr, _ = make_inputs(first["seed"], r, tuple(first["lead"]), first["n"], first["k"],
                            dtype_of(first["dtype"]), device)
        assert float(xr.float().sum()) == sums[r], "inputs regenerated on another GPU differ"

    failures, records = [], []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    call = {} if backend is None else {"backend": backend}
    if order is not None:
        call["order"] = order
    if order == "swizzled":
        cases = [dict(c, mode="overlap", bands=None) if c["bands"] is not None else c for c in cases]
    for case in cases:
        result = run_case(rank, world, case, **call)
        if result["error"]:
            failures.append(result["error"])
        lead, n, k = tuple(case["lead"]), case["n"], case["k"]
        m = math.prod(lead)
        if m == 0:
            continue
        x = torch.empty(*lead, k, dtype=dtype_of(case["dtype"]), device=device)
        w = torch.empty(n, k, dtype=dtype_of(case["dtype"]), device=device)
        plan = flashoverlap.plan_of(x, w, mode=case["mode"], bands_per_group=case["bands"], **call)
        groups = plan.groups
        problems = []
        if plan.shape != (m, n, k) or plan.world_size != world:
            problems.append(f"plan of {plan.shape} over {plan.world_size}")
        covered = plan.staging_elems if plan.order == "swizzled" else m * n
        if sum(g["count"] for g in groups) != covered:
            problems.append("groups do not cover the output")
        if [g["positions"] for g in groups] != [(a, b) for a, b in zip([0] + [g["positions"][1] for g in groups],
                                                                     [g["positions"][1] for g in groups])]:
            problems.append("groups' positions are not consecutive")
        if groups[-1]["positions"][1] != plan.tiles[0] * plan.tiles[1]:
            problems.append("groups do not cover every position")
        if order in ("banded", "swizzled") and plan.schedule == "overlap" and plan.order != order:
            problems.append(f"order={order} planned {plan.order}")
        if case["mode"] == "sequential":
            if plan.schedule != "sequential" or len(groups) != 1 or plan.ctas != sms:
                problems.append(f"sequential mode planned {plan!r}")
        elif case["bands"] is not None:
            expected = math.ceil(plan.tiles[0] / case["bands"])
            if plan.schedule != "overlap" or len(groups) != expected:
                problems.append(f"bands_per_group={case['bands']} planned {plan!r}, expected {expected} groups")
        elif case["mode"] == "overlap" and plan.schedule != "overlap":
            problems.append(f"overlap mode planned {plan!r}")
        if problems:
            failures.append(f"{result['what']}: " + "; ".join(problems))
        records.append({"case": case, "schedule": plan.schedule, "groups": len(groups), "order": plan.order})
    if failures:
        raise AssertionError(f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures))
    return {"records": records}


def cuda_graph(rank: int, world: int, m: int, n: int, k: int, replays: int, seed: int, backend=None,
               order="banded", sequential_graph: bool = True) -> dict:
    """Captures gemm_all_reduce once and replays it on fresh inputs (and, with `sequential_graph`,
    its sequential schedule: not where the group's collectives are gloo's, which no graph captures)."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.bfloat16
    # Banded: one group per row band (the most signals); swizzled: the planned waves.
    bands = 1 if order == "banded" else None
    call = dict(mode="overlap", bands_per_group=bands, backend=backend, order=order)
    static_x, static_w = make_inputs(seed, rank, (m,), n, k, dtype, device)

    # Warm up outside the capture, on a side stream.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            warm = flashoverlap.gemm_all_reduce(static_x, static_w, **call)
    torch.cuda.current_stream(device).wait_stream(side)
    failures = []
    error = mismatch(warm, reference(seed, world, (m,), n, k, dtype, device), "warm-up")
    if error:
        failures.append(error)

    plan = flashoverlap.plan_of(static_x, static_w, **call)
    assert plan.schedule == "overlap" and plan.order == order, repr(plan)
    if order == "banded":
        assert len(plan.groups) == plan.tiles[0] > 1, repr(plan)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashoverlap.gemm_all_reduce(static_x, static_w, **call)

    for i in range(replays):
        replay_seed = seed + 1 + i
        x, w = make_inputs(replay_seed, rank, (m,), n, k, dtype, device)
        static_x.copy_(x)
        static_w.copy_(w)
        out.fill_(float("nan"))
        graph.replay()
        ref = reference(replay_seed, world, (m,), n, k, dtype, device)
        error = mismatch(out, ref, f"replay {i}")
        if error:
            failures.append(error)
        if i % 10 == 9:
            # Eager calls of the captured shape between replays.
            eager = flashoverlap.gemm_all_reduce(static_x, static_w, **call)
            error = mismatch(eager, ref, f"eager call after replay {i}")
            if error:
                failures.append(error)
    if failures:
        raise AssertionError("\n".join(failures[:20]))

    if sequential_graph:
        # The sequential schedule (library GEMM, then one AllReduce) is capturable too.
        seq = dict(mode="sequential", backend=backend)
        with torch.cuda.stream(side):
            flashoverlap.gemm_all_reduce(static_x, static_w, **seq)
        torch.cuda.current_stream(device).wait_stream(side)
        seq_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(seq_graph):
            seq_out = flashoverlap.gemm_all_reduce(static_x, static_w, **seq)
        for i in range(20):
            replay_seed = seed + 1000 + i
            x, w = make_inputs(replay_seed, rank, (m,), n, k, dtype, device)
            static_x.copy_(x)
            static_w.copy_(w)
            seq_out.fill_(float("nan"))
            seq_graph.replay()
            error = mismatch(seq_out, reference(replay_seed, world, (m,), n, k, dtype, device),
                             f"sequential replay {i}")
            if error:
                failures.append(error)
        if failures:
            raise AssertionError("\n".join(failures[:20]))

    # A shape first seen under capture is refused with a clear error.
    fresh_x, fresh_w = make_inputs(seed, rank, (77,), 1024, 1024, dtype, device)
    refused = None
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            flashoverlap.gemm_all_reduce(fresh_x, fresh_w, mode="overlap", bands_per_group=1, backend=backend)
    except ValueError as e:
        refused = str(e)
    assert refused is not None and "capture" in refused, refused
    # ...and the op still works afterwards, for that shape too.
    result = run_case(rank, world, dict(seed=seed, lead=[77], n=1024, k=1024, dtype="bf16",
                                        mode="overlap", bands=1), backend=backend)
    assert result["error"] is None, result["error"]
    return {"replays": replays, "refused": refused}


def backends_agree(rank: int, world: int, seed: int, shapes: list) -> dict:
    """Both backends, interleaved on one communicator (a shape that grows the copy-engine
    buffers between calls of smaller ones included): bit-identical on every rank, and right;
    "auto" picks the same backend on every rank (the predictor's, per shape) and is right too."""
    import torch
    import torch.distributed as dist

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    failures, chosen_by = [], {}
    for i, (m, n, k) in enumerate(shapes):
        s = seed + i
        x, w = make_inputs(s, rank, (m,), n, k, torch.bfloat16, device)
        ref = reference(s, world, (m,), n, k, torch.bfloat16, device)
        outs = {}
        for backend in ("copy_engine", "nccl", "copy_engine"):
            poison((m, n), torch.bfloat16, device)
            out = flashoverlap.gemm_all_reduce(x, w, mode="overlap", bands_per_group=1, backend=backend)
            error = mismatch(out, ref, f"{m}x{n}x{k} {backend}")
            if error:
                failures.append(error)
            outs.setdefault(backend, out)
        # Every rank holds the same copy-engine sum, bit for bit.
        gathered = [torch.empty_like(outs["copy_engine"]) for _ in range(world)]
        dist.all_gather(gathered, outs["copy_engine"])
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            failures.append(f"{m}x{n}x{k}: ranks hold different copy-engine sums")
        for op in ("gemm_all_reduce", "gemm_reduce_scatter"):
            chosen = flashoverlap.backend_of(x, w, op=op) if m % world == 0 or op == "gemm_all_reduce" else None
            every = [None] * world
            dist.all_gather_object(every, chosen)
            if len(set(every)) != 1 or chosen not in ("nccl", "copy_engine", "push", None):
                failures.append(f"{m}x{n}x{k} {op}: ranks chose backends {every}")
            chosen_by.setdefault(op, []).append(chosen)
        poison((m, n), torch.bfloat16, device)
        error = mismatch(flashoverlap.gemm_all_reduce(x, w), ref, f"{m}x{n}x{k} auto")
        if error:
            failures.append(error)
    if failures:
        raise AssertionError("\n".join(failures))
    return {"shapes": len(shapes), "chosen": chosen_by}


def bad_inputs(rank: int, world: int, seed: int) -> dict:
    """Errors that need GPUs; after each one a correct call still gives the right answer."""
    import torch
    import torch.distributed as dist

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    good = dict(seed=seed, lead=[1000], n=4096, k=1024, dtype="bf16", mode="overlap", bands=2)

    def still_works(tag: str, **call) -> None:
        result = run_case(rank, world, good, **call)
        assert result["error"] is None, f"after {tag}: {result['error']}"

    comm = flashoverlap.get_communicator()
    assert comm.ranks == tuple(range(world)) and comm.rank == rank and comm.world_size == world
    assert comm.device == device
    assert flashoverlap.get_communicator() is comm
    assert flashoverlap.get_communicator(dist.group.WORLD) is comm
    still_works("creation")

    x, w = make_inputs(seed, rank, (1000,), 4096, 1024, torch.bfloat16, device)
    seen = {}
    if world > 1:
        other = torch.device("cuda", (rank + 1) % world)
        seen["x on another device"] = expect_error(
            ValueError, "x", lambda: flashoverlap.gemm_all_reduce(x.to(other), w.to(other)), str(device))
        still_works("x on another device")
        seen["x on another device, explicit communicator"] = expect_error(
            ValueError, "x", lambda: flashoverlap.gemm_all_reduce(x.to(other), w.to(other), communicator=comm))
        still_works("x on another device, explicit communicator")
        seen["weight on another device"] = expect_error(
            ValueError, "weight", lambda: flashoverlap.gemm_all_reduce(x, w.to(other)), str(other))
        still_works("weight on another device")
    seen["x on the CPU"] = expect_error(
        ValueError, "x", lambda: flashoverlap.gemm_all_reduce(x.cpu(), w.cpu()), "CUDA")
    still_works("x on the CPU")
    seen["weight on the CPU"] = expect_error(
        ValueError, "weight", lambda: flashoverlap.gemm_all_reduce(x, w.cpu()), "CUDA")
    still_works("weight on the CPU")

    # A group whose ranks differ from the communicator's.
    sub = dist.new_group(ranks=[0])
    if world > 1:
        if rank == 0:
            seen["group ranks differ"] = expect_error(
                ValueError, "group", lambda: flashoverlap.gemm_all_reduce(x, w, group=sub, communicator=comm),
                "differ")
        else:
            # Ranks outside the group hold no ProcessGroup for it.
            seen["group ranks differ"] = expect_error(
                (ValueError, TypeError), "group",
                lambda: flashoverlap.gemm_all_reduce(x, w, group=sub, communicator=comm))
        still_works("group ranks differ")
    # The world group with the world communicator is fine.
    still_works("explicit group and communicator", group=dist.group.WORLD, communicator=comm)

    seen["unknown name"] = expect_error(
        ValueError, "communicator", lambda: flashoverlap.gemm_all_reduce(x, w, communicator="nope"), "nope")
    seen["unknown name as group"] = expect_error(
        ValueError, "communicator", lambda: flashoverlap.gemm_all_reduce(x, w, "nope"), "nope")
    seen["name twice"] = expect_error(
        ValueError, "group", lambda: flashoverlap.gemm_all_reduce(x, w, comm.name, communicator=comm.name))
    seen["communicator type"] = expect_error(
        TypeError, "communicator", lambda: flashoverlap.gemm_all_reduce(x, w, communicator=3))
    seen["op with unknown name"] = expect_error(
        ValueError, "group_name",
        lambda: torch.ops.flashoverlap.gemm_all_reduce(x, w, "nope", "auto", None), "nope")
    still_works("unknown communicators")

    seen["mode"] = expect_error(ValueError, "mode", lambda: flashoverlap.gemm_all_reduce(x, w, mode="fast"))
    seen["op mode"] = expect_error(
        ValueError, "mode", lambda: torch.ops.flashoverlap.gemm_all_reduce(x, w, comm.name, "fast", None))
    seen["bands 0"] = expect_error(
        ValueError, "bands_per_group", lambda: flashoverlap.gemm_all_reduce(x, w, bands_per_group=0))
    seen["op bands 0"] = expect_error(
        ValueError, "bands_per_group",
        lambda: torch.ops.flashoverlap.gemm_all_reduce(x, w, comm.name, "overlap", 0))
    seen["bands float"] = expect_error(
        TypeError, "bands_per_group", lambda: flashoverlap.gemm_all_reduce(x, w, bands_per_group=2.0))
    seen["dtype"] = expect_error(TypeError, "x", lambda: flashoverlap.gemm_all_reduce(x.float(), w.float()))
    seen["mixed"] = expect_error(TypeError, "weight", lambda: flashoverlap.gemm_all_reduce(x, w.half()))
    seen["K"] = expect_error(ValueError, "x", lambda: flashoverlap.gemm_all_reduce(x[:, :512].contiguous(), w))
    seen["contiguous"] = expect_error(ValueError, "x", lambda: flashoverlap.gemm_all_reduce(x[:, ::2], w[:, :512]))
    still_works("argument errors")

    seen["duplicate name"] = expect_error(ValueError, "name", lambda: flashoverlap.Communicator(name=comm.name))

    # Bad environment values name the variable and leave the process usable.
    for name, value in (("FLASHOVERLAP_NCCL_MAX_CTAS", "many"), ("FLASHOVERLAP_NCCL_MAX_CTAS", "0")):
        os.environ[name] = value
        try:
            try:
                flashoverlap.Communicator(name="env-test")
            except ValueError as e:
                assert name in str(e), str(e)
            else:
                raise AssertionError(f"{name}={value!r} was accepted")
        finally:
            del os.environ[name]
    for name, value in (("FLASHOVERLAP_RESERVED_SMS", "lots"), ("FLASHOVERLAP_MAX_GROUPS", "0")):
        os.environ[name] = value
        try:
            try:
                flashoverlap.gemm_all_reduce(x, w)
            except ValueError as e:
                assert name in str(e), str(e)
            else:
                raise AssertionError(f"{name}={value!r} was accepted")
        finally:
            del os.environ[name]
        still_works(f"{name}={value}")
    for mode, bands in (("auto", None), ("sequential", None), ("overlap", 3)):
        result = run_case(rank, world, dict(good, mode=mode, bands=bands))
        assert result["error"] is None, result["error"]
    return {"errors": seen}


def communicators(rank: int, world: int, seed: int) -> dict:
    """Named communicators, subgroups, re-creation, and FLASHOVERLAP_FORCE_SEQUENTIAL."""
    import torch
    import torch.distributed as dist

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    case = dict(seed=seed, lead=[2, 300], n=1024, k=4096, dtype="fp16", mode="overlap", bands=1)
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def check(tag: str, mode: str = case["mode"], bands=case["bands"], **call) -> None:
        result = run_case(rank, world, dict(case, mode=mode, bands=bands), **call)
        assert result["error"] is None, f"{tag}: {result['error']}"

    # A named communicator with its own CTA cap, used by name, object and op.
    second = flashoverlap.Communicator(name="second", max_ctas=4)
    assert second.max_ctas == 4 and second.world_size == world
    check("by name", group="second")
    check("by communicator=", communicator=second)
    check("by object", group=second)
    dtype = dtype_of(case["dtype"])
    x, w = make_inputs(seed, rank, (2, 300), 1024, 4096, dtype, device)
    out = torch.ops.flashoverlap.gemm_all_reduce(x, w, "second", "sequential", None)
    error = mismatch(out, reference(seed, world, (2, 300), 1024, 4096, dtype, device), "op by name")
    assert error is None, error
    second.destroy()
    expect_error(ValueError, "communicator", lambda: flashoverlap.gemm_all_reduce(x, w, "second"), "second")

    # FLASHOVERLAP_FORCE_SEQUENTIAL wins over mode and bands_per_group.
    os.environ["FLASHOVERLAP_FORCE_SEQUENTIAL"] = "1"
    try:
        plan = flashoverlap.plan_of(x, w, mode="overlap", bands_per_group=1)
        assert plan.schedule == "sequential" and len(plan.groups) == 1 and plan.ctas == sms, repr(plan)
        check("forced sequential")
    finally:
        del os.environ["FLASHOVERLAP_FORCE_SEQUENTIAL"]
    plan = flashoverlap.plan_of(x, w, mode="overlap", bands_per_group=1)
    assert plan.schedule == "overlap" and len(plan.groups) == plan.tiles[0], repr(plan)

    # FLASHOVERLAP_RESERVED_SMS sets the GEMM's CTAs while overlapping.
    os.environ["FLASHOVERLAP_RESERVED_SMS"] = "24"
    try:
        plan = flashoverlap.plan_of(x, w, mode="overlap", bands_per_group=2)
        assert plan.ctas == sms - 24, repr(plan)
        check("reserved_sms=24", mode="overlap", bands=2)
    finally:
        del os.environ["FLASHOVERLAP_RESERVED_SMS"]

    # A group of the same ranks as the world gets its own communicator.
    same = dist.new_group(ranks=list(range(world)))
    check("same-ranks group", group=same)
    assert flashoverlap.get_communicator(same) is not flashoverlap.get_communicator()

    # A one-rank subgroup on rank 0: the "sum" is rank 0's product alone.
    solo = dist.new_group(ranks=[0])
    if rank == 0:
        out = flashoverlap.gemm_all_reduce(x, w, group=solo, mode="overlap", bands_per_group=1)
        ref = reference(seed, world, (2, 300), 1024, 4096, dtype, device, ranks=[0])
        error = mismatch(out, ref, "one-rank subgroup")
        assert error is None, error
    dist.barrier()

    # Destroyed communicators are re-created on the next call.
    flashoverlap.destroy_communicators()
    check("re-created")
    m0 = flashoverlap.gemm_all_reduce(torch.empty(0, 4096, dtype=dtype, device=device), w)
    assert m0.shape == (0, 1024)
    return {"ok": True}


def rs_cases(rank: int, world: int, cases: list, replays: int = 0, backend=None) -> dict:
    """gemm_reduce_scatter on each case (fresh inputs, poisoned memory) against rank `rank`'s rows
    of the fp32 sum; then, if `replays`, a CUDA graph of the first case replayed on fresh inputs."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    failures, records = [], []

    # Bad shapes are refused before anything runs; the op works afterwards.
    x, w = make_inputs(1, rank, (2, 8 * world), 64, 64, torch.bfloat16, device)
    expect_error(ValueError, "x", lambda: flashoverlap.gemm_reduce_scatter(x, w), "[M, K]")
    if world > 1:
        x, w = make_inputs(1, rank, (8 * world + 1,), 64, 64, torch.bfloat16, device)
        expect_error(ValueError, "x", lambda: flashoverlap.gemm_reduce_scatter(x, w), "divisible")

    def expected(seed, m, n, k, dtype):
        shard = m // world
        return reference(seed, world, (m,), n, k, dtype, device)[rank * shard:(rank + 1) * shard]

    for case in cases:
        m, n, k, seed = case["m"], case["n"], case["k"], case["seed"]
        dtype = dtype_of(case["dtype"])
        call = dict(mode=case["mode"], bands_per_group=case["bands"], backend=backend)
        x, w = make_inputs(seed, rank, (m,), n, k, dtype, device)
        poison((m // world + 256, n), dtype, device)
        poison(((m // world + 256) * world, n), dtype, device)
        out = flashoverlap.gemm_reduce_scatter(x, w, **call)
        what = f"rank {rank} {m}x{n}x{k} {case['dtype']} {call}"
        error = mismatch(out, expected(seed, m, n, k, dtype), what)
        if error:
            failures.append(error)
        if m:
            plan = flashoverlap.reduce_scatter_plan_of(x, w, **call)
            bands = [g["bands"] for g in plan["groups"]]
            if [b[0] for b in bands] != [0] + [b[1] for b in bands[:-1]] or bands[-1][1] != plan["bands"]:
                failures.append(f"{what}: groups {bands} do not cover the {plan['bands']} bands")
            if case["mode"] == "overlap" and plan["schedule"] != "overlap":
                failures.append(f"{what}: overlap mode planned {plan['schedule']}")
            records.append({"case": case, "schedule": plan["schedule"], "groups": len(bands)})
    if replays and cases:
        case = cases[0]
        m, n, k, dtype = case["m"], case["n"], case["k"], dtype_of(case["dtype"])
        call = dict(mode="overlap", bands_per_group=case["bands"], backend=backend)
        static_x, static_w = make_inputs(case["seed"], rank, (m,), n, k, dtype, device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            flashoverlap.gemm_reduce_scatter(static_x, static_w, **call)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flashoverlap.gemm_reduce_scatter(static_x, static_w, **call)
        for i in range(replays):
            seed = case["seed"] + 1 + i
            x, w = make_inputs(seed, rank, (m,), n, k, dtype, device)
            static_x.copy_(x)
            static_w.copy_(w)
            out.fill_(float("nan"))
            graph.replay()
            error = mismatch(out, expected(seed, m, n, k, dtype), f"replay {i}")
            if error:
                failures.append(error)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures[:20]))
    return {"records": records}


def rmsnorm_cases(rank: int, world: int, cases: list, replays: int = 0, backend=None) -> dict:
    """gemm_all_reduce_rmsnorm on each case (fresh inputs, poisoned outputs) against the fp32
    composition: r = sum_ranks(x @ w^T) + residual, out = r * rsqrt(mean(r^2) + eps) * norm_weight;
    then, if `replays`, a CUDA graph of the first case replayed on fresh inputs."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    failures, records = [], []

    def norm_inputs(seed, lead, n, dtype):
        # Each rank its own residual and weight, but for "peer", whose ranks normalize each
        # other's rows: it needs them replicated (as tensor parallelism has them).
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 31 + (0 if backend == "peer" else rank))
        residual = torch.randn(*lead, n, generator=gen, device=device, dtype=dtype)
        weight = torch.rand(n, generator=gen, device=device, dtype=dtype) + 0.5
        return residual, weight

    def expected(seed, lead, n, k, dtype, residual, weight, eps):
        r = reference(seed, world, lead, n, k, dtype, device) + residual.float()
        return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float(), r

    def check(out, res, seed, lead, n, k, dtype, residual, weight, eps, what):
        out_ref, res_ref = expected(seed, lead, n, k, dtype, residual, weight, eps)
        for error in (mismatch(out, out_ref, f"{what} out"), mismatch(res, res_ref, f"{what} residual")):
            if error:
                failures.append(error)

    call0 = {} if backend is None else {"backend": backend}
    for case in cases:
        lead, n, k, seed, eps = tuple(case["lead"]), case["n"], case["k"], case["seed"], case["eps"]
        dtype = dtype_of(case["dtype"])
        call = dict(call0, mode=case["mode"], bands_per_group=case["bands"])
        x, w = make_inputs(seed, rank, lead, n, k, dtype, device)
        residual, weight = norm_inputs(seed, lead, n, dtype)
        poison((*lead, n), dtype, device)
        out, res = flashoverlap.gemm_all_reduce_rmsnorm(x, w, residual, weight, eps, **call)
        check(out, res, seed, lead, n, k, dtype, residual, weight, eps,
              f"rank {rank} x{(*lead, k)} w{(n, k)} {case['dtype']} {call}")
        if math.prod(lead):
            plan = flashoverlap.plan_of(x, w, fused_norm=True, **call)
            records.append({"case": case, "schedule": plan.schedule, "groups": len(plan.groups)})
    if replays and cases:
        case = cases[0]
        lead, n, k, eps = tuple(case["lead"]), case["n"], case["k"], case["eps"]
        dtype = dtype_of(case["dtype"])
        call = dict(call0, mode="overlap", bands_per_group=case["bands"])
        static_x, static_w = make_inputs(case["seed"], rank, lead, n, k, dtype, device)
        static_res, static_nw = norm_inputs(case["seed"], lead, n, dtype)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            flashoverlap.gemm_all_reduce_rmsnorm(static_x, static_w, static_res, static_nw, eps, **call)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, res = flashoverlap.gemm_all_reduce_rmsnorm(static_x, static_w, static_res, static_nw, eps, **call)
        for i in range(replays):
            seed = case["seed"] + 1 + i
            x, w = make_inputs(seed, rank, lead, n, k, dtype, device)
            residual, weight = norm_inputs(seed, lead, n, dtype)
            for static, fresh in ((static_x, x), (static_w, w), (static_res, residual), (static_nw, weight)):
                static.copy_(fresh)
            out.fill_(float("nan"))
            res.fill_(float("nan"))
            graph.replay()
            check(out, res, seed, lead, n, k, dtype, residual, weight, eps, f"replay {i}")
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures[:20]))
    return {"records": records}


def a2a_cases(rank: int, world: int, cases: list, backend=None, replays: int = 20) -> dict:
    """gemm_all_to_all for each case's split matrix (matrix[p][r]: rows p sends r) against the fp32
    all_to_all_single of every rank's x_p @ w_p^T; bad splits are refused first. The copy-engine
    and push backends get the whole matrix on every call (they need it), with the case's group
    count."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    x, w = make_inputs(1, rank, (8,), 64, 64, torch.bfloat16, device)
    expect_error(ValueError, "input_split_sizes", lambda: flashoverlap.gemm_all_to_all(x, w, [8] * (world + 1),
                                                                                         [0] * world))
    expect_error(ValueError, "input_split_sizes", lambda: flashoverlap.gemm_all_to_all(x, w, [9] + [0] * (world - 1),
                                                                                         [0] * world), "sum")
    expect_error(ValueError, "output_split_sizes", lambda: flashoverlap.gemm_all_to_all(x, w, [8] + [0] * (world - 1),
                                                                                          [-1] * world))
    wrong = [[8] + [0] * (world - 1)] * world
    wrong[rank] = [0] * world
    expect_error(ValueError, "split_matrix", lambda: flashoverlap.gemm_all_to_all(
        x, w, [8] + [0] * (world - 1), [8 if rank == 0 else 0] + [0] * (world - 1), split_matrix=wrong))

    staged = backend in ("copy_engine", "push")
    if staged:
        expect_error(ValueError, "backend", lambda: flashoverlap.gemm_all_to_all(
            x, w, [8] + [0] * (world - 1), [8 if rank == 0 else 0] + [0] * (world - 1), backend=backend),
            "split_matrix")

    def how(groups, matrix, seed=0):
        if staged:
            return dict(split_matrix=matrix, backend=backend, groups=None if groups == "auto" else groups)
        # Forced group counts with the matrix (one band grid over x's rows) on odd seeds, without it
        # (each destination in whole bands of its own) on even ones: both layouts.
        if groups == "auto":
            return dict(split_matrix=matrix)
        return dict(groups=groups, split_matrix=matrix) if seed % 2 else dict(groups=groups)

    failures = []
    for case in cases:
        matrix, n, k, seed, groups = case["matrix"], case["n"], case["k"], case["seed"], case["groups"]
        dtype = dtype_of(case["dtype"])
        sends = matrix[rank]
        recvs = [matrix[p][rank] for p in range(world)]
        x, w = make_inputs(seed, rank, (sum(sends),), n, k, dtype, device)
        poison((sum(recvs), n), dtype, device)
        out = flashoverlap.gemm_all_to_all(x, w, sends, recvs, **how(groups, matrix, seed))
        parts = []
        for p in range(world):
            xp, wp = make_inputs(seed, p, (sum(matrix[p]),), n, k, dtype, device)
            start = sum(matrix[p][:rank])
            parts.append(xp[start:start + matrix[p][rank]].float() @ wp.float().T)
        ref = torch.cat(parts) if parts else torch.empty(0, n, device=device)
        error = mismatch(out, ref, f"rank {rank} matrix {matrix} {n}x{k} {case['dtype']} groups {groups}")
        if error:
            failures.append(error)
    # A CUDA graph of the first routing (run above, so its tables exist), replayed on fresh inputs.
    case = cases[0]
    matrix, n, k, groups, dtype = case["matrix"], case["n"], case["k"], case["groups"], dtype_of(case["dtype"])
    sends, recvs = matrix[rank], [matrix[p][rank] for p in range(world)]
    static_x, static_w = make_inputs(case["seed"], rank, (sum(sends),), n, k, dtype, device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        flashoverlap.gemm_all_to_all(static_x, static_w, sends, recvs, **how(groups, matrix))
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashoverlap.gemm_all_to_all(static_x, static_w, sends, recvs, **how(groups, matrix))
    for i in range(replays):
        seed = case["seed"] + 1 + i
        x, w = make_inputs(seed, rank, (sum(sends),), n, k, dtype, device)
        static_x.copy_(x)
        static_w.copy_(w)
        out.fill_(float("nan"))
        graph.replay()
        parts = []
        for p in range(world):
            xp, wp = make_inputs(seed, p, (sum(matrix[p]),), n, k, dtype, device)
            start = sum(matrix[p][:rank])
            parts.append(xp[start:start + matrix[p][rank]].float() @ wp.float().T)
        error = mismatch(out, torch.cat(parts), f"replay {i}")
        if error:
            failures.append(error)
    if failures:
        raise AssertionError(f"{len(failures)} failures:\n" + "\n".join(failures[:20]))
    return {"cases": len(cases)}


def without_nccl(rank: int, world: int, seed: int) -> dict:
    """On a communicator made without NCCL: asking for the NCCL backend is refused before anything
    runs; the sequential schedules use the group's own collectives; the copy engines still work."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    m, n, k = 256 * world, 1024, 512
    x, w = make_inputs(seed, rank, (m,), n, k, torch.bfloat16, device)
    message = expect_error(ValueError, "backend", lambda: flashoverlap.gemm_all_reduce(x, w, backend="nccl"),
                           "without NCCL")
    expect_error(ValueError, "backend", lambda: flashoverlap.gemm_reduce_scatter(x, w, backend="nccl"),
                 "without NCCL")
    # "auto" has only the copy engines to choose from.
    for op in ("gemm_all_reduce", "gemm_reduce_scatter"):
        if flashoverlap.backend_of(x, w, op=op) != "copy_engine":
            raise AssertionError(f"{op}: auto chose {flashoverlap.backend_of(x, w, op=op)} without NCCL")
    ref = reference(seed, world, (m,), n, k, torch.bfloat16, device)
    shard = ref[rank * (m // world):(rank + 1) * (m // world)]
    failures = []
    for what, out, expected in (
            ("sequential all-reduce", flashoverlap.gemm_all_reduce(x, w, mode="sequential"), ref),
            ("overlapped all-reduce", flashoverlap.gemm_all_reduce(x, w, mode="overlap", bands_per_group=1), ref),
            ("sequential reduce-scatter", flashoverlap.gemm_reduce_scatter(x, w, mode="sequential"), shard),
            ("overlapped reduce-scatter",
             flashoverlap.gemm_reduce_scatter(x, w, mode="overlap", bands_per_group=1, backend="copy_engine"),
             shard)):
        error = mismatch(out, expected, f"rank {rank} {what}")
        if error:
            failures.append(error)
    # All-to-All without split_matrix cannot use the copy engines: the GEMM, then the group's exchange.
    splits = [m // world] * world
    out = flashoverlap.gemm_all_to_all(x, w, splits, splits, groups=2)
    # Rank p's block of the output: rows rank*shard.. of x_p @ w_p^T.
    expected = torch.cat([reference(seed, world, (m,), n, k, torch.bfloat16, device, ranks=[p])
                          [rank * (m // world):(rank + 1) * (m // world)] for p in range(world)])
    error = mismatch(out, expected, f"rank {rank} all-to-all")
    if error:
        failures.append(error)
    if failures:
        raise AssertionError("\n".join(failures))
    return {"refused": message}


def plain_collectives(rank: int, world: int, seed: int, backend: str, replays: int = 20) -> dict:
    """flashoverlap.all_reduce and reduce_scatter alone on `backend`, sizes from one vector to
    several chunks, against the fp32 sums; inputs are left untouched; a captured pair replayed on
    fresh inputs; sizes the copy engines cannot take are refused (explicit backend) first."""
    import torch

    import flashoverlap

    device = device_of(rank)
    failures = []

    def data(s, shape, dtype, r=rank):
        gen = torch.Generator(device=device).manual_seed(s * 131 + r)
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    def expected(s, shape, dtype):
        return sum(data(s, shape, dtype, r).float() for r in range(world))

    def check(s, x, shape, dtype, what):
        before = x.clone()
        full = expected(s, shape, dtype)
        shard = full.shape[0] // world
        for name, out, ref in (
                ("all_reduce", flashoverlap.all_reduce(x, backend=backend), full),
                ("reduce_scatter", flashoverlap.reduce_scatter(x, backend=backend),
                 full[rank * shard:(rank + 1) * shard])):
            error = mismatch(out, ref, f"rank {rank} {name} {what}")
            if error:
                failures.append(error)
        if not torch.equal(x, before):
            failures.append(f"rank {rank} {what}: the input changed")

    if backend == "copy_engine":
        odd = data(seed, (world, 3), torch.bfloat16)
        expect_error(ValueError, "x", lambda: flashoverlap.all_reduce(odd, backend=backend), "16-byte")
    shapes = [(world * 8,), (world * 64, 1024), (world * 1000, 8192), (world * 3, 40), (world * 2048, 4096)]
    if backend != "copy_engine":
        shapes.append((world * 3, 3))  # not whole 16-byte vectors: "auto" runs NCCL
    for i, shape in enumerate(shapes):
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        s = seed + i
        check(s, data(s, shape, dtype), shape, dtype, f"{shape} {dtype}")
    shape, dtype = (world * 512, 2048), torch.bfloat16
    static = data(seed, shape, dtype)
    flashoverlap.all_reduce(static, backend=backend)
    flashoverlap.reduce_scatter(static, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        summed = flashoverlap.all_reduce(static, backend=backend)
        scattered = flashoverlap.reduce_scatter(static, backend=backend)
    for i in range(replays):
        s = seed + 100 + i
        static.copy_(data(s, shape, dtype))
        summed.fill_(float("nan"))
        scattered.fill_(float("nan"))
        graph.replay()
        full = expected(s, shape, dtype)
        shard = shape[0] // world
        for error in (mismatch(summed, full, f"replay {i} all_reduce"),
                      mismatch(scattered, full[rank * shard:(rank + 1) * shard], f"replay {i} reduce_scatter")):
            if error:
                failures.append(error)
    if failures:
        raise AssertionError("\n".join(failures[:20]))
    return {"replays": replays}


def tune_copy_engine(rank: int, world: int, seed: int) -> dict:
    """What `flashoverlap tune` measures for the copy-engine backend: one group's exchange (a
    single chunk) sums right, and its timed curve is a valid profile entry."""
    import torch

    import flashoverlap
    from flashoverlap import _core, profiles, tune

    device = device_of(rank)
    comm = flashoverlap.get_communicator()
    stream = torch.cuda.current_stream(device).cuda_stream
    failures = []
    # A single-chunk AllReduce and ReduceScatter on fresh data, against the fp32 sums.
    count = 48 * 1024 * world
    gens = [torch.Generator(device=device).manual_seed(seed * 17 + r) for r in range(world)]
    inputs = [torch.randn(count, generator=g, device=device, dtype=torch.bfloat16) for g in gens]
    total = sum(t.float() for t in inputs)
    mine = inputs[rank]
    for kind, expected in (("all_reduce", total), ("reduce_scatter", total.view(world, -1)[rank])):
        out = torch.full_like(expected, float("nan"), dtype=torch.bfloat16)
        comm.ensure_peer_buffers(out.numel() * 2)
        _core.copy_engine_collective(comm.name, kind, mine.data_ptr(), out.data_ptr(), count * 2, "bfloat16", 4,
                                     stream, 1)
        error = mismatch(out, expected, f"rank {rank} single-chunk {kind}")
        if error:
            failures.append(error)
    tune.SIZES = [1 << 16, 1 << 20, 3 << 20]
    buf = torch.randn(tune.SIZES[-1] // 2, device=device, dtype=torch.bfloat16)
    profile = profiles.empty(profiles.make_key("test", 132, world, "none", "bfloat16"))
    for kind in profiles.COPY_ENGINE_COLLECTIVES:
        item = {"kind": "collective", "collective": kind, "overlapped": True, "backend": "copy_engine", "ctas": 4}
        tune.record(profile, item, tune._measure_copy_engine(item, buf, "bfloat16", stream, 5, comm))
        assert tune.item_done(profile, item)
    profiles.validate(profile)
    if failures:
        raise AssertionError("\n".join(failures))
    return {"curves": [c["us"] for c in profile["collectives"]]}


def push_refused(rank: int, world: int, seed: int) -> dict:
    """backend="push" where it cannot run (3 ranks; the All-to-All without the split matrix that
    sizes its slots): a clear ValueError before anything runs, and the ops still right afterwards."""
    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    good = dict(seed=seed, lead=[600], n=2048, k=512, dtype="bf16", mode="overlap", bands=1)
    x, w = make_inputs(seed, rank, (600,), 2048, 512, torch.bfloat16, device)
    seen = {}
    if world != 2:
        seen["world"] = expect_error(ValueError, "backend",
                                     lambda: flashoverlap.gemm_all_reduce(x, w, backend="push"), "exactly 2 ranks")
        seen["world_rs"] = expect_error(ValueError, "backend", lambda: flashoverlap.gemm_reduce_scatter(
            x[:600 - 600 % world], w, backend="push"), "exactly 2 ranks")
        result = run_case(rank, world, good, backend="copy_engine")
        assert result["error"] is None, f"after a refused push: {result['error']}"
    seen["all_to_all"] = expect_error(ValueError, "backend", lambda: flashoverlap.gemm_all_to_all(
        x, w, [600 // world] * world, [600 // world] * world, backend="push"), "push")
    if world == 2:
        result = run_case(rank, world, good, backend="push")
        assert result["error"] is None, f"after a refused push: {result['error']}"
    return {"seen": seen}


def a2a_push_one_way(rank: int, world: int, seed: int, calls: int = 12) -> dict:
    """Back-to-back push All-to-Alls cycling through: neither rank sends the other anything; rank 1
    sends rank 0 rows, rank 0 sends rank 1 none; both send. Rank 0 lags on the host before each
    call, so rank 1, waiting for no push in the first two, runs ahead and hands rank 0 its next
    slot grant before rank 0 took the last one. Grants must still be taken one at a time: two
    merged into one leave rank 0 waiting for a grant that rank 1 gives only after rank 0's pushes
    of the third call (a hang). Every output must be right."""
    import time

    import torch

    import flashoverlap

    device = device_of(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    n, k = 1024, 256
    outs, refs = [], []
    for i in range(calls):
        matrix = ([[300, 0], [0, 100]], [[300, 0], [200 + i, 100]], [[300, 50 + i], [200, 100]])[i % 3]
        sends, recvs = matrix[rank], [matrix[p][rank] for p in range(world)]
        x, w = make_inputs(seed + i, rank, (sum(sends),), n, k, torch.bfloat16, device)
        if rank == 0:
            time.sleep(0.05)
        outs.append(flashoverlap.gemm_all_to_all(x, w, sends, recvs, split_matrix=matrix, groups=2, backend="push"))
        parts = []
        for p in range(world):
            xp, wp = make_inputs(seed + i, p, (sum(matrix[p]),), n, k, torch.bfloat16, device)
            start = sum(matrix[p][:rank])
            parts.append(xp[start:start + matrix[p][rank]].float() @ wp.float().T)
        refs.append(torch.cat(parts))
    failures = [e for e in (mismatch(o, r, f"rank {rank} call {i}") for i, (o, r) in enumerate(zip(outs, refs))) if e]
    if failures:
        raise AssertionError("\n".join(failures))
    return {"calls": calls}


def load_calls(rank: int, world: int) -> dict:
    """bench.load_calls on every rank, each asking a different duration: all get the largest count."""
    from flashoverlap import bench

    return {"counts": bench.load_calls(0.002 * (rank + 1), 0.0)}


def timing_rounds(rank: int, world: int) -> dict:
    """bench.interleaved_times_us over a local GEMM and a 1 MiB AllReduce on every rank."""
    import statistics

    import torch
    import torch.distributed as dist

    from flashoverlap import bench

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(1 << 19, device="cuda", dtype=torch.bfloat16)
    times = bench.interleaved_times_us({"gemm": lambda i: a @ a, "all_reduce": lambda i: dist.all_reduce(buf)},
                                       iters=10, warmup=2)
    return {name: [len(v), statistics.median(v)] for name, v in times.items()}


def nn_layers(rank: int, world: int, seed: int, **options) -> dict:
    """flashoverlap.nn's layers against the whole layer in fp32 (tests/nn_checks.py)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from nn_checks import compiled_checks, graph_checks, row_parallel_checks

    device = device_of(rank)
    return {"failures": row_parallel_checks(rank, world, device, seed, **options)
            + graph_checks(rank, world, device, seed + 100, **options)
            + compiled_checks(rank, world, device, seed + 200, **options)}



def weave_block(rank: int, world: int, seed: int, replays: int = 3) -> dict:
    """Two tensor-parallel MLP layers (GEMMs on the compute stream, all_reduce_rmsnorm on 8 CTAs on
    the communication stream) woven over two token halves, against the fp32 composition: eager at
    several splits (wave-aware, uneven, unsplit), then a captured CUDA graph replayed on fresh inputs."""
    import torch

    import flashoverlap

    device = device_of(rank)
    hidden, shard, layers, eps = 1024, 512, 2, 1e-5
    failures: list = []

    def weights(r: int, layer: int):
        gen = torch.Generator(device=device).manual_seed(seed * 1009 + layer * 31 + r)
        up = (torch.randn(shard, hidden, generator=gen, device=device) / hidden ** 0.5).bfloat16()
        down = (torch.randn(hidden, shard, generator=gen, device=device) / shard ** 0.5).bfloat16()
        norm = (torch.rand(hidden, generator=gen, device=device) + 0.5).bfloat16()
        return up, down, norm

    mine = [weights(rank, layer) for layer in range(layers)]
    # The norm weight is the same on every rank: rank 0's.
    norms = [weights(0, layer)[2] for layer in range(layers)]

    def stage(layer: int, residual_out: str = "full"):
        up, down, _ = mine[layer]

        def compute(h, res):
            return torch.relu(h @ up.T) @ down.T, res

        def communicate(partial, res):
            return flashoverlap.all_reduce_rmsnorm(partial, res, norms[layer], eps, ctas=8, residual_out=residual_out)

        return compute, communicate

    stages = [stage(layer) for layer in range(layers)]

    def reference(h, res):
        h, res = h.float(), res.float()
        for layer in range(layers):
            total = torch.zeros_like(res)
            for r in range(world):
                up, down, _ = weights(r, layer)
                total += torch.relu(h @ up.float().T) @ down.float().T
            res = res + total
            h = res * torch.rsqrt(res.pow(2).mean(-1, keepdim=True) + eps) * norms[layer].float()
        return h, res

    def inputs(tokens: int, draw: int):
        gen = torch.Generator(device=device).manual_seed(seed * 7 + draw)  # the same on every rank
        return (torch.randn(tokens, hidden, generator=gen, device=device).bfloat16(),
                torch.randn(tokens, hidden, generator=gen, device=device).bfloat16())

    def compare(got, want, what: str) -> None:
        for name, out, ref in zip(("out", "residual"), got, want):
            why = mismatch(out, ref, f"{what} {name}")
            if why:
                failures.append(why)

    for draw, (tokens, split) in enumerate([(1000, None), (2048, 1024), (777, (512, 265)), (64, 64)]):
        split = flashoverlap.token_split(tokens, [(shard, hidden), (hidden, shard)]) if split is None else split
        h, res = inputs(tokens, draw)
        poison((tokens, hidden), torch.bfloat16, device)
        compare(flashoverlap.weave(stages, (h, res), split), reference(h, res), f"{tokens} tokens split {split}")

    # The residual kept sharded from call to call: each half's rows of this rank's slice.
    tokens = 1000
    h, res = inputs(tokens, 50)
    split = flashoverlap.token_split(tokens, [(shard, hidden), (hidden, shard)])
    halves = flashoverlap.weave([stage(layer, "sharded") for layer in range(layers)], (h, res), split, merge=False)
    want_h, want_r = reference(h, res)
    why = mismatch(torch.cat([half[0] for half in halves]), want_h, "sharded residual: out")
    failures += [why] if why else []
    first = 0
    for n, half in zip((split.first, split.second), halves):
        a, b = n * rank // world, n * (rank + 1) // world
        if b > a:
            why = mismatch(half[1], want_r[first + a:first + b], f"sharded residual: rows {a}..{b - 1} of a half")
            failures += [why] if why else []
        first += n

    h, res = inputs(tokens, 100)
    flashoverlap.weave(stages, (h, res), split)  # peer buffers made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashoverlap.weave(stages, (h, res), split)
    for replay in range(replays):
        fresh = inputs(tokens, 200 + replay)
        h.copy_(fresh[0])
        res.copy_(fresh[1])
        for t in out:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        compare(out, reference(*fresh), f"graph replay {replay}")
    return {"failures": failures}

TARGETS = {
    "nn_layers": nn_layers,
    "weave_block": weave_block,
    "load_calls": load_calls,
    "timing_rounds": timing_rounds,
    "tune_copy_engine": tune_copy_engine,
    "plain_collectives": plain_collectives,
    "without_nccl": without_nccl,
    "a2a_cases": a2a_cases,
    "a2a_push_one_way": a2a_push_one_way,
    "rmsnorm_cases": rmsnorm_cases,
    "rs_cases": rs_cases,
    "cases": cases,
    "push_refused": push_refused,
    "cuda_graph": cuda_graph,
    "backends_agree": backends_agree,
    "bad_inputs": bad_inputs,
    "communicators": communicators,
}
