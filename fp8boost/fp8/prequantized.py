"""A weight that arrives already in FP8: :class:`Fp8WeightTensor`.

Some producers hand ``Fp8Linear`` its weight as FP8 bytes plus one FP32 inverse scale instead
of a high-precision tensor, e.g. FSDP2's FP8 all-gather, which casts each shard with a scale
shared by the whole weight and gathers the bytes. Dequantizing those bytes only for
``Fp8Linear`` to quantize them again would cost an extra amax + cast per weight and a second
rounding. The carrier lets the bytes go straight into the FP8 GEMM:

* it *looks like* the high-precision weight (``dtype`` bf16/fp32, shape ``[N, K]``), so modules,
  FSDP and autograd treat it as the parameter it stands for;
* ``Fp8Linear`` recognises it and uses ``fp8_data`` / ``inv_scale`` as its weight operand (no
  cast, no weight-cast cache);
* with ``block`` > 0 it carries one scale per ``block`` x ``block`` block (the blockwise
  recipe's weight operand, e.g. from FSDP2's block-scaled FP8 all-gather): ``inv_scale`` is
  ``[>= ceil(N/block), ceil(K/block)]`` (rows beyond the weight's are padding, unread);
* every other op sees the dequantized value (correct, slower, warned once per op), and an
  in-place write raises, since it would be lost.

A producer that already holds a layer's weight cast (ZeRO's FP8 all-gather) hands it over as a
:class:`PrequantizedWeight` instead (``Fp8Linear.set_prequantized_weight``): the layer's
parameter stays a plain tensor, and the operand is used while that tensor is unchanged.

This module knows nothing about distribution: who fills the bytes is not its business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree

from fp8boost import _state

from .config import Fp8Config
from .recompute import compiling
from .scaling import FP8_DTYPES, Fp8Tensor, dequantize

__all__ = ["Fp8WeightTensor", "PrequantizedWeight", "fp8_weight_operand", "fp8_weight_transpose",
           "fp8_input_operand", "dequantize_weight", "fp8_operand_mismatch"]

aten = torch.ops.aten
# Pure views/aliases of the bytes: the result is the same weight, still FP8 (FSDP2 applies
# as_strided to the gathered buffer, and nn.Parameter() detaches).
_VIEW_OPS = frozenset({aten.detach.default, aten.alias.default, aten.as_strided.default,
                       aten.view.default, aten._unsafe_view.default})


class Fp8WeightTensor(torch.Tensor):
    """A high-precision-looking weight whose payload is FP8 bytes with one inverse scale.

    Args:
        data: FP8 tensor (``float8_e4m3fn`` or ``float8_e5m2``), the weight's shape.
        inv_scale: FP32 0-dim tensor; ``data.float() * inv_scale`` is the weight. With
            ``block``: FP32 ``[>= ceil(N/block), ceil(K/block)]``, one per block.
        dtype: the dtype the weight presents (the parameter's compute dtype).
        block: 0 (one scale) or the side of the square blocks of a 2-D ``[N, K]`` weight.

    Example:
        >>> import torch
        >>> from fp8boost.fp8.prequantized import Fp8WeightTensor
        >>> w = Fp8WeightTensor(torch.ones(32, 16).to(torch.float8_e4m3fn),
        ...                     torch.tensor(0.5), torch.bfloat16)
        >>> w.shape, w.dtype, w.dequantize().max().item()
        (torch.Size([32, 16]), torch.bfloat16, 0.5)
    """

    fp8_data: torch.Tensor
    """The FP8 bytes, the weight's shape (``float8_e4m3fn`` or ``float8_e5m2``)."""
    inv_scale: torch.Tensor
    """FP32 0-dim: ``fp8_data.float() * inv_scale`` is the weight."""
    fp8_data_t: Optional[torch.Tensor]
    """Optional [K, M] transpose of ``fp8_data`` viewed as [M, K] (K = the last dim)."""
    block: int
    """0: ``inv_scale`` is one scale; else the side of the square blocks it scales."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False, data_t: Optional[torch.Tensor] = None,
                block: int = 0):
        if data.dtype not in FP8_DTYPES:
            raise TypeError(f"Fp8WeightTensor needs FP8 data, got {data.dtype}")
        if block and (data.dim() != 2 or data_t is not None):
            raise ValueError(f"a block-scaled Fp8WeightTensor is a 2-D weight without data_t, "
                             f"got shape {tuple(data.shape)}")
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, layout=data.layout, device=data.device, requires_grad=requires_grad)

    def __init__(self, data: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype,
                 requires_grad: bool = False, data_t: Optional[torch.Tensor] = None,
                 block: int = 0) -> None:
        self.fp8_data = data
        self.inv_scale = inv_scale
        self.block = block
        # Optional [K, M] transpose of the data viewed as [M, K] (K = the last dim), made once
        # by the producer and shared by every consumer (an activation feeding q, k and v).
        self.fp8_data_t = data_t

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        scales = f"block={self.block}" if self.block else f"inv_scale={self.inv_scale!r}"
        return (f"Fp8WeightTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self.fp8_data.dtype}, {scales})")

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The weight's value as a plain tensor (default: the dtype it presents)."""
        return dequantize_weight(self, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEW_OPS and _keeps_blocks(func, args, kwargs):
            src = args[0]
            data = func(src.fp8_data, *args[1:], **kwargs)
            if src.block:
                return cls(data, src.inv_scale, src.dtype, block=src.block)
            keep_t = src.fp8_data_t is not None and func is not aten.as_strided.default \
                and data.dim() > 0 and data.shape[-1] == src.fp8_data.shape[-1]
            return cls(data, src.inv_scale, src.dtype, data_t=src.fp8_data_t if keep_t else None)
        if func is aten.clone.default:
            src = args[0]
            data_t = src.fp8_data_t.clone() if src.fp8_data_t is not None else None
            return cls(src.fp8_data.clone(), src.inv_scale.clone(), src.dtype, data_t=data_t,
                       block=src.block)
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
        inner = ["fp8_data", "inv_scale"] + (["fp8_data_t"] if self.fp8_data_t is not None else [])
        return inner, {"dtype": self.dtype, "block": self.block}

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: dict, outer_size, outer_stride):
        return Fp8WeightTensor(inner["fp8_data"], inner["inv_scale"], meta["dtype"],
                               data_t=inner.get("fp8_data_t"), block=meta.get("block", 0))


def _keeps_blocks(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether view op ``func`` leaves a block-scaled carrier's blocks where they were: the
    result must be the leading rows of the same row-major ``[N, K]`` (FSDP2 narrows its padded
    all-gather output so); any other view (a reshape, a column slice, a transpose) would move
    bytes away from their scales, so it runs on the dequantized value instead."""
    src = args[0]
    if not src.block or func is not aten.as_strided.default:
        return not src.block or func in (aten.detach.default, aten.alias.default)
    size, stride = args[1], args[2]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    k = src.fp8_data.shape[1]
    return (len(size) == 2 and size[1] == k and tuple(stride) == (k, 1)
            and (offset or 0) == src.fp8_data.storage_offset())


# Module-level functions, not methods: torch.compile treats a method call on a tensor (subclass)
# as a tensor op that must return tensors, and breaks the graph on one returning Fp8Tensor.

def fp8_weight_operand(w: Fp8WeightTensor, with_transpose: bool = False) -> Fp8Tensor:
    """The GEMM operand: ``data`` [N, K] row-major (and ``data_t`` [K, N] if asked)."""
    data_t = fp8_weight_transpose(w) if with_transpose else None
    return Fp8Tensor(w.fp8_data.contiguous(), w.inv_scale, data_t)


def fp8_input_operand(x: Fp8WeightTensor, with_transpose: bool = False) -> Fp8Tensor:
    """An FP8 carrier as a GEMM input [M, K], with its [K, M] transpose if asked (the one the
    producer made, shared by every consumer, else made here)."""
    data = x.fp8_data.contiguous()
    data_t = None
    if with_transpose:
        data_t = x.fp8_data_t if x.fp8_data_t is not None else transpose_fp8(data)
    return Fp8Tensor(data, x.inv_scale, data_t)


def fp8_weight_transpose(w: Fp8WeightTensor) -> torch.Tensor:
    """``data^T`` [K, N], contiguous: the K-major weight operand of dgrad (1 byte/element)."""
    return w.fp8_data.t().contiguous()


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` for a 2-D FP8 tensor; a tiled Triton kernel on CUDA in eager
    mode (torch's strided byte copy is far below bandwidth), the torch op otherwise (inductor
    tiles it itself under ``torch.compile``)."""
    if data.is_cuda and not compiling() and data.is_contiguous():
        try:
            # lazy: the kernel imports triton, which is optional
            from .kernels.transpose import transpose_bytes
        except ImportError:  # no triton: the plain op is still correct
            return data.t().contiguous()
        return transpose_bytes(data.view(torch.uint8)).view(data.dtype)
    return data.t().contiguous()


def dequantize_weight(w: Fp8WeightTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The weight's value as a plain tensor (default: the dtype ``w`` presents)."""
    if w.block:  # the blockwise recipe's operand type expands the block scales
        # Imported here: fp8.granular imports this module.
        from .granular.quantize import GranularFp8
        return GranularFp8(w.fp8_data, w.inv_scale, "block", w.block).dequantize(dtype or w.dtype)
    return dequantize(w.fp8_data, w.inv_scale, dtype or w.dtype)


def fp8_operand_mismatch(t: Fp8WeightTensor, role: str, fwd_dtype: torch.dtype, delayed: bool,
                         shape: Optional[tuple] = None) -> Optional[str]:
    """Why an FP8 carrier cannot be a layer's ``role`` ("input"/"weight") GEMM operand as is.

    Its bytes must be what the layer would have made: the forward FP8 format, current
    (tensorwise) scaling (delayed scaling derives the scale from the layer's own amax history)
    and, where given, the operand's ``shape``. None when it can.
    """
    if t.block:
        return f"it carries {t.block}x{t.block} block scales (the blockwise recipe's weight)"
    if t.fp8_data.dtype != fwd_dtype:
        return f"its FP8 format {t.fp8_data.dtype} is not the forward format {fwd_dtype}"
    if delayed:
        return f"delayed scaling keeps its own {role} amax history"
    if shape is not None and tuple(t.shape) != tuple(shape):
        return f"shape {tuple(t.shape)} != {tuple(shape)}"
    return None


@dataclass
class PrequantizedWeight:
    """A layer's FP8 weight operand made by its producer (``Fp8Linear.set_prequantized_weight``).

    Valid while the layer's weight is the tensor it was made from: same storage, same version
    counter and no optimizer step since (``key``, checked by :meth:`matches`): any later write
    to the weight, a new weight tensor or an optimizer step drops it (warned once). Under
    ``torch.compile`` the key cannot be read without a graph break, so the operand is used as
    is until the producer re-sets or drops it or ``load_state_dict`` runs: a producer must
    re-set it whenever it changes the weight (ZeRO's all-gather does, after every step).
    """

    key: tuple
    """``(data_ptr, version, optimizer-step epoch)`` of the weight when the operand was set."""
    data: torch.Tensor
    """``[out_features, in_features]``, contiguous, forward FP8 format; not a copy."""
    inv_scale: torch.Tensor
    """FP32 0-dim tensor: ``data.float() * inv_scale`` is the weight. Blockwise (``block``):
    FP32 ``[ceil(N/block), ceil(K/block)]``, one per block."""
    data_t: Optional[torch.Tensor] = None
    """dgrad's K-major copy, ``data.t().contiguous()``, made on first need and kept."""
    block: int = 0
    """0: one scale (tensorwise); else the side of the blocks ``inv_scale`` scales."""

    @staticmethod
    def weight_key(weight: torch.Tensor) -> tuple:
        """What identifies ``weight``'s current value (an optimizer step changes the epoch)."""
        return (weight.data_ptr(), weight._version, _state.step_epoch())

    @classmethod
    def of(cls, weight: torch.Tensor, data: torch.Tensor, inv_scale: torch.Tensor,
           config: Fp8Config, shape: tuple) -> "PrequantizedWeight":
        """The operand ``data`` / ``inv_scale`` for ``weight`` as it is now.

        Raises:
            ValueError: ``config`` (the layer's ``Fp8Config``) is neither tensorwise nor
                blockwise, ``data`` is not a contiguous tensor of the forward FP8 format and the
                operand's ``shape``, or a blockwise ``inv_scale`` is not one per block.
        """
        if config.recipe not in ("tensorwise", "blockwise") or data.dtype != config.fwd_dtype \
                or tuple(data.shape) != tuple(shape) or not data.is_contiguous():
            raise ValueError(f"set_prequantized_weight needs a tensorwise or blockwise layer and "
                             f"a contiguous {config.fwd_dtype} tensor of shape {tuple(shape)}; "
                             f"got {data.dtype} {tuple(data.shape)}, recipe {config.recipe!r}")
        if config.recipe == "tensorwise":
            return cls(cls.weight_key(weight), data, inv_scale.float().reshape(()))
        b = config.block_size
        blocks = (-(-shape[0] // b), -(-shape[1] // b))
        if tuple(inv_scale.shape) != blocks:
            raise ValueError(f"a blockwise prequantized weight needs one inverse scale per "
                             f"{b}x{b} block, {blocks}; got {tuple(inv_scale.shape)}")
        return cls(cls.weight_key(weight), data, inv_scale.float(), block=b)

    def matches(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the tensor (and value) this operand was made from."""
        return self.key == self.weight_key(weight)

    def operand(self, with_transpose: bool) -> Fp8Tensor:
        """The GEMM operand, with dgrad's transposed copy when ``with_transpose``."""
        if with_transpose and self.data_t is None:
            self.data_t = transpose_fp8(self.data)  # made once, reused by later backwards
        return Fp8Tensor(self.data, self.inv_scale, self.data_t if with_transpose else None)


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
