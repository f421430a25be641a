"""``colossalai.booster``: fp8boost's ``Booster`` and ``Plugin`` under Colossal-AI's path.

Example:
    >>> from fp8boost.colossal.booster import Booster
    >>> from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin
    >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))  # doctest: +SKIP
"""
from fp8boost.booster import Booster
from fp8boost.plugins import Plugin

__all__ = ["Booster", "Plugin"]
