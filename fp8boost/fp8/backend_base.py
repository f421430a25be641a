"""The FP8 backend interface, apart from the registry so kernel modules can subclass it.

``backends.py`` resolves names to backends and imports ``kernels/backend.py`` lazily; both
import this module and neither imports the other at module level.
"""
from __future__ import annotations

from typing import Optional

import torch

from .scaling import Fp8Tensor, amax, cast_to_fp8, scale_from_amax


class Fp8Backend:
    """Base class: the reference (torch-op) quantize, subclasses supply ``mm``."""

    name = "base"

    def quantize(self, x: torch.Tensor, dtype: torch.dtype, *, scale: Optional[torch.Tensor] = None,
                 margin: int = 0, power_of_2: bool = False,
                 with_transpose: bool = False) -> tuple[Fp8Tensor, torch.Tensor]:
        """Cast a 2-D tensor; ``scale=None`` means current scaling from this tensor's amax.

        Returns the FP8 tensor and the amax of ``x`` (delayed scaling records it).
        """
        a = amax(x)
        if scale is None:
            scale = scale_from_amax(a, dtype, margin, power_of_2)
        data = cast_to_fp8(x, scale, dtype)
        data_t = data.t().contiguous() if with_transpose else None
        return Fp8Tensor(data, scale.reciprocal(), data_t), a

    def mm(self, a: torch.Tensor, b: torch.Tensor, a_inv_scale: torch.Tensor,
           b_inv_scale: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False) -> torch.Tensor:
        raise NotImplementedError
