"""``colossalai.quantization``: Colossal-AI's FP8 modules, implemented by fp8boost.

Submodules, loaded on first access (importing this package imports nothing, torch included):

* :mod:`.fp8`: casts, FP8 collectives, DDP/FSDP communication hooks, ``linear_fp8``;
* :mod:`.fp8_hook`: ``FP8Hook``, which routes ``F.linear`` to ``linear_fp8``;
* :mod:`.utils`: ``patch_fsdp_params_comm_hook`` (a parameter hook for torch's FSDP1).

Colossal-AI's bitsandbytes quantization (``quantize_model``, ``BnbQuantizationConfig``, from
this package's ``__init__``) is not provided: importing those names raises an ImportError
that says so.

Example:
    >>> from fp8boost.colossal.quantization import fp8
    >>> callable(fp8.all_reduce_fp8)
    True
"""
from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("fp8", "fp8_hook", "utils")
_NOT_PROVIDED = ("quantize_model", "BnbQuantizationConfig")

__all__ = list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    # Lazy (PEP 562), as fp8boost.colossal itself: no torch import until a submodule is used.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NOT_PROVIDED:
        # An ImportError (not AttributeError) so `from ... import quantize_model` shows this.
        raise ImportError(f"colossalai.quantization.{name} (bitsandbytes 4/8-bit quantization) "
                          "is not provided by fp8boost.colossal; fp8boost quantizes training to "
                          "FP8 (plugins' use_fp8=True) and exports FP8 checkpoints "
                          "(fp8boost.export)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
