"""ZeRO's FP8 all-gather of blockwise weights, with their block scales, into the GEMM directly.

A blockwise ``Fp8Linear`` (DeepSeek-V3 recipe) casts its weight per 128 x 128 block. ZeRO
splits each flattened parameter into ``world`` equal chunks (``sharding.py``); when ``N`` rows
split evenly into chunks of whole 128-row blocks, rank ``r``'s chunk is rows ``[r * N/world,
(r+1) * N/world)`` and every block lies in one chunk. Each rank then casts its FP32 master chunk
per block, exactly as one process casts the full weight, and no scale is shared: there is no
amax all-reduce at all (the tensorwise direct path needs one per step). On the wire, each
rank's piece is its FP8 bytes followed by its FP32 inverse block scales viewed as bytes, in the
plain uint8 buckets of the direct path (1 byte per element plus 4 per 128 x 128 block, against
2 for BF16). On arrival the bytes and scales are kept as the layer's prequantized weight
operand (``Fp8Linear.set_prequantized_weight``), and the working parameter is decoded from them
(checkpoints and other readers use it), as the tensorwise direct path does.

Which weights qualify: :func:`fp8boost.parallel.fsdp.block_gather.block_gather_unfit` with the
ZeRO world (the same even-shard condition as FSDP2's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fp8boost import _state
from fp8boost.fp8.granular.quantize import GranularFp8, quantize_operands
from fp8boost.fp8.linear import Fp8Linear

__all__ = ["BlockWeight", "cast_block_chunk", "receive_block"]


@dataclass
class BlockWeight:
    """One blockwise weight on the direct path: its parameter index, layer and buffers."""

    index: int
    layer: Fp8Linear
    plan: object  # fsdp.gather_plan.GatherPlan with block > 0: FP8 dtype, block, scale rule
    rows: int  # rows of one rank's chunk (a multiple of plan.block)
    cols: int  # K
    buffer: Optional[torch.Tensor] = None  # persistent FP8 [N, K], allocated on first gather
    inv_scale: Optional[torch.Tensor] = None  # FP32 [N / block, ceil(K / block)]
    handed: Optional[tuple[int, int, int]] = None  # as DirectWeight.handed

    @property
    def n_scales(self) -> int:
        """Inverse block scales in one rank's chunk."""
        b = self.plan.block
        return (self.rows // b) * -(-self.cols // b)

    @property
    def wire_numel(self) -> int:
        """Bytes of one rank's piece: the chunk's FP8 bytes, then its scales' bytes."""
        return self.rows * self.cols + 4 * self.n_scales


def cast_block_chunk(w: BlockWeight, master: torch.Tensor, out_u8: torch.Tensor) -> None:
    """Cast one FP32 master chunk per block into ``out_u8`` (``w.wire_numel`` bytes)."""
    src = master.to(out_u8.device, non_blocking=True).view(w.rows, w.cols)
    backend = "triton" if src.is_cuda else None  # the Triton kernel on CUDA: the same bytes
    q, _ = quantize_operands(src, w.plan.fp8_dtype, "blockwise", weight=True, rows=True,
                             cols=False, block=w.plan.block, margin=w.plan.margin,
                             power_of_2=w.plan.power_of_2, backend=backend)
    n = w.rows * w.cols
    out_u8[:n].copy_(q.data.view(torch.uint8).reshape(-1))
    out_u8[n:].copy_(q.inv_scale.float().contiguous().reshape(-1).view(torch.uint8))


def receive_block(w: BlockWeight, pieces: torch.Tensor, param: torch.Tensor) -> None:
    """Keep the gathered ``pieces [world, wire_numel]`` as the layer's FP8 operand and decode
    the working parameter from them."""
    world, n = pieces.shape[0], w.rows * w.cols
    b = w.plan.block
    if w.buffer is None or w.buffer.device != param.device:
        w.buffer = torch.empty(param.shape, dtype=w.plan.fp8_dtype, device=param.device)
    w.buffer.view(torch.uint8).view(world, n).copy_(pieces[:, :n])
    scales = pieces[:, n:].contiguous().view(torch.float32)  # 4-byte aligned after the copy
    w.inv_scale = scales.reshape(world * (w.rows // b), -(-w.cols // b))
    with torch.no_grad():
        # copy_ on the Parameter bumps its version: caches keyed on it see the new weight
        param.copy_(GranularFp8(w.buffer, w.inv_scale, "block", b).dequantize(param.dtype))
    w.layer.set_prequantized_weight(w.buffer, w.inv_scale)
    w.handed = (param.data_ptr(), param._version, _state.step_epoch())
