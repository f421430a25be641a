"""The HF attention function that runs Ulysses around the model's own attention.

transformers 5 looks attention up in ``ALL_ATTENTION_FUNCTIONS`` under
``config._attn_implementation`` and calls it as ``fn(module, query, key, value,
attention_mask, dropout=..., scaling=..., **kwargs)`` with ``[batch, heads, seq, head_dim]``
tensors. :data:`ATTN_NAME` is registered there (once, on first :func:`attach`); the function
moves q/k/v from this rank's tokens x all heads to all tokens x this rank's heads, calls the
implementation the model had before (``sdpa``, ``eager``, flash...) with causal masking over
the *global* sequence, and moves the output back. The per-layer settings (group, FP8 wire,
inner implementation) live on each attention module as :class:`UlyssesAttention`.

The name is not in transformers' mask registry, so the model builds no local (chunk-sized)
mask; the forward wrapper (``model.py``) refuses padding masks before the model runs.

Example:
    >>> from fp8boost.parallel.sp.attention import ATTN_NAME
    >>> ATTN_NAME
    'fp8boost_ulysses'
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .all_to_all import heads_to_seq, seq_to_heads

ATTN_NAME = "fp8boost_ulysses"
STATE_ATTR = "fp8boost_ulysses"
"""Attribute of each attention module holding its :class:`UlyssesAttention`."""


@dataclass
class UlyssesAttention:
    """One attention module's Ulysses settings."""

    group: object
    inner: str  # the attention implementation the model had ("sdpa", "eager", ...)
    fp8: bool = False
    comm_config: Optional[object] = None

    def inner_fn(self, module: nn.Module) -> Callable:
        # lazy: transformers takes seconds to import; only HF models get here
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.inner == "eager":  # each modeling file has its own eager function
            return sys.modules[type(module).__module__].eager_attention_forward
        return ALL_ATTENTION_FUNCTIONS[self.inner]


def _causal_mask(s: int, like: torch.Tensor) -> torch.Tensor:
    """Additive ``[1, 1, s, s]`` causal mask for implementations that do not take is_causal."""
    blocked = torch.ones(s, s, dtype=torch.bool, device=like.device).triu(1)
    mask = torch.zeros(s, s, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(blocked, torch.finfo(like.dtype).min).view(1, 1, s, s)


def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask, **kwargs):
    """The registered attention function (HF's calling convention; see the module docstring).

    Returns ``(attn_output [b, s/sp, heads, head_dim], None)`` as HF attention functions do
    (attention weights are not gathered)."""
    st: UlyssesAttention = getattr(module, STATE_ATTR)
    q = seq_to_heads(query, st.group, st.fp8, st.comm_config)
    k = seq_to_heads(key, st.group, st.fp8, st.comm_config)
    v = seq_to_heads(value, st.group, st.fp8, st.comm_config)
    kwargs.pop("is_causal", None)
    # The chunk's mask (if HF built one) is for s/sp tokens: causality is over the full sequence.
    mask = _causal_mask(q.shape[2], q) if st.inner == "eager" else None
    out, _ = st.inner_fn(module)(module, q, k, v, mask, is_causal=True, **kwargs)
    # HF returns [b, s, h/sp, d]; the all-to-all works on [b, h/sp, s, d].
    out = heads_to_seq(out.transpose(1, 2), st.group, st.fp8, st.comm_config)
    return out.transpose(1, 2).contiguous(), None


def attention_modules(model: nn.Module) -> list:
    """The HF self-attention modules of ``model`` (they read ``config._attn_implementation``)."""
    return [m for m in model.modules()
            if hasattr(m, "config") and hasattr(m, "head_dim") and hasattr(m, "q_proj")]


def attach(model: nn.Module, group, fp8: bool, comm_config) -> int:
    """Route ``model``'s attention through Ulysses over ``group``; returns the module count.

    Registers :data:`ATTN_NAME` with transformers (idempotent) and sets it as the
    implementation of every config the attention modules read."""
    # lazy: transformers takes seconds to import; only HF models get here
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention_forward)
    mods = attention_modules(model)
    for m in mods:
        inner = m.config._attn_implementation or "eager"
        if inner == ATTN_NAME:  # config shared by every layer: already switched
            inner = getattr(mods[0], STATE_ATTR).inner
        setattr(m, STATE_ATTR, UlyssesAttention(group, inner, fp8, comm_config))
    for m in mods:
        m.config._attn_implementation = ATTN_NAME
    return len(mods)
