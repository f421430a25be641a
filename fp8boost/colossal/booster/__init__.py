"""``colossalai.booster``: fp8boost's ``Booster`` and ``Plugin`` under Colossal-AI's path.

``Booster`` keeps Colossal-AI's positional order ``(device, mixed_precision, plugin)``
(fp8boost's own is ``(plugin, mixed_precision, device)``); keyword calls are the same.

Example:
    >>> from fp8boost.colossal.booster import Booster
    >>> from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin
    >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))  # doctest: +SKIP
"""
from fp8boost import booster as _booster
from fp8boost.colossal.positional import with_colossal_order
from fp8boost.plugins import Plugin

Booster = with_colossal_order(_booster.Booster, ("device", "mixed_precision", "plugin"))

__all__ = ["Booster", "Plugin"]
