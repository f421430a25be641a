"""Colossal-AI's ``GeminiPlugin`` arguments (v0.5.0) over fp8boost's: validation and mapping.

:class:`GeminiPlugin` takes them by keyword; ``gemini_args`` checks the types, raises
``ValueError`` naming the fp8boost alternative for what fp8boost does not support, logs once
per process (INFO, key ``"colossal-args.gemini.<arg>"``) what fp8boost does instead when a
value that tunes Colossal-AI internals (chunks, auto placement, Shardformer kernels) is
passed, and returns the mapped values.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from fp8boost import plugins

from .common import LOSS_SCALE_DEFAULTS, SHARDFORMER_TUNING, check_bools, check_type, \
    log_info, log_tuning, loss_scale_args, map_fused_norm, pick, takes_colossal_args, \
    tuning_rows

#: The Colossal-AI arguments ``GeminiPlugin.__init__`` passes to ``gemini_args`` (by name).
GEMINI_ARGS = (
    "chunk_config_dict", "chunk_init_device", "placement_policy", "max_prefetch",
    "shard_param_frac", "warmup_non_model_data_ratio", "steady_cuda_cap_ratio",
    "master_weights", "pin_memory", "force_outputs_fp32", "strict_ddp_mode", "search_range_m",
    "hidden_dim", "min_chunk_size_m", "memstats", "gpu_margin_mem_ratio", "min_scale",
    "growth_factor", "backoff_factor", "hysteresis", "max_scale", "tp_size", "extra_dp_size",
    "enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
    "enable_sequence_parallelism", "enable_jit_fused", "enable_async_reduce", "verbose")

_CHUNKS = ("fp8boost has no chunks: FSDP2 shards each decoder block (and the root) as one "
           "unit, flat over the data-parallel ranks")
_AUTO = ("it tunes Colossal-AI's auto placement; fp8boost places by the offload fractions "
         "(offload_optim_frac/offload_param_frac)")


def _check_number(name: str, value: object, low: float, high: Optional[float]) -> None:
    check_type(name, value, (int, float), "a number")
    if value < low or high is not None and value > high:
        raise ValueError(f"{name} must be a number in [{low}, {high if high is not None else 'inf'}]"
                         f", got {value!r}")


def _check_int(name: str, value: object, low: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    check_type(name, value, (int,), f"an int >= {low}" + (" or None" if none_ok else ""))
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def gemini_args(precision: str, a: dict) -> dict:
    """Validate Colossal-AI's extra ``GeminiPlugin`` arguments ``a`` (by name, ``GEMINI_ARGS``;
    no collectives). Returns the mapped plugin attributes: ``loss_scale_kwargs`` (the fp16
    ``DynamicLossScaler`` keywords) and ``force_outputs_fp32``."""
    check_bools(**{n: a[n] for n in (
        "enable_async_reduce", "enable_fused_normalization", "enable_flash_attention",
        "master_weights", "pin_memory", "force_outputs_fp32", "strict_ddp_mode",
        "enable_all_optimization", "enable_sequence_parallelism", "enable_jit_fused",
        "verbose")})
    check_type("placement_policy", a["placement_policy"], (str,), '"static" or "auto"')
    if a["chunk_config_dict"] is not None:
        check_type("chunk_config_dict", a["chunk_config_dict"], (dict,), "a dict or None")
    if a["chunk_init_device"] is not None:
        check_type("chunk_init_device", a["chunk_init_device"], (torch.device, str),
                    "a torch.device or None")
    for name, low, high in (("shard_param_frac", 0.0, 1.0),
                            ("warmup_non_model_data_ratio", 0.0, 1.0),
                            ("steady_cuda_cap_ratio", 0.0, 1.0),
                            ("gpu_margin_mem_ratio", 0.0, 1.0), ("min_chunk_size_m", 0.0, None)):
        _check_number(name, a[name], low, high)
    for name, low in (("max_prefetch", 0), ("search_range_m", 0), ("tp_size", 1),
                      ("extra_dp_size", 1)):
        _check_int(name, a[name], low)
    _check_int("hidden_dim", a["hidden_dim"], 1, none_ok=True)
    if a["placement_policy"] not in ("static", "auto"):
        raise ValueError(f'placement_policy must be "static" or "auto", got '
                         f"{a['placement_policy']!r}")
    _unsupported(a)
    _gemini_tuning(a)
    return dict(force_outputs_fp32=a["force_outputs_fp32"], loss_scale_kwargs=loss_scale_args(
        "gemini", precision, **pick(a, LOSS_SCALE_DEFAULTS)))


def _unsupported(a: dict) -> None:
    """Values that would change what is computed: ValueError naming the alternative."""
    tp_size, extra_dp_size = a["tp_size"], a["extra_dp_size"]
    if tp_size > 1 or extra_dp_size > 1:
        raise ValueError(
            f"GeminiPlugin(tp_size={tp_size}, extra_dp_size={extra_dp_size}): fp8boost's "
            "GeminiPlugin shards over all ranks (ZeRO-3) without tensor parallelism or an extra "
            "data-parallel group; use HybridParallelPlugin(tp_size=..., zero_stage=...) "
            "instead (tensor parallelism with ZeRO across the replicas)")
    if a["shard_param_frac"] != 1.0:
        raise ValueError(
            f"shard_param_frac={a['shard_param_frac']}: fp8boost's GeminiPlugin shards every "
            "parameter (FSDP2, ZeRO-3) and cannot keep part of them replicated; use "
            "shard_param_frac=1.0, or LowLevelZeroPlugin for unsharded parameters")
    if not a["master_weights"]:
        raise ValueError(
            "master_weights=False is not supported: fp8boost's GeminiPlugin keeps FP32 master "
            "parameters (the FSDP2 shards themselves) and steps the optimizer on them; use "
            "master_weights=True, or LowLevelZeroPlugin(master_weights=False) to step the "
            "low-precision parameters directly")


def _gemini_tuning(a: dict) -> None:
    if a["placement_policy"] == "auto":
        log_info("gemini", "placement_policy",
                 'placement_policy="auto" is not used: fp8boost places parameters, gradients and '
                 "optimizer state by offload_optim_frac/offload_param_frac (0.0: GPU, 1.0: CPU "
                 "through FSDP2's CPUOffloadPolicy)")
    if a["enable_sequence_parallelism"]:
        log_info("gemini", "enable_sequence_parallelism",
                 "enable_sequence_parallelism=True is ignored with tp_size=1, as in Colossal-AI "
                 "(it needs tensor parallelism); for sequence parallelism use "
                 "HybridParallelPlugin(tp_size=..., enable_sequence_parallelism=True)")
    log_tuning("gemini", [
        ("max_prefetch", a["max_prefetch"], 0, "FSDP2 prefetches the next block's all-gather "
         "itself"),
        ("enable_async_reduce", a["enable_async_reduce"], True, "FSDP2's reduce-scatter always "
         "overlaps backward"),
        ("warmup_non_model_data_ratio", a["warmup_non_model_data_ratio"], 0.8, _AUTO),
        ("steady_cuda_cap_ratio", a["steady_cuda_cap_ratio"], 0.9, _AUTO),
        ("gpu_margin_mem_ratio", a["gpu_margin_mem_ratio"], 0.0, "it sizes Colossal-AI's "
         "hybrid CPU/GPU optimizer under auto placement; fp8boost steps the optimizer wholly "
         "on the GPU, or wholly on the CPU with the offload fractions at 1.0"),
        ("memstats", a["memstats"], None, "it feeds Colossal-AI's auto placement; fp8boost "
         "places by the offload fractions"),
        ("chunk_config_dict", a["chunk_config_dict"], None, _CHUNKS),
        ("chunk_init_device", a["chunk_init_device"], None, "fp8boost builds the shards on the "
         "current device (on the CPU with the offload fractions at 1.0)"),
        ("search_range_m", a["search_range_m"], 32, _CHUNKS),
        ("hidden_dim", a["hidden_dim"], None, _CHUNKS),
        ("min_chunk_size_m", a["min_chunk_size_m"], 32, _CHUNKS),
        ("pin_memory", a["pin_memory"], False, "FSDP2's CPUOffloadPolicy pins the CPU shards "
         "itself when offloading"),
        ("strict_ddp_mode", a["strict_ddp_mode"], False, "fp8boost's GeminiPlugin is "
         "data-parallel only (no other parallelism) anyway"),
        ("verbose", a["verbose"], False, "fp8boost reports through the 'fp8boost' loggers "
         "(plugin.comm_report for FP8 comm)"),
    ] + tuning_rows(a, SHARDFORMER_TUNING))


def _fp32(x):
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, dict):  # a transformers ModelOutput too: set in place, keeps its class
        for key in list(x.keys()):
            x[key] = _fp32(x[key])
        return x
    if isinstance(x, (list, tuple)):
        values = [_fp32(v) for v in x]
        return type(x)(*values) if hasattr(x, "_fields") else type(x)(values)
    return x


def outputs_fp32_hook(module, args, output):
    """``force_outputs_fp32``: cast the floating-point tensors of the model's output to FP32
    (Colossal-AI's ``GeminiDDP`` does the same after forward)."""
    return _fp32(output)


@takes_colossal_args(positional=("precision", "max_norm", "norm_type"))
class GeminiPlugin(plugins.GeminiPlugin):
    """fp8boost's ``GeminiPlugin`` that also takes Colossal-AI's arguments (by keyword).

    Args:
        min_scale, growth_factor, backoff_factor, max_scale: fp16 loss scaling, as Colossal-AI
            (``hysteresis``: only 1 is implemented; other values log once under fp16).
        force_outputs_fp32: cast the model's floating-point outputs to FP32 (as Colossal-AI).
        shard_param_frac, placement_policy, max_prefetch, enable_async_reduce,
            warmup_non_model_data_ratio, enable_fused_normalization, enable_flash_attention,
            tp_size, extra_dp_size, chunk_config_dict, chunk_init_device, steady_cuda_cap_ratio,
            master_weights, pin_memory, strict_ddp_mode, search_range_m, hidden_dim,
            min_chunk_size_m, memstats, gpu_margin_mem_ratio, enable_all_optimization,
            enable_sequence_parallelism, enable_jit_fused, verbose: :func:`gemini_args`:
            ``shard_param_frac`` must be 1.0 (every parameter sharded), ``master_weights``
            True (FP32 masters are the FSDP2 shards; use ``LowLevelZeroPlugin`` without),
            ``tp_size``/``extra_dp_size`` > 1 raise (use ``HybridParallelPlugin``);
            ``enable_sequence_parallelism`` is ignored at ``tp_size=1`` as in Colossal-AI (INFO
            once); the others tune Colossal-AI internals and log once what fp8boost does
            instead. Colossal-AI's default ``precision="fp16"`` differs from fp8boost's
            (``"bf16"``: FP8 training wants BF16).
        **native: ``fp8boost.plugins.GeminiPlugin``'s arguments.
    """

    def __init__(self, *, shard_param_frac: float = 1.0, placement_policy: str = "static",
                 max_prefetch: int = 0, enable_async_reduce: bool = True,
                 warmup_non_model_data_ratio: float = 0.8,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 tp_size: int = 1, extra_dp_size: int = 1,
                 chunk_config_dict: Optional[dict] = None,
                 chunk_init_device: Optional[torch.device] = None,
                 steady_cuda_cap_ratio: float = 0.9, master_weights: bool = True,
                 pin_memory: bool = False, force_outputs_fp32: bool = False,
                 strict_ddp_mode: bool = False, search_range_m: int = 32,
                 hidden_dim: Optional[int] = None, min_chunk_size_m: float = 32,
                 memstats: Any = None, gpu_margin_mem_ratio: float = 0.0, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, hysteresis: int = 2,
                 max_scale: float = 2 ** 32, enable_all_optimization: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 verbose: bool = False, **native) -> None:
        colossal = {name: value for name, value in locals().items() if name in GEMINI_ARGS}
        map_fused_norm("gemini", native, enable_fused_normalization, enable_all_optimization)
        super().__init__(**native)
        mapped = gemini_args(self.precision, colossal)
        self.loss_scale_kwargs = mapped["loss_scale_kwargs"]
        self.force_outputs_fp32 = mapped["force_outputs_fp32"]

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = super().parallelize(model, device)
        if self.force_outputs_fp32:
            model.register_forward_hook(outputs_fp32_hook)
        return model
