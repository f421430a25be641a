"""Helpers of bench/train.py for the single-GPU table (bench/single_gpu.py).

* torchao float8 conversion with fp8boost's default layer filter (no ``lm_head``, both dims a
  multiple of 16), shared by the ``torchao_fsdp2`` and ``single_torchao`` configs, and the
  count of converted / kept linears (the ``fp8_layers`` field the fp8 rows have);
* AdamW as every config builds it, ``fused=True`` on CUDA with ``--fused-adamw``;
* the dense BF16 tensor-core peak of the device, for MFU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch


def torchao_filter(mod: torch.nn.Module, fqn: str) -> bool:
    """Same default filter as fp8boost: no lm_head, FP8-GEMM-friendly dims."""
    return "lm_head" not in fqn and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def convert_torchao(model: torch.nn.Module, recipe: Optional[str] = None,
                    **config: Any) -> dict[str, int]:
    """torchao ``convert_to_float8_training``: tensorwise dynamic scaling (torchao's default),
    or the named ``recipe`` (``rowwise``, ``rowwise_with_gw_hp``:
    ``Float8LinearConfig.from_recipe_name``); ``config`` goes to ``Float8LinearConfig``.
    Returns ``dict(converted=, kept=)``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig.from_recipe_name(recipe) if recipe else Float8LinearConfig(**config)
    convert_to_float8_training(model, config=cfg,
                               module_filter_fn=torchao_filter)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    return dict(converted=converted, kept=linears - converted)


def fused_adamw(args, device: torch.device) -> bool:
    return bool(getattr(args, "fused_adamw", False)) and device.type == "cuda"


def make_adamw(params, args, device: torch.device) -> torch.optim.AdamW:
    """The benchmark's AdamW; ``fused=True`` with ``--fused-adamw`` on CUDA. The fp8boost
    optimizer wrapper re-points its param groups at FP32 master copies on the same device,
    which the fused kernel takes as it would the params (dtype/device checked per step)."""
    extra = {"fused": True} if fused_adamw(args, device) else {}
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **extra)


def peak_bf16_tflops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    from _scale_report import dense_bf16_peak  # one peak table for every bench (data sheets)

    return dense_bf16_peak(torch.cuda.get_device_name(device))
