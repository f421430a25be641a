"""Public import path of the FP8 collectives (implemented in :mod:`fp8boost.parallel.comm`).

Example:
    >>> from fp8boost.parallel.fp8_comm import all_gather_fp8, reduce_scatter_fp8  # doctest: +SKIP
"""
from .comm.collectives import (Fp8Work, all_gather_fp8, all_gather_into_tensor_fp8,  # noqa: F401
                               all_reduce_fp8, all_to_all_fp8, irecv_fp8, isend_fp8, recv_fp8,
                               reduce_scatter_fp8, reduce_scatter_tensor_fp8, send_fp8)
from .comm.config import Fp8CommConfig  # noqa: F401

__all__ = ["Fp8Work", "Fp8CommConfig", "all_gather_fp8", "all_gather_into_tensor_fp8",
           "reduce_scatter_fp8", "reduce_scatter_tensor_fp8", "all_reduce_fp8", "all_to_all_fp8",
           "send_fp8", "recv_fp8", "isend_fp8", "irecv_fp8"]
