"""``torch.library`` custom ops around the Triton kernels, with fake (meta) implementations.

``torch.compile`` cannot trace into a Triton launcher written in Python (descriptor objects,
config caches), so under compilation :class:`TritonBackend` calls these ops instead: the graph
holds one opaque node per cast / GEMM, shapes come from the fake impls, and at run time the CUDA
kernel registered here launches the same Triton kernels as eager mode.

Ops (namespace ``fp8boost``):
  * ``quantize(x, dtype, scale?, margin, power_of_2, with_transpose)
    -> (data, data_t, inv_scale, amax)``; ``data_t`` is an empty ``[0]`` tensor when not asked.
  * ``scaled_mm(a, b, a_inv_scale, b_inv_scale, bias?, out_dtype, use_fast_accum,
    allow_cublas) -> out``.

Every device other than CUDA gets the reference implementation (``fp8boost.fp8.scaling`` casts,
FP32 matmul of the dequantized operands), so the same graphs run, and are tested, on CPU.

Eager calls do not go through the dispatcher (it costs tens of microseconds per call); only
``torch.compile`` does.

Example:
    >>> import torch, fp8boost.fp8.kernels.ops  # registers the ops
    >>> x = torch.randn(64, 32)
    >>> data, data_t, inv, amax = torch.ops.fp8boost.quantize(
    ...     x, torch.float8_e4m3fn, None, 0, False, True)
    >>> data.shape, data_t.shape
    (torch.Size([64, 32]), torch.Size([32, 64]))
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..scaling import amax as ref_amax
from ..scaling import cast_to_fp8, scale_from_amax


@torch.library.custom_op("fp8boost::quantize", mutates_args=())
def quantize(x: Tensor, dtype: torch.dtype, scale: Optional[Tensor], margin: int,
             power_of_2: bool, with_transpose: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Reference implementation (every device but CUDA)."""
    a = ref_amax(x)
    s = scale.reshape(()).float() if scale is not None else scale_from_amax(
        a, dtype, margin, power_of_2)
    data = cast_to_fp8(x, s, dtype)
    data_t = data.t().contiguous() if with_transpose else data.new_empty((0,))
    return data, data_t, s.reciprocal(), a


@quantize.register_kernel("cuda")
def _quantize_cuda(x, dtype, scale, margin, power_of_2, with_transpose):
    # lazy: cast imports triton, optional (CPU installs lack it); only the CUDA kernel needs it
    from . import cast

    r = cast.quantize(x, dtype, scale, margin, power_of_2, with_transpose)
    data_t = r.data_t if r.data_t is not None else r.data.new_empty((0,))
    return r.data, data_t, r.inv_scale, r.amax


@quantize.register_fake
def _quantize_fake(x, dtype, scale, margin, power_of_2, with_transpose):
    rows, cols = x.shape
    data = x.new_empty((rows, cols), dtype=dtype)
    data_t = x.new_empty((cols, rows) if with_transpose else (0,), dtype=dtype)
    scalar = x.new_empty((), dtype=torch.float32)
    return data, data_t, scalar, scalar.clone()


@torch.library.custom_op("fp8boost::scaled_mm", mutates_args=())
def scaled_mm(a: Tensor, b: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor,
              bias: Optional[Tensor], out_dtype: torch.dtype, use_fast_accum: bool,
              allow_cublas: bool = False) -> Tensor:
    """Reference implementation: FP32 matmul of the dequantized operands."""
    return reference_scaled_mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype)


def reference_scaled_mm(a: Tensor, b: Tensor, a_inv_scale: Tensor, b_inv_scale: Tensor,
                        bias: Optional[Tensor], out_dtype: torch.dtype) -> Tensor:
    """``scaled_mm``'s arithmetic on any device: FP32 matmul of the dequantized operands."""
    out = (a.float() * a_inv_scale.float()) @ (b.float() * b_inv_scale.float()).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@scaled_mm.register_kernel("cuda")
def _scaled_mm_cuda(a, b, a_inv_scale, b_inv_scale, bias, out_dtype, use_fast_accum,
                    allow_cublas=False):
    # lazy: gemm imports triton, optional (CPU installs lack it); only the CUDA kernel needs it
    from . import gemm

    return gemm.mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype, use_fast_accum,
                   allow_cublas=allow_cublas)


@scaled_mm.register_fake
def _scaled_mm_fake(a, b, a_inv_scale, b_inv_scale, bias, out_dtype, use_fast_accum,
                    allow_cublas=False):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8boost::scaled_mm expects a[M,K], b[N,K]; got {tuple(a.shape)}, "
                         f"{tuple(b.shape)}")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
