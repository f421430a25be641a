"""A small dequantizing loader for the three FP8 layouts (tests, CPU inspection)."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open

from ..checkpoint_io import hf_sharded as hf
from .quantize import dequantize_weight, is_conv1d

SCALE_NAMES = ("weight_scale", "weight_scale_inv")
STATIC_NAMES = ("input_scale", "k_scale", "v_scale")


def read_fp8_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 folder as stored (FP8 weights, FP32 scales, ...).

    Example:
        >>> sd = read_fp8_state("/tmp/export")  # doctest: +SKIP
    """
    out = {}
    for fname in hf.checkpoint_files(path):
        with safe_open(os.path.join(path, fname), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def dequantized_state(stored: dict[str, torch.Tensor], conv1d_keys: set,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``stored`` with every FP8 weight multiplied back by its scales; scale tensors dropped.

    Example:
        >>> from fp8boost.export.quantize import quantize_weight
        >>> q, s = quantize_weight(torch.ones(2, 2), False, "tensor")
        >>> dequantized_state({"w.weight": q, "w.weight_scale": s}, set())["w.weight"].sum()
        tensor(4.)
    """
    out = {}
    for k, t in stored.items():
        leaf = k.rsplit(".", 1)[-1]
        if leaf in SCALE_NAMES or leaf in STATIC_NAMES:
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            base = k[: -len("weight")]
            scale = next((stored[base + n] for n in SCALE_NAMES if base + n in stored), None)
            if scale is None:
                raise ValueError(f"{k} is FP8 but has no weight_scale / weight_scale_inv beside it")
            out[k] = dequantize_weight(t, scale, k in conv1d_keys, dtype)
        else:
            out[k] = t.to(dtype) if t.is_floating_point() else t
    return out


def load_dequantized(path: str, dtype: torch.dtype = torch.float32):
    """A transformers model (``AutoModelForCausalLM``) with the FP8 folder's weights
    dequantized to ``dtype``: what the FP8 checkpoint computes, on any device.

    Args:
        path: a folder written by ``save_model(..., fp8_export=...)``.
        dtype: the model's dtype (FP32 keeps the dequantized values exact).

    Example:
        >>> model = load_dequantized("/tmp/export")  # doctest: +SKIP
    """
    # lazy: transformers takes seconds to import; only HF models get here
    from transformers import AutoConfig, AutoModelForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if "quantization_config" not in raw:
        raise ValueError(f"{path}/config.json has no quantization_config: load it with "
                         "from_pretrained, it is not an FP8 export")
    raw.pop("quantization_config")
    config = AutoConfig.for_model(**raw)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    conv1d = {f"{n}.weight" for n, m in model.named_modules() if is_conv1d(m)}
    state = dequantized_state(read_fp8_state(path), conv1d, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight") or "embed" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{path} does not match its config's model: missing "
                           f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()
