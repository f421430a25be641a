"""The fused-expert step of ``convert_to_fp8`` / ``convert_from_fp8``.

``fp8boost.fp8.convert`` asks :func:`experts_decision` about every module it visits: a
fused-expert module (found structurally, :func:`~fp8boost.fp8.moe.detect.find_expert_spec`)
becomes an :class:`~fp8boost.fp8.moe.experts.Fp8Experts` holding the same Parameters, or is
kept with a reason (on a GPU, also where FP8 measured slower at the module's shape:
:mod:`~fp8boost.fp8.moe.choice`). The default filter applies the linear layers' rules to the expert
weights: H and I divisible by 16 (FP8 tensor-core alignment), both at least ``min_features``,
and ``min_numel`` compared with the whole ``gate_up_proj`` (E x 2I x H: one grouped GEMM does
the work of all experts, so its size, not one expert's, decides whether FP8 gains). A
``module_filter_fn`` replaces that filter for experts as for linear layers.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

from torch import nn

from .detect import ExpertSpec, find_expert_spec
from .experts import Fp8Experts
from ..min_numel import min_numel_limit


def experts_skip_reason(spec: ExpertSpec, config) -> Optional[str]:
    """Why the default filter keeps these experts in high precision, or None.

    Example:
        >>> from fp8boost.fp8 import Fp8Config
        >>> spec = ExpertSpec("gate_up_proj", "down_proj", 4, 64, 40)
        >>> experts_skip_reason(spec, Fp8Config(backend="emulated"))
        'expert width 40 or hidden size 64 not divisible by 16 (FP8 tensor-core alignment)'
    """
    h, i = spec.hidden, spec.intermediate
    if h % 16 or i % 16:
        return (f"expert width {i} or hidden size {h} not divisible by 16 (FP8 tensor-core "
                "alignment)")
    if min(h, i) < config.min_features:
        return f"a dim is below min_features={config.min_features} (too small to gain)"
    numel = spec.num_experts * 2 * i * h
    limit = min_numel_limit(config, numel)
    if numel < limit:
        return f"{numel} gate_up elements < min_numel={limit} (too small to gain)"
    return None


def experts_decision(module: nn.Module, fqn: str, config,
                     module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
                     ) -> Union[Fp8Experts, str, None]:
    """What conversion does with ``module``: its :class:`Fp8Experts`, a reason to keep it
    in high precision, or None when it is not a fused-expert module at all.

    Example:
        >>> import torch
        >>> experts_decision(torch.nn.Linear(4, 4), "fc", None) is None
        True
    """
    found = find_expert_spec(module)
    if found is None or isinstance(found, str):
        return found
    if module_filter_fn is not None:
        reason = None if module_filter_fn(module, fqn) else "module_filter_fn returned False"
    else:
        reason = experts_skip_reason(found, config)
    if reason is not None:
        return reason
    fp8 = Fp8Experts(module, found, config)
    if fp8.precision == "bf16":  # on the GPU already, and FP8 measured slower (moe.choice)
        fp8.to_hf()  # the HF module stays in place, with its own Parameters
        return ("FP8 measured slower than BF16 at this shape on this GPU (fp8.moe.choice); "
                "Fp8Config(min_numel=0) forces FP8")
    return fp8


def experts_back(module: nn.Module) -> Optional[nn.Module]:
    """The HF module to put back in place of an :class:`Fp8Experts` (same Parameters)."""
    return module.to_hf() if isinstance(module, Fp8Experts) else None
