"""``colossalai.booster.plugin.moe_hybrid_parallel_plugin``: ``MoeHybridParallelPlugin``.

Example:
    >>> from fp8boost.colossal.booster.plugin.moe_hybrid_parallel_plugin import (
    ...     MoeHybridParallelPlugin)
"""
from fp8boost.colossal.booster.plugin import MoeHybridParallelPlugin

from .hybrid_parallel_plugin import HybridParallelModule

__all__ = ["MoeHybridParallelPlugin", "HybridParallelModule"]
