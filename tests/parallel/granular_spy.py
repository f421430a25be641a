"""A spy shared by the block-scaled FP8 all-gather tests (FSDP2 and ZeRO)."""
from __future__ import annotations

import torch.distributed as dist


class GranularCastSpy:
    """Counts ``dist.all_reduce`` calls (``reduces``) and the rowwise/blockwise weight casts
    (``weight_casts``, through ``fp8boost.fp8.granular.function.quantize_with``) while active."""

    def __init__(self):
        import fp8boost.fp8.granular.function as fn
        self.fn, self.reduces, self.weight_casts = fn, 0, 0
        self._ar, self._q = dist.all_reduce, fn.quantize_with

    def __enter__(self):
        spy = self

        def all_reduce(*a, **k):
            spy.reduces += 1
            return spy._ar(*a, **k)

        def quantize(x, *a, weight, **k):
            spy.weight_casts += weight
            return spy._q(x, *a, weight=weight, **k)

        dist.all_reduce, self.fn.quantize_with = all_reduce, quantize
        return self

    def __exit__(self, *exc):
        dist.all_reduce, self.fn.quantize_with = self._ar, self._q
