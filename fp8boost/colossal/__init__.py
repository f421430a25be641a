"""Colossal-AI's module paths over fp8boost: a Colossal-AI script runs after one import edit.

The whole edit is ``import colossalai`` -> ``import fp8boost.colossal as colossalai`` and
``from colossalai.X import Y`` -> ``from fp8boost.colossal.X import Y``. Every name here keeps
Colossal-AI's signature and semantics and is a thin name over fp8boost's own classes (the
Booster and plugins are fp8boost's, re-exported), never a second implementation.

Importing this package does nothing: no torch import, no device probe, no environment read.
``launch_from_torch``/``launch`` and the submodules load on first access.

Example:
    >>> import fp8boost.colossal as colossalai
    >>> callable(colossalai.launch_from_torch)
    True
"""
from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("accelerator", "booster", "checkpoint_io", "cluster", "initialize", "interface",
               "lazy", "logging", "nn", "pipeline", "quantization", "shardformer", "testing",
               "utils", "zero")
_INITIALIZE = ("launch", "launch_from_torch")

__all__ = [*_INITIALIZE, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562): `import fp8boost.colossal` stays free of torch and of side effects.
    if name in _INITIALIZE:
        return getattr(importlib.import_module(f"{__name__}.initialize"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
