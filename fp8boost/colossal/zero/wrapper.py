"""``colossalai.zero.wrapper``: ``zero_model_wrapper`` / ``zero_optim_wrapper``, Colossal-AI's
pre-``Booster`` ZeRO entry points, importable and refused when called: boost the model and the
torch optimizer together with ``LowLevelZeroPlugin(stage=1 or 2)`` or ``GeminiPlugin()``
(ZeRO-3), which build both wrappers at once.

Example:
    >>> from fp8boost.colossal.zero import zero_model_wrapper
    >>> zero_model_wrapper(None)
    Traceback (most recent call last):
    ...
    NotImplementedError: zero_model_wrapper is not offered by fp8boost...
"""
from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["zero_model_wrapper", "zero_optim_wrapper"]


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is not offered by fp8boost: boost the plain model and torch optimizer "
        "together, model, optimizer, *_ = Booster(plugin=LowLevelZeroPlugin(stage=1 or 2)) or "
        "Booster(plugin=GeminiPlugin()) (ZeRO-3), then .boost(model, optimizer)")


def zero_model_wrapper(model: Any, zero_stage: int = 1, gemini_config: Any = None,
                       verbose: bool = False) -> NoReturn:
    """Refused (see the module docstring).

    Raises:
        NotImplementedError: always, naming the Booster plugins.
    """
    _refuse("zero_model_wrapper")


def zero_optim_wrapper(model: Any, optimizer: Any, initial_scale: float = 2 ** 16,
                       growth_factor: float = 2, backoff_factor: float = 0.5,
                       growth_interval: int = 1000, hysteresis: int = 2, min_scale: float = 1,
                       max_scale: float = 2 ** 32, max_norm: float = 0.0, norm_type: float = 2.0,
                       optim_config: Any = None, verbose: bool = False) -> NoReturn:
    """Refused (see the module docstring).

    Raises:
        NotImplementedError: always, naming the Booster plugins.
    """
    _refuse("zero_optim_wrapper")
