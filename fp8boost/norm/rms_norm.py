"""HF's Llama-family RMSNorm through torch's fused ``F.rms_norm`` in eager mode.

HF writes ``LlamaRMSNorm`` (and Mistral's, Mixtral's, Qwen2/3's, DeepSeek-V3's, ... the same
code) as plain torch ops: an FP32 upcast, a square, a mean, an rsqrt, two multiplies and a
downcast, each its own kernel in eager mode, forward and backward, each reading or writing the
whole ``[tokens, hidden]`` activation. ``torch.nn.functional.rms_norm`` computes the same
normalisation in one call (``aten._fused_rms_norm`` where torch has a fused kernel for the
device). Under ``torch.compile`` the model's own forward runs: inductor fuses it already, and
fuses the FP8 casts of the layers that read the norm's output into it.

Numerics: HF rounds the normalised value to the input dtype and then multiplies by the weight
(rounding again); ``F.rms_norm`` rounds the product once. Outputs differ by at most a unit in
the last place of the output dtype where HF's first rounding moved the value; both are within
two roundings of the exact result.

Which modules: those whose forward, called on a probe input, gives exactly what Llama's formula
gives (``y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, the FP32 math of HF's code).
A norm with another formula (Gemma's ``1 + weight``, OLMo-2's order of operations) fails the
probe and keeps its own forward; :class:`FusedNormReport` says which and why.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fp8boost import _state

__all__ = ["FusedForward", "FusedNormReport", "install_fused_rms_norms", "llama_rms_norm"]

_LOG = logging.getLogger("fp8boost.norm")


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm.forward`` as a function (the formula the probe checks against).

    Example:
        >>> y = llama_rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
        >>> tuple(y.shape)
        (2, 8)
    """
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


@dataclass(frozen=True)
class FusedNormReport:
    """What :func:`install_fused_rms_norms` did to a model."""

    fused: tuple[str, ...] = ()
    """Qualified names of the modules that now run ``F.rms_norm`` in eager mode."""
    kept: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Qualified name -> why it keeps its own forward, for modules named ``*RMSNorm``."""


def _epsilon(module: nn.Module) -> Optional[float]:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def _why_not(module: nn.Module) -> Optional[str]:
    """Why ``module`` cannot take the fused forward (None: it can)."""
    weight, eps = getattr(module, "weight", None), _epsilon(module)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
        return "no 1-D weight parameter"
    if eps is None:
        return "no float variance_epsilon / eps attribute"
    if getattr(module, "bias", None) is not None:
        return "it has a bias"
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return "its forward takes more than the hidden states"
    if weight.device.type == "meta":
        return "its weight is on the meta device (install after the weights are loaded)"
    # The probe: a small input with outliers, in the weight's dtype and on its device, through
    # the class's own forward and through Llama's formula; the module's RNG-free math must
    # agree bit for bit, so a norm with another formula keeps its own.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.numel(), generator=g) * torch.tensor([[1.0], [30.0], [1e-3], [5.0]])
    x = x.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        try:
            own = type(module).forward(module, x)
        except Exception as exc:  # noqa: BLE001 (a forward that cannot run the probe: keep it)
            return f"its forward failed on a probe input ({type(exc).__name__}: {exc})"
        if not isinstance(own, torch.Tensor) or not torch.equal(own, llama_rms_norm(x, weight,
                                                                                    eps)):
            return "its forward is not Llama's RMSNorm formula (checked on a probe input)"
    return None


def _fused_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if torch.compiler.is_compiling():  # inductor fuses the model's own ops (and FP8 casts)
        return type(module).forward(module, hidden_states)
    if hidden_states.dtype != weight.dtype:
        _state.warn_once(("fused-rms-norm-dtype", type(module).__name__, hidden_states.dtype,
                          weight.dtype),
                         f"fp8boost: {type(module).__name__} runs its own forward: its input is "
                         f"{hidden_states.dtype} and its weight {weight.dtype}, which "
                         "F.rms_norm does not mix (cast the model to one dtype)")
        return type(module).forward(module, hidden_states)
    return F.rms_norm(hidden_states, (weight.numel(),), weight, _epsilon(module))


class FusedForward:
    """The ``forward`` an installed module holds: a plain object (not a bound method of a
    local function), so that the model still pickles (``torch.save``) and deep-copies."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _fused_forward(self.module, hidden_states)


def install_fused_rms_norms(model: nn.Module) -> FusedNormReport:
    """Run every Llama-formula RMSNorm of ``model`` through ``F.rms_norm`` in eager mode.

    Per module, in place: the instance's ``forward`` is replaced, so its class, parameters,
    ``state_dict`` keys and hooks stay as they were (``isinstance`` still holds). Idempotent.
    Under ``torch.compile`` the module's own forward runs. Call it after the weights are
    loaded (the check runs the module once on a probe input, on the weight's device).

    Args:
        model: any module; its submodules whose class name ends with ``RMSNorm`` are checked.

    Returns:
        :class:`FusedNormReport`: the modules fused and, for the others named ``*RMSNorm``,
        why not (also logged once at INFO).

    Example:
        >>> from transformers.models.llama.modeling_llama import LlamaRMSNorm
        >>> model = nn.Sequential(LlamaRMSNorm(8), nn.Linear(8, 8))
        >>> install_fused_rms_norms(model).fused
        ('0',)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"install_fused_rms_norms takes an nn.Module, got {type(model).__name__}")
    fused, kept = [], {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("RMSNorm"):
            continue
        if isinstance(module.__dict__.get("forward"), FusedForward):
            fused.append(name)
            continue
        why = _why_not(module)
        if why is not None:
            kept[name] = why
            _state.log_once(_LOG, ("fused-rms-norm-kept", type(module).__name__, why),
                            f"fp8boost: {type(module).__name__} keeps its own forward: {why}")
            continue
        module.forward = FusedForward(module)
        fused.append(name)
    return FusedNormReport(tuple(fused), MappingProxyType(kept))
