"""FP8 point-to-point: send / recv (and their async forms), the tensor as one FP8 segment.

Ranks are global ranks, as in ``torch.distributed.send``. Contract and fallbacks:
:mod:`fp8boost.parallel.comm.collectives`; public as :mod:`fp8boost.parallel.fp8_comm`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ._utils import (Fp8Work, check_tensor, complete, group_info, plan_collective,
                     resolve_cast_impl, resolve_config, resolve_fp8_dtype, staging, waiting)
from .config import Fp8CommConfig
from .wire import dequantize_rows, quantize_rows, segment_bytes

__all__ = ["send_fp8", "recv_fp8", "isend_fp8", "irecv_fp8"]


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
