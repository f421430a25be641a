"""The staged pipeline shared by all-gather, reduce-scatter and all-reduce.

The payload is cut into up to ``MAX_PIPELINE_STAGES`` column stages
(``Fp8CommConfig.pipeline_bytes``), each with its own scales, so that stage k+1 is cast while
stage k is on the wire (see :mod:`fp8boost.parallel.comm.collectives`). Here: the stage bounds,
each stage's scales, the uint8 send/receive buffers, and the issue half of an FP8
reduce-scatter (cast every chunk bound for another rank, start its all-to-all).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .config import MAX_PIPELINE_STAGES, Fp8CommConfig
from .wire import num_stages, quantize_rows, segment_bytes, stage_bounds, stage_scales

__all__ = ["stages", "fused_scales", "wire_scales", "carve", "quantize_except",
           "reduce_scatter_issue"]


def stages(payload: int, numel: int, cfg: Fp8CommConfig) -> list[tuple[int, int]]:
    """Column bounds of the stages of rows of ``numel`` elements (``payload``: the total)."""
    return stage_bounds(numel, num_stages(payload, cfg.pipeline_bytes, MAX_PIPELINE_STAGES))


def fused_scales(impl: str, bounds) -> bool:
    """One stage with the Triton impl: each row's amax, scale, cast and trailer come from two
    launches (``wire_triton.quantize_rows``) instead of separate scale math."""
    return impl == "triton" and len(bounds) == 1


def wire_scales(x2d: torch.Tensor, bounds, dt: torch.dtype, cfg: Fp8CommConfig,
                impl: str) -> Optional[torch.Tensor]:
    """Each row's scale per stage (``[rows, stages]``), or None where the cast fuses them."""
    if fused_scales(impl, bounds):
        return None
    return stage_scales(x2d, bounds, dt, cfg.power_of_2_wire_scale)


def carve(total_rows: int, bounds, device) -> list[torch.Tensor]:
    """One uint8 buffer cut into per-stage ``[total_rows, segment_bytes(width)]`` blocks."""
    sizes = [segment_bytes(hi - lo) for lo, hi in bounds]
    buf = torch.empty(total_rows * sum(sizes), dtype=torch.uint8, device=device)
    return [b.view(total_rows, sz) for b, sz in
            zip(buf.split([total_rows * sz for sz in sizes]), sizes)]


def quantize_except(x2d: torch.Tensor, skip: int, packed: torch.Tensor, dt: torch.dtype,
                    cfg: Fp8CommConfig, impl: str, scale: Optional[torch.Tensor]) -> None:
    """Quantize every row of ``x2d`` but row ``skip`` into the consecutive rows of ``packed``
    (``scale=None``: each row's own amax, fused into the cast launches with the Triton impl)."""
    if skip > 0:
        quantize_rows(x2d[:skip], packed[:skip], dt, power_of_2=cfg.power_of_2_wire_scale,
                      impl=impl, scale=None if scale is None else scale[:skip])
    if skip < x2d.shape[0] - 1:
        quantize_rows(x2d[skip + 1:], packed[skip:], dt, power_of_2=cfg.power_of_2_wire_scale,
                      impl=impl, scale=None if scale is None else scale[skip + 1:])


def reduce_scatter_issue(x2d: torch.Tensor, rank: int, ws: int, dt: torch.dtype,
                         cfg: Fp8CommConfig, impl: str, group, bounds):
    """Cast each stage's chunks for the other ranks and start its all-to-all (async)."""
    scales = wire_scales(x2d, bounds, dt, cfg, impl)
    sends, recvs = carve(ws - 1, bounds, x2d.device), carve(ws - 1, bounds, x2d.device)
    works = []
    for k, (lo, hi) in enumerate(bounds):
        quantize_except(x2d[:, lo:hi], rank, sends[k], dt, cfg, impl,
                        None if scales is None else scales[:, k])
        seg = sends[k].shape[1]
        splits = [0 if j == rank else seg for j in range(ws)]
        works.append(dist.all_to_all_single(recvs[k].view(-1), sends[k].view(-1), splits, splits,
                                            group=group, async_op=True))
    return works, sends, recvs
