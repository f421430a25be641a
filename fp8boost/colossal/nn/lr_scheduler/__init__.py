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
from typing import Any, Dict, List, Optional

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler

from fp8boost.colossal.logging import get_dist_logger

__all__ = ["CosineAnnealingWarmupLR"]


class _CosineAnnealingLR(CosineAnnealingLR):
    """torch's ``CosineAnnealingLR`` as of torch 2.5, the last version Colossal-AI supports.

    Newer torch (2.11 and 2.13 at least) keeps the current lr in ``CosineAnnealingLR.get_lr``
    only inside the scheduler's own first step (``_is_initial``); torch 2.5 keeps it whenever
    ``last_epoch`` is 0, and Colossal-AI's warm-up wrapper relies on that: it calls this
    ``get_lr`` at the first cosine step, from its own ``step``. Newer torch would scale the
    whole cosine phase by ``2 / (1 + cos(pi / T_max))`` there; this class keeps torch 2.5's rule.
    """

    def get_lr(self) -> List[Any]:
        groups = self.optimizer.param_groups
        if self.last_epoch == 0:
            return [group["lr"] for group in groups]
        if self._step_count == 1 and self.last_epoch > 0:  # built with last_epoch >= 0
            return self._get_closed_form_lr()
        if (self.last_epoch - 1 - self.T_max) % (2 * self.T_max) == 0:  # leaving a trough
            return [group["lr"] + (base - self.eta_min) * (1 - math.cos(math.pi / self.T_max)) / 2
                    for base, group in zip(self.base_lrs, groups)]
        return [(1 + math.cos(math.pi * self.last_epoch / self.T_max))
                / (1 + math.cos(math.pi * (self.last_epoch - 1) / self.T_max))
                * (group["lr"] - self.eta_min) + self.eta_min for group in groups]


class CosineAnnealingWarmupLR(LRScheduler):
    """Linear warm-up, then cosine annealing: Colossal-AI's ``WarmupScheduler`` over torch's
    ``CosineAnnealingLR``, with the same steps, attributes and ``state_dict``.

    With ``W = warmup_steps``, ``T = total_steps - W``, ``base`` a group's ``initial_lr`` (its
    lr when the first scheduler was built on the optimizer: torch keeps an existing one) and
    ``k`` the number of ``step()`` calls so far:

    * construction: the group's lr becomes ``base / W`` if ``W > 0``, and stays as it is if
      ``W == 0`` (a scheduler built on an optimizer that already stepped leaves its lr alone);
    * ``k < W``: ``base * (k + 1) / W`` (the first step already trains at ``base / W``, the
      last warm-up step at ``base``);
    * ``k == W``: the lr stays as it is (``base`` after the warm-up);
    * ``k > W``: torch's recursive cosine update of the group's *current* lr (as
      ``CosineAnnealingLR``: an lr set by hand, or loaded with the optimizer's state, is carried
      on), which from an untouched schedule is ``eta_min + (base - eta_min) * (1 + cos(pi *
      (k - W) / T)) / 2``; past ``total_steps`` it rises again, as there.

    From the first cosine step on, ``step()`` steps ``after_scheduler`` (the cosine part) and
    this scheduler's own ``last_epoch`` stays at ``W``, as in Colossal-AI. ``state_dict()``
    holds this scheduler's attributes but ``optimizer`` and ``after_scheduler``, plus
    ``after_scheduler_type`` (``"CosineAnnealingLR"``) and ``after_scheduler_dict`` (the cosine
    part's ``state_dict()``), so checkpoints load either way between the two libraries.

    Args:
        optimizer: the optimizer whose groups' ``lr`` it sets.
        total_steps: warm-up plus annealing steps.
        warmup_steps: linear warm-up steps (0: cosine from the first step).
        eta_min: the learning rate at ``total_steps``.
        last_epoch: the index of the last step (-1: a fresh schedule).

    Raises:
        ValueError: ``warmup_steps`` negative, or ``total_steps`` not above it. Colossal-AI
            takes these and fails later (a ``ZeroDivisionError`` at the first cosine step
            past ``total_steps``); the schedule they describe has no cosine phase.

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
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps "
                             f"({warmup_steps}): the cosine phase needs at least one step")
        after = _CosineAnnealingLR(optimizer, total_steps - warmup_steps, eta_min=eta_min,
                                   last_epoch=last_epoch)
        self.warmup_epochs = int(warmup_steps)
        self.after_scheduler = after
        self.finished = False
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> List[Any]:
        if self.last_epoch >= self.warmup_epochs:
            if not self.finished:
                self.after_scheduler.base_lrs = self.base_lrs
                self.finished = True
            return self.after_scheduler.get_lr()
        return [(self.last_epoch + 1) / self.warmup_epochs * base for base in self.base_lrs]

    def step(self, epoch: Optional[int] = None) -> None:
        if not self.finished:
            super().step(epoch)
            return
        self.after_scheduler.step(None if epoch is None else epoch - self.warmup_epochs)
        self._last_lr = self.after_scheduler.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        state = {key: value for key, value in self.__dict__.items()
                 if key not in ("optimizer", "after_scheduler")}
        state["after_scheduler_type"] = "CosineAnnealingLR"  # torch's class, in Colossal-AI
        state["after_scheduler_dict"] = self.after_scheduler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "after_scheduler_dict" in state_dict:
            self.after_scheduler.load_state_dict(state_dict["after_scheduler_dict"])
        else:
            get_dist_logger().warning(
                "after_scheduler_dict is not found, skip loading after_scheduler. "
                "This may cause unexpected behavior.")
        super().load_state_dict({key: value for key, value in state_dict.items()
                                 if key not in ("after_scheduler_type", "after_scheduler_dict")})
