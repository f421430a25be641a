"""``colossalai.booster``: fp8boost's ``Booster`` and ``Plugin`` under Colossal-AI's path.

The submodules mirror Colossal-AI's: ``booster`` (the ``Booster``, with Colossal-AI's
positional order and defaults), ``plugin`` (the plugins), ``accelerator`` (``Accelerator``),
``mixed_precision`` (``MixedPrecision``).

Example:
    >>> from fp8boost.colossal.booster import Booster
    >>> from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin
    >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))  # doctest: +SKIP
"""
from .accelerator import Accelerator
from .booster import Booster, Plugin

__all__ = ["Accelerator", "Booster", "Plugin"]
