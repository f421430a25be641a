"""FP8 all-gather: each rank's shard cast to FP8, gathered as uint8, decoded on every rank.

The scale travels in the same all-gather as the data (``all_gather_scale="per_rank"``) or is
one group-wide scale from an all-reduce(MAX) of the amaxes (``"shared"``). Pipelined in stages
(:mod:`fp8boost.parallel.comm.pipeline`). Contract and fallbacks: :mod:`fp8boost.parallel.comm.
collectives`; public as :mod:`fp8boost.parallel.fp8_comm`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fp8boost.fp8.scaling import scale_from_amax

from ._utils import (Fp8Work, all_gather_single, check_pair, check_tensor, complete, group_info,
                     plan_collective, resolve_cast_impl, resolve_config, resolve_fp8_dtype,
                     staging, waiting)
from .config import Fp8CommConfig
from .pipeline import carve, stages, wire_scales
from .wire import dequantize_rows, quantize_rows, row_amax

__all__ = ["all_gather_into_tensor_fp8", "all_gather_fp8"]


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
    bounds = stages(ws * n, n, cfg)
    if cfg.all_gather_scale == "shared":
        amax = row_amax(x)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scales = scale_from_amax(amax, dt, 0, cfg.power_of_2_wire_scale).expand(1, len(bounds))
    else:  # per-rank scale: fused into the cast launches with the Triton impl, one stage
        scales = wire_scales(x, bounds, dt, cfg, impl)
    sends, recvs = carve(1, bounds, x.device), carve(ws, bounds, x.device)
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
