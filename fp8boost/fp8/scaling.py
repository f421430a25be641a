"""Reference FP8 scaling math: amax, scale, saturating cast, dequantize, delayed-scaling state.

Conventions used everywhere in fp8boost:
  * ``scale`` multiplies on the way in: ``q = saturate(x * scale).to(fp8)``;
  * ``inv_scale = 1 / scale`` multiplies on the way out: ``x ~= q.float() * inv_scale``
    (this is what ``torch._scaled_mm`` and our GEMM epilogues take);
  * ``x * scale`` is computed in FP32, then clamped to +-fp8_max, then cast with torch's
    round-to-nearest-even. Kernels must reproduce this bit for bit.

Non-finite inputs are never hidden: if ``amax`` is NaN or Inf the scale becomes NaN, so every
element of the cast (and of any GEMM that consumes it) is NaN and the loss shows it at once.
We propagate rather than raise because raising would need a device-to-host sync per cast.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = (E4M3, E5M2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    if dtype not in FP8_DTYPES:
        raise TypeError(f"expected torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


def amax(x: torch.Tensor) -> torch.Tensor:
    """Max of |x| as an FP32 0-dim tensor (NaN if x holds a NaN; 0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    # max() skips nothing: NaN propagates, which is what we want.
    return x.detach().abs().amax().float()


def scale_from_amax(a: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                    power_of_2: bool = False) -> torch.Tensor:
    """FP32 scale that maps ``a`` onto ``fp8_max(dtype) / 2**margin``.

    amax == 0 gives scale 1 (a tensor of zeros casts exactly to zeros). A non-finite amax
    gives NaN (see module docstring).
    """
    a = a.float()
    target = fp8_max(dtype) / (2.0 ** margin)
    scale = target / torch.where(a > 0, a, 1.0)
    scale = torch.where(a > 0, scale, 1.0)
    # a - a is 0 for a finite amax and NaN for Inf/NaN. Not a NaN constant: under torch.compile
    # a NaN literal never equals itself, so common-subexpression elimination could not merge
    # the casts of layers reading one tensor (q/k/v would keep three FP8 copies, not one).
    scale = scale + (a - a)
    # target / tiny amax can overflow FP32: cap at the largest finite float.
    scale = torch.clamp(scale, max=torch.finfo(torch.float32).max)
    if power_of_2:
        scale = round_down_pow2(scale)
    return scale


def aligned_scalars(v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``v``'s elements as 0-dim views, each at a 16-byte aligned address.

    For per-weight scales made as one vector and handed to compiled layers one by one:
    inductor copies every graph input that is not 16-byte aligned on each call, so plain
    ``unbind`` views (4 bytes apart) would cost a clone kernel per weight per call (168 per
    LLaMA2-7B step under FSDP, measured on 4xH200).

    Example:
        >>> s = aligned_scalars(torch.tensor([1.0, 2.0, 3.0]))
        >>> [t.item() for t in s], all(t.data_ptr() % 16 == 0 for t in s)
        ([1.0, 2.0, 3.0], True)
    """
    buf = torch.empty((v.numel(), 4), dtype=v.dtype, device=v.device)
    buf[:, 0].copy_(v.reshape(-1))
    return buf[:, 0].unbind(0)


def round_down_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= scale (exact: uses frexp, not log2)."""
    mantissa, exponent = torch.frexp(scale)
    pow2 = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return torch.where(torch.isfinite(scale) & (mantissa != 0), pow2, scale)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast ``clamp(x * scale, -max, max).to(dtype)`` computed in FP32.

    For values whose scaled magnitude is <= fp8_max the result is bit-identical to torch's own
    ``(x.float() * scale).to(dtype)``; larger ones saturate to +-max instead of becoming
    Inf (e5m2) or relying on the cast's own saturation (e4m3fn). NaN stays NaN.
    """
    m = fp8_max(dtype)
    return (x.float() * scale.float()).clamp(-m, m).to(dtype)


def dequantize(q: torch.Tensor, inv_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q.float() * inv_scale`` in FP32, returned as ``dtype``."""
    return (q.float() * inv_scale.float()).to(dtype)


@dataclass
class Fp8Tensor:
    """An FP8 payload with its FP32 inverse scale (``data.float() * inv_scale ~= original``).

    ``data_t`` is the transposed (K-major for the other GEMMs) contiguous copy of a 2-D tensor,
    or None when no consumer needs it.
    """

    data: torch.Tensor
    inv_scale: torch.Tensor
    data_t: Optional[torch.Tensor] = None
    amax: Optional[torch.Tensor] = None
    """With current scaling, the amax the scale came from (``scale_from_amax`` of it is the
    scale, bit for bit), when the producer records it; lets a consumer re-cast the same source
    later with the same scale."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.inv_scale, dtype)

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size() + self.inv_scale.numel() * 4
        if self.data_t is not None:
            n += self.data_t.numel() * self.data_t.element_size()
        return n


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, margin: int = 0,
                        power_of_2: bool = False) -> Fp8Tensor:
    """Current (real-time) per-tensor scaling: scale from this tensor's own amax."""
    scale = scale_from_amax(amax(x), dtype, margin, power_of_2)
    return Fp8Tensor(cast_to_fp8(x, scale, dtype), scale.reciprocal())


AmaxReduceFn = Callable[[torch.Tensor], None]


class DelayedScalingState:
    """Amax history and current scale of one tensor role (input, weight or grad) of one layer.

    ``scale`` is derived from the history *before* the current tensor is seen (TE-style); the
    current amax is then appended. On the very first use, when the history is empty, the current
    amax seeds it so step 0 is not cast with a meaningless scale of 1.

    The state updates its tensors in place, so a module can own them as buffers (moved by
    ``.to()``, saved in ``state_dict``) and hand views to this object via ``bind``.

    ``amax_reduce_fn`` (the distribution hook) is called on each new amax in place before it
    enters the history, e.g. an all-reduce(MAX) over the tensor- or data-parallel group so that
    every rank derives the same scale.
    """

    def __init__(self, dtype: torch.dtype, history_len: int = 16, algo: str = "max",
                 margin: int = 0, power_of_2: bool = False, device=None) -> None:
        self.dtype = dtype
        self.algo = algo
        self.margin = margin
        self.power_of_2 = power_of_2
        self.history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.initialized = False
        self.amax_reduce_fn: Optional[AmaxReduceFn] = None

    def bind(self, history: torch.Tensor, scale: torch.Tensor) -> "DelayedScalingState":
        """Use externally owned tensors (e.g. module buffers) as the history and scale."""
        self.history, self.scale = history, scale
        return self

    def reduce(self, a: torch.Tensor) -> torch.Tensor:
        """Apply the distribution hook (if any) to a fresh amax, in place."""
        if self.amax_reduce_fn is not None:
            self.amax_reduce_fn(a)
        return a

    def _scale_from_history(self) -> torch.Tensor:
        a = self.history.amax() if self.algo == "max" else self.history[0]
        return scale_from_amax(a, self.dtype, self.margin, self.power_of_2)

    def seed(self, a: torch.Tensor) -> None:
        """First use: start the history from the current (reduced) amax."""
        self.history.zero_()
        self.history[0] = a
        self.scale.copy_(self._scale_from_history())
        self.initialized = True

    def record(self, a: torch.Tensor) -> None:
        """Append a (reduced) amax to the history and refresh the scale for the next cast."""
        self.history.copy_(torch.roll(self.history, 1))
        self.history[0] = a
        self.scale.copy_(self._scale_from_history())

    def quantize(self, x: torch.Tensor) -> Fp8Tensor:
        """Reference: cast ``x`` with the delayed scale, then record its amax."""
        a = self.reduce(amax(x))
        if not self.initialized:
            self.seed(a)
        scale = self.scale.clone()
        out = Fp8Tensor(cast_to_fp8(x, scale, self.dtype), scale.reciprocal())
        self.record(a)
        return out


def cast_result(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, without a no-op ``.to``. A GEMM result is what an autograd.Function
    returns (y, dx, dW), and torch 2.11's dynamo lost every gradient of a Function whose output
    came from a no-op ``.to()`` (an alias of an intermediate; pytorch/pytorch#180642): zero
    gradients for FP32 layers and a 4-layer BF16 Llama that stopped learning, compiled, on the
    H100; every gradient of the compiled FP8 experts (BF16 GEMM output into a BF16 model);
    torch 2.13 is right. Every FP8 GEMM result (dense, granular, experts, emulated) goes
    through here. Tested in tests/fp8/test_granular_linear.py and test_moe_compile.py."""
    return t if t.dtype == dtype else t.to(dtype)
