"""The three checkpoint layouts inference engines load: tensor names, shapes, config.json.

=====================  ===========================  =======================================
``fp8_export``         weight scales                ``quantization_config``
=====================  ===========================  =======================================
``per_tensor``         ``weight_scale`` FP32 ``[]``   ``{"quant_method": "fp8", ...}`` (vLLM's
                       (+ ``input_scale`` static)    ``Fp8Config``; q/k/v, gate/up share one)
``block``              ``weight_scale_inv`` FP32     DeepSeek-V3's: ``fmt``, ``weight_block_size``
                       ``[ceil(out/128),             (transformers' ``FineGrainedFP8Config``,
                       ceil(in/128)]``                vLLM's ``Fp8Config``)
``compressed_tensors`` ``weight_scale`` FP32 ``[1]``  ``compressed-tensors`` ``float-quantized``
                       / ``[out, 1]`` / blocks       (its ``QuantizationConfig`` schema)
=====================  ===========================  =======================================

Every scale is a dequantization *multiplier* (``x ~= q * s``), ``weight_scale_inv`` included.
KV-cache scales are ``<attention>.k_scale`` / ``.v_scale`` (vLLM remaps them to
``.attn.k_scale``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LAYOUTS = ("per_tensor", "block", "compressed_tensors")
SCHEMES = ("dynamic", "static")
STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class ExportSpec:
    """A validated export request (see :func:`make_spec`).

    Attributes:
        layout: one of ``LAYOUTS``.
        activation_scheme: ``"dynamic"`` or ``"static"`` (static writes ``input_scale``).
        strategy: the weight scale granularity (``tensor``, ``channel`` or ``block``).
        kv_cache_scales: write ``k_scale`` / ``v_scale`` per attention layer.
    """

    layout: str
    activation_scheme: str = "dynamic"
    strategy: str = "tensor"
    kv_cache_scales: bool = False

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.layout == "block" else "weight_scale"

    @property
    def scalar_shape(self) -> tuple:
        """Shape of a per-tensor scale: ``[]`` for ``fp8`` (AutoFP8's), ``[1]`` for CT."""
        return (1,) if self.layout == "compressed_tensors" else ()

    @property
    def calibrates(self) -> bool:
        return self.activation_scheme == "static" or self.kv_cache_scales


def make_spec(layout, activation_scheme="dynamic", weight_strategy=None, kv_cache_scales=False,
              calibration_batches=None) -> ExportSpec:
    """Validate the export arguments (no collective; every rank raises alike).

    Example:
        >>> make_spec("block").strategy
        'block'
    """
    if layout not in LAYOUTS:
        raise ValueError(f"fp8_export must be one of {LAYOUTS}, got {layout!r}")
    if activation_scheme not in SCHEMES:
        raise ValueError(f"activation_scheme must be 'dynamic' or 'static', got "
                         f"{activation_scheme!r}")
    default = {"per_tensor": "tensor", "block": "block", "compressed_tensors": "tensor"}[layout]
    strategy = default if weight_strategy is None else weight_strategy
    if strategy not in STRATEGIES or (layout != "compressed_tensors" and strategy != default):
        allowed = STRATEGIES if layout == "compressed_tensors" else (default,)
        raise ValueError(f"weight_strategy={weight_strategy!r} is not available for "
                         f"fp8_export={layout!r}: use one of {allowed}")
    if activation_scheme == "static" and (layout == "block" or strategy != "tensor"):
        raise ValueError("activation_scheme='static' needs per-tensor weight scales: use "
                         "fp8_export='per_tensor' or compressed_tensors with weight_strategy="
                         "'tensor' (block and channel layouts quantize activations dynamically)")
    if not isinstance(kv_cache_scales, bool):
        raise TypeError(f"kv_cache_scales must be a bool, got {type(kv_cache_scales).__name__}")
    spec = ExportSpec(layout, activation_scheme, strategy, kv_cache_scales)
    if spec.calibrates and not calibration_batches:
        raise ValueError("activation_scheme='static' and kv_cache_scales=True observe amaxes in "
                         "forward: pass calibration_batches (a list of model input dicts)")
    return spec


def _float_args(strategy: str, dynamic: bool, **extra) -> dict:
    out = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
           "strategy": strategy, "dynamic": dynamic}
    out.update(extra)
    return out


def _ct_scheme(spec: ExportSpec) -> dict:
    if spec.strategy == "block":
        weights = _float_args("block", False, block_structure=[128, 128])
        inputs = _float_args("group", True, group_size=128)
    else:
        weights = _float_args(spec.strategy, False)
        inputs = _float_args("tensor", False, observer="static_minmax") \
            if spec.activation_scheme == "static" else _float_args("token", True)
    return {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
            "output_activations": None, "format": None}


def quantization_config(spec: ExportSpec, ignored: list[str]) -> dict:
    """The ``quantization_config`` entry of ``config.json``.

    Example:
        >>> quantization_config(make_spec("block"), ["lm_head"])["weight_block_size"]
        [128, 128]
    """
    if spec.layout == "per_tensor":
        return {"quant_method": "fp8", "activation_scheme": spec.activation_scheme,
                "ignored_layers": list(ignored)}
    if spec.layout == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "ignored_layers": list(ignored)}
    kv: Optional[dict] = _float_args("tensor", False) if spec.kv_cache_scales else None
    return {"config_groups": {"group_0": _ct_scheme(spec)}, "quant_method": "compressed-tensors",
            "kv_cache_scheme": kv, "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": list(ignored), "moe_sparsity_config": None}
