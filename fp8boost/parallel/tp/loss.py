"""Cross-entropy over vocabulary-parallel logits: full logits are never gathered.

Each tensor-parallel rank holds the logits of its vocabulary slice ``[start, start + V/tp)``.
The loss needs three group reductions of one value per token (max, the target's logit, the sum
of exponentials), as Megatron-LM's ``vocab_parallel_cross_entropy`` does; the gradient is local:
``softmax - onehot(target)`` on this rank's slice.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8boost.loss import VocabParallel

__all__ = ["vocab_parallel_cross_entropy", "HfVocabParallelLoss"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        x = logits.float()
        lmax = x.max(dim=-1).values
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        x = x - lmax.unsqueeze(-1)
        n_local = x.shape[-1]
        in_range = (target >= vocab_start) & (target < vocab_start + n_local)
        local_t = torch.where(in_range, target - vocab_start, torch.zeros_like(target))
        picked = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_range
        ex = x.exp()
        sums = torch.stack([picked, ex.sum(dim=-1)])
        dist.all_reduce(sums, group=group)  # one collective for both per-token values
        picked, sumexp = sums[0], sums[1]
        ctx.save_for_backward(ex.div_(sumexp.unsqueeze(-1)), local_t, in_range)
        ctx.dtype = logits.dtype
        return sumexp.log() - picked

    @staticmethod
    def backward(ctx, dloss):
        softmax, local_t, in_range = ctx.saved_tensors
        grad = softmax  # saved for this backward only: updated in place
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -in_range.to(grad.dtype).unsqueeze(-1))
        grad.mul_(dloss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 group) -> torch.Tensor:
    """Per-token cross-entropy of ``logits`` [T, V/tp] (this rank's vocabulary slice).

    Args:
        logits: this rank's logits, vocabulary slice starting at ``vocab_start``.
        target: [T] global token ids (ids outside every slice, e.g. -100, give ``logsumexp``
            and must be masked by the caller).
        vocab_start: first vocabulary id of this rank's slice.
        group: the tensor-parallel process group.

    Returns:
        [T] FP32 losses, identical on every rank of ``group``.

    Example:
        >>> import torch, torch.distributed as dist                                   # doctest: +SKIP
        >>> loss = vocab_parallel_cross_entropy(local_logits, ids, rank * v_local, tp_group)  # doctest: +SKIP
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [T, V] and target [T], got {tuple(logits.shape)} "
                         f"and {tuple(target.shape)}")
    return _VocabParallelCE.apply(logits, target, vocab_start, group)


class HfVocabParallelLoss:
    """Drop-in for a HF causal-LM ``loss_function`` when ``lm_head`` is vocabulary-parallel.

    Same contract as ``transformers``' ``ForCausalLMLoss``: labels are shifted by one (unless
    ``shift_labels`` is given), ``ignore_index`` tokens are skipped, and the result is the mean
    over counted tokens, or their sum divided by ``num_items_in_batch`` when given.

    ``vocab_parallel`` describes the split lm_head (group, first id, the collective its input
    goes through: ``head_input``), so that ``fp8boost.loss`` can fuse the head with this loss
    without the logits (``install_fused_lm_loss``).
    """

    def __init__(self, group, vocab_start: int,
                 head_input: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        self.group, self.vocab_start = group, vocab_start
        self.vocab_parallel = VocabParallel(group=group, vocab_start=vocab_start,
                                            head_input=head_input)

    def __call__(self, logits: torch.Tensor, labels: Optional[torch.Tensor], vocab_size: int = 0,
                 num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels: Optional[torch.Tensor] = None, **kwargs) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        target = shift_labels.reshape(-1).to(logits.device)
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), target,
                                                 self.vocab_start, self.group)
        keep = target != ignore_index
        total = torch.where(keep, per_token, torch.zeros_like(per_token)).sum()
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(total.device)
            return total / num_items_in_batch
        return total / keep.sum()
