"""A tiled transpose of 1-byte (FP8 / uint8) matrices.

``x.t().contiguous()`` on a [M, K] byte matrix is a strided copy in eager PyTorch: reads or
writes land one byte per 32-byte sector, far below memory bandwidth. Gathered FP8 activations
need their transpose once per region (the wgrad operand); this kernel moves [64, 64]-byte
tiles, so both its reads and its writes are coalesced. Under ``torch.compile`` callers use the
plain torch op instead: inductor emits its own tiled transpose.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, BLOCK: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = (pid_r * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    offs_c = (pid_c * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    tile = tl.load(x_ptr + offs_r[:, None] * C + offs_c[None, :], mask=mask)
    # y[c, r] = x[r, c]: the transposed tile, stored row by row of y.
    tl.store(y_ptr + offs_c[None, :] * R + offs_r[:, None], tile, mask=mask)


def transpose_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()`` for a contiguous 2-D CUDA tensor of 1-byte elements.

    Example:
        >>> x = torch.randint(0, 255, (128, 64), dtype=torch.uint8, device="cuda")  # doctest: +SKIP
        >>> torch.equal(transpose_bytes(x), x.t().contiguous())                      # doctest: +SKIP
        True
    """
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_bytes needs a contiguous 2-D 1-byte tensor, got "
                         f"{tuple(x.shape)} {x.dtype}")
    R, C = x.shape
    y = torch.empty((C, R), dtype=x.dtype, device=x.device)
    if x.numel():
        block = 64
        grid = (triton.cdiv(R, block), triton.cdiv(C, block))
        _transpose_kernel[grid](x.view(torch.uint8), y.view(torch.uint8), R, C, BLOCK=block)
    return y
