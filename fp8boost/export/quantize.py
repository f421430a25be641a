"""Which tensors an FP8 export quantizes, and how: the training casts, bit for bit.

Every quantized weight is seen in its GEMM form ``W[out, in]`` (a ``Conv1D`` weight, stored
``[in, out]``, is transposed first, and its FP8 bytes transposed back to the stored layout):

* ``tensor``: ``scale = scale_from_amax(amax, e4m3)``, ``q = cast_to_fp8(W, scale)``, the
  dequantization multiplier ``1 / scale`` (= amax/448 up to rounding), as the tensorwise
  training GEMM casts its weight operand. q/k/v and gate/up share one amax (their max);
* ``channel``: one scale per output row (``quantize_rows``: the rowwise recipe's cast);
* ``block``: 128 x 128 blocks (``quantize_blocks``: the blockwise recipe's cast), multipliers
  ``[ceil(out/128), ceil(in/128)]``.

Embeddings, norms, biases and the output head stay in the checkpoint's own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from ..fp8.granular.quantize import quantize_blocks, quantize_rows
from ..fp8.scaling import E4M3, amax, cast_to_fp8, scale_from_amax

SHARED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
HEAD_NAMES = ("lm_head", "embed_out", "output")
BLOCK = 128


@dataclass(frozen=True)
class QuantTarget:
    """One weight the export quantizes.

    Attributes:
        key: state-dict key of the weight (``<module>.weight``).
        module: the owning module's name.
        conv1d: True when stored ``[in, out]`` (transformers' ``Conv1D``).
    """

    key: str
    module: str
    conv1d: bool


def is_conv1d(module: nn.Module) -> bool:
    """True for transformers' ``Conv1D`` (and fp8boost's ``Fp8Conv1D``): weight ``[in, out]``."""
    return type(module).__name__.endswith("Conv1D")


def is_linear_like(module: nn.Module) -> bool:
    """A GEMM layer whose weight an inference engine runs in FP8 (``nn.Linear``, ``Conv1D``)."""
    w = getattr(module, "weight", None)
    return (isinstance(module, nn.Linear) or is_conv1d(module)) and w is not None and w.dim() == 2


def find_targets(module: nn.Module) -> tuple[list[QuantTarget], list[str]]:
    """The weights to quantize and the linear modules kept high precision (``ignored``).

    Args:
        module: the unwrapped model (every rank's own modules; pipeline stages differ).

    Returns:
        ``(targets, ignored)``: output heads (``lm_head`` ...) are ignored.

    Example:
        >>> targets, ignored = find_targets(nn.Sequential(nn.Linear(4, 4)))
        >>> [t.key for t in targets], ignored
        (['0.weight'], [])
    """
    targets, ignored = [], []
    for name, m in module.named_modules():
        if not is_linear_like(m):
            continue
        if name.split(".")[-1] in HEAD_NAMES:
            ignored.append(name)
        else:
            targets.append(QuantTarget(f"{name}.weight", name, is_conv1d(m)))
    return targets, ignored


def shared_group(module_name: str) -> Optional[str]:
    """The name q/k/v (or gate/up) siblings share, or None.

    Example:
        >>> shared_group("model.layers.0.self_attn.k_proj")
        'model.layers.0.self_attn.(q_proj|k_proj|v_proj)'
    """
    parent, _, leaf = module_name.rpartition(".")
    for group in SHARED_GROUPS:
        if leaf in group:
            return f"{parent}.({'|'.join(group)})"
    return None


def gemm_form(w: torch.Tensor, conv1d: bool) -> torch.Tensor:
    """``w`` as ``[out, in]`` (a Conv1D weight is ``[in, out]``)."""
    return w.t() if conv1d else w


def group_amaxes(amaxes: dict[str, torch.Tensor], targets: Iterable[QuantTarget]
                 ) -> dict[str, torch.Tensor]:
    """Per key, the amax its per-tensor scale uses: the max over its shared group."""
    targets = list(targets)
    best: dict[str, torch.Tensor] = {}
    for t in targets:
        g = shared_group(t.module) or t.key
        best[g] = torch.maximum(best[g], amaxes[t.key]) if g in best else amaxes[t.key]
    return {t.key: best[shared_group(t.module) or t.key] for t in targets}


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """amax of a weight as the training cast computes it (FP32 0-dim)."""
    return amax(w)


def quantize_weight(w: torch.Tensor, conv1d: bool, strategy: str,
                    group_amax: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight in the stored layout, FP32 dequantization multipliers)``.

    Args:
        w: the weight as stored (``[out, in]``, or ``[in, out]`` when ``conv1d``).
        conv1d: see :class:`QuantTarget`.
        strategy: ``"tensor"`` (0-dim multiplier), ``"channel"`` (``[out, 1]``) or
            ``"block"`` (``[ceil(out/128), ceil(in/128)]``).
        group_amax: per-tensor only: the amax to scale with (default: ``w``'s own).

    Example:
        >>> q, s = quantize_weight(torch.ones(3, 2), False, "tensor")
        >>> q.dtype, float(s) == 1 / 448
        (torch.float8_e4m3fn, True)
    """
    g = gemm_form(w, conv1d)
    if strategy == "tensor":
        scale = scale_from_amax(weight_amax(g) if group_amax is None else group_amax, E4M3)
        q, mult = cast_to_fp8(g, scale, E4M3), scale.reciprocal()
    elif strategy == "channel":
        r = quantize_rows(g, E4M3)
        q, mult = r.data, r.inv_scale
    elif strategy == "block":
        r = quantize_blocks(g, E4M3, block=BLOCK)
        q, mult = r.data, r.inv_scale
    else:
        raise ValueError(f"unknown weight strategy {strategy!r}: use tensor, channel or block")
    q = q.t().contiguous() if conv1d else q.contiguous()
    return q, mult.float().contiguous()


def dequantize_weight(q: torch.Tensor, mult: torch.Tensor, conv1d: bool,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_weight` (up to FP8 rounding), any of the three strategies.

    Example:
        >>> q, s = quantize_weight(torch.ones(3, 2), False, "block")
        >>> dequantize_weight(q, s, False).tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    g = gemm_form(q, conv1d).float()
    m = mult.float()
    if m.numel() == 1:
        out = g * m.reshape(())
    elif m.dim() == 2 and m.shape[1] == 1 and m.shape[0] == g.shape[0]:
        out = g * m
    else:
        rows = m.repeat_interleave(BLOCK, 0)[: g.shape[0]]
        out = g * rows.repeat_interleave(BLOCK, 1)[:, : g.shape[1]]
    out = out.t() if conv1d else out
    return out.to(dtype).contiguous()
