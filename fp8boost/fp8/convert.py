"""Swap ``nn.Linear`` layers for ``Fp8Linear`` in place (and back), keeping Parameter objects.

Because the very same Parameter objects move into the new modules, an optimizer built before the
conversion keeps updating the right tensors, checkpoints keep their keys, and tied weights stay
tied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from .config import Fp8Config
from .linear import Fp8Linear

FilterFn = Callable[[nn.Module, str], bool]


@dataclass
class ConversionReport:
    """What ``convert_to_fp8`` did: converted layer names, and skipped ones with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"fp8boost: converted {len(self.converted)} linear layer(s) to FP8, "
                 f"kept {len(self.skipped)} in high precision"]
        lines += [f"  kept {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


def skip_reason(module: nn.Linear, fqn: str, config: Fp8Config) -> Optional[str]:
    """Why the default filter keeps this layer in high precision, or None to convert it."""
    leaf = fqn.rsplit(".", 1)[-1]
    if leaf in config.skip_module_names or fqn in config.skip_module_names:
        return "name is in skip_module_names (output head: keep full precision logits)"
    k, n = module.in_features, module.out_features
    if k % 16 or n % 16:
        return f"shape [{n}, {k}] has a dim not divisible by 16 (FP8 tensor-core alignment)"
    if min(k, n) < config.min_features:
        return f"a dim is below min_features={config.min_features} (too small to gain)"
    if k * n < config.min_numel:
        return f"{k * n} weight elements < min_numel={config.min_numel} (too small to gain)"
    return None


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

    Args:
        model: the model to convert (its submodules are replaced; the model object is kept).
        config: FP8 recipe for every converted layer (default: ``Fp8Config()``, tensorwise).
        module_filter_fn: ``fn(module, fqn) -> bool``; True converts. Replaces the default
            filter, which keeps ``lm_head``, layers with a dim not divisible by 16, and layers
            below ``config.min_features`` / ``config.min_numel`` in high precision.

    Returns:
        A ConversionReport listing converted and skipped layers (with reasons).

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
        if type(mod) is not nn.Linear:  # exact type: Fp8Linear and other subclasses are left alone
            return None
        if module_filter_fn is not None:
            reason = None if module_filter_fn(mod, fqn) else "module_filter_fn returned False"
        else:
            reason = skip_reason(mod, fqn, config)
        if reason is not None:
            report.skipped[fqn] = reason
            return None
        report.converted.append(fqn)
        return Fp8Linear.from_linear(mod, config)

    _swap(model, make)
    return report


def convert_from_fp8(model: nn.Module) -> int:
    """Swap every ``Fp8Linear`` back to a plain ``nn.Linear`` (same Parameters) for export.

    Returns the number of layers converted back.

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
        if not isinstance(mod, Fp8Linear):
            return None
        with torch.device("meta"):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        lin.weight, lin.bias = mod.weight, mod.bias
        lin.train(mod.training)
        count += 1
        return lin

    _swap(model, make)
    return count
