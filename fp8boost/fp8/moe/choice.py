"""Which precision an expert module trains in on a GPU: measured once per shape, cached on disk.

An FP8 grouped GEMM is not faster than BF16 at every expert shape: with many narrow experts
(Qwen3-30B-A3B: 128 x 768) torch's FP8 K-grouped weight-gradient GEMM ran at 0.21-0.31x
BF16's on an H200 (issue 34). So on the GPU backend the experts time the candidates below on
their own shape, once, and train in the fastest (all-FP8 handicapped: :data:`HANDICAP`):

* ``fp8``: the three grouped GEMMs in FP8;
* ``fp8_wgrad_hp``: forward and input gradient in FP8, the weight gradient in BF16
  (``Fp8Config.expert_wgrad="high_precision"``);
* ``bf16``: the HF module's own BF16 experts (transformers' ``grouped_mm``), offered only under
  the library's default filter (``Fp8Config.min_numel=None``): an explicit ``min_numel``
  (``0`` included) forces FP8, as it does for linear layers.

``Fp8Config.expert_wgrad`` narrows the FP8 candidates (``fp8`` or ``high_precision`` offer one;
``auto`` both). Each candidate runs one forward + backward of the whole module (both
projections, the activation, routing and combine) on :data:`TOKENS` random tokens routed
evenly to ``top_k`` experts, in the weights' dtype; the winner is cached per (experts, hidden,
width, top-k, dtype, device) in the kernel-decision files of
:mod:`fp8boost.fp8.kernels.tuning` (``autotune-moe-precision-<gpu>...json``), so later runs on
the same machine skip the timing. Decisions are logged once: keeping BF16 warns, saying why.

Off the GPU backend (CPU, ``emulated``) nothing is timed: ``fp8`` unless ``expert_wgrad`` is
``high_precision``.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Callable

import torch
from torch import nn

from ... import _state
from ..kernels.tuning import ConfigCache

# forward(experts, x, top_k_index, top_k_weights, precision, device) -> y: the experts module's
# forward in a given precision, handed in by the module (this file never imports it).
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, str, torch.device],
                   torch.Tensor]

TOKENS = 8192
"""Tokens of the timed forward + backward (a micro-batch of 2 x 4096 or 4 x 2048)."""

PRECISIONS = ("fp8", "fp8_wgrad_hp", "bf16")
HANDICAP = MappingProxyType({"fp8": 1.05})
"""All-FP8 must time 5% faster than the others to be chosen. On an H200 the module timing put
it 1.4% ahead of the BF16 weight gradient at Mixtral-8x7B's shape (33.3 against 33.8 ms),
while in the compiled training step the BF16 weight gradient was the faster (1.044-1.058x BF16
against 1.027x; ``bench/results/moe_step_h200_*_2026-11-28.json``) and is the numerically
safer one: a near tie goes to it."""
_CACHE = ConfigCache("moe-precision")
_LOG = logging.getLogger("fp8boost.fp8.moe")


def candidates(config, backend: str) -> list[str]:
    """The precisions offered to the experts under ``config`` on ``backend``.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> candidates(Fp8Config(), "scaled_grouped_mm")
        ['fp8', 'fp8_wgrad_hp', 'bf16']
        >>> candidates(Fp8Config(min_numel=0, expert_wgrad="fp8"), "scaled_grouped_mm")
        ['fp8']
        >>> candidates(Fp8Config(), "emulated")
        ['fp8']
    """
    if backend != "scaled_grouped_mm":
        return ["fp8_wgrad_hp" if config.expert_wgrad == "high_precision" else "fp8"]
    out = [p for p, w in (("fp8", "fp8"), ("fp8_wgrad_hp", "high_precision"))
           if config.expert_wgrad in ("auto", w)]
    if config.min_numel is None:
        out.append("bf16")
    return out


def top_k_of(experts: nn.Module) -> int:
    """The experts per token of the module's model config (2 if it carries none)."""
    cfg = getattr(experts.hf_module, "config", None)
    k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", None)
    return int(k) if isinstance(k, int) and 0 < k <= experts.spec.num_experts else 2


def choose(experts: nn.Module, device: torch.device, backend: str, forward: Forward) -> str:
    """The precision ``experts`` (an ``Fp8Experts``) train in on ``device`` (one of
    :data:`PRECISIONS`), timing ``forward`` in each candidate precision."""
    cands = candidates(experts.fp8_config, backend)
    if len(cands) == 1:
        return cands[0]
    spec = experts.spec
    weight = getattr(experts, spec.gate_up)
    k = top_k_of(experts)
    # "handicap-fp8-1.05": decisions stored before the handicap are timed again.
    key = (spec.num_experts, spec.hidden, spec.intermediate, k, weight.dtype,
           "handicap-fp8-1.05", device.index)
    try:
        run = _timed_step(experts, device, k, forward)
        choice = _CACHE.pick(key, cands, run, handicap=HANDICAP)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory in every candidate
        cause = exc.__cause__ or exc
        _state.warn_once(("moe-precision-failed", key),
                         f"fp8boost: could not time the experts' precision at {key} "
                         f"({type(cause).__name__}: {str(cause)[:200]}); they train in "
                         f"{cands[0]}")
        return cands[0]
    _report(key, choice, _CACHE.timings.get(key), device)
    return choice


def _report(key, choice: str, timings, device: torch.device) -> None:
    e, h, i, k = key[:4]
    what = f"experts (E={e}, hidden={h}, width={i}, top-{k})"
    ms = ", ".join(f"{c} {t:.2f} ms" for c, t in timings) if timings else "a cached decision"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    if choice == "bf16":
        _state.warn_once(("moe-precision-bf16", key),
                         f"fp8boost: {what} keep BF16 on {where}: FP8 measured slower at this "
                         f"shape ({ms} per forward+backward of {TOKENS} tokens). "
                         "Fp8Config(min_numel=0) forces FP8")
    else:
        _state.log_once(_LOG, ("moe-precision", key),
                        f"fp8boost: {what} train in {choice} on {where} ({ms})",
                        level=logging.INFO)


def _timed_step(experts: nn.Module, device: torch.device, k: int, forward: Forward):
    """``run(precision)``: one forward + backward of the module on random routed tokens.

    Gradients come back from ``torch.autograd.grad`` (never accumulated into ``.grad``).
    """
    spec = experts.spec
    w_up, w_down = getattr(experts, spec.gate_up), getattr(experts, spec.down)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(TOKENS, spec.hidden, device=device, dtype=w_up.dtype, generator=g)
    scores = torch.rand(TOKENS, spec.num_experts, device=device, generator=g)
    idx = scores.topk(k, dim=-1).indices
    weights = torch.rand(TOKENS, k, device=device, generator=g).softmax(-1).to(w_up.dtype)
    dy = torch.randn_like(x)
    params = [p for p in (w_up, w_down) if p.requires_grad]

    def run(precision: str) -> None:
        xg = x.detach().requires_grad_()
        y = forward(experts, xg, idx, weights, precision, device)
        torch.autograd.grad(y, [xg, *params], dy)

    return run
