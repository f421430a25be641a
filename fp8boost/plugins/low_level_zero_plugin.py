"""LowLevelZeroPlugin: ZeRO stage 1/2 over the data-parallel ranks (``parallel/zero``)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.fp8.config import Fp8Config
from fp8boost.parallel.zero import ZeroOptimizer

from .delayed_amax import reduce_delayed_amax
from .plugin_base import Boosted, Plugin, check_bool, check_boost_args, default_device, \
    init_distributed, shard_dataloader
from .precision import check_comm_config, check_fp8_config, check_max_norm, check_precision, \
    make_loss_scaler, prepare_model
from .wrappers import DTYPES, ModelWrapper

_MIB = 1024 * 1024
FP8_PARAM_GATHER = ("fp8_linear", "all", "none")


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

    Every argument is checked here, before any process group is touched.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import LowLevelZeroPlugin
        >>> booster = Booster(plugin=LowLevelZeroPlugin(stage=2, use_fp8=True))
        >>> # model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
    """

    supported_precisions = ("fp32", "bf16", "fp16")

    def __init__(self, stage: int = 2, precision: str = "bf16", use_fp8: bool = False,
                 fp8_communication: bool = False, *, overlap_communication: bool = True,
                 reduce_bucket_size_in_m: Optional[float] = None, max_norm: float = 0.0,
                 cpu_offload: bool = False, master_weights: bool = True,
                 initial_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 fp8_config: Optional[Fp8Config] = None, comm_config=None,
                 fp8_param_gather: str = "fp8_linear", fp8_reduce_scatter: bool = False) -> None:
        if isinstance(stage, bool) or stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-3 is GeminiPlugin), got {stage!r}")
        check_precision(precision, self.supported_precisions)
        for name, value in (("use_fp8", use_fp8), ("fp8_communication", fp8_communication),
                            ("overlap_communication", overlap_communication),
                            ("cpu_offload", cpu_offload), ("master_weights", master_weights),
                            ("fp8_reduce_scatter", fp8_reduce_scatter)):
            check_bool(name, value)
        if fp8_reduce_scatter and not fp8_communication:
            raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
        if reduce_bucket_size_in_m is None:
            reduce_bucket_size_in_m = 64 if fp8_communication else 12
        if isinstance(reduce_bucket_size_in_m, bool) or \
                not isinstance(reduce_bucket_size_in_m, (int, float)) or reduce_bucket_size_in_m <= 0:
            raise ValueError("reduce_bucket_size_in_m must be > 0 (millions of elements), got "
                             f"{reduce_bucket_size_in_m!r}")
        if not isinstance(initial_scale, (int, float)) or initial_scale <= 0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if fp8_param_gather not in FP8_PARAM_GATHER:
            raise ValueError(f"fp8_param_gather={fp8_param_gather!r} is not supported; use one of "
                             f"{FP8_PARAM_GATHER}")
        self.fp8_param_gather = fp8_param_gather
        self.fp8_reduce_scatter = fp8_reduce_scatter
        self.comm_report: dict = {}
        self.stage, self.precision = stage, precision
        self.use_fp8, self.fp8_communication = use_fp8, fp8_communication
        self.overlap_communication = overlap_communication
        self.reduce_bucket_numel = max(1, int(reduce_bucket_size_in_m * _MIB))
        self.max_norm = check_max_norm(max_norm)
        self.cpu_offload, self.master_weights = cpu_offload, master_weights
        self.initial_scale, self.growth_interval = float(initial_scale), growth_interval
        self.fp8_config = check_fp8_config(fp8_config)
        self.comm_config = check_comm_config(comm_config)
        if fp8_communication:
            from fp8boost.parallel.comm import collectives  # noqa: F401 - fail now, not mid-boost
        self.fp8_report = None

    def __repr__(self) -> str:
        return (f"LowLevelZeroPlugin(stage={self.stage}, precision={self.precision!r}, "
                f"use_fp8={self.use_fp8}, fp8_communication={self.fp8_communication}, "
                f"cpu_offload={self.cpu_offload})")

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        if optimizer is not None:
            ZeroOptimizer.validate(optimizer)
        init_distributed()
        device = torch.device(device) if device is not None else default_device()
        self._topology = None  # a fresh mesh for this run's process group
        group = self.topology(device).group("dp")
        self.fp8_report = prepare_model(model, self.precision, self.use_fp8, self.fp8_config, device)
        if self.dp_size > 1:
            _broadcast_module(model, group)
            reduce_delayed_amax(model, group)  # one delayed-scaling history on every rank
        opt = None
        if optimizer is not None:
            opt = ZeroOptimizer(
                optimizer, dp_group=group, stage=self.stage, master_weights=self.master_weights,
                overlap_communication=self.overlap_communication,
                reduce_bucket_numel=self.reduce_bucket_numel, max_norm=self.max_norm,
                cpu_offload=self.cpu_offload,
                loss_scaler=make_loss_scaler(self.precision, self.initial_scale, self.growth_interval),
                fp8_communication=self.fp8_communication, comm_config=self.comm_config,
                fp8_params=self._fp8_gather_params(model),
                fp8_reduce_scatter=self.fp8_reduce_scatter)
            self.comm_report = opt.comm_report
            opt.bind_fp8_layers(model)  # FP8-gathered weights feed their FP8 GEMMs directly
        wrapped = ModelWrapper(model, DTYPES[self.precision])
        wrapped.boosted_optimizers = [opt] if opt is not None else []
        loader = shard_dataloader(dataloader, self.dp_world_size, self.dp_rank)
        return wrapped, opt, criterion, loader, lr_scheduler

    def _fp8_gather_params(self, model: nn.Module) -> Optional[list]:
        if self.fp8_param_gather == "all":
            return None
        if self.fp8_param_gather == "none":
            return []
        from fp8boost.fp8.backends import warn_once
        from fp8boost.fp8.linear import Fp8Linear
        weights = [m.weight for m in model.modules() if isinstance(m, Fp8Linear)]
        if self.fp8_communication and not weights:
            warn_once("zero_fp8_gather_none",
                      "LowLevelZeroPlugin(fp8_communication=True): the model has no Fp8Linear "
                      "layers (use_fp8=False), so only gradients travel in FP8 and parameters "
                      "are all-gathered in their own dtype; pass fp8_param_gather='all' to send "
                      "every parameter in FP8")
        return weights


def _broadcast_module(model: nn.Module, group) -> None:
    """Make every replica start from rank 0's parameters and buffers (like DDP does)."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                dist.broadcast(t.view(torch.uint8), src, group=group)  # gloo has no FP8 type
            else:
                dist.broadcast(t, src, group=group)
