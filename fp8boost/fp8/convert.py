"""Swap ``nn.Linear`` layers for ``Fp8Linear`` in place (and back), keeping Parameter objects.

Because the very same Parameter objects move into the new modules, an optimizer built before the
conversion keeps updating the right tensors, checkpoints keep their keys, and tied weights stay
tied. HF ``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, ...: a linear layer whose weight is
stored transposed, ``[in, out]``) becomes an :class:`Fp8Conv1D`, which keeps that layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import sys

import torch
from torch import nn

from fp8boost import _state

from .config import GRANULAR_RECIPES, Fp8Config
from .linear import Fp8Linear
from .linear_granular import granular_forward
from .matmul import Fp8Matmul
from .min_numel import min_numel_limit
from .moe import experts_back, experts_decision, is_fp8_experts
from .prequantized import Fp8WeightTensor, dequantize_weight
from .operands import OperandSource
from .record import Fp8Record, fp8_record, record_module
from .scaling import Fp8Tensor

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class ConversionReport:
    """What ``convert_to_fp8`` did: converted layer names, and skipped ones with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    already_fp8: list[str] = field(default_factory=list)
    """Layers that were FP8 before this call (a second conversion, or a boosted model)."""
    experts: list[str] = field(default_factory=list)
    """Fused-expert modules of MoE models now running grouped FP8 GEMMs (``fp8.moe``)."""
    record: Fp8Record = field(default_factory=Fp8Record)
    """Every FP8 module of the model after this call (converted now or before), by name, with
    its recipe: what downstream code reads (``fp8.record``; ``fp8_record(model)`` later)."""

    def __str__(self) -> str:
        lines = [f"fp8boost: converted {len(self.converted)} linear layer(s) and "
                 f"{len(self.experts)} expert module(s) to FP8, "
                 f"{len(self.already_fp8)} already in FP8, "
                 f"kept {len(self.skipped)} in high precision"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)

    def nothing_converted_advice(self, config: Fp8Config) -> str:
        """Why no layer runs FP8 and what to change: only advice that applies to ``config``."""
        reasons = sorted(set(self.skipped.values()))
        if not reasons:
            return ("the model has no nn.Linear or transformers Conv1D layer: FP8 applies to "
                    "linear layers only (convolutions, embeddings and norms stay as they are)")
        hints = []
        if any("min_numel" in r or "min_features" in r for r in reasons):
            hints.append("Fp8Config(min_numel=0) converts small layers anyway")
        if any("skip_module_names" in r for r in reasons):
            hints.append("Fp8Config(skip_module_names=()) converts the named layers too")
        if any("subclass" in r for r in reasons):
            hints.append("module_filter_fn=lambda m, name: True converts nn.Linear subclasses")
        hint = "; ".join(hints) or "these layers cannot run FP8 GEMMs"
        return (f"{'; '.join(reasons)}. Fix: {hint}. The Fp8Config goes to the plugin "
                "(Plugin(use_fp8=True, fp8_config=...)), to Booster(mixed_precision="
                "MixedPrecision('fp8', fp8_config)) without a plugin, or to "
                "convert_to_fp8(model, fp8_config) directly")


def _hf_conv1d_type() -> Optional[type]:
    """``transformers.pytorch_utils.Conv1D`` if transformers is already imported, else None.

    Never imports transformers itself (seconds): a model holding a Conv1D imported it already.
    """
    mod = sys.modules.get("transformers.pytorch_utils")
    return getattr(mod, "Conv1D", None) if mod is not None else None


def is_hf_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is an HF ``Conv1D`` (a linear layer with a ``[in, out]`` weight)."""
    conv1d = _hf_conv1d_type()
    return conv1d is not None and isinstance(module, conv1d)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or an HF Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: weight is [in, out]


LORA_ADAPTER_NAMES = frozenset(("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"))


def lora_adapter_reason(fqn: str) -> Optional[str]:
    """Why a peft LoRA adapter (``...q_proj.lora_A.default``) stays in high precision, else
    None. Checked before any filter: the frozen ``base_layer`` beside it converts, the small
    trainable adapters never do (their rank-r GEMMs gain nothing and their updates are small)."""
    if LORA_ADAPTER_NAMES.intersection(fqn.split(".")):
        return "LoRA adapter (lora_A/lora_B): trained in high precision, never FP8"
    return None


def skip_reason(module: nn.Module, fqn: str, config: Fp8Config) -> Optional[str]:
    """Why the default filter keeps this layer in high precision, or None to convert it."""
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in config.skip_module_names or fqn in config.skip_module_names:
        return "name is in skip_module_names (output head: keep full precision logits)"
    if type(module) is not nn.Linear and not is_hf_conv1d(module):
        # A subclass may change forward (LoRA, quantized layers): converting would drop that.
        return (f"{type(module).__name__} is an nn.Linear subclass with its own forward "
                "(converted only when module_filter_fn accepts it)")
    k, n = _features(module)
    if k % 16 or n % 16:
        return f"shape [{n}, {k}] has a dim not divisible by 16 (FP8 tensor-core alignment)"
    if min(k, n) < config.min_features:
        return f"a dim is below min_features={config.min_features} (too small to gain)"
    limit = min_numel_limit(config, k * n)
    if k * n < limit:
        return f"{k * n} weight elements < min_numel={limit} (too small to gain)"
    return None


class TransposedWeightSource(OperandSource):
    """Fp8Conv1D's operands: the GEMMs get ``weight.t()`` (``[out, in]``) of the stored
    ``[in, out]`` Parameter."""

    def is_direct(self, w: torch.Tensor) -> bool:
        # An FP8 all-gathered [in, out] weight is dequantized and re-cast here: the direct path
        # assumes Fp8Linear's [out, in] layout.
        return False

    def weight_operand(self, w: torch.Tensor, with_transpose: bool,
                       recompute: bool = False) -> Fp8Tensor:
        # The stored [in, out] weight cast with its transpose gives both operands: the [out, in]
        # forward operand is its transpose, and the [in, out] dgrad operand is the cast itself
        # (so there is nothing to re-cast in backward).
        wq = super().weight_operand(w.t(), with_transpose=True)
        return Fp8Tensor(wq.data_t, wq.inv_scale, wq.data)


class Fp8Conv1D(Fp8Linear):
    """FP8 replacement for HF ``transformers.pytorch_utils.Conv1D``: ``y = x @ W + b``.

    The weight keeps Conv1D's ``[in, out]`` layout and is the very same Parameter, so state_dict
    keys and shapes, ``from_pretrained``/``save_pretrained`` and optimizers are unaffected. The
    three GEMMs are Fp8Linear's: the weight's FP8 cast and its transpose simply swap roles.

    Example:
        >>> import torch
        >>> from transformers.pytorch_utils import Conv1D
        >>> from fp8boost.fp8 import Fp8Config
        >>> from fp8boost.fp8.convert import Fp8Conv1D
        >>> layer = Fp8Conv1D.from_conv1d(Conv1D(32, 64), Fp8Config(backend="emulated"))
        >>> layer.weight.shape, layer(torch.randn(2, 5, 64)).shape
        (torch.Size([64, 32]), torch.Size([2, 5, 32]))
    """

    source_cls = TransposedWeightSource

    @classmethod
    def from_conv1d(cls, conv: nn.Module, config: Optional[Fp8Config] = None) -> "Fp8Conv1D":
        """Build an Fp8Conv1D sharing ``conv``'s weight and bias Parameters (no copy)."""
        if conv.weight.dim() != 2:
            raise TypeError(f"expected a Conv1D with a 2-D weight, got {tuple(conv.weight.shape)}")
        k, n = conv.weight.shape
        config = config if config is not None else Fp8Config()
        with torch.device("meta"):  # nothing allocated: the Parameters come from conv
            new = cls(k, n, bias=conv.bias is not None, config=config)
        new.weight = conv.weight
        new.bias = conv.bias
        new.nx, new.nf = k, n  # HF code (e.g. head pruning) reads these
        new.delayed_buffers_on(conv.weight.device)
        new.train(conv.training)
        new.resolve_backend()
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Conv1D expected last dim {self.in_features}, got "
                             f"{tuple(x.shape)}")
        backend = self.resolve_backend(x.device)
        self.bind_delayed_buffers()  # the buffers may have been replaced since (.to())
        weight = self.weight
        if isinstance(weight, Fp8WeightTensor):
            weight = dequantize_weight(weight)
        x2d = x.reshape(-1, self.in_features)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        # The Function returns the weight gradient as [out, in]; passing the transposed view
        # lets autograd hand the [in, out] Parameter its gradient in its own layout.
        if self.fp8_config.recipe in GRANULAR_RECIPES:  # rowwise/blockwise: no cache kept
            y = granular_forward(x2d, weight.t(), bias, self.fp8_config, backend)
        else:
            y = Fp8Matmul.apply(x2d, weight.t(), bias, self.operands)  # Fp8Linear's GEMMs
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"nf={self.out_features}, nx={self.in_features}, {super().extra_repr()}"


def _swap(model: nn.Module, make: Callable[[nn.Module, str], Optional[nn.Module]]) -> None:
    """Replace every submodule for which ``make`` returns a module; shared modules stay shared."""
    replaced: dict[int, nn.Module] = {}
    targets = [(name, mod) for name, mod in model.named_modules(remove_duplicate=False) if name]
    for fqn, mod in targets:
        new = replaced.get(id(mod))
        if new is None:
            new = make(mod, fqn)
            if new is None:
                continue
            _copy_hooks(mod, new)
            replaced[id(mod)] = new
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, new)


def _copy_hooks(old: nn.Module, new: nn.Module) -> None:
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_state_dict_hooks", "_load_state_dict_pre_hooks"):
        if hasattr(old, attr) and hasattr(new, attr):
            getattr(new, attr).update(getattr(old, attr))


def convert_to_fp8(model: nn.Module, config: Optional[Fp8Config] = None,
                   module_filter_fn: Optional[FilterFn] = None) -> ConversionReport:
    """Swap eligible ``nn.Linear`` submodules of ``model`` for ``Fp8Linear``, in place.

    HF ``Conv1D`` layers (GPT-2 family) become :class:`Fp8Conv1D` (same ``[in, out]`` weight).
    Other ``nn.Linear`` subclasses are converted only when ``module_filter_fn`` accepts them.
    Warns (once) when nothing was converted, saying why and what to change.

    Args:
        model: the model to convert (its submodules are replaced; the model object is kept).
        config: FP8 recipe for every converted layer (default: ``Fp8Config()``, tensorwise).
        module_filter_fn: ``fn(module, fqn) -> bool``; True converts. Replaces the default
            filter, which keeps ``lm_head``, layers with a dim not divisible by 16, and layers
            below ``config.min_features`` / ``config.min_numel`` in high precision.

    Returns:
        A ConversionReport listing converted, skipped (with reasons) and already-FP8 layers.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
        >>> report = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
        >>> report.converted, list(report.skipped)
        (['0'], ['1'])
    """
    config = config if config is not None else Fp8Config()
    if not isinstance(config, Fp8Config):
        raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if type(model) is nn.Linear:
        raise ValueError("convert_to_fp8 swaps submodules in place and cannot replace the model "
                         "object itself; use Fp8Linear.from_linear(layer, config) instead")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError("module_filter_fn must be callable as fn(module, fqn) -> bool")
    report = ConversionReport()

    def make(mod: nn.Module, fqn: str) -> Optional[nn.Module]:
        if is_fp8_layer(mod) or is_fp8_experts(mod):
            report.already_fp8.append(fqn)
            record_module(mod)  # built by hand or converted before: recorded now, once
            return None
        experts = experts_decision(mod, fqn, config, module_filter_fn)  # MoE fused experts
        if isinstance(experts, str):
            report.skipped[fqn] = experts
        elif experts is not None:
            report.experts.append(fqn)
            record_module(experts)
            return experts
        conv1d = is_hf_conv1d(mod)
        if not (isinstance(mod, nn.Linear) or conv1d):
            return None
        reason = lora_adapter_reason(fqn)
        if reason is None and module_filter_fn is not None:
            reason = None if module_filter_fn(mod, fqn) else "module_filter_fn returned False"
        elif reason is None:
            reason = skip_reason(mod, fqn, config)
        if reason is not None:
            report.skipped[fqn] = reason
            return None
        report.converted.append(fqn)
        new = Fp8Conv1D.from_conv1d(mod, config) if conv1d else Fp8Linear.from_linear(mod, config)
        record_module(new)  # the decision, kept on the module: the engines read it (fp8.record)
        return new

    _swap(model, make)
    report.record = fp8_record(model)
    if not report.converted and not report.already_fp8 and not report.experts:
        _warn_nothing_converted(report, config)
    return report


def _warn_nothing_converted(report: ConversionReport, config: Fp8Config) -> None:
    # The plugins warn under this same key after calling us; warn_once then keeps only this,
    # more specific, message (theirs always suggested min_numel=0, even when it was set).
    reasons = sorted(set(report.skipped.values()))
    _state.warn_once(f"fp8-nothing-converted-{reasons}",
                     "fp8boost: no linear layer was converted to FP8: "
                     + report.nothing_converted_advice(config), stacklevel=4)


def convert_from_fp8(model: nn.Module) -> int:
    """Swap every ``Fp8Linear`` back to a plain ``nn.Linear`` (same Parameters) for export.

    FP8 experts (``fp8.moe.Fp8Experts``) go back to the HF modules they replaced, holding
    the same Parameters. Returns the number of layers and expert modules converted back.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8, convert_from_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> _ = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
        >>> convert_from_fp8(model)
        1
    """
    count = 0

    def make(mod: nn.Module, fqn: str) -> Optional[nn.Module]:
        nonlocal count
        hf_experts = experts_back(mod)
        if hf_experts is not None:
            count += 1
            return hf_experts
        if not is_fp8_layer(mod):
            return None
        with torch.device("meta"):
            if isinstance(mod, Fp8Conv1D):  # back to HF Conv1D, same [in, out] Parameter
                lin = _hf_conv1d_type()(mod.out_features, mod.in_features)
            else:
                lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        lin.weight, lin.bias = mod.weight, mod.bias
        lin.train(mod.training)
        count += 1
        return lin

    _swap(model, make)
    return count


def is_fp8_layer(module: nn.Module) -> bool:
    """Whether ``module`` runs its GEMMs in FP8 (an :class:`Fp8Linear` or FP8 GPT-2 ``Conv1D``).

    For users and ``fp8/`` itself: conversion decides once (``convert_to_fp8``) and records it;
    code above ``fp8/`` reads that record (:func:`fp8boost.fp8.record.fp8_entry`).

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, convert_to_fp8, is_fp8_layer
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32))
        >>> _ = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0))
        >>> is_fp8_layer(model[0])
        True
    """
    return isinstance(module, Fp8Linear)


def fp8_layers(model: nn.Module) -> list[nn.Module]:
    """Every FP8 layer of ``model`` (see :func:`is_fp8_layer`), in ``modules()`` order."""
    return [m for m in model.modules() if is_fp8_layer(m)]
