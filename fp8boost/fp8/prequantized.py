"""A weight that arrives already in FP8: :class:`Fp8WeightTensor`.

Some producers hand ``Fp8Linear`` its weight as FP8 bytes plus one FP32 inverse scale instead
of a high-precision tensor, e.g. FSDP2's FP8 all-gather, which casts each shard with a scale
shared by the whole weight and gathers the bytes. Dequantizing those bytes only for
``Fp8Linear`` to quantize them again would cost an extra amax + cast per weight and a second
rounding. The carrier lets the bytes go straight into the FP8 GEMM:

* it *looks like* the high-precision weight (``dtype`` bf16/fp32, shape ``[N, K]``), so modules,
  FSDP and autograd treat it as the parameter it stands for;
* ``Fp8Linear`` recognises it and uses ``_data`` / ``_inv_scale`` as its weight operand (no
  cast, no weight-cast cache);
* every other op sees the dequantized value (correct, slower, warned once per op), and an
  in-place write raises, since it would be lost.

This module knows nothing about distribution: who fills the bytes is not its business.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from fp8boost import _state

from .scaling import FP8_DTYPES, Fp8Tensor, dequantize

__all__ = ["Fp8WeightTensor", "fp8_weight_operand", "fp8_weight_transpose", "dequantize_weight"]

aten = torch.ops.aten
# Pure views/aliases of the bytes: the result is the same weight, still FP8 (FSDP2 applies
# as_strided to the gathered buffer, and nn.Parameter() detaches).
_VIEW_OPS = frozenset({aten.detach.default, aten.alias.default, aten.as_strided.default,
                       aten.view.default, aten._unsafe_view.default})


class Fp8WeightTensor(torch.Tensor):
    """A high-precision-looking weight whose payload is FP8 bytes with one inverse scale.

    Args:
        data: FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``), the weight's shape.
        inv_scale: FP32 0-dim tensor; ``data.float() * inv_scale`` is the weight.
        dtype: the dtype the weight presents (the parameter's compute dtype).

    Example:
        >>> import torch
        >>> from fp8boost.fp8.prequantized import Fp8WeightTensor
        >>> w = Fp8WeightTensor(torch.ones(32, 16).to(torch.float8_e4m3fn),
        ...                     torch.tensor(0.5), torch.bfloat16)
        >>> w.shape, w.dtype, w.dequantize().max().item()
        (torch.Size([32, 16]), torch.bfloat16, 0.5)
    """

    _data: torch.Tensor
    _inv_scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False, data_t: Optional[torch.Tensor] = None):
        if data.dtype not in FP8_DTYPES:
            raise TypeError(f"Fp8WeightTensor needs FP8 data, got {data.dtype}")
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, layout=data.layout, device=data.device, requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype,
                 requires_grad: bool = False, data_t: Optional[torch.Tensor] = None) -> None:
        self._data = data
        self._inv_scale = inv_scale
        # Optional [K, M] transpose of the data viewed as [M, K] (K = the last dim), made once
        # by the producer and shared by every consumer (an activation feeding q, k and v).
        self._data_t = data_t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return (f"Fp8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self._data.dtype}, inv_scale={self._inv_scale!r})")

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight's value as a plain tensor (default: the dtype it presents)."""
        return dequantize_weight(self, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS:
            src = args[0]
            data = func(src._data, *args[1:], **kwargs)
            keep_t = src._data_t is not None and func is not aten.as_strided.default \
                and data.dim() > 0 and data.shape[-1] == src._data.shape[-1]
            return cls(data, src._inv_scale, src.dtype, data_t=src._data_t if keep_t else None)
        if func is aten.clone.default:
            src = args[0]
            data_t = src._data_t.clone() if src._data_t is not None else None
            return cls(src._data.clone(), src._inv_scale.clone(), src.dtype, data_t=data_t)
        _reject_writes(func, args, kwargs)
        # Anything else reads the weight: give it the exact dequantized value, never FP8 bytes
        # reinterpreted, and say once per op that this costs a dequantize.
        _state.warn_once(("fp8-weight-tensor-fallback", str(func)),
                         f"fp8boost: {func} on an Fp8WeightTensor (FP8 weight from the FP8 "
                         "all-gather) runs on its dequantized value; only Fp8Linear consumes "
                         "the FP8 bytes directly")
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        inner = ["_data", "_inv_scale"] + (["_data_t"] if self._data_t is not None else [])
        return inner, {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: dict, outer_size, outer_stride):
        return Fp8WeightTensor(inner["_data"], inner["_inv_scale"], meta["dtype"],
                               data_t=inner.get("_data_t"))


# Module-level functions, not methods: torch.compile treats a method call on a tensor (subclass)
# as a tensor op that must return tensors, and breaks the graph on one returning Fp8Tensor.

def fp8_weight_operand(w: Fp8WeightTensor, with_transpose: bool = False) -> Fp8Tensor:
    """The GEMM operand: ``data`` [N, K] row-major (and ``data_t`` [K, N] if asked)."""
    data_t = fp8_weight_transpose(w) if with_transpose else None
    return Fp8Tensor(w._data.contiguous(), w._inv_scale, data_t)


def fp8_weight_transpose(w: Fp8WeightTensor) -> torch.Tensor:
    """``data^T`` [K, N], contiguous: the K-major weight operand of dgrad (1 byte/element)."""
    return w._data.t().contiguous()


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` for a 2-D FP8 tensor; a tiled Triton kernel on CUDA in eager
    mode (torch's strided byte copy is far below bandwidth), the torch op otherwise (inductor
    tiles it itself under ``torch.compile``)."""
    compiling = bool(getattr(torch.compiler, "is_compiling", lambda: False)())
    if data.is_cuda and not compiling and data.is_contiguous():
        try:
            from .kernels.transpose import transpose_bytes
        except ImportError:  # no triton: the plain op is still correct
            return data.t().contiguous()
        return transpose_bytes(data.view(torch.uint8)).view(data.dtype)
    return data.t().contiguous()


def dequantize_weight(w: Fp8WeightTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The weight's value as a plain tensor (default: the dtype ``w`` presents)."""
    return dequantize(w._data, w._inv_scale, dtype or w.dtype)


def _reject_writes(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise if ``func`` writes into an Fp8WeightTensor: the write would hit a temporary."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, Fp8WeightTensor):
            raise RuntimeError(
                f"{func} would write into an Fp8WeightTensor (an FP8 weight owned by the FP8 "
                "all-gather, e.g. FSDP2's unsharded parameter); write the sharded parameter "
                "instead")
