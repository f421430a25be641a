"""``colossalai.nn.lr_scheduler``: ``CosineAnnealingWarmupLR``.

Example:
    >>> import torch
    >>> from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    >>> sched = CosineAnnealingWarmupLR(opt, total_steps=10, warmup_steps=2)
    >>> opt.param_groups[0]["lr"]
    0.5
"""
from __future__ import annotations

import math
from typing import List

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["CosineAnnealingWarmupLR"]


class CosineAnnealingWarmupLR(LRScheduler):
    """Linear warm-up, then cosine annealing: Colossal-AI's schedule, in closed form.

    After ``k`` calls of ``step()`` (``k = last_epoch``; 0 right after construction), each
    group's learning rate is, with ``W = warmup_steps``, ``T = total_steps - W`` and ``base``
    the group's initial lr:

    * ``k < W``: ``base * (k + 1) / W`` (Colossal-AI's ``WarmupScheduler``: the first step
      already trains at ``base / W``, the last warm-up step at ``base``);
    * ``k >= W``: ``eta_min + (base - eta_min) * (1 + cos(pi * (k - W) / T)) / 2`` (torch's
      ``CosineAnnealingLR`` over ``T`` steps; past ``total_steps`` it rises again, as there).

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets.
        total_steps: warm-up plus annealing steps.
        warmup_steps: linear warm-up steps (0: cosine from the first step).
        eta_min: the learning rate at ``total_steps``.
        last_epoch: the index of the last step (-1: a fresh schedule).

    Raises:
        ValueError: ``warmup_steps`` negative, or not below ``total_steps``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        >>> sched = CosineAnnealingWarmupLR(opt, total_steps=4, warmup_steps=0)
        >>> lrs = []
        >>> for _ in range(3):
        ...     opt.step(); sched.step(); lrs.append(round(sched.get_last_lr()[0], 3))
        >>> lrs
        [0.854, 0.5, 0.146]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int,
                 warmup_steps: int = 0, eta_min: float = 0.0, last_epoch: int = -1) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if total_steps <= warmup_steps:
            # Colossal-AI would fail later with a ZeroDivisionError in the first cosine step.
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps "
                             f"({warmup_steps})")
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, int(warmup_steps), eta_min
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[float]:
        return self._closed_form(self.last_epoch)

    def _get_closed_form_lr(self) -> List[float]:
        return self._closed_form(self.last_epoch)

    def _closed_form(self, k: int) -> List[float]:
        w, t = self.warmup_steps, self.total_steps - self.warmup_steps
        if k < w:
            return [base * (k + 1) / w for base in self.base_lrs]
        cos = (1 + math.cos(math.pi * (k - w) / t)) / 2
        return [self.eta_min + (base - self.eta_min) * cos for base in self.base_lrs]
