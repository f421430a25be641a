"""Where an :class:`~fp8boost.fp8.linear.Fp8Linear`'s FP8 operands come from: the
:class:`OperandSource` each layer owns.

* **A cast of the weight, cached.** From the second forward of an unchanged weight on
  (micro-batches, gradient accumulation, recomputation) its cast is kept; with one forward per
  step nothing is kept. An optimizer step (a global ``torch.optim`` step hook), an in-place
  write to the Parameter (its version counter) or a new storage invalidates it; writes through
  ``.data`` are invisible: call :func:`~fp8boost.fp8.linear.invalidate_weight_caches`. A frozen
  weight (LoRA's base layer) is cast once, with its transpose, and reused until written or
  loaded.
* **FSDP's FP8 carrier.** A weight that is already FP8 (an
  :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor`, FSDP2's FP8 all-gather) is the GEMM
  operand as is: no amax, no cast, no cache; its transpose for dgrad is made in backward.
* **ZeRO's pre-quantized bytes** (:meth:`OperandSource.set_prequantized`), used while the
  weight is unchanged.
* **An FP8 input** (the sequence-parallel FP8 all-gather's output): its bytes as they are.

The scaling itself is the recipe's (``fp8/casts.py``): the source asks its ``casts`` to cast.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from fp8boost import _state

from . import shared_cast
from .linear_granular import RowGroups, prequantized_block_operands, weight_operands
from .prequantized import (Fp8WeightTensor, PrequantizedWeight, dequantize_weight,
                           fp8_input_operand, fp8_operand_mismatch, fp8_weight_operand,
                           transpose_fp8)
from .recompute import compiling as _compiling, recomputing
from .scaling import Fp8Tensor

if TYPE_CHECKING:
    from .casts import TensorwiseCasts


class OperandSource:
    """The FP8 operands of one layer whose weight is ``shape`` = ``(out_features, in_features)``.

    Implements :class:`~fp8boost.fp8.matmul.Fp8Operands`.
    """

    def __init__(self, casts: "TensorwiseCasts", shape: tuple[int, int]) -> None:
        self.casts = casts
        self.shape = shape
        self.cache: Optional[tuple] = None
        """``(key, cast or None)``: the weight's last cast (kept from its second forward on)."""
        self.prequantized: Optional[PrequantizedWeight] = None
        """The operand of :meth:`set_prequantized`, until it is dropped."""
        self.keep_frozen_cast = True
        """False: a frozen weight's cast is not kept (FSDP frees unsharded weights)."""
        self._share_src: Optional[torch.Tensor] = None

    # -- state changes ---------------------------------------------------------------------

    def invalidate(self) -> None:
        """Drop the cached weight cast (the weight changed where its key cannot see it)."""
        self.cache = None

    def loaded(self) -> None:
        """After a load: the cached cast and a prequantized operand describe the old weight."""
        self.cache = self.prequantized = None

    def set_prequantized(self, weight: torch.Tensor, data_fp8: Optional[torch.Tensor],
                         inv_scale: Optional[torch.Tensor]) -> None:
        """``Fp8Linear.set_prequantized_weight``: the producer's bytes of ``weight``, or None."""
        if data_fp8 is None:
            self.prequantized = None
            return
        pre = PrequantizedWeight.of(weight, data_fp8, inv_scale, self.casts.config, self.shape)
        self.cache = None  # an older cast of the same weight would only pin memory
        self.prequantized = pre

    @contextlib.contextmanager
    def sharing_input(self, x: torch.Tensor) -> Iterator[None]:
        """Eager tensorwise layers reading the same tensor ``x`` share its cast meanwhile."""
        self._share_src = x
        try:
            yield
        finally:
            self._share_src = None

    # -- the input --------------------------------------------------------------------------

    def input_operand(self, x2d: torch.Tensor, with_transpose: bool) -> Fp8Tensor:
        """The input operand: the bytes of an FP8 carrier as they are (e.g. the sequence-
        parallel FP8 all-gather's output: no amax, no cast), else a cast of ``x2d``."""
        casts = self.casts
        cfg = casts.config
        if isinstance(x2d, Fp8WeightTensor):
            why = fp8_operand_mismatch(x2d, "input", cfg.fwd_dtype, casts.delayed)
            if why is None:
                return fp8_input_operand(x2d, with_transpose)
            _state.warn_once(("fp8-linear-prequantized-input", why),
                             f"fp8boost: Fp8Linear dequantizes and re-quantizes an FP8 input: {why}")
            x2d = dequantize_weight(x2d)
        src = None if _compiling() else self._share_src
        if src is None:
            return casts.quantize("input", x2d, cfg.fwd_dtype, with_transpose=with_transpose)
        key = (cfg.fwd_dtype, cfg.margin, cfg.power_of_2_scale, casts.backend.name,
               casts.amax_groups.get("input"), tuple(x2d.shape), x2d.stride())
        return shared_cast.cast_once(src, key, with_transpose, lambda: casts.quantize(
            "input", x2d, cfg.fwd_dtype, with_transpose=with_transpose))

    # -- the weight -------------------------------------------------------------------------

    def is_direct(self, w: torch.Tensor) -> bool:
        """Whether ``w`` is an :class:`Fp8WeightTensor` whose bytes are the weight operand this
        layer would make (forward format, its shape, tensorwise); else re-quantized, warned."""
        if not isinstance(w, Fp8WeightTensor):
            return False
        casts = self.casts
        why = fp8_operand_mismatch(w, "weight", casts.config.fwd_dtype, casts.delayed, self.shape)
        if why is not None:
            _state.warn_once(("fp8-linear-prequantized", why),
                             f"fp8boost: Fp8Linear dequantizes and re-quantizes an FP8 weight: "
                             f"{why}")
            return False
        return True

    def weight_operand(self, w: torch.Tensor, with_transpose: bool,
                       recompute: bool = False) -> Fp8Tensor:
        """The FP8 weight operand, with its K-major transpose when ``with_transpose``.

        ``recompute``: backward wants the transpose but may re-cast it itself; then it comes
        without it where possible (current scaling, no cache entry, a plain Parameter)."""
        casts = self.casts
        dtype = casts.config.fwd_dtype
        if isinstance(w, Fp8WeightTensor):
            self.cache = None  # a cast of an earlier plain weight would only pin memory
            if self.is_direct(w):
                return fp8_weight_operand(w, with_transpose)  # no cast, no cache
            return casts.quantize("weight", dequantize_weight(w), dtype,
                                  with_transpose=with_transpose or recompute)
        pre = self.prequantized
        if pre is not None:
            # Under torch.compile the key cannot be read without a graph break: a set operand
            # is trusted (its producer re-sets it after each step; eager runs check it).
            why = None if _compiling() or pre.matches(w) else \
                "the weight was written or an optimizer step ran since it was set"
            if why is None:
                return pre.operand(with_transpose or recompute)
            _state.warn_once(("fp8-linear-prequantized-dropped", why),
                             f"fp8boost: Fp8Linear casts its weight itself instead of using the "
                             f"prequantized FP8 weight: {why}")
            self.prequantized = None
        item = casts.replayed_weight()  # delayed scaling, recomputing: repeat the forward's
        if isinstance(item, Fp8Tensor):
            return item
        if item is not None:
            return casts.quantize("weight", w.detach(), dtype,
                                  with_transpose=with_transpose or recompute, replay_scale=item)
        return self._cast_weight(w, with_transpose, recompute)

    def _cast_weight(self, w: torch.Tensor, with_transpose: bool, recompute: bool) -> Fp8Tensor:
        """A cast of the plain weight ``w``, from or into the cache."""
        casts = self.casts
        use_cache = casts.config.cache_weight_cast and not _compiling()
        keep = use_cache and not w.requires_grad and self.keep_frozen_cast  # frozen: kept
        if use_cache:
            key = self.cache_key(w)
            if self.cache is not None and self.cache[0] == key:
                if self.cache[1] is not None:
                    casts.remember_weight(self.cache[1])
                    return self.cache[1]  # cached casts always carry the transpose
                # A second forward (micro-batches, accumulation): the kept cast now pays for
                # its memory. A recomputation is none: its backward follows at once.
                keep = keep or not recomputing()
        # Always emit the transpose when caching: the next backward will want it.
        wq = casts.quantize("weight", w.detach(), casts.config.fwd_dtype,
                            with_transpose=with_transpose or keep)
        self.cache = (key, wq if keep else None) if use_cache else None
        if recompute and wq.data_t is None and wq.amax is None:  # delayed: no re-cast scale
            wq = Fp8Tensor(wq.data, wq.inv_scale, transpose_fp8(wq.data))
        return wq

    def cache_key(self, w: torch.Tensor) -> tuple:
        """What a cached cast of ``w`` is valid for (storage, version, step, dtype, backend)."""
        # No optimizer steps a frozen weight: the step epoch is left out.
        return (w.data_ptr(), w._version, _state.step_epoch() if w.requires_grad else None,
                w.dtype, w.device, self.casts.backend.name)

    def cached_transpose(self, w: torch.Tensor) -> Optional[Fp8Tensor]:
        """The cached cast of ``w`` (with its transpose) if it is still valid, else None."""
        entry = self.cache
        if entry is None or entry[1] is None or isinstance(w, Fp8WeightTensor):
            return None
        return entry[1] if entry[0] == self.cache_key(w) else None

    def weight_transpose(self, w: torch.Tensor, w_amax: torch.Tensor) -> Fp8Tensor:
        """Backward: ``W^T`` K-major, from a still-valid cached cast (same bytes) or re-cast
        from ``w`` with the forward's amax."""
        cached = None if _compiling() else self.cached_transpose(w)
        if cached is not None:
            return Fp8Tensor(cached.data_t, cached.inv_scale)
        return self.casts.recast_weight_t(w, w_amax)

    def frozen_granular_operands(self, w: torch.Tensor,
                                 groups: Optional[RowGroups]) -> Optional[tuple]:
        """Rowwise/blockwise: the blockwise operands set by :meth:`set_prequantized` while
        valid, else a frozen weight's FP8 operands, made once and kept (eager), else None."""
        pre = self.prequantized
        if pre is not None and pre.block:
            if _compiling() or pre.matches(w):  # as in weight_operand
                return prequantized_block_operands(pre)
            _state.warn_once(("fp8-linear-prequantized-dropped", "blockwise"),
                             "fp8boost: Fp8Linear casts its blockwise weight itself instead of "
                             "using the prequantized FP8 weight: the weight was written or an "
                             "optimizer step ran since it was set")
            self.prequantized = None
        cfg = self.casts.config
        if (_compiling() or w.requires_grad or not self.keep_frozen_cast
                or not cfg.cache_weight_cast or isinstance(w, Fp8WeightTensor)):
            return None
        key = self.cache_key(w)
        if self.cache is None or self.cache[0] != key:
            self.cache = (key, weight_operands(w, cfg, groups))
        return self.cache[1]
