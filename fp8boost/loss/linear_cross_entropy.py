"""Linear + cross-entropy without the ``[tokens, vocab]`` logits: the lm_head and its loss, fused.

A causal LM's last GEMM and its loss make the largest activation of the step: at 8192 tokens
and a 128256 vocabulary the BF16 logits are 2.1 GB, their FP32 copy for the loss 4.2 GB, and
the FP32 gradient of that copy another 4.2 GB. :func:`chunked_linear_cross_entropy` walks the
tokens in chunks; for each chunk it computes the logits (GEMM in the input dtype, FP32
accumulation), their log-sum-exp and the target's logit in FP32, the loss, and right away the
gradient of the logits, which it turns into the chunk's rows of ``dL/dhidden`` and adds to
``dL/dweight`` (and ``dL/dbias``). The chunk's logits are then dropped. Backward only scales the
stored gradients by the incoming gradient. Extra memory: ``chunk_size x vocab`` per chunk
instead of ``tokens x vocab``, and nothing of that size is saved for backward. The chunk's
elementwise work (log-sum-exp, target logit, gradient) is :mod:`fp8boost.loss.chunk_ops`,
compiled on CUDA into three passes over the BF16 logits.

The rounding follows HF's BF16 path: logits rounded to the input dtype by their GEMM, softmax in
FP32, the logits' gradient (already divided by the token count, as HF's backward does) rounded
to the input dtype before the two gradient GEMMs. The weight gradient is accumulated chunk by
chunk in the weight's dtype (one ``addmm`` per chunk, as Liger-Kernel does), where HF's single
GEMM rounds once: BF16 weight gradients differ by a few BF16 ulps.

Under tensor parallelism with a vocabulary-parallel lm_head (:class:`VocabParallel`), each rank
holds ``weight``'s rows ``[vocab_start, vocab_start + V/tp)``: per chunk, one all-gather of two
values per token (the slice's log-sum-exp and the target's logit, zero off the slice) gives the
full-vocabulary loss on every rank; the weight gradient is the local slice's, and the hidden
gradient is this slice's partial sum, which the lm_head input's own collective
(``VocabParallel.head_input``, e.g. ``copy_to_tp``) all-reduces in backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import chunk_ops
from .fp8_head import Fp8Head, head_config

__all__ = ["VocabParallel", "chunked_linear_cross_entropy", "auto_chunk_size",
           "CHUNK_ELEMENTS"]

#: Default chunk: about this many logits (``chunk_size x vocab``) alive at once, i.e. ~12
#: bytes each (input-dtype logits, FP32 logits, their FP32 exp, the input-dtype gradient):
#: ~1.6 GB. 1024 tokens at a 128256 vocabulary, so an 8192-token batch takes 8 chunks; fewer,
#: larger chunks cut the weight-gradient read-modify-write per chunk (2 x weight bytes).
CHUNK_ELEMENTS = 2 ** 27
REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True, kw_only=True)
class VocabParallel:
    """The vocabulary slice of a tensor-parallel lm_head held by this rank.

    Example:
        >>> from fp8boost.loss import VocabParallel
        >>> VocabParallel(group=None, vocab_start=0).vocab_start
        0
    """

    group: object
    """The tensor-parallel process group the vocabulary is split over."""
    vocab_start: int
    """The first vocabulary id of this rank's rows of the weight."""
    head_input: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    """What the lm_head's input goes through before its GEMM (``copy_to_tp``: identity forward,
    all-reduce backward; ``gather_seq`` under sequence parallelism). Applied by the caller
    (``fp8boost.loss.causal_lm``), not by :func:`chunked_linear_cross_entropy`."""


def auto_chunk_size(tokens: int, vocab: int) -> int:
    """Tokens per chunk for ``vocab`` logits per token: :data:`CHUNK_ELEMENTS` logits at once,
    a multiple of 128 rows (whole GEMM tiles), at most ``tokens``.

    Example:
        >>> from fp8boost.loss import auto_chunk_size
        >>> auto_chunk_size(8192, 128256), auto_chunk_size(100, 64)
        (1024, 100)
    """
    rows = max(128, (CHUNK_ELEMENTS // max(vocab, 1)) // 128 * 128)
    return max(1, min(tokens, rows))


def _check(hidden, weight, labels, bias, chunk_size, reduction) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"expected labels [N] = [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"expected bias [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1 or None (auto), got {chunk_size!r}")


def _gemm(h, weight, bias, head: Optional[Fp8Head]) -> torch.Tensor:
    """The chunk's lm_head GEMM, its result in the input dtype (BF16, or FP8 with ``head``)."""
    return head.logits(h, bias) if head is not None else F.linear(h, weight, bias)


def _all_tokens(lse, picked, group):
    """Per token: log-sum-exp over the whole vocabulary and the target's logit, from every
    rank's slice (one collective per chunk)."""
    if group is None:
        return lse, picked
    mine = torch.stack([lse, picked])
    n = dist.get_world_size(group)
    every = mine.new_empty((n * 2, mine.shape[1]))
    # torch >= 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine, group=group)
    every = every.view(n, 2, -1)
    return torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(dim=0)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and every gradient; backward scales them by ``grad_loss``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, divisor, ignore_index: int, chunk: int,
                mean: bool, logit_scale: float, softcap: Optional[float], vocab_start: int,
                group, fp8_recipe: Optional[str]):
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        want_b = want_b and bias is not None
        n, v_local = hidden.shape[0], weight.shape[0]
        valid = labels != ignore_index
        # HF's mean: the sum over counted tokens / their count (NaN when there are none, as
        # F.cross_entropy gives; the gradient is then zero, as its backward gives).
        if mean:
            divisor = valid.sum().float()
        inv = 1.0 / divisor if divisor is not None else torch.ones((), device=hidden.device)
        per_token = torch.where(valid, inv, 0.0)
        target = labels - vocab_start
        on_slice = valid & (target >= 0) & (target < v_local)
        target = torch.where(on_slice, target, 0)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros(v_local, device=hidden.device) if want_b else None
        total = torch.zeros((), device=hidden.device)
        # The weight's FP8 operands, once per call (fp8_head: the logits and dL/dh GEMMs).
        head = Fp8Head.prepare(weight, head_config(fp8_recipe), want_dgrad=want_h) \
            if fp8_recipe is not None else None
        for s in range(0, n, chunk):  # a static count: torch.compile unrolls it, no host sync
            e = min(s + chunk, n)
            h = hidden[s:e]
            z = _gemm(h, weight, bias, head)
            lse, picked = chunk_ops.run(chunk_ops.chunk_stats, z, target[s:e], on_slice[s:e],
                                        logit_scale, softcap)
            lse, picked = _all_tokens(lse, picked, group)
            total = total + torch.where(valid[s:e], lse - picked, 0.0).sum()
            if not (want_h or want_w or want_b):
                continue
            g = chunk_ops.run(chunk_ops.chunk_grad, z, lse, target[s:e], on_slice[s:e],
                              per_token[s:e], logit_scale, softcap, hidden.dtype)
            if want_h:
                grad_h[s:e] = head.input_grad(g) if head is not None else g @ weight
            if want_w:
                grad_w.addmm_(g.t(), h)
            if want_b:
                grad_b += g.float().sum(dim=0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total * inv

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        # A bf16 tensor times an FP32 0-d tensor is computed in FP32 and rounded once.
        grad_h = grad_h * grad_loss if grad_h is not None else None
        grad_w = grad_w * grad_loss if grad_w is not None else None
        grad_b = (grad_b * grad_loss).to(ctx.bias_dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None, None, None


def chunked_linear_cross_entropy(
        hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
        bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
        chunk_size: Optional[int] = None, reduction: str = "mean",
        num_items_in_batch: Union[torch.Tensor, int, None] = None, logit_scale: float = 1.0,
        softcap: Optional[float] = None,
        vocab_parallel: Optional[VocabParallel] = None,
        fp8_recipe: Optional[str] = None) -> torch.Tensor:
    """``F.cross_entropy(softcap(logit_scale * F.linear(hidden, weight, bias)), labels)``
    without ever holding the ``[N, V]`` logits (module docstring: how, and the rounding).

    Labels are used as given (no shift: :mod:`fp8boost.loss.causal_lm` shifts them as HF does).

    Args:
        hidden: ``[N, H]`` inputs of the lm_head (BF16, FP16 or FP32).
        weight: ``[V, H]`` lm_head weight, same dtype (this rank's rows under ``vocab_parallel``).
        labels: ``[N]`` target ids (global ids under ``vocab_parallel``).
        bias: optional ``[V]`` bias.
        ignore_index: tokens with this label count neither in the loss nor in the mean.
        chunk_size: tokens per chunk; None: :func:`auto_chunk_size` (1024 at a 128k vocab).
        reduction: ``"mean"`` over counted tokens (NaN when none, as ``F.cross_entropy``), or
            ``"sum"``.
        num_items_in_batch: with ``"sum"``, divide by this (HF's gradient-accumulation
            normalisation: ``fixed_cross_entropy``); the division is folded into the stored
            gradients in FP32.
        logit_scale: logits = scale x GEMM output (Cohere ``logit_scale``, Granite
            ``1 / logits_scaling``), applied in FP32.
        softcap: logits = softcap x tanh(logits / softcap) (Gemma-2 ``final_logit_softcapping``),
            applied in FP32.
        vocab_parallel: this rank's vocabulary slice under tensor parallelism (the loss is the
            full-vocabulary one, equal on every rank).
        fp8_recipe: ``"rowwise"`` or ``"blockwise"``: the logits and ``dL/dhidden`` GEMMs in
            FP8 with that recipe's scales (:mod:`fp8boost.loss.fp8_head`; the weight gradient
            stays a BF16 GEMM); None: every GEMM in the input dtype.

    Returns:
        The FP32 scalar loss. Its backward may run once (the gradients are stored, not the
        graph).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from fp8boost.loss import chunked_linear_cross_entropy
        >>> h = torch.randn(10, 8, requires_grad=True); w = torch.randn(32, 8, requires_grad=True)
        >>> y = torch.randint(0, 32, (10,)); y[3] = -100
        >>> loss = chunked_linear_cross_entropy(h, w, y, chunk_size=4)
        >>> torch.allclose(loss, F.cross_entropy(h @ w.t(), y))
        True
        >>> loss.backward(); h.grad.shape, w.grad.shape
        (torch.Size([10, 8]), torch.Size([32, 8]))
    """
    _check(hidden, weight, labels, bias, chunk_size, reduction)
    if fp8_recipe is not None:
        head_config(fp8_recipe)  # a bad name fails here, before any GEMM
    if num_items_in_batch is not None and reduction != "sum":
        raise ValueError("num_items_in_batch divides the summed loss: pass reduction='sum'")
    divisor = None
    if num_items_in_batch is not None:
        divisor = torch.as_tensor(num_items_in_batch, device=hidden.device).float()
    chunk = chunk_size or auto_chunk_size(hidden.shape[0], weight.shape[0])
    vp = vocab_parallel
    return _LinearCrossEntropy.apply(
        hidden, weight, bias, labels.to(hidden.device), divisor, ignore_index, chunk,
        reduction == "mean", float(logit_scale), None if softcap is None else float(softcap),
        vp.vocab_start if vp is not None else 0, vp.group if vp is not None else None,
        fp8_recipe)
