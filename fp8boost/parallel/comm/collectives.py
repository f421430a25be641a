"""FP8 collectives: real FP8 bytes on the wire, high-precision tensors in and out.

Every function takes and returns ordinary FP32/BF16/FP16 tensors; in between, the payload
travels as FP8 (1 byte per element) in ``torch.uint8`` buffers, because NCCL and gloo reject
float8 dtypes. The layout (FP8 bytes + a 16-byte trailer holding the FP32 inverse scale per
chunk) is described in :mod:`fp8boost.parallel.comm.wire`.

* all-gather: each rank casts its shard and the scale travels in the same all-gather
  (``Fp8CommConfig.all_gather_scale="per_rank"``: one collective, best precision), or one scale
  shared by the group from an all-reduce(MAX) of the amaxes (``"shared"``).
* reduce-scatter: one scale per destination chunk, an all-to-all of the FP8 chunks, FP32 sum on
  the receiver. A rank's own chunk never goes on the wire and is added in full precision.
* all-reduce = FP8 reduce-scatter + FP8 all-gather (any numel: padded to the world size). Every
  rank decodes the same gathered bytes, so results are bit-identical across ranks.
* all-to-all (even and uneven splits) and point-to-point send/recv, one scale per chunk.

All-gather, reduce-scatter and all-reduce are pipelined (``Fp8CommConfig.pipeline_bytes``):
the payload is cut into up to 8 column stages, each with its own scales; stage k+1 is cast
while stage k is on the wire and stage k is decoded while k+1 is, so the casts (which move
about as many HBM bytes as FP8 saves on the link) overlap the transfer instead of adding to it.

Defaults: e4m3 for activations and parameters (all-gather, all-to-all, send/recv), e5m2 for
gradients (reduce-scatter, all-reduce), from :class:`Fp8CommConfig`; ``fp8_dtype=`` overrides.

Where the plain collective runs instead, it runs in the input's own dtype and is logged once
per collective and reason (logger ``fp8boost.parallel.fp8_comm``): world size 1 (local math, no
communication), ``config.enabled=False``, a non-floating-point input, or a payload below
``config.min_payload_numel``. Float8 inputs are refused (they are already 1 byte: send
``t.view(torch.uint8)`` with the plain collective).

``async_op=True`` returns an :class:`Fp8Work`; its ``wait()`` completes the communication and
the dequantization and returns the result tensor. As with ``torch.distributed``, inputs must
not be modified before ``wait()``. All ranks must pass equal shapes (per the collective's rules)
and equal configs. ``group=None`` means the default (WORLD) group; ranks in ``send_fp8`` /
``recv_fp8`` are global ranks, as in ``torch.distributed.send``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fp8boost.fp8.scaling import scale_from_amax

# reduce_scatter_single and all_gather_single are re-exported for bench/comm.py (which still
# reads them under their former names, _all_gather_single / _reduce_scatter_single: below).
from ._utils import (Fp8Work, ReduceOpLike, all_gather_single,  # noqa: F401
                     check_pair, check_tensor, complete, group_info, plan_collective, post_scale,
                     reduce_scatter_single, resolve_cast_impl, resolve_config, resolve_fp8_dtype,
                     staging, waiting)
from .config import MAX_PIPELINE_STAGES, Fp8CommConfig
from .wire import (dequantize_rows, dequantize_sum_rows, num_stages, quantize_rows,
                       row_amax, segment_bytes, stage_bounds, stage_scales)

_all_gather_single, _reduce_scatter_single = all_gather_single, reduce_scatter_single  # bench

__all__ = ["Fp8Work", "all_gather_fp8", "all_gather_into_tensor_fp8", "reduce_scatter_fp8",
           "reduce_scatter_tensor_fp8", "all_reduce_fp8", "all_to_all_fp8", "send_fp8",
           "recv_fp8", "isend_fp8", "irecv_fp8"]

def _stages(payload: int, numel: int, cfg: Fp8CommConfig) -> list[tuple[int, int]]:
    return stage_bounds(numel, num_stages(payload, cfg.pipeline_bytes, MAX_PIPELINE_STAGES))


def _fused_scales(impl: str, bounds) -> bool:
    """One stage with the Triton impl: each row's amax, scale, cast and trailer come from two
    launches (``wire_triton.quantize_rows``) instead of separate scale math."""
    return impl == "triton" and len(bounds) == 1


def _carve(total_rows: int, bounds, device) -> list[torch.Tensor]:
    """One uint8 buffer cut into per-stage ``[total_rows, segment_bytes(width)]`` blocks."""
    sizes = [segment_bytes(hi - lo) for lo, hi in bounds]
    buf = torch.empty(total_rows * sum(sizes), dtype=torch.uint8, device=device)
    return [b.view(total_rows, sz) for b, sz in
            zip(buf.split([total_rows * sz for sz in sizes]), sizes)]


def _quantize_except(x2d: torch.Tensor, skip: int, packed: torch.Tensor, dt: torch.dtype,
                     cfg: Fp8CommConfig, impl: str, scale: Optional[torch.Tensor]) -> None:
    """Quantize every row of ``x2d`` but row ``skip`` into the consecutive rows of ``packed``
    (``scale=None``: each row's own amax, fused into the cast launches with the Triton impl)."""
    if skip > 0:
        quantize_rows(x2d[:skip], packed[:skip], dt, power_of_2=cfg.power_of_2_wire_scale,
                      impl=impl, scale=None if scale is None else scale[:skip])
    if skip < x2d.shape[0] - 1:
        quantize_rows(x2d[skip + 1:], packed[skip:], dt, power_of_2=cfg.power_of_2_wire_scale,
                      impl=impl, scale=None if scale is None else scale[skip + 1:])


def _reduce_scatter_issue(x2d: torch.Tensor, rank: int, ws: int, dt: torch.dtype,
                          cfg: Fp8CommConfig, impl: str, group, bounds):
    """Cast each stage's chunks for the other ranks and start its all-to-all (async)."""
    fused = _fused_scales(impl, bounds)
    scales = None if fused else stage_scales(x2d, bounds, dt, cfg.power_of_2_wire_scale)
    sends, recvs = _carve(ws - 1, bounds, x2d.device), _carve(ws - 1, bounds, x2d.device)
    works = []
    for k, (lo, hi) in enumerate(bounds):
        _quantize_except(x2d[:, lo:hi], rank, sends[k], dt, cfg, impl,
                         None if fused else scales[:, k])
        seg = sends[k].shape[1]
        splits = [0 if j == rank else seg for j in range(ws)]
        works.append(dist.all_to_all_single(recvs[k].view(-1), sends[k].view(-1), splits, splits,
                                            group=group, async_op=True))
    return works, sends, recvs


# ----------------------------------------------------------------------------- all-gather


def all_gather_into_tensor_fp8(output: torch.Tensor, input: torch.Tensor, group=None, *,
                               fp8_dtype: Optional[torch.dtype] = None, async_op: bool = False,
                               config: Optional[Fp8CommConfig] = None) -> Optional[Fp8Work]:
    """All-gather ``input`` from every rank into ``output`` with FP8 on the wire.

    ``output`` holds ``world_size * input.numel()`` elements: rank r's input, flattened, at
    offset ``r * input.numel()`` (as ``torch.distributed.all_gather_into_tensor``). Its dtype may
    differ from the input's (dequantization writes it directly).

    Args:
        output: destination, any floating dtype and layout.
        input: this rank's shard (FP32/BF16/FP16/FP64, any layout).
        group: process group (None: WORLD).
        fp8_dtype: wire format (default ``config.param_dtype``, e4m3).
        async_op: return an :class:`Fp8Work` instead of finishing now.
        config: :class:`Fp8CommConfig` (default: ``Fp8CommConfig()``).

    Returns:
        None, or an :class:`Fp8Work` whose ``wait()`` returns ``output``.

    Example:
        >>> out = torch.empty(world * 1024, dtype=torch.bfloat16)         # doctest: +SKIP
        >>> all_gather_into_tensor_fp8(out, torch.randn(1024).bfloat16())  # doctest: +SKIP
    """
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.param_dtype)
    ws, _ = check_pair(output, input, group)
    n = input.numel()
    if output.numel() != ws * n:
        raise ValueError(f"output must hold world_size * input.numel() = {ws} * {n} elements, "
                         f"got {output.numel()}")
    plan = plan_collective("all_gather", (input, output), ws * n, ws, cfg)
    if plan == "local":
        output.copy_(input.reshape(output.shape))
        return complete(None, lambda: None, async_op, output)
    if n == 0:  # every rank has the same (empty) shape: nothing to send anywhere
        return complete(None, lambda: None, async_op, output)
    if plan == "plain":
        dst, commit = staging(output, (ws * n,), input.dtype)
        work = all_gather_single(dst, input.contiguous().view(-1), group, async_op)
        return complete(work, waiting(work, commit), async_op, output)
    impl = resolve_cast_impl(cfg, input.device)
    x = input.contiguous().view(1, n)
    bounds = _stages(ws * n, n, cfg)
    if cfg.all_gather_scale == "shared":
        amax = row_amax(x)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scales = scale_from_amax(amax, dt, 0, cfg.power_of_2_wire_scale).expand(1, len(bounds))
    else:  # per-rank scale: fused into the cast launches with the Triton impl, one stage
        scales = None if _fused_scales(impl, bounds) else stage_scales(
            x, bounds, dt, cfg.power_of_2_wire_scale)
    sends, recvs = _carve(1, bounds, x.device), _carve(ws, bounds, x.device)
    works = []
    for k, (lo, hi) in enumerate(bounds):  # cast stage k+1 while stage k is on the wire
        quantize_rows(x[:, lo:hi], sends[k], dt, power_of_2=cfg.power_of_2_wire_scale, impl=impl,
                      scale=None if scales is None else scales[:, k])
        works.append(all_gather_single(recvs[k].view(-1), sends[k].view(-1), group, True))
    out2d, commit = staging(output, (ws, n))

    def finish() -> None:
        for k, (lo, hi) in enumerate(bounds):  # decode stage k while k+1 is on the wire
            works[k].wait()
            dequantize_rows(recvs[k], hi - lo, dt, out2d[:, lo:hi],
                            power_of_2=cfg.power_of_2_wire_scale, impl=impl)
        commit()

    return complete(works, finish, async_op, output, keep=(sends, recvs, x))


def all_gather_fp8(tensor: torch.Tensor, group=None, *, fp8_dtype: Optional[torch.dtype] = None,
                   async_op: bool = False, config: Optional[Fp8CommConfig] = None):
    """All-gather with FP8 on the wire: concatenation along dim 0 of every rank's ``tensor``.

    Every rank must pass the same shape. Returns a new tensor of the input's dtype (or, with
    ``async_op=True``, an :class:`Fp8Work` whose ``wait()`` returns it). Error per element:
    e4m3 rounding, ``|err| <= 2**-4 |x| + 2**-10 * amax / 448`` (subnormals) per rank's scale.

    Example:
        >>> import torch.distributed as dist                               # doctest: +SKIP
        >>> from fp8boost.parallel.fp8_comm import all_gather_fp8          # doctest: +SKIP
        >>> full = all_gather_fp8(torch.randn(4096, 1024, device="cuda"))  # doctest: +SKIP
        >>> full.shape                                                     # doctest: +SKIP
        torch.Size([8192, 1024])   # on 2 ranks
    """
    check_tensor(tensor, "tensor")
    if tensor.dim() == 0:
        raise ValueError("all_gather_fp8 concatenates along dim 0: pass at least a 1-D tensor "
                         "(e.g. t.view(1))")
    ws, _ = group_info(group)
    output = torch.empty((ws * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                         device=tensor.device)
    work = all_gather_into_tensor_fp8(output, tensor, group, fp8_dtype=fp8_dtype,
                                      async_op=async_op, config=config)
    return work if async_op else output


# ----------------------------------------------------------------------------- reduce-scatter


def reduce_scatter_tensor_fp8(output: torch.Tensor, input: torch.Tensor, group=None, *,
                              op: ReduceOpLike = "sum", fp8_dtype: Optional[torch.dtype] = None,
                              async_op: bool = False,
                              config: Optional[Fp8CommConfig] = None) -> Optional[Fp8Work]:
    """Reduce-scatter with FP8 on the wire: ``output = op_r(input_r)[chunk of this rank]``.

    ``input`` holds ``world_size * output.numel()`` elements; rank r receives flat chunk r (as
    ``torch.distributed.reduce_scatter_tensor``). Each chunk bound for another rank is cast with
    its own scale; the chunks go through one all-to-all as uint8; the receiver sums in FP32,
    starting from its own chunk in full precision.

    Args:
        output: this rank's reduced chunk (any floating dtype and layout).
        input: full-size input (FP32/BF16/FP16/FP64, any layout).
        group: process group (None: WORLD).
        op: ``"sum"``, ``"avg"``, or a ``torch.distributed.ReduceOp`` SUM / AVG / PREMUL_SUM.
        fp8_dtype: wire format (default ``config.grad_dtype``, e5m2).
        async_op: return an :class:`Fp8Work` instead of finishing now.
        config: :class:`Fp8CommConfig`.

    Example:
        >>> out = torch.empty(1024)                                            # doctest: +SKIP
        >>> reduce_scatter_tensor_fp8(out, torch.randn(world * 1024), op="avg")  # doctest: +SKIP
    """
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.grad_dtype)
    ws, rank = check_pair(output, input, group)
    post = post_scale(op, ws)
    m = output.numel()
    if input.numel() != ws * m:
        raise ValueError(f"input must hold world_size * output.numel() = {ws} * {m} elements, "
                         f"got {input.numel()}")
    plan = plan_collective("reduce_scatter", (input, output), input.numel(), ws, cfg)
    if plan == "local":
        output.copy_(input.reshape(output.shape))
        if post != 1.0:
            output.mul_(post)
        return complete(None, lambda: None, async_op, output)
    if m == 0:
        return complete(None, lambda: None, async_op, output)
    if plan == "plain":
        dst, commit = staging(output, (m,), input.dtype)
        work = reduce_scatter_single(dst, input.contiguous().view(-1), group, async_op)

        def finish_plain() -> None:
            if post != 1.0:
                dst.mul_(post)
            commit()

        return complete(work, waiting(work, finish_plain), async_op, output)
    impl = resolve_cast_impl(cfg, input.device)
    x2d = input.contiguous().view(ws, m)
    bounds = _stages(ws * m, m, cfg)
    works, sends, recvs = _reduce_scatter_issue(x2d, rank, ws, dt, cfg, impl, group, bounds)
    out_flat, commit = staging(output, (m,))

    def finish() -> None:
        for k, (lo, hi) in enumerate(bounds):
            works[k].wait()
            dequantize_sum_rows(recvs[k], hi - lo, dt, out_flat[lo:hi], local=x2d[rank, lo:hi],
                                post_scale=post, impl=impl)
        commit()

    return complete(works, finish, async_op, output, keep=(sends, recvs, x2d))


def reduce_scatter_fp8(tensor: torch.Tensor, group=None, *, op: ReduceOpLike = "sum",
                       fp8_dtype: Optional[torch.dtype] = None, async_op: bool = False,
                       config: Optional[Fp8CommConfig] = None):
    """Reduce-scatter with FP8 on the wire; returns this rank's dim-0 chunk of the reduction.

    ``tensor.shape[0]`` must be divisible by the world size. Error bound per element of the
    sum (e5m2, unit roundoff u = 2**-3): ``sum over the other ranks r of (u |x_r| +
    2**-17 * amax_r / 57344)``, plus FP32 and output-dtype rounding; the own chunk is exact.

    Example:
        >>> g = torch.randn(8192, 1024, device="cuda")                      # doctest: +SKIP
        >>> reduce_scatter_fp8(g, op="avg").shape                          # doctest: +SKIP
        torch.Size([4096, 1024])   # on 2 ranks
    """
    check_tensor(tensor, "tensor")
    ws, _ = group_info(group)
    if tensor.dim() == 0 or tensor.shape[0] % ws:
        raise ValueError(f"reduce_scatter_fp8 splits dim 0 into {ws} equal chunks: dim 0 of "
                         f"shape {tuple(tensor.shape)} is not divisible by the world size; pad "
                         "it, or use reduce_scatter_tensor_fp8 / all_reduce_fp8")
    output = torch.empty((tensor.shape[0] // ws, *tensor.shape[1:]), dtype=tensor.dtype,
                         device=tensor.device)
    work = reduce_scatter_tensor_fp8(output, tensor, group, op=op, fp8_dtype=fp8_dtype,
                                     async_op=async_op, config=config)
    return work if async_op else output


# ----------------------------------------------------------------------------- all-reduce


def all_reduce_fp8(tensor: torch.Tensor, group=None, *, op: ReduceOpLike = "sum",
                   fp8_dtype: Optional[torch.dtype] = None, async_op: bool = False,
                   config: Optional[Fp8CommConfig] = None) -> Optional[Fp8Work]:
    """In-place all-reduce as FP8 reduce-scatter + FP8 all-gather (any numel, any layout).

    The reduced chunk is re-quantized (from FP32) for the all-gather, so each element sees the
    reduce-scatter error plus one more rounding of the result (``u |sum|``, u = 2**-3 for
    e5m2). All ranks decode the same bytes: the result is bit-identical on every rank. With
    ``async_op=True`` the all-gather phase runs inside ``wait()``.

    Example:
        >>> grad = torch.randn(1 << 20, device="cuda")                     # doctest: +SKIP
        >>> all_reduce_fp8(grad, op="avg")                                 # doctest: +SKIP
    """
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.grad_dtype)
    check_tensor(tensor, "tensor")
    ws, rank = group_info(group)
    post = post_scale(op, ws)
    n = tensor.numel()
    plan = plan_collective("all_reduce", (tensor,), n, ws, cfg)
    if plan == "local":
        if post != 1.0:
            tensor.mul_(post)
        return complete(None, lambda: None, async_op, tensor)
    if n == 0:
        return complete(None, lambda: None, async_op, tensor)
    if plan == "plain":
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

        def finish_plain() -> None:
            if post != 1.0:
                buf.mul_(post)
            if buf is not tensor:
                tensor.copy_(buf)

        return complete(work, waiting(work, finish_plain), async_op, tensor)
    impl = resolve_cast_impl(cfg, tensor.device)
    m = -(-n // ws)
    in_place = tensor.is_contiguous() and m * ws == n
    if in_place:
        x = tensor.view(ws, m)
    else:  # pad to a multiple of the world size (zeros reduce to zeros and are dropped)
        x = torch.zeros((ws, m), dtype=tensor.dtype, device=tensor.device)
        x.view(-1)[:n].copy_(tensor.reshape(-1))
    bounds = _stages(ws * m, m, cfg)
    works, sends, recvs = _reduce_scatter_issue(x, rank, ws, dt, cfg, impl, group, bounds)

    def finish() -> None:
        chunk = torch.empty((1, m), dtype=torch.float32, device=x.device)
        sends2, recvs2 = _carve(1, bounds, x.device), _carve(ws, bounds, x.device)
        works2 = []
        for k, (lo, hi) in enumerate(bounds):  # stage k's all-gather overlaps stage k+1's sum
            works[k].wait()
            dequantize_sum_rows(recvs[k], hi - lo, dt, chunk[0, lo:hi], local=x[rank, lo:hi],
                                post_scale=post, impl=impl)
            quantize_rows(chunk[:, lo:hi], sends2[k], dt, power_of_2=cfg.power_of_2_wire_scale,
                          impl=impl)
            works2.append(all_gather_single(recvs2[k].view(-1), sends2[k].view(-1), group,
                                             True))
        for k, (lo, hi) in enumerate(bounds):
            works2[k].wait()
            dequantize_rows(recvs2[k], hi - lo, dt, x[:, lo:hi],
                            power_of_2=cfg.power_of_2_wire_scale, impl=impl)
        if not in_place:
            tensor.copy_(x.view(-1)[:n].view(tensor.shape))

    return complete(works, finish, async_op, tensor, keep=(sends, recvs, x))


# ----------------------------------------------------------------------------- all-to-all


def _splits(sizes: Optional[Sequence[int]], rows: int, ws: int, name: str) -> list[int]:
    if sizes is None:
        if rows % ws:
            raise ValueError(f"{name}=None splits dim 0 evenly, but {rows} rows are not "
                             f"divisible by the world size {ws}; pass explicit split sizes")
        return [rows // ws] * ws
    sizes = [int(s) for s in sizes]
    if len(sizes) != ws or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"{name} must be {ws} non-negative ints summing to dim 0 ({rows}), "
                         f"got {sizes}")
    return sizes


def all_to_all_fp8(output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None, group=None, *,
                   fp8_dtype: Optional[torch.dtype] = None, async_op: bool = False,
                   config: Optional[Fp8CommConfig] = None) -> Optional[Fp8Work]:
    """All-to-all with FP8 on the wire, same contract as ``dist.all_to_all_single``.

    Dim 0 of ``input`` is split by ``input_split_sizes`` (even when None); chunk j goes to rank
    j, cast with its own scale. The chunk a rank keeps is copied locally in full precision.
    ``config.min_payload_numel`` is not applied (payloads differ between ranks, so a per-rank choice
    could deadlock): all-to-all always uses FP8 when enabled.

    Example:
        >>> out = torch.empty(6, 64)                                      # doctest: +SKIP
        >>> all_to_all_fp8(out, torch.randn(4, 64), [3, 3], [1, 3])      # doctest: +SKIP
    """
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.param_dtype)
    ws, rank = check_pair(output, input, group)
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_fp8 splits dim 0: pass tensors with at least one dim")
    row = math.prod(input.shape[1:])
    if math.prod(output.shape[1:]) != row:
        raise ValueError(f"input and output rows differ: {tuple(input.shape[1:])} vs "
                         f"{tuple(output.shape[1:])} elements per dim-0 slice")
    ins = _splits(input_split_sizes, input.shape[0], ws, "input_split_sizes")
    outs = _splits(output_split_sizes, output.shape[0], ws, "output_split_sizes")
    if ins[rank] != outs[rank]:
        raise ValueError(f"this rank keeps {ins[rank]} rows of its input but expects "
                         f"{outs[rank]} from itself: input/output split sizes disagree")
    plan = plan_collective("all_to_all", (input, output), None, ws, cfg)
    if plan == "local":
        output.copy_(input.reshape(output.shape))
        return complete(None, lambda: None, async_op, output)
    if plan == "plain":
        dst, commit = staging(output, tuple(output.shape), input.dtype)
        work = dist.all_to_all_single(dst, input.contiguous(), outs, ins, group=group,
                                      async_op=async_op)
        return complete(work, waiting(work, commit), async_op, output)
    impl = resolve_cast_impl(cfg, input.device)
    x = input.contiguous().view(input.shape[0], row)
    in_off = [sum(ins[:j]) for j in range(ws)]
    out_off = [sum(outs[:j]) for j in range(ws)]
    send_b = [0 if j == rank else segment_bytes(ins[j] * row) for j in range(ws)]
    recv_b = [0 if j == rank else segment_bytes(outs[j] * row) for j in range(ws)]
    send = torch.empty(sum(send_b), dtype=torch.uint8, device=x.device)
    recv = torch.empty(sum(recv_b), dtype=torch.uint8, device=x.device)
    pos = 0
    for j in range(ws):
        if j != rank:
            chunk = x[in_off[j]:in_off[j] + ins[j]].reshape(1, ins[j] * row)
            quantize_rows(chunk, send[pos:pos + send_b[j]].view(1, -1), dt,
                          power_of_2=cfg.power_of_2_wire_scale, impl=impl)
        pos += send_b[j]
    work = dist.all_to_all_single(recv, send, recv_b, send_b, group=group, async_op=async_op)
    out2d, commit = staging(output, (output.shape[0], row))

    def finish() -> None:
        pos = 0
        for j in range(ws):
            dst = out2d[out_off[j]:out_off[j] + outs[j]]
            if j == rank:
                dst.copy_(x[in_off[j]:in_off[j] + ins[j]])
            else:
                dequantize_rows(recv[pos:pos + recv_b[j]].view(1, -1), outs[j] * row, dt,
                                dst.reshape(1, outs[j] * row), power_of_2=cfg.power_of_2_wire_scale,
                                impl=impl)
            pos += recv_b[j]
        commit()

    return complete(work, waiting(work, finish), async_op, output, keep=(send, recv, x))


# ----------------------------------------------------------------------------- send / recv


def _p2p_plan(op: str, tensor: torch.Tensor, cfg: Fp8CommConfig) -> str:
    # Both ends see the same numel and config, so this choice agrees on the two ranks.
    return plan_collective(op, (tensor,), tensor.numel(), None, cfg)


def _send(tensor, dst, group, fp8_dtype, config, async_op: bool):
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.param_dtype)
    check_tensor(tensor, "tensor")
    group_info(group)
    send_fn = dist.isend if async_op else dist.send
    if _p2p_plan("send", tensor, cfg) == "plain":
        buf = tensor.contiguous()
        work = send_fn(buf, dst, group=group)
        return complete(work, waiting(work), async_op, tensor, keep=(buf,))
    n = tensor.numel()
    packed = torch.empty((1, segment_bytes(n)), dtype=torch.uint8, device=tensor.device)
    quantize_rows(tensor.contiguous().view(1, n), packed, dt, power_of_2=cfg.power_of_2_wire_scale,
                  impl=resolve_cast_impl(cfg, tensor.device))
    work = send_fn(packed.view(-1), dst, group=group)
    return complete(work, waiting(work), async_op, tensor, keep=(packed,))


def _recv(tensor, src, group, fp8_dtype, config, async_op: bool):
    cfg = resolve_config(config)
    dt = resolve_fp8_dtype(fp8_dtype, cfg.param_dtype)
    check_tensor(tensor, "tensor")
    group_info(group)
    n = tensor.numel()
    if _p2p_plan("recv", tensor, cfg) == "plain":
        buf, commit = staging(tensor, tuple(tensor.shape))
        work = (dist.irecv if async_op else dist.recv)(buf, src, group=group)
        return complete(work, waiting(work, commit), async_op, tensor, keep=(buf,))
    impl = resolve_cast_impl(cfg, tensor.device)
    packed = torch.empty((1, segment_bytes(n)), dtype=torch.uint8, device=tensor.device)
    work = (dist.irecv if async_op else dist.recv)(packed.view(-1), src, group=group)
    out2d, commit = staging(tensor, (1, n))

    def finish() -> None:
        dequantize_rows(packed, n, dt, out2d, power_of_2=cfg.power_of_2_wire_scale, impl=impl)
        commit()

    return complete(work, waiting(work, finish), async_op, tensor, keep=(packed,))


def send_fp8(tensor: torch.Tensor, dst: int, group=None, *,
             fp8_dtype: Optional[torch.dtype] = None,
             config: Optional[Fp8CommConfig] = None) -> None:
    """Send ``tensor`` to global rank ``dst`` as FP8 (one scale) plus its scale.

    The receiver calls :func:`recv_fp8` with a tensor of the same numel and the same
    ``fp8_dtype`` (e4m3 by default: activations; pass e5m2 for gradients).

    Example:
        >>> send_fp8(activations, dst=1)                                  # doctest: +SKIP
    """
    _send(tensor, dst, group, fp8_dtype, config, async_op=False)


def recv_fp8(tensor: torch.Tensor, src: int, group=None, *,
             fp8_dtype: Optional[torch.dtype] = None,
             config: Optional[Fp8CommConfig] = None) -> torch.Tensor:
    """Receive from global rank ``src`` into the high-precision ``tensor`` (in place); returns it.

    Example:
        >>> buf = torch.empty(8, 1024, dtype=torch.bfloat16)              # doctest: +SKIP
        >>> recv_fp8(buf, src=0)                                          # doctest: +SKIP
    """
    _recv(tensor, src, group, fp8_dtype, config, async_op=False)
    return tensor


def isend_fp8(tensor: torch.Tensor, dst: int, group=None, *,
              fp8_dtype: Optional[torch.dtype] = None,
              config: Optional[Fp8CommConfig] = None) -> Fp8Work:
    """Asynchronous :func:`send_fp8`; the cast happens now, ``wait()`` waits for the send."""
    return _send(tensor, dst, group, fp8_dtype, config, async_op=True)


def irecv_fp8(tensor: torch.Tensor, src: int, group=None, *,
              fp8_dtype: Optional[torch.dtype] = None,
              config: Optional[Fp8CommConfig] = None) -> Fp8Work:
    """Asynchronous :func:`recv_fp8`; ``wait()`` dequantizes into ``tensor`` and returns it."""
    return _recv(tensor, src, group, fp8_dtype, config, async_op=True)
