"""The default size filter's threshold: :func:`min_numel_limit`, the one place that resolves
``Fp8Config.min_numel`` (read by the linear-layer conversion, :mod:`.convert`, and the experts',
:mod:`.moe.convert`; its own module so that neither imports the other).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from fp8boost import _state

from .config import DEFAULT_MIN_NUMEL, Fp8Config


def min_numel_limit(config: Fp8Config, numel: Optional[int] = None) -> int:
    """The ``min_numel`` the default filter applies: the one place that resolves the field.

    An explicit ``config.min_numel`` (any int, ``DEFAULT_MIN_NUMEL`` included) applies as given.
    ``None`` is the library default ``DEFAULT_MIN_NUMEL``, a speed rule, where FP8 can be fast
    (a hardware backend, or ``auto`` with an FP8 GPU here); without FP8 tensor cores (CPU,
    emulated) FP8 is asked for its numerics, which a size filter would silently take away from
    every small model: there the default is waived (0), logged once when a layer of ``numel``
    weight elements (the layer being filtered, if any) would have been kept by it.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> from fp8boost.fp8.config import DEFAULT_MIN_NUMEL
        >>> min_numel_limit(Fp8Config(backend="cublas")) == DEFAULT_MIN_NUMEL
        True
        >>> min_numel_limit(Fp8Config(backend="emulated", min_numel=DEFAULT_MIN_NUMEL))
        16777216
    """
    if config.min_numel is not None:
        return config.min_numel
    if config.backend in ("triton", "cublas") or (
            config.backend == "auto" and _fp8_gpu_present()):
        return DEFAULT_MIN_NUMEL
    if numel is not None and numel < DEFAULT_MIN_NUMEL:
        _state.log_once(logging.getLogger("fp8boost.fp8"), "min-numel-waived",
                        "fp8boost: no FP8 tensor cores (emulated FP8): the default size filter "
                        f"min_numel={DEFAULT_MIN_NUMEL} (a speed rule) is not applied, so every "
                        "eligible layer runs FP8 numerics; set min_numel explicitly to filter",
                        level=logging.INFO)
    return 0


def _fp8_gpu_present() -> bool:
    if not torch.cuda.is_available():
        return False
    return any(torch.cuda.get_device_capability(i) >= (8, 9)
               for i in range(torch.cuda.device_count()))
