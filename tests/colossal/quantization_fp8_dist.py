"""Rank functions of tests/colossal/test_quantization_fp8.py (spawned on gloo by run_distributed).

Every FP8 collective is compared with the plain collective run in FP32 on the same inputs,
element by element, against an error bound built from FP8 rounding (see ``once``): inputs are
generated from (rank, case) seeds, so each rank rebuilds every rank's input for the bound. A
spy on ``torch.distributed`` checks that the FP8 calls sent only ``torch.uint8`` payloads.
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch import nn

# fmt -> (unit roundoff u, half the smallest subnormal step h, largest finite value)
FORMATS = {"e4m3": (2.0**-4, 2.0**-10, 448.0), "e5m2": (2.0**-3, 2.0**-17, 57344.0)}
SPIED = ("all_to_all_single", "all_to_all", "all_gather_single", "all_gather_into_tensor",
         "all_gather", "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor",
         "reduce_scatter", "broadcast")


def once(x_abs: torch.Tensor, amax, fmt: str, pow2: bool = True) -> torch.Tensor:
    """Bound on one FP8 rounding of values ``|x|`` scaled from ``amax``: ``u |x|`` for normal
    values plus the subnormal step. A power-of-two wire scale is up to 2x below
    ``fp8_max / amax`` (one binade unused), which doubles the subnormal term."""
    u, h, mx = FORMATS[fmt]
    return u * x_abs + h * (2.0 if pow2 else 1.0) * amax / mx


def rnd(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound on rounding ``v`` to ``dtype`` (half an ulp, or half a subnormal step)."""
    fi = torch.finfo(dtype)
    return fi.eps / 2 * v + fi.smallest_normal * fi.eps


def data(rank: int, case: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Random input with outliers (every 13th element x40), scaled per rank."""
    g = torch.Generator().manual_seed(7919 * case + rank)
    x = torch.randn(shape, generator=g) * (1 + rank)
    x.view(-1)[::13] *= 40
    return x.to(dtype)


@contextlib.contextmanager
def wire_dtypes():
    """Collect the dtypes of every tensor passed to a torch.distributed collective."""
    seen: set = set()
    saved = {n: getattr(dist, n) for n in SPIED if hasattr(dist, n)}

    def spy(fn):
        def call(*args, **kwargs):
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        seen.add(t.dtype)
            return fn(*args, **kwargs)
        return call

    for n, fn in saved.items():
        setattr(dist, n, spy(fn))
    try:
        yield seen
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _finish(handle, async_op: bool) -> None:
    from fp8boost.colossal.quantization.fp8 import Handle

    if async_op:
        assert isinstance(handle, Handle)
        handle.wait()
    else:
        assert handle is None


def _assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - ref.double()).abs()
    assert (err <= bound).all(), f"{what}: error exceeds the FP8 bound by {(err - bound).max():.3g}"


def check_all_reduce(rank, ws, case, shape, dtype, fmt, avg, async_op) -> None:
    from fp8boost.colossal.quantization.fp8 import all_reduce_fp8

    xs = [data(r, case, shape, dtype) for r in range(ws)]
    ref = xs[rank].to(torch.float32, copy=True)
    dist.all_reduce(ref, op=dist.ReduceOp.SUM)  # the high-precision collective
    x = xs[rank].clone()
    op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
    with wire_dtypes() as seen:
        _finish(all_reduce_fp8(x, fp8_format=fmt, op=op, async_op=async_op), async_op)
    assert seen == {torch.uint8}, f"all_reduce_fp8 sent {seen}"
    div = ws if avg else 1
    ref = ref.double() / div
    # FP8 reduce-scatter (each addend rounded once, summed in FP32), then the reduced value
    # rounded once more for the all-gather, then to the output dtype.
    e1 = sum(once(t.double().abs(), t.double().abs().max(), fmt) for t in xs) / div
    s = ref.abs() + e1
    e2 = once(s, s.max(), fmt)
    fp32 = ws * 2.0**-23 * sum(t.double().abs() for t in xs) / div
    _assert_within(x, ref, e1 + e2 + fp32 + rnd(s + e2, dtype), f"all_reduce_fp8 {fmt} {dtype}")


def _moved_bound(xs, ref, fmt, dtype) -> torch.Tensor:
    """Bound for values moved once through FP8 (gather, all-to-all): any rank's scale."""
    amax = max(t.double().abs().max() for t in xs)
    e = once(ref.double().abs(), amax, fmt)
    return e + rnd(ref.double().abs() + e, dtype)


def check_all_to_all_single(rank, ws, case, shape, dtype, fmt, async_op, splits=None) -> None:
    from fp8boost.colossal.quantization.fp8 import all_to_all_single_fp8

    xs = [data(r, case, shape, dtype) for r in range(ws)]
    outs = None if splits is None else [splits[rank]] * ws  # every rank sends `splits`
    out_shape = list(shape) if splits is None else [sum(outs), *shape[1:]]
    ref = torch.empty(out_shape)
    dist.all_to_all_single(ref, xs[rank].float(), outs, splits)
    got = torch.empty(out_shape, dtype=dtype)
    with wire_dtypes() as seen:
        _finish(all_to_all_single_fp8(got, xs[rank], outs, splits, fp8_format=fmt,
                                      async_op=async_op), async_op)
    assert seen == {torch.uint8}, f"all_to_all_single_fp8 sent {seen}"
    _assert_within(got, ref, _moved_bound(xs, ref, fmt, dtype), f"all_to_all_single {shape}")


def check_all_to_all_list(rank, ws, case, dim, dtype, fmt) -> None:
    from fp8boost.colossal.quantization.fp8 import _all_to_all_fp8

    xs = [data(r, case, (16, 8, 4), dtype) for r in range(ws)]
    ins = [c.contiguous() for c in xs[rank].chunk(ws, dim)]
    refs = [torch.empty(c.shape) for c in ins]
    dist.all_to_all(refs, [c.float() for c in ins])
    outs = [torch.empty_like(c) for c in ins]
    with wire_dtypes() as seen:
        assert _all_to_all_fp8(outs, ins, fp8_format=fmt) is None
    assert seen == {torch.uint8}, f"all_to_all_fp8 sent {seen}"
    for got, ref in zip(outs, refs):
        _assert_within(got, ref, _moved_bound(xs, ref, fmt, dtype), f"all_to_all_fp8 dim {dim}")


def check_all_gather(rank, ws, case, dtype, fmt, async_op) -> None:
    from fp8boost.colossal.quantization.fp8 import _all_gather_fp8, all_gather_into_tensor_flat_fp8

    xs = [data(r, case, (3, 7, 16), dtype) for r in range(ws)]
    refs = [torch.empty(3, 7, 16) for _ in range(ws)]
    dist.all_gather(refs, xs[rank].float())
    outs = [torch.empty_like(xs[rank]) for _ in range(ws)]
    with wire_dtypes() as seen:
        _finish(_all_gather_fp8(outs, xs[rank], fp8_format=fmt, async_op=async_op), async_op)
    assert seen == {torch.uint8}, f"all_gather_fp8 sent {seen}"
    for got, ref in zip(outs, refs):
        _assert_within(got, ref, _moved_bound(xs, ref, fmt, dtype), "all_gather_fp8")
    # flat form: only the unpadded prefix (prod(output_shape)) is written
    flat = torch.full((ws * xs[rank].numel(),), 7.0, dtype=dtype)
    numel = flat.numel() - 5
    all_gather_into_tensor_flat_fp8(flat, xs[rank].reshape(-1), torch.Size([numel]), None, fmt)
    ref = torch.cat([r.reshape(-1) for r in refs])[:numel]
    _assert_within(flat[:numel], ref, _moved_bound(xs, ref, fmt, dtype), "flat all-gather")
    assert (flat[numel:] == 7.0).all(), "the padding after output_shape was overwritten"


def check_reduce_scatter(rank, ws, case, dim, dtype, fmt, async_op) -> None:
    from fp8boost.colossal.quantization.fp8 import reduce_scatter_fp8

    xs = [data(r, case, (16, 8, 4), dtype) for r in range(ws)]
    chunks = [[c.contiguous() for c in x.chunk(ws, dim)] for x in xs]
    ref = torch.empty(chunks[rank][0].shape)
    dist.reduce_scatter(ref, [c.float() for c in chunks[rank]])  # the FP32 collective
    got = torch.empty_like(chunks[rank][0])
    with wire_dtypes() as seen:
        _finish(reduce_scatter_fp8(got, chunks[rank], None, fp8_format=fmt, async_op=async_op),
                async_op)
    assert seen == {torch.uint8}, f"reduce_scatter_fp8 sent {seen}"
    e = sum(once(c[rank].double().abs(), c[rank].double().abs().max(), fmt) for c in chunks)
    s = sum(c[rank].double().abs() for c in chunks)
    _assert_within(got, ref, e + ws * 2.0**-23 * s + rnd(s + e, dtype), f"reduce_scatter dim {dim}")


def run_collectives(rank: int, ws: int, full: bool) -> None:
    """Every collective, both formats; ``full`` adds dtypes, async and shape variants."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,)
    case = 0
    for fmt in ("e4m3", "e5m2"):
        for dtype in dtypes:
            for async_op in ((False, True) if full else (fmt == "e5m2",)):
                case += 1
                for shape in (((3, 7), (8,), (8, 9)) if full else ((3, 7),)):
                    check_all_reduce(rank, ws, case, shape, dtype, fmt, False, async_op)
                    check_all_reduce(rank, ws, case, shape, dtype, fmt, True, async_op)
                for shape in ((4,), (1, 8, 16), (4, 8, 16)) if full else ((1, 8, 16),):
                    check_all_to_all_single(rank, ws, case, shape, dtype, fmt, async_op)
                uneven = [3, 3, 1, 1][:ws] if ws == 4 else [3, 5]
                check_all_to_all_single(rank, ws, case, (8, 8, 16), dtype, fmt, async_op, uneven)
                check_all_gather(rank, ws, case, dtype, fmt, async_op)
                for dim in (0, 1, 2) if full else (dim_for(case),):
                    check_all_to_all_list(rank, ws, case, dim, dtype, fmt)
                    check_reduce_scatter(rank, ws, case, dim, dtype, fmt, async_op)


def dim_for(case: int) -> int:
    return case % 3


class ToyModel(nn.Module):
    """Colossal-AI's DDP/FSDP hook test model."""

    def __init__(self, d_in: int = 10, d_out: int = 5) -> None:
        super().__init__()
        self.net1 = nn.Linear(d_in, d_in)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _ddp_grads(model: nn.Module, x, y, hook=None) -> tuple[list[torch.Tensor], set]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(copy.deepcopy(model))
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    with wire_dtypes() as seen:
        nn.functional.mse_loss(ddp(x), y).backward()
    return [p.grad.clone() for p in ddp.parameters()], seen


def run_ddp_hooks(rank: int, ws: int) -> None:
    """Both DDP hooks average like DDP's own all-reduce, within the e5m2 bound, in FP8."""
    from fp8boost.colossal.quantization.fp8 import (fp8_compress_ddp_grad_comm_hook_async,
                                                    fp8_compress_ddp_grad_comm_hook_sync)

    torch.manual_seed(0)
    model = ToyModel()
    x, y = data(rank, 900, (20, 10), torch.float32), data(rank, 901, (20, 5), torch.float32)
    ref, _ = _ddp_grads(model, x, y)
    local = copy.deepcopy(model)
    nn.functional.mse_loss(local(x), y).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    per_rank = [torch.empty_like(mine) for _ in range(ws)]
    dist.all_gather(per_rank, mine)
    # reduce-scatter of the bucket (one rounding per addend), all-gather of the average
    e1 = sum(once(g.double().abs(), g.double().abs().max(), "e5m2") for g in per_rank) / ws
    s = torch.cat([g.reshape(-1) for g in ref]).double().abs() + e1
    bound = e1 + once(s, s.max(), "e5m2") + 2.0**-22 * s
    results = []
    for hook in (fp8_compress_ddp_grad_comm_hook_sync, fp8_compress_ddp_grad_comm_hook_async):
        grads, seen = _ddp_grads(model, x, y, hook)
        assert torch.uint8 in seen and torch.float32 not in seen, f"{hook.__name__} sent {seen}"
        flat = torch.cat([g.reshape(-1) for g in grads])
        _assert_within(flat, torch.cat([g.reshape(-1) for g in ref]), bound, hook.__name__)
        results.append(flat)
    assert torch.equal(results[0], results[1]), "sync and async hooks reduce the same bytes"


def _fsdp_grads(grad_hook=None, params_hook=None) -> tuple[torch.Tensor, set]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    fsdp = FSDP(ToyModel(100, 50), device_id=torch.device("cpu"))
    if grad_hook is not None:
        fsdp.register_comm_hook(None, grad_hook)
    if params_hook is not None:
        fsdp.register_params_comm_hook(None, params_hook)
    torch.manual_seed(1)  # the same batch on every rank, as Colossal-AI's test
    x, y = torch.randn(20, 100), torch.randn(20, 50)
    with wire_dtypes() as seen:
        nn.functional.mse_loss(fsdp(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in fsdp.parameters()]), seen


def run_fsdp_hooks(rank: int, ws: int) -> None:
    """FSDP1 gradient and parameter hooks (through patch_fsdp_params_comm_hook)."""
    from fp8boost.colossal.quantization.fp8 import (fp8_compress_fsdp_grad_comm_hook,
                                                    fp8_compress_fsdp_params_comm_hook)
    from fp8boost.colossal.quantization.utils import patch_fsdp_params_comm_hook

    patch_fsdp_params_comm_hook()
    ref, _ = _fsdp_grads()
    got, seen = _fsdp_grads(grad_hook=fp8_compress_fsdp_grad_comm_hook)
    assert torch.uint8 in seen, f"the FSDP gradient hook sent {seen}"
    # Every rank has the same gradient g: the average of its FP8 copies errs by <= one rounding.
    bound = once(ref.double().abs(), ref.abs().max().double(), "e5m2") + 2.0**-22 * ref.abs()
    _assert_within(got, ref, bound, "FSDP gradient hook")
    got, seen = _fsdp_grads(params_hook=fp8_compress_fsdp_params_comm_hook)
    assert torch.uint8 in seen, f"the FSDP parameter hook sent {seen}"
    # Forward on e5m2-rounded weights (<= 12.5% each): gradients move, but stay close.
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.25, f"FSDP parameter hook: relative gradient change {rel:.3f}"
    torch.testing.assert_close(got, ref, rtol=0.1, atol=0.1)  # Colossal-AI's tolerance


def world_2(rank: int, ws: int) -> None:
    run_collectives(rank, ws, full=True)
    run_ddp_hooks(rank, ws)
    run_fsdp_hooks(rank, ws)


def world_4(rank: int, ws: int) -> None:
    run_collectives(rank, ws, full=False)
