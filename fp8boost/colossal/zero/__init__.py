"""``colossalai.zero``: the classes of the optimizers and models that the ZeRO plugins boost.

``isinstance(optimizer, LowLevelZeroOptimizer)`` holds for the optimizer ``LowLevelZeroPlugin``
boosts (and ``HybridParallelPlugin`` / ``MoeHybridParallelPlugin`` at ``zero_stage`` 1 or 2);
``GeminiDDP`` / ``GeminiOptimizer`` for what ``GeminiPlugin`` boosts. Built directly, and
Colossal-AI's pre-``Booster`` helpers (``zero_model_wrapper``, ``zero_optim_wrapper``,
``get_static_torch_model``), they raise, naming the ``Booster`` call that replaces them.

Example:
    >>> from fp8boost.colossal.zero import LowLevelZeroOptimizer
"""
from .gemini import GeminiAdamOptimizer, GeminiDDP, GeminiOptimizer, get_static_torch_model
from .low_level import LowLevelZeroOptimizer
from .wrapper import zero_model_wrapper, zero_optim_wrapper

__all__ = ["GeminiDDP", "GeminiOptimizer", "GeminiAdamOptimizer", "zero_model_wrapper",
           "zero_optim_wrapper", "LowLevelZeroOptimizer", "get_static_torch_model"]
