"""fp8boost's plugins taking Colossal-AI's arguments too, by keyword, in fp8boost's order.

Each class here subclasses its ``fp8boost.plugins`` namesake and adds, as keyword-only
arguments, what Colossal-AI v0.5.0's plugin takes and fp8boost's does not: it checks them,
maps them onto fp8boost's arguments (``mixed_precision`` -> ``precision``,
``zero_bucket_size_in_m`` -> ``reduce_bucket_size_in_m``, loss-scaling details -> the plugin's
``loss_scale_kwargs``, ...), logs once what a tuning value does not change, or refuses with the
alternative. Positional arguments keep fp8boost's order and defaults; the classes of
:mod:`fp8boost.colossal.booster.plugin` put Colossal-AI's order on top of these.

Example:
    >>> from fp8boost.colossal.booster.plugin.args import GeminiPlugin
    >>> GeminiPlugin(placement_policy="static", precision="bf16").precision
    'bf16'
"""
from .ddp import TorchDDPPlugin
from .fsdp import TorchFSDPPlugin
from .gemini import GeminiPlugin
from .hybrid import HybridParallelPlugin
from .low_level_zero import LowLevelZeroPlugin
from .moe import MoeHybridParallelPlugin

__all__ = ["TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin", "TorchFSDPPlugin",
           "HybridParallelPlugin", "MoeHybridParallelPlugin"]
