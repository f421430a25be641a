"""FSDP2's FP8 all-gather of blockwise weights: FP8 bytes with their 128 x 128 block scales.

A blockwise ``Fp8Linear`` (DeepSeek-V3 recipe) scales its weight per ``block`` x ``block``
block. FSDP2 shards a weight by rows; when every shard holds a whole number of block rows, each
rank can cast its own shard exactly as one process would cast the full weight: the blocks never
straddle two ranks. So there is no scale to agree on, no amax all-reduce at all:

1. ``fsdp_pre_all_gather``: the local shard is quantized to blocks (:func:`quantize_operands`:
   the Triton kernel on CUDA, the torch reference elsewhere; the same bytes) and handed to FSDP
   as two all-gather inputs, the bytes as ``uint8`` ``[rows, K]`` and the FP32 inverse block
   scales ``[rows / block, ceil(K / block)]`` (FSDP gathers mixed dtypes as bytes);
2. ``fsdp_post_all_gather``: the gathered bytes and scales become the unsharded parameter
   itself, a block-scaled :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor` that the layer
   feeds to its blockwise GEMMs as is (fprop takes the blocks, dgrad their transpose): no
   dequantize, no re-quantize, bit-identical to the layer's own cast of the full weight.

The wire carries 1 byte per weight element plus 4 bytes per block (about 1/4096 more), against
2 for BF16. Conditions (else the weight stays out of the FP8 all-gather, warned once by the
plugin: :func:`block_gather_unfit`): a 2-D weight of a blockwise ``Fp8Linear``, not tied,
``Fp8CommConfig.param_dtype`` equal to the layer's forward format (e4m3), and ``N / shard
ranks`` a whole multiple of ``block``. Even shards because FSDP2 requires every all-gather input
of an unevenly sharded weight to have the padded shard's shape (torch 2.13,
``FSDPParam.all_gather_inputs``), which leaves no room for the scales tensor.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from fp8boost.fp8.granular.quantize import quantize_operands
from fp8boost.fp8.prequantized import Fp8WeightTensor
from fp8boost.fp8.record import fp8_entry, recorded_linear

__all__ = ["block_gather_unfit", "pre_all_gather_blocks", "post_all_gather_blocks"]


def block_gather_unfit(module: Optional[nn.Module], shard_ranks: Optional[int],
                       wire_dtype: Optional[torch.dtype] = None, tied: bool = False,
                       shape: Optional[tuple] = None, rows: Optional[int] = None
                       ) -> Optional[str]:
    """Why ``module``'s weight cannot be all-gathered as block-scaled FP8 (None: it can).

    Args:
        module: the weight's consumer.
        shard_ranks: the ranks FSDP shards the weight over (None: not checked yet).
        wire_dtype: ``Fp8CommConfig.param_dtype`` (None: not checked).
        tied: the weight is shared with another module.
        shape: the unsharded shape FSDP gathers (None: not checked); under tensor parallelism
            it is a local DTensor shard, which the layer does not unwrap.
        rows: the weight's rows when sharded (None: ``module.weight``'s own). A communication
            plan decided before a tensor-parallel split passes the rows the split will leave.
    """
    entry = fp8_entry(module)
    if not recorded_linear(module) or entry.recipe != "blockwise":
        return "the consumer is not a blockwise Fp8Linear"
    cfg = module.fp8_config
    w = module.weight
    b = cfg.block_size
    if w.dim() != 2 or (shape is not None and tuple(shape) != tuple(w.shape)):
        return "the unsharded weight is a tensor-parallel DTensor or not 2-D"
    if tied:
        return "the weight is tied to another module's"
    if wire_dtype is not None and wire_dtype != cfg.fwd_dtype:
        return (f"Fp8CommConfig.param_dtype {wire_dtype} != the blockwise GEMM's weight format "
                f"{cfg.fwd_dtype}")
    n = w.shape[0] if rows is None else rows
    if shard_ranks is not None and n % shard_ranks:
        return (f"its {n} rows do not split evenly over {shard_ranks} ranks (FSDP2 "
                "gives an uneven shard's all-gather inputs the padded shard's shape: no room "
                "for the block scales)")
    if shard_ranks is not None and (n // shard_ranks) % b:
        return (f"its {n} rows over {shard_ranks} ranks give shards of "
                f"{n // shard_ranks} rows, not a multiple of the {b}-row blocks "
                "(a block would straddle two ranks)")
    return None


def pre_all_gather_blocks(local: torch.Tensor, rows: int, fp8_dtype: torch.dtype, block: int,
                          margin: int, power_of_2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The local shard ``[rows, K]`` as FSDP's two all-gather inputs: FP8 bytes ``[rows, K]``
    (uint8) and FP32 inverse block scales ``[rows / block, ceil(K / block)]``."""
    if rows % block or local.shape[0] != rows:
        raise ValueError(f"block all-gather needs even shards of whole {block}-row blocks, got "
                         f"a shard of {local.shape[0]} rows (padded: {rows})")
    backend = "triton" if local.is_cuda else None  # the same bytes either way (tested)
    q, _ = quantize_operands(local.detach(), fp8_dtype, "blockwise", weight=True, rows=True,
                             cols=False, block=block, margin=margin, power_of_2=power_of_2,
                             backend=backend)
    return q.data.view(torch.uint8), q.inv_scale.float().contiguous()


def post_all_gather_blocks(outputs: tuple, fp8_dtype: torch.dtype, block: int,
                           param_dtype: torch.dtype, out: Optional[torch.Tensor]):
    """The gathered bytes and scales as the unsharded parameter (first gather), or nothing to
    do (later gathers refill the same buffers in place: ``out`` already holds them)."""
    data, inv = outputs
    if out is None:
        return Fp8WeightTensor(data.view(fp8_dtype), inv, param_dtype, block=block), (data, inv)
    if not isinstance(out, Fp8WeightTensor) or not out.block:
        raise RuntimeError(f"FP8 block all-gather expected to refill a block-scaled "
                           f"Fp8WeightTensor, got {type(out).__name__}")
    if out.inv_scale.data_ptr() != inv.data_ptr():  # not FSDP's reused buffer: take the new one
        out.inv_scale = inv
    target = out.fp8_data
    n = target.numel()
    if n and target.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
            target.view(torch.uint8).copy_(data.reshape(-1)[:n].view(target.shape))
    return None
