"""LowLevelZeroPlugin: ZeRO stage 1/2 over the data-parallel ranks (``parallel/zero``)."""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import torch
from torch import nn

from fp8boost.parallel.comm.plan import PARAM_GATHER
from fp8boost.parallel.distributed import broadcast_module
from fp8boost.parallel.zero import ZeroOptimizer

from .delayed_amax import reduce_delayed_amax
from .options import check_bool, check_bucket_size, takes_plugin_options
from .plugin_base import Plugin
from .precision import make_loss_scaler

FP8_PARAM_GATHER = PARAM_GATHER  # the plan (parallel/comm/plan.py) resolves the choice


@takes_plugin_options(positional=("stage", "precision", "use_fp8", "fp8_communication"))
class LowLevelZeroPlugin(Plugin):
    """ZeRO-1/2: replicated low-precision params, FP32 master weights + optimizer state sharded.

    Args:
        stage: 1 (gradients all-reduced, kept whole) or 2 (gradients reduce-scattered in buckets
            during backward; each rank keeps only its 1/dp of them).
        precision: ``"bf16"`` (default), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        use_fp8: run eligible linear layers' GEMMs in FP8 (``convert_to_fp8``).
        fp8_communication: all-gather updated parameters in FP8 (e4m3) as chosen by
            ``fp8_param_gather`` (FP8 weights feed their FP8 GEMMs directly). Gradients reduce
            in their own dtype unless ``fp8_reduce_scatter``: FP8 gradients measured slower on
            NVLink (the reason is logged once and kept in ``plugin.comm_report``).
        fp8_reduce_scatter: with ``fp8_communication``, reduce-scatter / all-reduce gradients
            with FP8 (e5m2, per-chunk scales) payloads too: for slow (inter-node) links.
        overlap_communication: launch gradient buckets from backward hooks as they fill.
        overlap_allgather: after ``optimizer.step()`` only launch the updated parameters'
            all-gather; each module unpacks its own before its forward, so the gather overlaps
            the next forward (Colossal-AI's argument; ``fp8boost.parallel.zero.overlap``).
            Costs one more copy of the parameters until they are unpacked, and parameters read
            by hand between ``step()`` and the next forward need ``optimizer.wait_params()``.
        reduce_bucket_size_in_m: bucket size in millions (2**20) of elements. Default (None):
            12, or 64 with ``fp8_communication``: each FP8 collective carries a fixed cost of
            about 1 ms (scale, cast and decode launches), so FP8 wants fewer, larger buckets.
            Measured on 2xH200, Llama-7B shapes, 8 layers: ZeRO-2 + FP8 comm ran 21.5k
            tokens/s/GPU with 12M buckets and 39.6k with 64M (bench/results/train_2gpu_*.json).
        max_norm: clip gradients to this global norm (across shards) at every step; 0 disables.
        cpu_offload: keep master weights and optimizer state on the CPU (the step runs there).
        master_weights: keep FP32 master weights (False: step the low-precision chunks directly).
        initial_scale, growth_interval: FP16 dynamic loss scaling.
        fp8_config: FP8 recipe for ``use_fp8`` (default ``Fp8Config()``).
        comm_config: ``Fp8CommConfig`` for ``fp8_communication``.
        fp8_param_gather: which parameters the post-step all-gather sends in FP8 when
            ``fp8_communication``: ``"fp8_linear"`` (default) only the weights of ``Fp8Linear``
            layers, whose consumer is an FP8 GEMM that quantizes them to e4m3 anyway;
            ``"all"`` every parameter (most bytes saved, but e4m3 cannot hold small updates of
            e.g. norm weights near 1.0, where its step is 0.125); ``"none"`` gradients only.

    Colossal-AI's own arguments (``norm_type``, ``communication_dtype``, loss-scaling details,
    ...) are taken by ``fp8boost.colossal.booster.plugin.LowLevelZeroPlugin``, which maps them
    onto these. Every argument is checked here, before any process group is touched.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import LowLevelZeroPlugin
        >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))
        >>> # model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
    """

    #: more fp16 ``DynamicLossScaler`` keywords (``min_scale``, ...; Colossal-AI's class sets
    #: them from its arguments); empty: the scaler's defaults
    loss_scale_kwargs: Mapping[str, float] = MappingProxyType({})

    def __init__(self, stage: int = 2, *, overlap_communication: bool = True,
                 reduce_bucket_size_in_m: Optional[float] = None, cpu_offload: bool = False,
                 master_weights: bool = True, fp8_param_gather: str = "fp8_linear",
                 overlap_allgather: bool = False, **options) -> None:
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-3 is GeminiPlugin), got {stage!r}")
        for name, value in (("overlap_communication", overlap_communication),
                            ("cpu_offload", cpu_offload), ("master_weights", master_weights),
                            ("overlap_allgather", overlap_allgather)):
            check_bool(name, value)
        if fp8_param_gather not in FP8_PARAM_GATHER:
            raise ValueError(f"fp8_param_gather={fp8_param_gather!r} is not supported; use one of "
                             f"{FP8_PARAM_GATHER}")
        self.reduce_bucket_numel = check_bucket_size(reduce_bucket_size_in_m,
                                                     self.fp8_communication)
        self.stage, self.fp8_param_gather = stage, fp8_param_gather
        self.overlap_communication, self.overlap_allgather = (overlap_communication,
                                                              overlap_allgather)
        self.cpu_offload, self.master_weights = cpu_offload, master_weights
        if self.fp8_communication:
            from fp8boost.parallel.comm import collectives  # noqa: F401 - fail now, not mid-boost

    def __repr__(self) -> str:
        return (f"LowLevelZeroPlugin(stage={self.stage}, precision={self.precision!r}, "
                f"use_fp8={self.use_fp8}, fp8_communication={self.fp8_communication}, "
                f"cpu_offload={self.cpu_offload})")

    # configure's steps (Plugin.configure): the default build (move, cast) and FP8 conversion.
    def validate(self, model: nn.Module, optimizer) -> None:
        if optimizer is not None:
            ZeroOptimizer.validate(optimizer)

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        group = self.topology().group("dp")
        broadcast_module(model, group)  # every replica starts from dp rank 0's weights
        reduce_delayed_amax(model, group)  # one delayed-scaling history on every rank
        return model

    comm_engine = "zero"

    def comm_plan_args(self, model: nn.Module) -> dict:
        # which parameters the post-step all-gather sends in FP8 (the plan resolves it)
        return {"zero_stage": self.stage, "param_gather": self.fp8_param_gather}

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device) -> ZeroOptimizer:
        opt = ZeroOptimizer(
            optimizer, dp_group=self.topology().group("dp"), stage=self.stage,
            master_weights=self.master_weights, overlap_communication=self.overlap_communication,
            reduce_bucket_numel=self.reduce_bucket_numel, max_norm=self.max_norm,
            cpu_offload=self.cpu_offload,
            loss_scaler=make_loss_scaler(self.precision, self.initial_scale,
                                         self.growth_interval, **self.loss_scale_kwargs),
            comm_plan=self.comm_plan, fp8_params=self.comm_plan.fp8_gather_params(model),
            overlap_allgather=self.overlap_allgather)
        opt.bind_fp8_layers(model)  # FP8-gathered weights feed their FP8 GEMMs directly
        opt.bind_overlap(model)  # overlap_allgather: modules unpack their own before forward
        return opt
