"""FP8 all-to-all, even and uneven splits: one scale per chunk, one all-to-all of uint8.

Unpipelined; the chunk a rank keeps never goes on the wire. Contract and fallbacks:
:mod:`fp8boost.parallel.comm.collectives`; public as :mod:`fp8boost.parallel.fp8_comm`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ._utils import (Fp8Work, check_pair, complete, plan_collective, resolve_cast_impl,
                     resolve_config, resolve_fp8_dtype, staging, waiting)
from .config import Fp8CommConfig
from .wire import dequantize_rows, quantize_rows, segment_bytes

__all__ = ["all_to_all_fp8"]


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

    Dim 0 of ``input`` is split by ``input_split_sizes``; chunk j goes to rank j, cast with its
    own scale. With no split sizes the split is even over the flattened elements, as
    ``dist.all_to_all_single``'s (``numel / world`` each: dim 0's even split where dim 0
    divides, and e.g. a ``(1, 8, 16)`` tensor on 4 ranks otherwise). The chunk a rank keeps
    is copied locally in full precision.
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
    if input_split_sizes is None and output_split_sizes is None and input.shape[0] % ws:
        return _flat_even(output, input, ws, group, fp8_dtype, async_op, config)
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


def _flat_even(output, input, ws, group, fp8_dtype, async_op, config) -> Optional[Fp8Work]:
    """The even split of ``dist.all_to_all_single`` when dim 0 does not divide: each rank
    gets ``numel / world`` consecutive elements of the flattened tensor."""
    if input.numel() % ws or output.numel() != input.numel():
        raise ValueError(f"all_to_all_fp8 without split sizes splits the {input.numel()} "
                         f"elements evenly over {ws} ranks (as dist.all_to_all_single): pass "
                         f"tensors of equal numel divisible by {ws}, or explicit split sizes "
                         f"(got input {tuple(input.shape)}, output {tuple(output.shape)})")
    flat, commit = staging(output, (ws, output.numel() // ws))
    work = all_to_all_fp8(flat, input.reshape(ws, -1), group=group, fp8_dtype=fp8_dtype,
                          async_op=async_op, config=config)
    if work is None:
        commit()
        return None
    return complete(work, waiting(work, commit), True, output)
