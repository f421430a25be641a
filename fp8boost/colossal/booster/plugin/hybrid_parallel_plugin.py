"""``colossalai.booster.plugin.hybrid_parallel_plugin``: ``HybridParallelPlugin`` and
``HybridParallelModule``, the class of the models it boosts.

Example:
    >>> from fp8boost.colossal.booster.plugin.hybrid_parallel_plugin import (
    ...     HybridParallelModule, HybridParallelPlugin)
"""
from __future__ import annotations

from abc import ABCMeta
from typing import Any

from fp8boost import plugins as _plugins
from fp8boost.colossal.booster.plugin import HybridParallelPlugin
from fp8boost.colossal.interface import AMPModelMixin, ModelWrapper
from fp8boost.parallel import wrappers

__all__ = ["HybridParallelPlugin", "HybridParallelModule"]


class BoostedByMeta(ABCMeta):
    """``isinstance(model, cls)`` also holds for a model that a plugin of
    ``cls.plugin_classes`` boosted (``ModelWrapper.boosted_by``)."""

    plugin_classes: tuple[type, ...] = ()

    def __instancecheck__(cls, obj: Any) -> bool:
        boosted_by = getattr(obj, "boosted_by", None) if isinstance(
            obj, wrappers.ModelWrapper) else None
        if cls.plugin_classes and isinstance(boosted_by, type) \
                and issubclass(boosted_by, cls.plugin_classes):
            return True
        return super().__instancecheck__(obj)


class HybridParallelModule(ModelWrapper, AMPModelMixin, metaclass=BoostedByMeta):
    """Colossal-AI's class of the models ``HybridParallelPlugin`` (and the MoE plugin) boost:
    ``isinstance(model, HybridParallelModule)`` holds for those, and only those.

    Here ``module`` is the user's model with its layers split over tp in place (no
    ``DistributedDataParallel`` around it: gradients are reduced by the ZeRO optimizer), so
    ``model.module`` is the model itself; ``model.unwrap()`` is the portable way to reach it.

    Raises:
        TypeError: when built directly (``booster.boost`` builds it).
    """

    plugin_classes = (_plugins.HybridParallelPlugin, _plugins.MoeHybridParallelPlugin)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("HybridParallelModule is built by booster.boost(model, ...) with "
                        "HybridParallelPlugin; boost the plain model instead of wrapping it")
