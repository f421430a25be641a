"""FP8 compute backends: who casts and who multiplies.

Every backend implements the same two operations, in the "NT" form Hopper tensor cores need
(both GEMM operands K-major, i.e. row-major with K as the last dim):

  quantize(x[R,C])  -> (Fp8Tensor(data[R,C], inv_scale, data_t[C,R] if asked), amax)
  mm(a[M,K], b[N,K]) -> a @ b.T * a_inv_scale * b_inv_scale (+ bias), in out_dtype

Backends: ``emulated`` (reference; any device), ``cublas`` (``torch._scaled_mm``), ``triton``
(fused kernels in ``fp8boost.fp8.kernels``, imported only when selected).
"""
from __future__ import annotations

from typing import Optional

import torch

from fp8boost import _state
from fp8boost._state import probe, warn_once  # noqa: F401 - warn_once is re-exported

from .backend_base import Fp8Backend
from .scaling import cast_result

class EmulatedBackend(Fp8Backend):
    """Exact FP8 rounding, FP32 matmul of the dequantized operands. Runs anywhere."""

    name = "emulated"

    def mm(self, a, b, a_inv_scale, b_inv_scale, *, bias=None, out_dtype=torch.bfloat16,
           use_fast_accum=False):
        out = (a.float() * a_inv_scale) @ (b.float() * b_inv_scale).t()
        if bias is not None:
            out = out + bias.float()
        return cast_result(out, out_dtype)  # FP32 layers: no no-op .to (see cast_result)


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    # fp8 tensors cannot be zero-padded by F.pad on every torch: go through uint8.
    out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
    out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
    return out.view(t.dtype)


def _ceil16(n: int) -> int:
    return (n + 15) // 16 * 16


class CublasBackend(Fp8Backend):
    """``torch._scaled_mm`` (cuBLASLt). Pads any dim that is not a multiple of 16 with zeros."""

    name = "cublas"

    def mm(self, a, b, a_inv_scale, b_inv_scale, *, bias=None, out_dtype=torch.bfloat16,
           use_fast_accum=False):
        m, k = a.shape
        n = b.shape[0]
        mp, kp, np_ = _ceil16(m), _ceil16(k), _ceil16(n)
        a_p = _pad_to(a, mp, kp)
        b_p = _pad_to(b, np_, kp)
        fuse_bias = bias is not None and out_dtype == torch.bfloat16 and bias.dtype == out_dtype \
            and np_ == n
        out = torch._scaled_mm(a_p, b_p.t(), scale_a=a_inv_scale.float(),
                               scale_b=b_inv_scale.float(), bias=bias if fuse_bias else None,
                               out_dtype=out_dtype, use_fast_accum=use_fast_accum)
        if (mp, np_) != (m, n):
            out = out[:m, :n]
        if bias is not None and not fuse_bias:
            out = (out.float() + bias.float()).to(out_dtype)
        return out


def _triton_backend() -> Optional[Fp8Backend]:
    try:
        from .kernels.backend import TritonBackend  # noqa: WPS433 (lazy: imports triton)
    except ImportError as exc:  # triton missing, or the kernels module not available
        warn_once("triton-import", f"fp8boost: triton backend unavailable ({exc})")
        return None
    return TritonBackend()


def _fp8_tensor_cores(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    return bool(probe(f"fp8-tensor-cores-cuda:{idx}",
                      lambda: torch.cuda.get_device_capability(idx) >= (8, 9)))


def get_backend(name: str, device: torch.device) -> Fp8Backend:
    """Resolve a backend name for a device; ``auto`` picks the fastest that works there.

    Fallbacks are never silent: each one warns once, saying why.
    """
    device = torch.device(device)
    if name == "auto":
        if _fp8_tensor_cores(device):
            name = "triton"
        else:
            why = ("no CUDA device" if device.type != "cuda" else
                   f"GPU capability {torch.cuda.get_device_capability(device)} < sm89")
            warn_once(f"auto-emulated-{why}",
                      f"fp8boost: FP8 tensor cores unavailable ({why}); using the 'emulated' "
                      "backend: FP8 numerics, no speed-up")
            name = "emulated"
    if name in ("triton", "cublas") and not _fp8_tensor_cores(device):
        raise ValueError(f"backend {name!r} needs a CUDA GPU with FP8 tensor cores (sm89+), got "
                         f"{device}; use backend='emulated' or 'auto'")
    backends = _state.cache("fp8.backends")  # name -> the process's one instance of it
    if name not in backends:
        if name == "triton":
            backend = _triton_backend()
            if backend is None:
                warn_once("triton-fallback", "fp8boost: falling back to the 'cublas' backend")
                return get_backend("cublas", device)
        elif name == "cublas":
            backend = CublasBackend()
        elif name == "emulated":
            backend = EmulatedBackend()
        else:
            raise ValueError(f"unknown FP8 backend {name!r}; use auto|triton|cublas|emulated")
        backends[name] = backend
    return backends[name]
