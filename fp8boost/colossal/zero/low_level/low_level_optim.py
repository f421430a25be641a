"""``colossalai.zero.low_level.low_level_optim``: ``LowLevelZeroOptimizer``, the class of the
optimizers that ZeRO-1/2 boosts return.

In Colossal-AI, ``LowLevelZeroPlugin`` and ``HybridParallelPlugin`` / ``MoeHybridParallelPlugin``
with ``zero_stage`` 1 or 2 return a ``LowLevelZeroOptimizer``. fp8boost's plugins return their
:class:`~fp8boost.parallel.zero.ZeroOptimizer` sharding the master weights and optimizer state
over a data-parallel group. ``isinstance(optimizer, LowLevelZeroOptimizer)`` holds for exactly
those: a ``ZeroOptimizer`` with a data-parallel group and stage 1 or 2. It does not hold for the
``ZeroOptimizer`` that only keeps one replica's master weights (``Booster(mixed_precision=...)``,
``TorchDDPPlugin`` in bf16/fp16: Colossal-AI's AMP optimizer there) or for ``zero_stage=0``
(nothing sharded: Colossal-AI's AMP/naive optimizer). Nothing is registered at import.

Example:
    >>> import torch
    >>> from fp8boost.booster import Booster
    >>> model = torch.nn.Linear(4, 4)
    >>> _, opt, *_ = Booster(mixed_precision="bf16", device="cpu").boost(
    ...     model, torch.optim.SGD(model.parameters()))
    >>> isinstance(opt, LowLevelZeroOptimizer)  # one replica's master weights: not ZeRO
    False
"""
from __future__ import annotations

from abc import ABCMeta
from typing import Any

from fp8boost.parallel.zero import ZeroOptimizer

__all__ = ["LowLevelZeroOptimizer", "is_low_level_zero"]


def is_low_level_zero(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ZeRO stage 1 or 2 over a data-parallel group (what
    Colossal-AI calls a ``LowLevelZeroOptimizer``)."""
    return (isinstance(optimizer, ZeroOptimizer) and optimizer.dp_group is not None
            and optimizer.stage in (1, 2))


class _ShardedOverDp(ABCMeta):
    """``isinstance(opt, LowLevelZeroOptimizer)`` also holds where :func:`is_low_level_zero`
    does (for that class itself: a subclass keeps plain subclass semantics)."""

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is LowLevelZeroOptimizer and is_low_level_zero(obj):
            return True
        return super().__instancecheck__(obj)


class LowLevelZeroOptimizer(ZeroOptimizer, metaclass=_ShardedOverDp):
    """Colossal-AI's ZeRO-1/2 optimizer: the optimizer ``booster.boost`` returns with
    ``LowLevelZeroPlugin``, and with ``HybridParallelPlugin`` / ``MoeHybridParallelPlugin`` at
    ``zero_stage`` 1 or 2, is one (see the module docstring). Its methods are
    :class:`~fp8boost.parallel.zero.ZeroOptimizer`'s, Colossal-AI's ``OptimizerWrapper``
    surface among them (``backward``, ``step``, ``clip_grad_by_norm``, ``state_dict``,
    ``get_param_grad``, ``working_to_master_param``, ...).

    Raises:
        TypeError: when built directly (``booster.boost`` builds it: boost the torch optimizer
            with ``LowLevelZeroPlugin(stage=...)``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("LowLevelZeroOptimizer is built by booster.boost(model, optimizer) with "
                        "LowLevelZeroPlugin(stage=1 or 2) (or HybridParallelPlugin(zero_stage=1 "
                        "or 2)); boost the plain torch optimizer instead of wrapping it")
