"""``colossalai.booster.plugin``: fp8boost's five plugins under Colossal-AI's path.

Example:
    >>> from fp8boost.colossal.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
"""
from fp8boost.plugins import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, Plugin,
                              TorchDDPPlugin, TorchFSDPPlugin)

__all__ = ["Plugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelPlugin"]
