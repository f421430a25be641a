"""``colossalai.interface.optimizer``: ``OptimizerWrapper``, the class of boosted optimizers.

fp8boost's boosted optimizers (``ZeroOptimizer``, ``FsdpOptimizer`` and the plugins' own
``OptimizerWrapper``) all derive from ``OptimizerProxy``, whose methods are Colossal-AI's
(:mod:`fp8boost.parallel.optimizer_surface`); this class makes ``isinstance`` say so, without
registering anything at import (an ABC subclass hook).
"""
from __future__ import annotations

from abc import ABCMeta

import torch

from fp8boost.parallel.boosted_optimizer import OptimizerProxy
from fp8boost.parallel import wrappers

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(wrappers.OptimizerWrapper, metaclass=ABCMeta):
    """Colossal-AI's ``OptimizerWrapper``: every optimizer ``booster.boost`` returns is one.

    Built directly, it wraps a torch optimizer in one process without master weights
    (fp8boost's single-replica wrapper): ``backward``, ``step``, ``zero_grad``,
    ``clip_grad_by_norm`` / ``clip_grad_by_value``, ``get_grad_norm``, ``state_dict`` /
    ``load_state_dict`` (torch's), ``unwrap`` (the torch optimizer), ``param_groups``.
    Subclass it to add behaviour, as with Colossal-AI's.

    Args:
        optim: the torch optimizer to wrap.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(3, 1)
        >>> opt = OptimizerWrapper(torch.optim.SGD(layer.parameters(), lr=0.1))
        >>> opt.backward(layer(torch.ones(2, 3)).sum())
        >>> norm = opt.clip_grad_by_norm(1.0); opt.step(); opt.zero_grad()
        >>> opt.unwrap() is opt.optim
        True
    """

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        super().__init__(optim)

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        # Only for this class itself: a user's subclass keeps plain subclass semantics.
        if cls is OptimizerWrapper and issubclass(subclass, OptimizerProxy):
            return True
        return NotImplemented
