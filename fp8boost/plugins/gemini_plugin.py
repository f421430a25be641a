"""GeminiPlugin: ZeRO-3 on FSDP2 (``fully_shard`` per block + root), with Colossal-AI's names."""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from fp8boost import _state

from .colossal_args import make_scaler
from .colossal_args_gemini import GEMINI_ARGS, gemini_args, outputs_fp32_hook
from .fsdp_plugin_base import FsdpPluginBase
from .options import check_bool, takes_plugin_options

logger = logging.getLogger("fp8boost.plugins")


def _check_frac(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if 0.0 < value < 1.0:
        raise ValueError(f"{name}={value}: partial offload is not supported yet; use 0.0 (all on "
                         "the GPU) or 1.0 (all on the CPU through FSDP2's CPUOffloadPolicy)")
    return float(value)


@takes_plugin_options(positional=("precision", "max_norm", "norm_type"))
class GeminiPlugin(FsdpPluginBase):
    """ZeRO-3: parameters, gradients and optimizer state sharded 1/dp, on FSDP2.

    Each decoder block (and the root) is a ``fully_shard`` unit: its FP32 master parameters
    are sharded over the data-parallel ranks, all-gathered in ``precision`` for forward and
    backward, and gradients are reduce-scattered in FP32. The user's optimizer is rebound to
    the sharded parameters, so its state is sharded too.

    Args:
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        max_norm: clip the global gradient norm (over all shards) at every step; 0 disables.
        norm_type: the norm for clipping.
        offload_optim_frac, offload_param_frac: 0.0 or 1.0. Any 1.0 keeps parameters,
            gradients and optimizer state on the CPU (FSDP2 ``CPUOffloadPolicy``: the optimizer
            step runs on the CPU); fractions in between raise.
        enable_gradient_accumulation: allow ``booster.no_sync`` (local accumulation, no
            reduce-scatter) for all but the last micro-batch.
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); False keeps
            them until backward (more memory, one all-gather less).
        use_fp8: run eligible linear layers' GEMMs in FP8 (``convert_to_fp8``).
        fp8_communication: all-gather the weights of FP8 linear layers as FP8 bytes, one scale
            per weight (all scales refreshed in one all-reduce after each step). Gradients stay
            FP32 on the wire unless ``fp8_reduce_scatter``: FP8 reduce-scatter measured slower
            on NVLink (the reason is logged once and kept in ``plugin.comm_report``).
        fp8_reduce_scatter: reduce-scatter gradients as FP8 (e5m2, per-chunk scales) too.
        fp8_config: FP8 recipe for ``use_fp8``. comm_config: ``Fp8CommConfig``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.
        min_scale, growth_factor, backoff_factor, max_scale: fp16 loss scaling, as Colossal-AI
            (``hysteresis``: only 1 is implemented; other values log once under fp16).
        force_outputs_fp32: cast the model's floating-point outputs to FP32 (as Colossal-AI).
        shard_param_frac, placement_policy, max_prefetch, enable_async_reduce,
            warmup_non_model_data_ratio, enable_fused_normalization, enable_flash_attention,
            tp_size, extra_dp_size, chunk_config_dict, chunk_init_device, steady_cuda_cap_ratio,
            master_weights, pin_memory, strict_ddp_mode, search_range_m, hidden_dim,
            min_chunk_size_m, memstats, gpu_margin_mem_ratio, enable_all_optimization,
            enable_sequence_parallelism, enable_jit_fused, verbose: Colossal-AI's arguments,
            taken so its scripts run (``colossal_args_gemini.gemini_args``):
            ``shard_param_frac`` must be 1.0 (every parameter sharded), ``master_weights``
            True (FP32 masters are the FSDP2 shards; use ``LowLevelZeroPlugin`` without),
            ``tp_size``/``extra_dp_size`` > 1 raise (use ``HybridParallelPlugin``);
            ``enable_sequence_parallelism`` is ignored at ``tp_size=1`` as in Colossal-AI (INFO
            once); the others tune Colossal-AI internals and log once what fp8boost does
            instead. Colossal-AI's default ``precision="fp16"`` differs from fp8boost's
            (``"bf16"``: FP8 training wants BF16).

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import GeminiPlugin
        >>> booster = Booster(plugin=GeminiPlugin(precision="bf16", use_fp8=True))
        >>> # model, optimizer, *_ = booster.boost(model, optimizer)
    """

    def __init__(self, norm_type: float = 2.0, *, offload_optim_frac: float = 0.0,
                 offload_param_frac: float = 0.0, enable_gradient_accumulation: bool = False,
                 reshard_after_forward: bool = True, shard_param_frac: float = 1.0,
                 placement_policy: str = "static", max_prefetch: int = 0,
                 enable_async_reduce: bool = True, warmup_non_model_data_ratio: float = 0.8,
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
                 verbose: bool = False, **options) -> None:
        colossal = {name: value for name, value in locals().items() if name in GEMINI_ARGS}
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        # Colossal-AI's own arguments (colossal_args_gemini): checked, mapped or logged.
        mapped = gemini_args(self.precision, colossal)
        self.loss_scale_kwargs = mapped["loss_scale_kwargs"]
        self.force_outputs_fp32 = mapped["force_outputs_fp32"]
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or norm_type <= 0:
            raise ValueError(f"norm_type must be a number > 0 (2.0: L2), got {norm_type!r}")
        self.norm_type = float(norm_type)
        optim_frac = _check_frac("offload_optim_frac", offload_optim_frac)
        param_frac = _check_frac("offload_param_frac", offload_param_frac)
        for name, value in (("enable_gradient_accumulation", enable_gradient_accumulation),
                            ("reshard_after_forward", reshard_after_forward)):
            check_bool(name, value)
        # FSDP2 offloads parameters, gradients and optimizer state together.
        self.cpu_offload = optim_frac == 1.0 or param_frac == 1.0
        if optim_frac != param_frac:
            _state.log_once(logger, "gemini-offload-together",
                            "fp8boost: FSDP2's CPUOffloadPolicy moves parameters, gradients and "
                            "optimizer state to the CPU together, so offload_optim_frac="
                            f"{optim_frac} with offload_param_frac={param_frac} offloads all of "
                            "them (as both = 1.0)")
        self.offload_optim_frac, self.offload_param_frac = optim_frac, param_frac
        self.allow_no_sync = enable_gradient_accumulation
        self.reshard_after_forward = reshard_after_forward

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = super().parallelize(model, device)
        if self.force_outputs_fp32:
            model.register_forward_hook(outputs_fp32_hook)
        return model

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device):
        opt = super().wrap_optimizer(model, optimizer, device)
        # Colossal-AI's fp16 loss-scaling arguments (min_scale, growth_factor, ...).
        opt.loss_scaler = make_scaler(self.precision, self.initial_scale, self.growth_interval,
                                      self.loss_scale_kwargs)
        return opt

    def __repr__(self) -> str:
        return (f"GeminiPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, cpu_offload={self.cpu_offload})")
