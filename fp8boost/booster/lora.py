"""LoRA through the Booster (Colossal-AI's ``enable_lora`` / ``save_lora_as_pretrained``) on peft.

``enable_lora`` wraps the model with peft before ``boost``; ``boost`` then converts peft's frozen
``base_layer`` linears to FP8 (their weight cast is made once and reused every step, and no
weight-gradient GEMM runs for them), while the trainable ``lora_A`` / ``lora_B`` adapters stay in
the training dtype (``convert.lora_adapter_reason``). Frozen parameters are dropped from the
optimizer before the plugin wraps it, so ZeRO / FSDP keep no gradients, masters or optimizer
state for them. ``save_lora_as_pretrained`` gathers the adapters (tp shards, FSDP shards) and
writes peft's own adapter layout from rank 0, loadable by ``PeftModel.from_pretrained``.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.parallel.wrappers import ModelWrapper

__all__ = ["enable_lora", "save_lora_as_pretrained", "is_peft_model", "drop_frozen_params",
           "adapter_state_dict", "whole_param"]

logger = logging.getLogger("fp8boost.booster")

_QUANTIZE_WHY = ("fp8boost does not quantize the frozen base with bitsandbytes; its way to make "
                 "the frozen base cheap is FP8: pass use_fp8=True to the plugin (the base "
                 "layers' GEMMs run in FP8 with their weight cast cached once). Call "
                 "enable_lora(model, lora_config=...) without quantize/bnb_quantization_config")


def _require_peft():
    try:
        # lazy: peft is optional (pip install 'fp8boost[lora]')
        import peft
    except ImportError as exc:  # an environment problem, said before anything runs
        raise ImportError("Booster.enable_lora needs the peft package: pip install peft "
                          "(or pip install 'fp8boost[lora]')") from exc
    return peft


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (never imports peft itself)."""
    mod = sys.modules.get("peft")
    return mod is not None and isinstance(model, mod.PeftModel)


def _check_plugin(plugin) -> None:
    if getattr(plugin, "pp_size", 1) > 1:
        raise ValueError(f"enable_lora with {type(plugin).__name__}(pp_size="
                         f"{plugin.pp_size}) is not supported: fp8boost's pipeline split does not "
                         "handle peft's wrapped model yet; use pp_size=1 (tp_size and zero_stage "
                         "work with LoRA)")


def enable_lora(plugin, model: nn.Module, pretrained_dir: Optional[str] = None,
                lora_config=None, bnb_quantization_config=None,
                quantize: bool = False) -> nn.Module:
    """Wrap ``model`` with peft LoRA adapters (new, or loaded from ``pretrained_dir``).

    See :meth:`fp8boost.booster.Booster.enable_lora`. Every check runs before anything else
    (no collective is involved at all).
    """
    if quantize or bnb_quantization_config is not None:
        raise ValueError(f"enable_lora(quantize=True / bnb_quantization_config=...): "
                         f"{_QUANTIZE_WHY}")
    peft = _require_peft()
    if isinstance(model, ModelWrapper):
        raise ValueError("enable_lora got a boosted model: call model = "
                         "booster.enable_lora(model, lora_config=...) before booster.boost(...)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_lora needs an nn.Module, got {type(model).__name__}")
    if isinstance(model, peft.PeftModel):
        raise ValueError("enable_lora got a model that is already a peft PeftModel: pass the "
                         "base model (or load adapters with pretrained_dir=...)")
    if pretrained_dir is None:
        if lora_config is None:
            raise ValueError("enable_lora needs lora_config=peft.LoraConfig(...) when no "
                             "pretrained_dir (saved adapters) is given")
        if not isinstance(lora_config, peft.LoraConfig):
            raise TypeError(f"lora_config must be a peft.LoraConfig, got "
                            f"{type(lora_config).__name__}")
    elif not os.path.isdir(os.fspath(pretrained_dir)):
        raise ValueError(f"pretrained_dir {pretrained_dir!r} is not a directory of saved "
                         "adapters (save_lora_as_pretrained / PeftModel.save_pretrained)")
    if lora_config is not None and getattr(lora_config, "use_dora", False):
        raise ValueError("enable_lora(LoraConfig(use_dora=True)) is not supported: DoRA reads "
                         "the full base weight every forward (no FP8 base, no tensor "
                         "parallel split); use plain LoRA (use_dora=False)")
    _check_plugin(plugin)
    _state.log_once(logger, ("lora-enabled",), "fp8boost: LoRA enabled: only the adapters "
                    "train (check the learning rate); with use_fp8=True the frozen base "
                    "layers run FP8 GEMMs", level=logging.INFO)
    if pretrained_dir is None:
        return peft.get_peft_model(model, lora_config)
    return peft.PeftModel.from_pretrained(model, os.fspath(pretrained_dir), is_trainable=True)


def drop_frozen_params(optimizer: Optional[torch.optim.Optimizer]) -> int:
    """Remove parameters with ``requires_grad=False`` from ``optimizer``'s param groups.

    The user's optimizer over ``model.parameters()`` holds LoRA's frozen base: without this,
    ZeRO / FSDP would keep FP32 masters and state for weights that never change. Groups stay
    (maybe empty), so an lr scheduler built over them keeps its per-group values. Returns the
    number of parameters dropped.
    """
    if optimizer is None or not hasattr(optimizer, "param_groups"):
        return 0
    dropped = 0
    for group in optimizer.param_groups:
        keep = [p for p in group["params"] if p.requires_grad]
        dropped += len(group["params"]) - len(keep)
        group["params"] = keep
    if dropped:
        _state.log_once(logger, ("lora-frozen-dropped",), f"fp8boost: the optimizer's {dropped} "
                        "frozen parameter(s) (LoRA's base) are left out of it: no gradients, "
                        "master copies or optimizer state for them", level=logging.INFO)
    return dropped


def whole_param(plugin, name: str, t: torch.Tensor) -> torch.Tensor:
    """This parameter's whole value on every rank (FSDP2 DTensor, or a tp shard)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    tp_state = getattr(plugin, "tp_state", None)
    dim = tp_state.shard_dims.get(name) if tp_state is not None else None
    if dim is not None and tp_state.size > 1:
        parts = [torch.empty_like(t) for _ in range(tp_state.size)]
        dist.all_gather(parts, t.contiguous(), group=tp_state.group)
        t = torch.cat(parts, dim=dim)
    return t


def adapter_state_dict(plugin, model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (adapter) parameters of the boosted ``model``, whole, on the CPU.

    Collective over the plugin's ranks (gathers shards): every rank calls it.
    """
    inner = plugin.unwrap_model(model)
    exact = plugin.exact_weights(model)
    out = {}
    for name, p in inner.named_parameters():
        if p.requires_grad:
            out[name] = whole_param(plugin, name, exact.get(id(p), p)).cpu().clone()
    return out


def save_lora_as_pretrained(plugin, model: nn.Module, checkpoint: str,
                            use_safetensors: bool = False) -> None:
    """Write the adapters of the boosted peft ``model`` in peft's layout (rank 0 writes).

    See :meth:`fp8boost.booster.Booster.save_lora_as_pretrained`.
    """
    peft = _require_peft()
    if not isinstance(use_safetensors, bool):
        raise TypeError(f"use_safetensors must be True or False, got {use_safetensors!r}")
    inner = plugin.unwrap_model(model)
    if not isinstance(inner, peft.PeftModel):
        raise TypeError(f"save_lora_as_pretrained needs the model returned by boost after "
                        f"booster.enable_lora(...), got {type(inner).__name__}")
    checkpoint = os.fspath(checkpoint)
    if os.path.isfile(checkpoint):  # Colossal-AI logs this and saves nothing
        raise ValueError(f"save_lora_as_pretrained writes a directory (peft's adapter layout); "
                         f"{checkpoint!r} is a file: pass a directory path")
    sd = adapter_state_dict(plugin, model)  # collective
    if not dist.is_initialized() or dist.get_rank() == 0:
        inner.save_pretrained(checkpoint, state_dict=sd, safe_serialization=use_safetensors)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
