"""Training strategies for the Booster: one file per plugin.

``TorchDDPPlugin`` (DDP), ``LowLevelZeroPlugin`` (ZeRO-1/2), ``GeminiPlugin`` (ZeRO-3 on
FSDP2), ``TorchFSDPPlugin`` (plain FSDP2), ``HybridParallelPlugin`` (pipeline x tensor/sequence
parallel x ZeRO; with ``pp_size > 1`` a step is one ``booster.execute_pipeline`` call, with
1F1B, interleaved or zero-bubble V schedules).
"""
from .gemini_plugin import GeminiPlugin
from .hybrid_parallel_plugin import HybridParallelPlugin
from .low_level_zero_plugin import LowLevelZeroPlugin
from .moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from .plugin_base import Plugin, init_distributed
from .torch_ddp_plugin import TorchDDPPlugin
from .torch_fsdp_plugin import TorchFSDPPlugin

__all__ = ["Plugin", "TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelPlugin", "MoeHybridParallelPlugin", "init_distributed"]
