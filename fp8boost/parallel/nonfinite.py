"""Non-finite guard: an optimizer step whose loss or gradients hold NaN/Inf is skipped on every
rank, with a warning naming the step and the first rank/tensor that went bad; after
``max_consecutive`` bad steps in a row training stops with :class:`NonFiniteError`.

Every optimizer wrapper of the plugins (``ZeroOptimizer``, ``OptimizerWrapper``,
``FsdpOptimizer``) consults its ``nonfinite_guard`` before stepping: ``Booster.boost`` attaches
one (on by default; ``Booster(nonfinite_guard=False)`` turns it off). A skipped step touches
neither the master weights nor the optimizer state, so a non-finite value never reaches them or
a checkpoint. FP16 training keeps the loss scaler's own overflow handling (skip and lower the
scale): the guard stands aside when a wrapper has a loss scaler.

Cost per optimizer step: one fused ``torch._foreach_norm`` over this rank's gradient tensors
(reads each gradient once, as clipping does; no per-parameter host sync), one all-reduce of a
``world x 2`` int64 table over the job, and one host sync to read it.

Example:
    >>> import torch
    >>> guard = NonFiniteGuard(max_consecutive=2)
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> guard.observe_loss(torch.tensor(float("inf")))
    >>> guard.check([torch.ones(2)], [w])  # doctest: +SKIP
    True
"""
from __future__ import annotations

import copy
import warnings
from typing import Optional, Sequence

import torch
import torch.distributed as dist


class NonFiniteError(FloatingPointError):
    """Training stopped: too many consecutive optimizer steps had a non-finite loss/gradient."""


class NonFiniteStepWarning(RuntimeWarning):
    """An optimizer step was skipped because its loss or gradients were not finite."""


class NonFiniteGuard:
    """Skip optimizer steps with a NaN/Inf loss or gradient, identically on every rank.

    Args:
        max_consecutive: stop with :class:`NonFiniteError` after this many bad steps in a row
            (a one-off spike is skipped; a run that keeps diverging is stopped).
        enabled: False makes :meth:`check` a no-op (no collective).

    Attributes:
        step: number of the last optimizer step checked (1-based; set it to the resumed step
            so that warnings name the training step).
        skipped: steps skipped so far.
    """

    def __init__(self, max_consecutive: int = 3, enabled: bool = True) -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) \
                or max_consecutive < 1:
            raise ValueError(f"max_consecutive must be an int >= 1 (bad steps in a row before "
                             f"training stops), got {max_consecutive!r}")
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be True or False, got {enabled!r}")
        self.max_consecutive = max_consecutive
        self.enabled = enabled
        self.group = None
        self.names: dict[int, str] = {}
        self.step = 0
        self.consecutive = 0
        self.skipped: list[int] = []
        self._loss_bad: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        return f"NonFiniteGuard(max_consecutive={self.max_consecutive}, enabled={self.enabled})"

    def bind(self, group, model: Optional[torch.nn.Module] = None) -> "NonFiniteGuard":
        """A fresh copy of this guard checking over ``group`` (None: this process alone), with
        ``model``'s parameter names for the warnings."""
        new = copy.copy(self)
        new.group = group
        new.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        new.step, new.consecutive, new.skipped, new._loss_bad = 0, 0, [], None
        return new

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Remember whether a loss of this step (any micro-batch) is non-finite; no sync."""
        if not self.enabled or not torch.is_tensor(loss):
            return
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad.to(
            self._loss_bad.device)

    def check(self, grads: Sequence[Optional[torch.Tensor]],
              params: Sequence[torch.Tensor]) -> bool:
        """Whether this step must be skipped (collective over ``group`` when enabled).

        Args:
            grads: this rank's gradient tensors (DTensors: their local shards), None allowed.
            params: the parameter each gradient belongs to (for the name in the warning).

        Raises:
            NonFiniteError: the ``max_consecutive``-th bad step in a row, on every rank.
        """
        if not self.enabled:
            return False
        self.step += 1
        loss_bad, self._loss_bad = self._loss_bad, None
        device = self._device(grads)
        pairs = [(i, _local(g)) for i, g in enumerate(grads) if g is not None]
        row = torch.zeros(2, dtype=torch.int64, device=device)
        if loss_bad is not None:
            row[0] = loss_bad.to(device=device, dtype=torch.int64)
        if pairs:
            # One fused kernel over all gradients: a NaN/Inf anywhere makes its norm non-finite.
            norms = torch._foreach_norm([g for _, g in pairs])
            bad = ~torch.isfinite(torch.stack([n.float().to(device) for n in norms]))
            index = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=device)
            first = torch.where(bad, index, torch.full_like(index, len(grads))).min()
            row[1] = torch.where(bad.any(), first + 1, torch.zeros_like(first))
        rank, world = self._rank_world()
        if world > 1:
            table = torch.zeros(world, 2, dtype=torch.int64, device=device)
            table[rank] = row
            dist.all_reduce(table, group=self.group)
            rows = table.tolist()
        else:
            rows = [row.tolist()]
        bad_ranks = [(r, loss, g) for r, (loss, g) in enumerate(rows) if loss or g]
        if not bad_ranks:
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped.append(self.step)
        # Rare (a bad step): one more small collective, so that every rank's first bad tensor
        # is named by the rank that holds it (pipeline stages hold different parameters).
        mine = self._name(params, rows[rank][1])
        names = [mine]
        if world > 1:
            names = [None] * world
            dist.all_gather_object(names, mine, group=self.group)
        what = self._describe(bad_ranks, names)
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(
                f"fp8boost: {self.consecutive} optimizer steps in a row "
                f"({self.step - self.consecutive + 1}-{self.step}) had a non-finite loss or "
                f"gradient (last: {what}); training stopped. Every bad step was skipped, so the "
                "weights and optimizer state are those before them. Lower the learning rate, "
                "check the data of these steps, or resume from the last checkpoint; "
                "NonFiniteGuard(max_consecutive=...) allows more bad steps in a row")
        if rank == 0:  # the verdict is the same on every rank: one warning per job
            warnings.warn(f"fp8boost: non-finite {what} at optimizer step {self.step}: the "
                          f"step was skipped on every rank ({self.consecutive} in a row; "
                          f"training stops at {self.max_consecutive})", NonFiniteStepWarning,
                          stacklevel=3)
        return True

    # ------------------------------------------------------------------------------ helpers
    def _rank_world(self) -> tuple[int, int]:
        if self.group is None or not dist.is_initialized():
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _device(self, grads: Sequence[Optional[torch.Tensor]]) -> torch.device:
        if self.group is not None and dist.is_initialized() \
                and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        if self.group is not None and dist.is_initialized():
            return torch.device("cpu")  # gloo
        for g in grads:
            if g is not None:
                return _local(g).device
        return torch.device("cpu")

    def _name(self, params: Sequence[torch.Tensor], g: int) -> Optional[str]:
        """This rank's name of its first bad gradient (``g``: 1-based index, 0: none)."""
        if g <= 0:
            return None
        p = params[g - 1] if g <= len(params) else None
        name = self.names.get(id(p)) if p is not None else None
        return name or f"parameter #{g - 1}" + (f" {tuple(p.shape)}" if p is not None else "")

    @staticmethod
    def _describe(bad_ranks: list[tuple[int, int, int]], names: list[Optional[str]]) -> str:
        """'loss on rank 1' / 'gradient of <name> on rank 0' for the first bad rank.

        A bad loss is named first: gradients are reduced across ranks, so every rank's gradient
        goes bad when one rank's batch does, but the loss stays local to the rank that had it.
        """
        for r, loss, _ in bad_ranks:
            if loss:
                return f"loss on rank {r}"
        r = next(r for r, _, g in bad_ranks if g)
        return f"gradient of {names[r]} on rank {r}"


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor gradients (FSDP2): this rank's shard; checking it needs no communication.
    return t._local_tensor if hasattr(t, "_local_tensor") else t.detach()
