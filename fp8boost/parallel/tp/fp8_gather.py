"""The sequence-parallel all-gather in FP8, feeding the column-parallel FP8 GEMMs directly.

With sequence parallelism a region's entry all-gathers the normed activation [B, S/tp, H] to
[B, S, H] and hands it to the column-parallel linears (q/k/v, gate/up). In BF16 that moves 2
bytes per element, then each ``Fp8Linear`` computes the amax of the whole gathered tensor and
casts it again (three times for q/k/v). Here each rank casts only its shard, with one scale
from the amax all-reduced (MAX) over the tp group, the group all-gathers the e4m3 bytes, and
the result is an :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor` carrier: ``Fp8Linear``
uses its bytes and scale as the GEMM input (no amax, no cast), bit-identical to casting the
gathered tensor once. Backward is the usual reduce-scatter of the input gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fp8boost.fp8.prequantized import Fp8WeightTensor, transpose_fp8
from fp8boost.fp8.scaling import E4M3, amax, scale_from_amax

from .functional import all_gather_dim, reduce_scatter_dim

__all__ = ["gather_seq_fp8"]


class _GatherSeqFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, layer):
        cfg = layer.fp8_config
        backend = layer.resolve_backend(x.device)
        a = amax(x)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
        scale = scale_from_amax(a, E4M3, cfg.margin, cfg.power_of_2_scale)
        q, _ = backend.quantize(x.reshape(-1, x.shape[-1]), E4M3, scale=scale)
        local = q.data.view(torch.uint8).view(x.shape)  # gloo and NCCL have no FP8 type
        full = all_gather_dim(local, dim, group).contiguous().view(E4M3)
        ctx.dim, ctx.group = dim, group
        data_t = None
        if ctx.needs_input_grad[0] and layer.weight.requires_grad:
            # The wgrad operand, made once here and shared by every consumer (q, k and v).
            data_t = transpose_fp8(full.view(-1, full.shape[-1]))
        return Fp8WeightTensor(full, q.inv_scale, x.dtype, data_t=data_t)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_dim(dy, ctx.dim, ctx.group), None, None, None


def gather_seq_fp8(x: torch.Tensor, group, layer, dim: int = 1) -> torch.Tensor:
    """All-gather ``x``'s sequence shards as e4m3 bytes with one shared scale.

    Args:
        x: this rank's shard [B, S/tp, H] (BF16/FP32).
        group: the tensor-parallel group.
        layer: an ``Fp8Linear`` consuming the result: its recipe (margin, power-of-2 scales)
            and backend make the cast, so the bytes are what it would have made itself.
        dim: the sequence dimension.

    Returns:
        An ``Fp8WeightTensor`` [B, S, H] presenting ``x``'s dtype; ``Fp8Linear`` consumes its
        bytes directly, any other op sees the dequantized value.
    """
    return _GatherSeqFp8.apply(x, group, dim, layer)
