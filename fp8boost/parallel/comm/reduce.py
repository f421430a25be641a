"""FP8 reductions: reduce-scatter, and all-reduce as FP8 reduce-scatter + FP8 all-gather.

Gradients by default (e5m2). Each chunk bound for another rank is cast with its own scale and
sent through an all-to-all of uint8; the receiver sums in FP32, starting from its own chunk in
full precision. Pipelined in stages (:mod:`fp8boost.parallel.comm.pipeline`). Contract and
fallbacks: :mod:`fp8boost.parallel.comm.collectives`; public as :mod:`fp8boost.parallel.fp8_comm`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._utils import (Fp8Work, ReduceOpLike, all_gather_single, check_pair, check_tensor,
                     complete, group_info, plan_collective, post_scale, reduce_scatter_single,
                     resolve_cast_impl, resolve_config, resolve_fp8_dtype, staging, waiting)
from .config import Fp8CommConfig
from .pipeline import carve, reduce_scatter_issue, stages
from .wire import dequantize_rows, dequantize_sum_rows, quantize_rows

__all__ = ["reduce_scatter_tensor_fp8", "reduce_scatter_fp8", "all_reduce_fp8"]


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
    bounds = stages(ws * m, m, cfg)
    works, sends, recvs = reduce_scatter_issue(x2d, rank, ws, dt, cfg, impl, group, bounds)
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
    bounds = stages(ws * m, m, cfg)
    works, sends, recvs = reduce_scatter_issue(x, rank, ws, dt, cfg, impl, group, bounds)

    def finish() -> None:
        chunk = torch.empty((1, m), dtype=torch.float32, device=x.device)
        sends2, recvs2 = carve(1, bounds, x.device), carve(ws, bounds, x.device)
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
