"""Training strategies for the Booster: one file per plugin.

GeminiPlugin, HybridParallelPlugin and TorchFSDPPlugin arrive in later releases.
"""
from .low_level_zero_plugin import LowLevelZeroPlugin
from .plugin_base import Plugin, init_distributed
from .torch_ddp_plugin import TorchDDPPlugin

__all__ = ["Plugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "init_distributed"]
