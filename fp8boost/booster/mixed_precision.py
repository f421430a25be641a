"""``Booster(mixed_precision=...)``: the :class:`MixedPrecision` choice and the one-process
``LocalPlugin`` that trains it, both defined in ``fp8boost.plugins`` (this module keeps their
public path).

Example:
    >>> from fp8boost.booster.mixed_precision import MixedPrecision
    >>> MixedPrecision("bf16").precision
    'bf16'
"""
from fp8boost.plugins.local_plugin import LocalPlugin
from fp8boost.plugins.mixed_precision import MixedPrecision

__all__ = ["LocalPlugin", "MixedPrecision"]
