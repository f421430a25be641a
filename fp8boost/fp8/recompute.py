"""Activation recomputation (checkpointing) and FP8 casts: detecting it, and repeating a forward.

``torch.utils.checkpoint`` (both forms), HF's ``gradient_checkpointing_enable()`` and torch's
selective activation checkpointing run a block's forward a second time in backward and require
it to save the same tensors as the first run. With current (tensorwise) scaling a recomputed
cast is the forward's cast bit for bit by construction: same tensor, same amax, same scale.
Delayed scaling casts with a scale from an amax history that every forward advances, so a
recomputation must cast with the scale its forward used and record nothing:
:class:`DelayedReplayLog` keeps those scales for one optimizer step.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from fp8boost import _state

from .scaling import Fp8Tensor

MAX_REMEMBERED = 4096
"""Forwards of one layer in one optimizer step whose casts a recomputation can repeat."""


def compiling() -> bool:
    """Whether ``torch.compile`` is tracing this code."""
    return bool(getattr(torch.compiler, "is_compiling", lambda: False)())


def recomputing() -> bool:
    """Whether a forward runs inside a backward pass: activation checkpointing recomputing it.

    Both forms of ``torch.utils.checkpoint`` recompute from within autograd's engine (the
    reentrant form in its backward, the non-reentrant form in a saved-tensor unpack hook), and
    an ordinary forward never runs there. Eager only (False under ``torch.compile``, where the
    partitioner, not this module, decides what is recomputed).

    Example:
        >>> from fp8boost.fp8.recompute import recomputing
        >>> recomputing()
        False
    """
    return not compiling() and torch._C._current_graph_task_id() != -1


Replayed = Union[torch.Tensor, Fp8Tensor]  # a scale, or the cached cast the forward used


class DelayedReplayLog:
    """Delayed scaling: what each forward of this optimizer step cast its input and weight
    with, in order, so that activation recomputation repeats it.

    Recomputations of a layer run in the order of its forwards (one backward per forward;
    micro-batches in order, as gradient accumulation and pipeline schedules run them), so they
    replay first in, first out. The log is emptied at every optimizer step.
    """

    def __init__(self) -> None:
        self.active = False
        """Whether the forward under way runs with grad mode on (set by the layer before its
        autograd function, inside which grad mode is always off)."""
        self._epoch = -1
        self._items: dict[str, list] = {}
        self._replayed: dict[str, int] = {}

    def _current(self) -> None:
        epoch = _state.step_epoch()
        if epoch != self._epoch:
            self._epoch = epoch
            self._items = {"input": [], "weight": []}
            self._replayed = {"input": 0, "weight": 0}

    def remember(self, role: str, item: Replayed) -> None:
        """A forward (with grad enabled) cast ``role`` with this scale, or used this cast."""
        if not self.active:
            return  # no backward follows, so nothing is recomputed
        self._current()
        items = self._items[role]
        if len(items) < MAX_REMEMBERED:
            items.append(item)
            return
        _state.warn_once(("fp8-delayed-replay-log-full", role),
                         f"fp8boost: more than {MAX_REMEMBERED} forwards of one delayed-scaling "
                         "layer in one optimizer step; a recomputation of a later one casts "
                         "with the current scale")

    def replay(self, role: str) -> Optional[Replayed]:
        """What the forward this recomputation repeats used (None: nothing was recorded)."""
        self._current()
        k = self._replayed[role]
        if k < len(self._items[role]):
            self._replayed[role] = k + 1
            return self._items[role][k]
        _state.warn_once(("fp8-delayed-no-forward-scale", role),
                         "fp8boost: a delayed-scaling Fp8Linear is recomputed (activation "
                         "checkpointing) but its forward recorded no scale (a reentrant "
                         "checkpoint runs the forward under no_grad): it casts with the current "
                         "scale, so recomputed FP8 values can differ from the forward's. Use "
                         "use_reentrant=False, or the default tensorwise recipe")
        return None
