"""Colossal-AI's ``linear_fp8``: ``F.linear`` with its three GEMMs in FP8, on fp8boost's FP8 linear.

Each call runs :class:`fp8boost.fp8.Fp8Linear`'s autograd function (tensorwise current
scaling: x and W in e4m3, the output gradient in e5m2; the FP8 copies, not the high-precision
input, are saved for backward) around the given ``weight`` and ``bias``, through a module
shell that holds them for this one call. The backend is fp8boost's ``auto``: fused Triton
kernels on FP8 GPUs (sm89+), otherwise the ``emulated`` backend (exact FP8 rounding, FP32
matmul: FP8 numerics, no speed-up), with a one-time warning saying so.

Unlike Colossal-AI's, every shape runs in FP8 (fp8boost's GEMMs pad or mask where tensor cores
need multiples of 16) rather than quietly falling back to ``F.linear``; float32 inputs are
accepted as well as bfloat16 and float16.
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost.fp8 import Fp8Config, Fp8Linear

__all__ = ["linear_fp8"]


def _config() -> Fp8Config:
    # Stateless per call: no weight-cast cache and no input-cast sharing across calls (the
    # shell lives for one call; a cache would only pin memory until the next one).
    return Fp8Config(cache_weight_cast=False, share_input_casts=False)


def _check(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is None and name == "bias":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_fp8: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"linear_fp8: {name} is {t.dtype}; pass bfloat16, float16 or "
                            "float32 (FP8 operands are cast inside)")
    if weight.dim() != 2:
        raise ValueError(f"linear_fp8: weight must be 2-D [out_features, in_features], got "
                         f"shape {tuple(weight.shape)}")
    if input.dim() == 0 or input.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_fp8: input's last dim must equal weight.shape[1] "
                         f"({weight.shape[1]}), got input shape {tuple(input.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear_fp8: bias must have shape ({weight.shape[0]},), got "
                         f"{tuple(bias.shape)}")
    if input.dtype != weight.dtype:
        raise TypeError(f"linear_fp8: input is {input.dtype} but weight is {weight.dtype}; "
                        "cast one to the other's dtype (as F.linear requires)")


def linear_fp8(input: torch.Tensor, weight: torch.Tensor,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` with forward, input-gradient and weight-gradient GEMMs
    in FP8; differentiable in ``input``, ``weight`` and ``bias``.

    Args:
        input: ``[..., in_features]``, bfloat16/float16/float32.
        weight: ``[out_features, in_features]``, same dtype as ``input``.
        bias: optional ``[out_features]`` (kept in high precision).

    Returns:
        ``[..., out_features]`` in ``input``'s dtype.

    Example:
        >>> import torch
        >>> x = torch.randn(4, 32, requires_grad=True)
        >>> w = torch.randn(16, 32, requires_grad=True)
        >>> y = linear_fp8(x, w)
        >>> y.sum().backward()
        >>> y.shape, x.grad.shape, w.grad.shape
        (torch.Size([4, 16]), torch.Size([4, 32]), torch.Size([16, 32]))
    """
    _check(input, weight, bias)
    with torch.device("meta"):  # a shell: its own parameters are never allocated
        layer = Fp8Linear(weight.shape[1], weight.shape[0], bias=False, config=_config())
    # Hand the layer the caller's tensors (deleting the shell's registered ones first, so a
    # plain tensor is accepted where a Parameter was): FP8 linear reads them as its operands.
    del layer.weight
    del layer.bias
    layer.weight = weight
    layer.bias = bias
    return layer(input)
