"""Structural detection of transformers' fused-expert modules (no class-name list).

transformers 5 stores the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and OLMoE
as one module holding two 3-D Parameters, ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``, called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
A module is recognised by that structure: two 3-D Parameters of those relative shapes, an
activation (``act_fn`` or ``_apply_gate``), that call signature and, where the module carries
its model config, sizes that agree with it (hidden size, expert count, expert width). Variants
this package does not run (transposed or interleaved storage, biases, ungated experts) are
recognised too, and reported with the reason they stay in high precision.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Union

from torch import nn

EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
EXPERT_WIDTH_FIELDS = ("moe_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class ExpertSpec:
    """Where a fused-expert module keeps its weights, and their sizes.

    Attributes:
        gate_up: attribute name of the ``[E, 2I, H]`` Parameter (HF: ``gate_up_proj``).
        down: attribute name of the ``[E, H, I]`` Parameter (HF: ``down_proj``).
        num_experts: E.
        hidden: H.
        intermediate: I (one expert's width).
    """

    gate_up: str
    down: str
    num_experts: int
    hidden: int
    intermediate: int


def _pair(module: nn.Module) -> Union[ExpertSpec, str, None]:
    params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if len(params) < 2:
        return None
    for gname, g in params:
        e, two_i, h = g.shape
        if two_i % 2:
            continue
        for dname, d in params:
            if d is not g and tuple(d.shape) == (e, h, two_i // 2):
                return ExpertSpec(gname, dname, e, h, two_i // 2)
    shapes = {n: tuple(p.shape) for n, p in params}
    return (f"3-D Parameters {shapes} are not a [E, 2I, H] gate_up / [E, H, I] down pair "
            "(transposed or ungated experts): kept in high precision")


def _flags_reason(module: nn.Module) -> Optional[str]:
    """The ``@use_experts_implementation`` flags this package does not run, if any is set."""
    bad = {"is_transposed": True, "has_bias": True, "has_gate": False,
           "is_concatenated": False, "has_post_expert_norm": True}
    for flag, value in bad.items():
        if getattr(module, flag, not value) is value:
            return f"experts with {flag}={value} are not supported yet: kept in high precision"
    return None


def _config_reason(module: nn.Module, spec: ExpertSpec) -> Optional[str]:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    checks = [("hidden_size", spec.hidden, ("hidden_size",)),
              ("expert count", spec.num_experts, EXPERT_COUNT_FIELDS),
              ("expert width", spec.intermediate, EXPERT_WIDTH_FIELDS)]
    for what, got, fields in checks:
        values = [getattr(cfg, f) for f in fields if isinstance(getattr(cfg, f, None), int)]
        if values and got not in values:
            return (f"expert Parameters give {what} {got} but the module's config says "
                    f"{values}: not a standard fused-expert module, kept in high precision")
    return None


def _signature_ok(module: nn.Module) -> bool:
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3 or any(p.kind is p.VAR_POSITIONAL for p in params)


def find_expert_spec(module: nn.Module) -> Union[ExpertSpec, str, None]:
    """Recognise a fused-expert module.

    Args:
        module: any module (only its own Parameters are looked at, not its children's).

    Returns:
        An :class:`ExpertSpec` for a module the FP8 grouped experts can run; a str saying why
        not for a module that holds 3-D expert Parameters but cannot run them; None for any
        other module (the common case, decided from its Parameters' ranks alone).

    Example:
        >>> import torch
        >>> from transformers import MixtralConfig
        >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        >>> cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=4)
        >>> spec = find_expert_spec(MixtralExperts(cfg))
        >>> spec.gate_up, spec.down, spec.num_experts, spec.hidden, spec.intermediate
        ('gate_up_proj', 'down_proj', 4, 64, 32)
    """
    found = _pair(module)
    if not isinstance(found, ExpertSpec):
        return found
    reason = _flags_reason(module) or _config_reason(module, found)
    if reason is not None:
        return reason
    if not (callable(getattr(module, "act_fn", None)) or hasattr(module, "_apply_gate")):
        return "fused experts without an act_fn or _apply_gate: kept in high precision"
    if not _signature_ok(module):
        return ("fused experts whose forward is not (hidden_states, top_k_index, "
                "top_k_weights): kept in high precision")
    n = getattr(module, "num_experts", found.num_experts)
    if n != found.num_experts:
        return (f"module.num_experts={n} but its Parameters hold {found.num_experts} experts "
                "(expert-parallel shard?): kept in high precision")
    return found


def router_aux_loss_on(model: nn.Module) -> bool:
    """Whether ``model`` is an MoE model whose forward adds the router's load-balancing loss.

    HF MoE causal LMs add ``router_aux_loss_coef * aux_loss`` to ``loss`` when
    ``config.output_router_logits`` is True. That loss is a product of means over *all* the
    model's router logits (every layer, every token of the forward), so it is not a sum of
    per-layer or per-shard terms: parallel schemes that split layers (pipeline) or tokens
    whose gradients are summed (tensor-parallel sequence parallelism) change it.

    Example:
        >>> import torch
        >>> router_aux_loss_on(torch.nn.Linear(2, 2))
        False
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "output_router_logits", False) is not True:
        return False
    return any(find_expert_spec(m) is not None for m in model.modules())
