"""The elementwise work of one chunk of the fused lm_head + loss: log-sum-exp, target logit and
the logit gradient, each one pass over the chunk's logits.

Run op by op, a chunk's ``[c, V]`` logits go through about ten full passes (an FP32 copy, the
two of ``logsumexp``, subtract, exp, scale, scatter, round to BF16): ~5.8 GB of traffic per
1024-token chunk at a 128k vocabulary, ~12 ms a step at 8192 tokens on an H200, as much time as
the head's BF16 weight-gradient GEMM. Compiled, :func:`chunk_stats` reads the GEMM's BF16
logits twice (max, then the sum of exponentials) and :func:`chunk_grad` reads them once and
writes the gradient once; the FP32 logits never exist.

On CUDA each is ``torch.compile``-d once per process (:func:`run`), unless already inside a
compiled graph (dynamo then inlines the plain function). Elsewhere (CPU tests, no Triton) the
plain functions run; they are the same math.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from fp8boost import _state

__all__ = ["chunk_grad", "chunk_stats", "run"]

logger = logging.getLogger("fp8boost.loss")


def _transform(z: torch.Tensor, logit_scale: float, softcap: Optional[float]):
    """The model's logits in FP32 from the GEMM output, and ``d logits / d z`` (None: 1)."""
    x = z.float()
    if logit_scale != 1.0:
        x = x * logit_scale
    if softcap is None:
        return x, (logit_scale if logit_scale != 1.0 else None)
    t = torch.tanh(x / softcap)
    return t * softcap, (1.0 - t * t) * logit_scale  # d/dz of softcap * tanh(scale * z / softcap)


def chunk_stats(z: torch.Tensor, target: torch.Tensor, on_slice: torch.Tensor,
                logit_scale: float, softcap: Optional[float]):
    """Per token of the chunk: FP32 log-sum-exp over this rank's vocabulary and the target's
    logit (0 where the target is not on this rank's slice or the token is ignored)."""
    x, _ = _transform(z, logit_scale, softcap)
    picked = torch.where(on_slice, x.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)
    return torch.logsumexp(x, dim=1), picked


def chunk_grad(z: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, on_slice: torch.Tensor,
               weight_per_token: torch.Tensor, logit_scale: float, softcap: Optional[float],
               dtype: torch.dtype) -> torch.Tensor:
    """``d loss / d z`` of the chunk: ``(softmax - onehot) * weight_per_token`` (x the
    transform's slope), rounded to ``dtype`` once."""
    x, slope = _transform(z, logit_scale, softcap)
    p = torch.exp(x - lse.unsqueeze(1))
    # where(), not scatter_add_: a pointwise select fuses into the one pass
    cols = torch.arange(z.shape[1], device=z.device)
    hit = (cols.unsqueeze(0) == target.unsqueeze(1)) & on_slice.unsqueeze(1)
    p = torch.where(hit, p - 1.0, p) * weight_per_token.unsqueeze(1)
    if slope is not None:
        p = p * slope
    return p.to(dtype)


def _compiled(fn: Callable) -> Callable:
    # dynamic=False: a chunk has one or two shapes per model (the last chunk may be shorter).
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _wants_compile(z: torch.Tensor) -> bool:
    return z.is_cuda and not torch.compiler.is_compiling()


def run(fn: Callable, *args):
    """``fn(*args)``, compiled on CUDA (module docstring). A compile failure warns once, says
    why, and the plain function runs from then on."""
    if not _wants_compile(args[0]):
        return fn(*args)
    table = _state.cache("loss.chunk_ops")  # fn name -> its compiled (or plain) function
    use = table.get(fn.__name__)
    if use is not None:
        return use(*args)
    compiled = _compiled(fn)
    try:  # the first call compiles; only its failure falls back
        out = compiled(*args)
    except Exception as exc:  # noqa: BLE001 - any compile failure: the plain ops still work
        table[fn.__name__] = fn
        _state.warn_once(("loss-chunk-ops-eager", fn.__name__),
                         f"fp8boost: the fused loss's {fn.__name__} could not be compiled "
                         f"({type(exc).__name__}: {exc}); it runs op by op, slower and with an "
                         "FP32 copy of each chunk's logits")
        return fn(*args)
    table[fn.__name__] = compiled
    return out
