"""``TritonBackend``: fused Triton cast kernels and the persistent FP8 GEMM behind Fp8Backend.

Selected by ``get_backend("triton", device)`` (and by ``auto`` on sm89+). Eager calls go straight
to the Python launchers in :mod:`.cast` and :mod:`.gemm` (a config-cache lookup and one or two
kernel launches); under ``torch.compile`` the same kernels are reached through the custom ops of
:mod:`.ops`, which the compiler can trace, and the GEMM of static-shape graphs through
:mod:`.gemm_direct` (kernel chosen at trace time, launched by inductor).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..backend_base import Fp8Backend
from ..recompute import compiling as _compiling
from ..scaling import Fp8Tensor
from . import cast, gemm, gemm_direct, ops


class TritonBackend(Fp8Backend):
    """FP8 casts and GEMMs as Triton kernels (CUDA, sm89+; TMA on sm90).

    Example:
        >>> from fp8boost.fp8.backends import get_backend
        >>> be = get_backend("triton", torch.device("cuda"))
        >>> x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
        >>> w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        >>> xq, _ = be.quantize(x, torch.float8_e4m3fn, with_transpose=True)
        >>> wq, _ = be.quantize(w, torch.float8_e4m3fn)
        >>> y = be.mm(xq.data, wq.data, xq.inv_scale, wq.inv_scale, use_fast_accum=True)
    """

    name = "triton"

    def __init__(self, allow_cublas: bool = True) -> None:
        # Measured per-shape dispatch: when a GEMM shape is first seen, torch._scaled_mm is
        # timed alongside the Triton configs and kept only if it was faster (see gemm.mm and
        # bench/gemm.py for the measured cases). False = always the Triton GEMM.
        self.allow_cublas = allow_cublas

    def quantize(self, x: torch.Tensor, dtype: torch.dtype, *, scale: Optional[torch.Tensor] = None,
                 margin: int = 0, power_of_2: bool = False,
                 with_transpose: bool = False) -> tuple[Fp8Tensor, torch.Tensor]:
        """Fused amax + scale + saturating cast (+ transposed copy); see :func:`cast.quantize`."""
        if _compiling():
            data, data_t, inv, a = ops.quantize(x, dtype, scale, int(margin), bool(power_of_2),
                                                bool(with_transpose))
            return Fp8Tensor(data, inv, data_t if with_transpose else None), a
        r = cast.quantize(x, dtype, scale, margin, power_of_2, with_transpose)
        return Fp8Tensor(r.data, r.inv_scale, r.data_t), r.amax

    def mm(self, a: torch.Tensor, b: torch.Tensor, a_inv_scale: torch.Tensor,
           b_inv_scale: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.bfloat16, use_fast_accum: bool = False) -> torch.Tensor:
        """``a[M,K] @ b[N,K].T * a_inv * b_inv (+ bias)``; see :func:`gemm.mm`."""
        if _compiling():
            # The kernel is chosen at trace time and launched by inductor's wrapper
            # (gemm_direct: less CPU per call); symbolic shapes keep the dispatching op.
            return gemm_direct.compiled_mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype,
                                           bool(use_fast_accum), self.allow_cublas)
        return gemm.mm(a, b, a_inv_scale, b_inv_scale, bias, out_dtype, use_fast_accum,
                       allow_cublas=self.allow_cublas)
