"""``colossalai.zero.low_level``: ``LowLevelZeroOptimizer`` (see :mod:`.low_level_optim`).

Example:
    >>> from fp8boost.colossal.zero.low_level import LowLevelZeroOptimizer
"""
from .low_level_optim import LowLevelZeroOptimizer

__all__ = ["LowLevelZeroOptimizer"]
