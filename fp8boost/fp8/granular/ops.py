"""``fp8boost::blockwise_scaled_mm``: cuBLAS's blockwise FP8 GEMM as one opaque op.

dynamo does not trace ``torch._scaled_mm_v2`` (what ``torch.nn.functional.scaled_mm`` calls:
"marked as skipped" in torch 2.11), so every blockwise GEMM broke the compiled graph: 21 of
27 graph breaks in a 4-layer Llama on an H100. Registered as a custom op with a fake
implementation, the GEMM is one node of the graph, as the tensorwise GEMM is
(``fp8boost.fp8.kernels.ops``). Registered when this module is first imported (by
``gemm.blockwise_scaled_mm``), never at package import.

The scales travel contiguous and are viewed into the layouts cuBLAS wants inside the op, so
no compiler pass can change their strides: ``sa_km`` is ``[K/128, M]`` (viewed ``[M, K/128]``,
strides ``(1, M)``); ``sb`` is ``[N/128, L4]`` for 128x128 blocks (viewed ``[L4, N/128]``) or
``[K/128, N]`` for 1x128 tiles (viewed ``[N, K/128]``). ``a[M, K]``, ``b[N, K]`` are FP8,
every dim a multiple of 128; the result is ``[M, N]`` BF16.
"""
from __future__ import annotations

import torch
from torch import Tensor


def blockwise_scaled_mm_call(a: Tensor, b: Tensor, sa_km: Tensor, sb: Tensor,
                             b_blocks: bool) -> Tensor:
    """The ``F.scaled_mm`` call itself (what the op runs; on meta tensors torch's meta
    registration checks every shape and stride of it, which is how CPU tests verify it)."""
    # lazy: only newer torch has F.scaled_mm's blockwise scaling (callers check first)
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    kind_b = ScalingType.BlockWise128x128 if b_blocks else ScalingType.BlockWise1x128
    return scaled_mm(a.contiguous(), b.contiguous().t(), sa_km.contiguous().t(),
                     ScalingType.BlockWise1x128, sb.contiguous().t(), kind_b,
                     swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE,
                     output_dtype=torch.bfloat16)


@torch.library.custom_op("fp8boost::blockwise_scaled_mm", mutates_args=())
def blockwise_scaled_mm_op(a: Tensor, b: Tensor, sa_km: Tensor, sb: Tensor,
                           b_blocks: bool) -> Tensor:
    """``a . b^T`` with 1x128 scales on ``a`` and 128x128 (``b_blocks``) or 1x128 on ``b``."""
    return blockwise_scaled_mm_call(a, b, sa_km, sb, b_blocks)


@blockwise_scaled_mm_op.register_fake
def _blockwise_scaled_mm_fake(a, b, sa_km, sb, b_blocks):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.bfloat16)
