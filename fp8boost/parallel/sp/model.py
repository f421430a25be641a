"""Ulysses sequence parallelism for a HF causal LM: split the batch along the sequence, keep
the loss global.

Every sp rank is fed the same full batch (as tp ranks are); the wrapped ``forward`` keeps this
rank's chunk of ``seq / sp`` consecutive tokens:

* ``input_ids`` / ``inputs_embeds`` and ``position_ids`` (default ``arange(seq)``: rotary
  embeddings see global positions) are sliced;
* ``labels`` are shifted over the *whole* sequence first (the label of a chunk's last token is
  the next chunk's first token) and passed to the model's loss as ``shift_labels``;
* ``attention_mask``: all ones is dropped (causal masking over the global sequence happens in
  the attention wrapper); a padding mask raises ``ValueError`` (pack sequences instead).

Loss: with ``S_r`` this rank's summed token loss and ``N`` the batch's counted tokens (known on
every rank: each has all the labels), the returned ``loss`` is ``sum_r S_r / N`` on every sp
rank, and its backward seeds ``sp * S_r / N``: after the optimizer averages gradients over
dp x sp, each parameter gets the gradient of the global token mean. ``logits`` are this
rank's chunk ``[batch, seq / sp, vocab]`` (vocabulary slice under tp).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fp8boost.parallel.comm.plan import CommPlan

from .attention import attach

__all__ = ["check_ulysses", "apply_ulysses", "UlyssesForward"]

IGNORE_INDEX = -100


def check_ulysses(model: nn.Module, sp: int, tp: int) -> None:
    """Raise ``ValueError`` (before any collective) when ``model`` cannot run Ulysses over ``sp``
    ranks with ``tp``-way tensor parallelism: each rank's query *and* kv heads (``heads / tp``)
    must split evenly over sp (kv heads are not replicated to make them fit)."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if heads is None or not hasattr(model, "loss_function"):
        raise ValueError("sequence_parallelism_mode='all_to_all' supports HF causal LMs (a "
                         "config with num_attention_heads and a loss_function); for other models "
                         "use sp_size=1")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n % tp or (n // tp) % sp:
            raise ValueError(f"{name}={n}: Ulysses needs {name} / tp_size ({n} / {tp}) divisible "
                             f"by sp_size={sp}; choose an sp_size (and tp_size) that divides it")


class _GlobalMean(torch.autograd.Function):
    """Forward: ``sum_r local_r / sp`` over the group; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, local, group):
        out = local.detach().clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class UlyssesForward:
    """Replaces ``model.forward`` (an instance attribute: parameters and state_dict keys are
    untouched) with the chunking forward described in the module docstring."""

    def __init__(self, model: nn.Module, group) -> None:
        self.model, self.inner = model, model.forward
        self.group = group
        self.sp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.signature = inspect.signature(self.inner)

    def _chunk(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        s = t.shape[1]
        return t.narrow(1, self.rank * (s // self.sp), s // self.sp).contiguous()

    def _split(self, kw: dict) -> tuple:
        ref = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
        if ref is None:
            raise ValueError("Ulysses sequence parallelism needs input_ids or inputs_embeds")
        b, s = ref.shape[:2]
        if s % self.sp:
            raise ValueError(f"sequence length {s} is not divisible by sp_size={self.sp}: pad or "
                             "cut the batch to a multiple of sp_size")
        mask = kw.pop("attention_mask", None)
        if mask is not None and not bool((mask == 1).all()):
            raise ValueError("Ulysses sequence parallelism (all_to_all) supports causal attention "
                             "without padding: pass attention_mask=None (or all ones), e.g. pack "
                             "sequences, or use sequence_parallelism_mode='split_gather'")
        if kw.get("position_ids") is None:
            kw["position_ids"] = torch.arange(s, device=ref.device).unsqueeze(0).expand(b, s)
        labels = kw.pop("labels", None)
        shift = kw.pop("shift_labels", None)
        if shift is None and labels is not None:
            shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        for name in ("input_ids", "inputs_embeds", "position_ids"):
            kw[name] = self._chunk(kw.get(name))
        return kw, shift

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind_partial(*args, **kwargs)
        kw = dict(bound.arguments)
        kw.update(kw.pop("kwargs", {}) if isinstance(kw.get("kwargs"), dict) else {})
        kw, shift = self._split(kw)
        count = kw.pop("num_items_in_batch", None)
        out = self.inner(**kw)
        if shift is None:
            return out
        if count is None:
            count = (shift != IGNORE_INDEX).sum()
        vocab = getattr(self.model.config, "vocab_size", out.logits.shape[-1])
        local_sum = self.model.loss_function(logits=out.logits, labels=None, vocab_size=vocab,
                                             shift_labels=self._chunk(shift),
                                             num_items_in_batch=1)
        if torch.is_tensor(count):
            count = count.to(local_sum.device)
        loss = _GlobalMean.apply(local_sum * self.sp / count, self.group)
        # Rebuilt, not `out.loss = ...`: a ModelOutput field that was None is not among its
        # keys, so the attribute alone would leave `out[0]` / `out["loss"]` (Colossal-AI's
        # `outputs[0]`) pointing at the logits.
        return type(out)(**{**dict(out.items()), "loss": loss})


def apply_ulysses(model: nn.Module, group, comm_plan: Optional[CommPlan] = None) -> int:
    """Make ``model`` (a HF causal LM, after any tensor-parallel split) run Ulysses over
    ``group``; returns the number of attention modules routed through the all-to-alls.

    ``comm_plan`` (the plugin's :class:`~fp8boost.parallel.comm.plan.CommPlan`; None: plain
    all-to-alls): ``sp_all_to_all.fp8`` sends the forward payloads as FP8 bytes, with
    ``comm_plan.config``.

    Example:
        >>> n = apply_ulysses(model, topology.group("sp"), plugin.comm_plan)  # doctest: +SKIP
    """
    comm = comm_plan if comm_plan is not None else CommPlan()
    n = attach(model, group, comm.sp_all_to_all.fp8, comm.config)
    if n == 0:
        raise ValueError("found no HF attention module (q_proj + head_dim + config) to run "
                         "Ulysses around; use sp_size=1 for this model")
    if getattr(model, "config", None) is not None:
        model.config._attn_implementation = "fp8boost_ulysses"
    model.forward = UlyssesForward(model, group)
    return n
