"""The Triton expert casts of :mod:`.moe_cast` as torch custom ops, for eager and compiled code.

Same API as :mod:`.moe_cast` (``supports``, ``why_unsupported``, ``quantize_rows``,
``quantize_experts``, ``quantize_groups_t``), which :func:`fp8boost.fp8.moe.quantize.fused_kernels`
hands out; every cast runs as one ``fp8boost::moe_cast_*`` op (with a fake implementation).

Why ops: under ``torch.compile`` the casts used to stay torch ops for inductor to fuse, and the
per-(expert, column) amax of the weight-gradient operands is a ``scatter_reduce`` that inductor
leaves to ATen's atomic scatter kernel: on an H100 that kernel alone took 15 ms of a 124 ms
Mixtral step and 85 ms of a 250 ms Qwen3-30B-A3B step (bench/moe_step.py profile,
2026-11-27), more than the expert GEMMs. As opaque ops the compiled graph calls the same
two-pass kernels as eager mode, on the same bytes; the cost is that inductor no longer fuses a
cast into the kernel producing its input (the activation before ``down_proj``).

The ops' implementations look the kernels up on :mod:`.moe_cast` at call time (tests count
calls there).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import moe_cast
from .moe_cast import supports, why_unsupported

__all__ = ["supports", "why_unsupported", "quantize_rows", "quantize_experts",
           "quantize_groups_t"]

Pair = tuple[torch.Tensor, torch.Tensor]


@torch.library.custom_op("fp8boost::moe_cast_rows", mutates_args=())
def _rows(x: torch.Tensor, dtype: torch.dtype, margin: int, power_of_2: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    data, inv = moe_cast.quantize_rows(x, dtype, margin=margin, power_of_2=power_of_2)
    return data, inv.contiguous()


@_rows.register_fake
def _(x, dtype, margin, power_of_2):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("fp8boost::moe_cast_experts_t", mutates_args=())
def _experts_t(w: torch.Tensor, dtype: torch.dtype, rows: bool, margin: int, power_of_2: bool
               ) -> list[torch.Tensor]:
    rq, (data_t, inv_t) = moe_cast.quantize_experts(w, dtype, rows=rows, cols=True,
                                                    margin=margin, power_of_2=power_of_2)
    return ([rq[0], rq[1]] if rows else []) + [data_t, inv_t]


@_experts_t.register_fake
def _(w, dtype, rows, margin, power_of_2):
    e, n, k = w.shape
    out = [w.new_empty(e, k, n, dtype=dtype), w.new_empty(e, k, dtype=torch.float32)]
    if rows:
        out = [w.new_empty(e, n, k, dtype=dtype), w.new_empty(e, n, dtype=torch.float32)] + out
    return out


@torch.library.custom_op("fp8boost::moe_cast_groups_t", mutates_args=())
def _groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int, dtype: torch.dtype,
              rows: bool, margin: int, power_of_2: bool, offsets: Optional[torch.Tensor]
              ) -> list[torch.Tensor]:
    rq, (data_t, inv_t) = moe_cast.quantize_groups_t(x, group, num_experts, dtype, rows=rows,
                                                     margin=margin, power_of_2=power_of_2,
                                                     offsets=offsets)
    return ([rq[0], rq[1]] if rows else []) + [data_t, inv_t]


@_groups_t.register_fake
def _(x, group, num_experts, dtype, rows, margin, power_of_2, offsets):
    r, c = x.shape
    out = [x.new_empty(c, r, dtype=dtype), x.new_empty(num_experts, c, dtype=torch.float32)]
    if rows:
        out = [x.new_empty(r, c, dtype=dtype), x.new_empty(r, dtype=torch.float32)] + out
    return out


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, *, margin: int = 0,
                  power_of_2: bool = False) -> Pair:
    """:func:`.moe_cast.quantize_rows` as the op ``fp8boost::moe_cast_rows``."""
    data, inv = _rows(x.detach(), dtype, margin, power_of_2)
    return data, inv


def quantize_experts(w: torch.Tensor, dtype: torch.dtype, *, rows: bool = True,
                     cols: bool = False, margin: int = 0, power_of_2: bool = False
                     ) -> tuple[Optional[Pair], Optional[Pair]]:
    """:func:`.moe_cast.quantize_experts` as ops (the rows operand alone: ``moe_cast_rows`` on
    the ``[E*N, K]`` view; with ``cols``: ``moe_cast_experts_t``)."""
    w = w.detach()
    e, n, k = w.shape
    if not cols:
        if not rows:
            return None, None
        data, inv = _rows(w.reshape(e * n, k), dtype, margin, power_of_2)
        return (data.view(e, n, k), inv.view(e, n)), None
    out = _experts_t(w, dtype, rows, margin, power_of_2)
    return ((out[0], out[1]) if rows else None), (out[-2], out[-1])


def quantize_groups_t(x: torch.Tensor, group: torch.Tensor, num_experts: int,
                      dtype: torch.dtype, *, rows: bool = False, margin: int = 0,
                      power_of_2: bool = False, offsets: Optional[torch.Tensor] = None
                      ) -> tuple[Optional[Pair], Pair]:
    """:func:`.moe_cast.quantize_groups_t` as the op ``fp8boost::moe_cast_groups_t``."""
    out = _groups_t(x.detach(), group, num_experts, dtype, rows, margin, power_of_2, offsets)
    return ((out[0], out[1]) if rows else None), (out[-2], out[-1])
