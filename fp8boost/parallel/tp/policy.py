"""Which modules of a model are split how: tensor-parallel plans for HF causal LMs.

A :class:`TpPlan` names modules by their qualified names. :func:`hf_decoder_plan` finds one
from the module structure shared by Llama, Mistral, Qwen2 and their relatives (Qwen3, Gemma,
...): decoder layers under ``<base>.layers``, each with ``self_attn.{q,k,v,o}_proj`` and
``mlp.{gate,up,down}_proj`` linears; input embeddings and ``lm_head`` from the model's own
``get_input_embeddings`` / ``get_output_embeddings``. Anything else raises a ``ValueError``
naming ``custom_policy``.

Mixture-of-experts layers (Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE: ``mlp`` holds a router and
a fused-expert module with 3-D ``gate_up_proj`` / ``down_proj`` Parameters instead of the three
MLP linears) are planned with their attention split and their whole MoE block *replicated*: it
runs on the full residual stream, identical on every tp rank (the router and the grouped FP8
expert GEMMs are deterministic given the same input and weights), so its gradients need no tp
reduction; under sequence parallelism it runs on each rank's sequence shard and, like the
norms, its replicated gradients are summed over tp. Splitting the experts along their width is
not implemented (``TpPlan.replicated_moe`` lists the blocks kept whole).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from torch import nn

from fp8boost.fp8.moe.detect import find_expert_spec

from .lora_plan import lora_decoder_plan, peft_base

__all__ = ["TpPlan", "hf_decoder_plan", "resolve_plan", "check_plan"]

ATTN_COLWISE = ("q_proj", "k_proj", "v_proj")
ATTN_ROWWISE = ("o_proj",)
MLP_COLWISE = ("gate_proj", "up_proj")
MLP_ROWWISE = ("down_proj",)


@dataclass
class TpPlan:
    """Tensor-parallel layout of one model, by qualified module name.

    Example:
        >>> plan = TpPlan(regions=["layers.0.mlp"], colwise=["layers.0.mlp.up_proj"],
        ...               rowwise=["layers.0.mlp.down_proj"])
        >>> len(plan.regions)
        1
    """

    regions: list[str] = field(default_factory=list)
    """Blocks entered through a tp collective and left through one (attention, MLP)."""

    colwise: list[str] = field(default_factory=list)
    """Linears split along their output features (weight dim 0), at a region's entry."""

    rowwise: list[str] = field(default_factory=list)
    """Linears split along their input features (weight dim 1), at a region's exit."""

    embedding: Optional[str] = None
    """Vocabulary-parallel input embedding (weight dim 0), or None to keep it replicated."""

    lm_head: Optional[str] = None
    """Vocabulary-parallel output projection; its logits feed a vocabulary-parallel loss."""

    layers: list[str] = field(default_factory=list)
    """Decoder layers in order; with sequence parallelism the first one splits the sequence."""

    sequence_sharded: list[str] = field(default_factory=list)
    """Modules outside ``layers`` that run on sequence shards under sequence parallelism (the
    final norm): their replicated parameters get partial gradients, summed over tp."""

    head_counts: dict[str, int] = field(default_factory=dict)
    """Sizes tp must divide (attention heads, kv heads, FFN, vocab), for the error message."""

    replicated_moe: list[str] = field(default_factory=list)
    """Mixture-of-experts blocks (router + fused experts) kept whole on every tp rank."""

    split_sequence: bool = True
    """With sequence parallelism, split the sequence at the input of ``layers[0]``. False on
    later pipeline stages, whose input arrives from the previous stage already split."""


def _base_model(model: nn.Module) -> Optional[str]:
    for name in ("model", "transformer", "base_model"):
        sub = getattr(model, name, None)
        if isinstance(sub, nn.Module) and isinstance(getattr(sub, "layers", None), nn.ModuleList):
            return name
    if isinstance(getattr(model, "layers", None), nn.ModuleList):
        return ""
    return None


def _name_of(model: nn.Module, module: Optional[nn.Module]) -> Optional[str]:
    if module is None:
        return None
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def hf_decoder_plan(model: nn.Module) -> TpPlan:
    """The plan for a Llama-structured HF model (Llama, Mistral, Qwen2 and relatives).

    A peft LoRA model (``get_base_model()``) is planned through its HF model: see
    :mod:`fp8boost.parallel.tp.lora_plan`.

    Raises:
        ValueError: the model does not have that structure (pass ``custom_policy``).
    """
    if peft_base(model) is not None:
        return lora_decoder_plan(model, _plain_decoder_plan)
    return _plain_decoder_plan(model)


def _plain_decoder_plan(model: nn.Module) -> TpPlan:
    base = _base_model(model)
    if base is None:
        raise _unsupported(model, "no ModuleList of decoder layers at model.layers")
    prefix = f"{base}." if base else ""
    layers = getattr(model, base) if base else model
    plan = TpPlan()
    for i, layer in enumerate(layers.layers):
        lp = f"{prefix}layers.{i}"
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        owners = [(attn, "self_attn", ATTN_COLWISE, ATTN_ROWWISE)]
        if is_moe_block(mlp):  # replicated whole: see the module docstring
            plan.replicated_moe.append(f"{lp}.mlp")
        else:
            owners.append((mlp, "mlp", MLP_COLWISE, MLP_ROWWISE))
        for owner, oname, col, row in owners:
            missing = [n for n in col + row if not isinstance(
                getattr(getattr(owner, n, None), "base_layer", getattr(owner, n, None)),
                nn.Linear)]  # a LoRA wrapper's base_layer is the linear (lora_plan.py)
            if owner is None or missing:
                raise _unsupported(model, f"{lp}.{oname} lacks linear layers {missing or col + row}")
            plan.regions.append(f"{lp}.{oname}")
            plan.colwise += [f"{lp}.{oname}.{n}" for n in col]
            plan.rowwise += [f"{lp}.{oname}.{n}" for n in row]
        plan.layers.append(lp)
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    plan.embedding = _name_of(model, get_in() if callable(get_in) else None)
    plan.lm_head = _name_of(model, get_out() if callable(get_out) else None)
    if isinstance(getattr(layers, "norm", None), nn.Module):
        plan.sequence_sharded.append(f"{prefix}norm")
    cfg = getattr(model, "config", None)
    # intermediate_size is split only by dense MLPs (in MoE models it may be the expert width)
    dense = len(plan.replicated_moe) < len(plan.layers)
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if key == "intermediate_size" and not dense:
            continue
        value = getattr(cfg, key, None)
        if isinstance(value, int):
            plan.head_counts[key] = value
    return plan


def is_moe_block(module: Optional[nn.Module]) -> bool:
    """Whether ``module`` holds fused experts (3-D expert Parameters, HF or FP8-converted).

    Example:
        >>> is_moe_block(nn.Linear(2, 2)), is_moe_block(None)
        (False, False)
    """
    if module is None:
        return False
    # find_expert_spec: an ExpertSpec, or a reason for expert variants FP8 does not run; both
    # are experts whose 3-D Parameters the plan cannot split.
    return any(find_expert_spec(m) is not None for m in module.modules())


def _unsupported(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"no tensor-parallel policy for {type(model).__name__}: {why}. Built-in policies cover "
        "HF models structured like Llama, Mistral and Qwen2 (separate q/k/v/o and gate/up/down "
        "projections); pass HybridParallelPlugin(custom_policy=...) with a TpPlan or a "
        "function model -> TpPlan for other models")


PlanLike = Union[TpPlan, Callable[[nn.Module], TpPlan], None]


def resolve_plan(model: nn.Module, custom_policy: PlanLike) -> TpPlan:
    """``custom_policy`` (a plan, or a function building one) or the built-in HF plan."""
    if custom_policy is None:
        return hf_decoder_plan(model)
    plan = custom_policy if isinstance(custom_policy, TpPlan) else custom_policy(model)
    if not isinstance(plan, TpPlan):
        raise TypeError(f"custom_policy must be a TpPlan or return one, got {type(plan).__name__}")
    return plan


def check_plan(model: nn.Module, plan: TpPlan, tp: int) -> None:
    """Every split dimension divisible by ``tp``; raises ``ValueError`` naming the first that is not."""
    for key, value in plan.head_counts.items():
        if value % tp:
            raise ValueError(f"tp_size={tp} must divide the model's {key} ({value}); choose a "
                             "tp_size that divides it")
    modules = dict(model.named_modules())
    for names, dim, what in ((plan.colwise, 0, "output"), (plan.rowwise, 1, "input")):
        for name in names:
            m = modules.get(name)
            if not isinstance(m, nn.Linear):
                raise ValueError(f"the tensor-parallel plan names {name!r}, which is not an "
                                 "nn.Linear of this model")
            if m.weight.shape[dim] % tp:
                raise ValueError(f"tp_size={tp} must divide {name}'s {what} features "
                                 f"({m.weight.shape[dim]})")
            if dim == 1 and m.bias is not None:
                raise ValueError(f"{name} is row-parallel and has a bias: a bias after a "
                                 "tensor-parallel reduction is not supported; keep it in a "
                                 "custom_policy's replicated modules")
    for name in (plan.embedding, plan.lm_head):
        if name is None:
            continue
        w = getattr(modules.get(name), "weight", None)
        if w is None:
            raise ValueError(f"the tensor-parallel plan names {name!r}, which has no weight")
        if w.shape[0] % tp:
            raise ValueError(f"tp_size={tp} must divide the vocabulary of {name} ({w.shape[0]})")
    for name in plan.regions + plan.layers:
        if name not in modules:
            raise ValueError(f"the tensor-parallel plan names {name!r}, not a module of this model")
