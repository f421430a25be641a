"""Mixture-of-experts in the training example: ``--model mixtral|qwen3_moe`` and ``--plugin moe``.

``--model mixtral`` / ``--model qwen3_moe`` build the transformers model at the ``--preset``
width, depth and heads, with the experts of :data:`MOE_SHAPES` in every layer: Mixtral-style
(8 experts of the preset's FFN size, top 2; ``7b`` is Mixtral-8x7B's layout at Llama-2-7B's
attention) or, for Qwen3-MoE, fine-grained (:data:`FINE_GRAINED` times the experts at
1/FINE_GRAINED the FFN size, top 4x as many: the same active FLOPs per token, the way
Qwen3-30B-A3B routes to 8 of 128 small experts). Every expert FFN size is a multiple of 16
(FP8 GEMM shapes). The router's load-balancing loss stays off (transformers' default
``output_router_logits=False``): the loss is the LM loss alone, as for the dense families.

``--plugin moe --ep N`` trains with ``MoeHybridParallelPlugin``: each MoE layer's experts split
over N ranks (tokens travel to them by all-to-all; ``--fp8-comm``: in e4m3 with a scale per
row), data parallelism over the ``world / N`` ranks holding the same experts, with ZeRO stage
``--zero`` over them. Every rank reads its own batches. Checkpoints resume at any ``--ep``
and number of ranks (bit-exactly with the saving layout).

Example:
    >>> moe_fields("mixtral", "tiny")["num_local_experts"]
    4
    >>> moe_fields("qwen3_moe", "tiny")["num_experts"], moe_fields("llama", "tiny")
    (16, {})
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from torch import nn

import presets

MOE_FAMILIES = ("mixtral", "qwen3_moe")
# --preset -> (experts, top-k, expert FFN size) of the Mixtral-style layout
MOE_SHAPES: dict[str, tuple[int, int, int]] = {
    "tiny": (4, 2, 128), "small": (8, 2, 512), "125m": (8, 2, 1024), "1b": (8, 2, 2816),
    "7b": (8, 2, 11008), "7b-8l": (8, 2, 11008),
    "mistral-8l": (8, 2, 14336)}  # Mixtral-8x7B's experts (and GQA 32/8), 8 layers
FINE_GRAINED = 4  # qwen3_moe: 4x the experts at 1/4 the FFN size, top 4x as many


def moe_fields(family: str, preset: str) -> dict[str, Any]:
    """The transformers config fields of ``family``'s experts at ``preset`` ({} if dense)."""
    if family not in MOE_FAMILIES:
        return {}
    experts, top_k, ffn = MOE_SHAPES[preset]
    if family == "mixtral":
        return dict(num_local_experts=experts, num_experts_per_tok=top_k, intermediate_size=ffn)
    size = presets.PRESETS[preset]
    return dict(num_experts=experts * FINE_GRAINED, num_experts_per_tok=top_k * FINE_GRAINED,
                moe_intermediate_size=ffn // FINE_GRAINED, norm_topk_prob=True,
                head_dim=size["hidden_size"] // size["num_attention_heads"])


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--plugin moe`` flag (``--zero`` is shared with ``--plugin hybrid``)."""
    group.add_argument("--ep", type=int, default=1,
                       help="--plugin moe: expert-parallel size (ranks each MoE layer's experts "
                            "are split over; divides the number of ranks and of experts)")


def num_experts(args: argparse.Namespace) -> Optional[int]:
    """Experts per MoE layer of the model to train, read without building it (None: dense or
    unknown)."""
    if args.model is not None:
        fields = moe_fields(args.model, args.preset)
        return fields.get("num_local_experts", fields.get("num_experts"))
    config = Path(args.model_path) / "config.json"
    if not config.is_file():
        return None  # check_model_folder names the problem
    data = json.loads(config.read_text())
    return data.get("num_local_experts", data.get("num_experts"))


def validate_moe_args(args: argparse.Namespace, world_size: int) -> None:
    """``--ep`` belongs to ``--plugin moe``; the experts must split over it. ValueError naming
    the fix, before any work or collective."""
    if args.ep < 1:
        raise ValueError(f"--ep must be >= 1, got {args.ep}")
    if args.plugin != "moe":
        if args.ep != 1:
            raise ValueError(f"--ep configures --plugin moe (expert parallelism); add --plugin "
                             f"moe (this run has --plugin {args.plugin})")
        return
    if args.model is not None and args.model not in MOE_FAMILIES:
        raise ValueError(f"--plugin moe trains mixture-of-experts models; --model {args.model} "
                         f"is dense: use --model {'|'.join(MOE_FAMILIES)} (or --model-path to "
                         "a local MoE model)")
    if world_size % args.ep:
        raise ValueError(f"--ep {args.ep} must divide the number of ranks ({world_size}); "
                         f"launch with torchrun --nproc_per_node=<multiple of {args.ep}>")
    experts = num_experts(args)
    if experts is not None and experts % args.ep:
        raise ValueError(f"--ep {args.ep} must divide the model's {experts} experts per layer; "
                         "choose an --ep that divides it")


def make_plugin(args: argparse.Namespace, fp8_config):
    """``MoeHybridParallelPlugin`` for ``--plugin moe`` (clipping stays with the example)."""
    from fp8boost.plugins import MoeHybridParallelPlugin

    return MoeHybridParallelPlugin(ep_size=args.ep, zero_stage=args.zero,
                                   precision=args.precision, use_fp8=args.use_fp8,
                                   fp8_communication=args.fp8_comm, fp8_config=fp8_config)


def fp8_coverage(model: nn.Module) -> dict[str, int]:
    """How much of the boosted ``model`` runs FP8 GEMMs (every layer runs in every step).

    Returns: ``linear_fp8`` / ``linear_total`` (linear layers, GPT-2 ``Conv1D`` included),
    ``experts_fp8`` / ``experts_total`` (fused-expert layers), ``expert_gemms_fp8`` (FP8
    grouped GEMMs per forward: 2 per FP8 expert layer, each over this rank's experts),
    ``local_experts`` / ``num_experts`` (of one layer, on this rank; 0 without experts).
    """
    from fp8boost.fp8 import is_fp8_layer
    from fp8boost.fp8.moe import is_fp8_experts
    from fp8boost.parallel.ep import EpExperts, expert_spec_of

    from transformers.pytorch_utils import Conv1D

    out = dict(linear_fp8=0, linear_total=0, experts_fp8=0, experts_total=0, local_experts=0,
               num_experts=0)

    def count(experts: nn.Module, local: int, total: int) -> None:
        out["experts_total"] += 1
        out["experts_fp8"] += is_fp8_experts(experts)
        out["local_experts"], out["num_experts"] = local, total

    for m in model.modules():
        if isinstance(m, (nn.Linear, Conv1D)):
            out["linear_total"] += 1
            out["linear_fp8"] += is_fp8_layer(m)
        elif isinstance(m, EpExperts):  # its experts module is not a submodule: ask it
            count(m.inner, m.local, m.num_experts)
        elif expert_spec_of(m) is not None:  # experts on every rank (another plugin)
            count(m, expert_spec_of(m).num_experts, expert_spec_of(m).num_experts)
    out["expert_gemms_fp8"] = 2 * out["experts_fp8"]
    return out


def describe_coverage(cov: dict[str, int], pp: int = 1) -> str:
    """One line for the start of a run (``pp`` > 1: the counts are this rank's stage's)."""
    where = f" of this rank's pipeline stage (the model is split over {pp})" if pp > 1 else ""
    line = f"FP8 GEMMs: {cov['linear_fp8']}/{cov['linear_total']} linear layers{where}"
    if cov["experts_total"]:
        line += (f", {cov['experts_fp8']}/{cov['experts_total']} expert layers "
                 f"({cov['expert_gemms_fp8']} FP8 grouped GEMMs per forward, each over "
                 f"{cov['local_experts']} of {cov['num_experts']} experts on this rank)")
    return line


def inactive_expert_params(model: nn.Module) -> int:
    """Expert parameters a token does not use (``(E - k) / E`` of the fused 3-D expert
    weights): subtracted from the matmul parameters so FLOPs/token count active experts only."""
    cfg = getattr(model, "config", None)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 0
    fused = sum(p.numel() for p in model.parameters() if p.dim() == 3)  # [E, out, in] weights
    return fused * (experts - top_k) // experts
