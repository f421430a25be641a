"""``CastSpy``: what a block of code all-reduces and which FP8 operands it casts.

Inside ``with CastSpy() as spy:`` every ``dist.all_reduce`` call is recorded as ``(op, numel)``
in ``spy.reduces`` and every cast of an ``Fp8Linear`` (its recipe strategy's ``quantize``,
tensorwise and delayed) as ``(id(layer.casts), role)`` in ``spy.casts``.
"""
from __future__ import annotations

import torch.distributed as dist

from fp8boost.fp8.casts import DelayedCasts, TensorwiseCasts


class CastSpy:
    """Records ``dist.all_reduce`` calls and the layers' FP8 casts (see the module docstring)."""

    _CLASSES = (TensorwiseCasts, DelayedCasts)

    def __init__(self) -> None:
        self.reduces: list[tuple] = []
        self.casts: list[tuple[int, str]] = []
        self._ar = dist.all_reduce
        self._qs = [cls.__dict__["quantize"] for cls in self._CLASSES]

    def __enter__(self) -> "CastSpy":
        spy, ar = self, self._ar

        def all_reduce(*a, **k):
            t = a[0] if a else k["tensor"]
            op = k.get("op", a[1] if len(a) > 1 else dist.ReduceOp.SUM)
            spy.reduces.append((op, t.numel()))
            return ar(*a, **k)

        def spying(quantize):
            def spied(casts, role, *a, **k):
                spy.casts.append((id(casts), role))
                return quantize(casts, role, *a, **k)
            return spied

        dist.all_reduce = all_reduce
        for cls, quantize in zip(self._CLASSES, self._qs):
            cls.quantize = spying(quantize)
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._ar
        for cls, quantize in zip(self._CLASSES, self._qs):
            cls.quantize = quantize
