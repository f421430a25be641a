"""Tensor-parallel plans for peft LoRA models: the base layer is split as before, the adapters
so that the sum ``base(x) + B(A(x))`` is exact.

peft wraps e.g. ``q_proj`` in a ``LoraLayer`` holding ``base_layer`` (the original linear),
``lora_A.<adapter>`` ([r, in]) and ``lora_B.<adapter>`` ([out, r]). For a wrapper at a
column-parallel name (q/k/v, gate/up) the region's input is whole on every rank:

* ``base_layer`` splits its output features, ``lora_B`` too (so ``B_r A x`` is this rank's
  output slice); ``lora_A`` is replicated and its gradient (a partial sum per rank) is summed
  over tp by the region's gradient hook (``apply._record_params``).

For a wrapper at a row-parallel name (o_proj, down_proj) the input is this rank's slice of
features and the region's exit all-reduces the output once:

* ``base_layer`` splits its input features, ``lora_A`` too (``A_r x_r`` is a partial sum of
  ``A x``); ``lora_B`` is replicated, so ``sum_r B A_r x_r = B A x`` comes out of the same
  single all-reduce; ``lora_B``'s gradient is a partial sum per rank, summed by the same hook.

LoRA on the embedding or ``lm_head`` with tp, and a ``lora_B`` bias on a row-parallel wrapper
(it would be added tp times), raise ``ValueError``.
"""
from __future__ import annotations

from typing import Callable, Optional

from torch import nn

__all__ = ["peft_base", "lora_decoder_plan", "is_lora_wrapper"]


def peft_base(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """``(name, hf_model)`` of a peft model's wrapped HF model, or None for any other model."""
    if not callable(getattr(type(model), "get_base_model", None)):
        return None
    inner = model.get_base_model()
    if inner is model or not isinstance(inner, nn.Module):
        return None
    for name, m in model.named_modules():
        if m is inner:
            return name, inner
    return None


def is_lora_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (``base_layer`` + ``lora_A``/``lora_B`` dicts)."""
    return (isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def _split(names: list[str], modules: dict, adapter_attr: str, row: bool) -> list[str]:
    out = []
    for name in names:
        m = modules[name]
        if not is_lora_wrapper(m):
            out.append(name)
            continue
        if not isinstance(m.base_layer, nn.Linear):
            raise ValueError(f"{name}'s LoRA base layer is a {type(m.base_layer).__name__}, "
                             "not an nn.Linear: tensor parallelism cannot split it")
        if row and any(b.bias is not None for b in m.lora_B.values()):
            raise ValueError(f"{name} is row-parallel and its LoRA lora_B has a bias (it would "
                             "be added tp_size times): use LoraConfig(lora_bias=False)")
        out.append(f"{name}.base_layer")
        out += [f"{name}.{adapter_attr}.{a}" for a in getattr(m, adapter_attr)]
    return out


def lora_decoder_plan(model: nn.Module, plain_plan: Callable[[nn.Module], "TpPlan"]) -> "TpPlan":
    """The plan of a peft LoRA model: ``plain_plan`` of its HF model, adapters added, every
    name prefixed with the HF model's name inside the peft model."""
    name, inner = peft_base(model)
    plan = plain_plan(inner)
    modules = dict(inner.named_modules())
    for what in ("embedding", "lm_head"):
        target = getattr(plan, what)
        if target is not None and is_lora_wrapper(modules[target]):
            raise ValueError(f"LoRA on {target} (the {what}) with tensor parallelism is not "
                             "supported: leave it out of LoraConfig(target_modules=...) or "
                             "use tp_size=1")
    plan.colwise = _split(plan.colwise, modules, "lora_B", row=False)
    plan.rowwise = _split(plan.rowwise, modules, "lora_A", row=True)
    pre = f"{name}." if name else ""

    def add(n: Optional[str]) -> Optional[str]:
        return None if n is None else pre + n

    for field_name in ("regions", "colwise", "rowwise", "layers", "sequence_sharded"):
        setattr(plan, field_name, [add(n) for n in getattr(plan, field_name)])
    plan.embedding, plan.lm_head = add(plan.embedding), add(plan.lm_head)
    return plan
