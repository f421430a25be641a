"""TorchDDPPlugin: ``torch.nn.parallel.DistributedDataParallel`` (+ an FP8 gradient comm hook)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import ContextManager, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fp8boost.parallel.ddp.hooks import register_fp8_comm_hook
from fp8boost.parallel.wrappers import ModelWrapper

from .options import check_bool, check_precision, takes_plugin_options
from .plugin_base import Plugin
from .precision import MIXED_PRECISIONS


# No loss-scaling arguments (fp16 scales from PluginOptions' defaults) and no
# fp8_reduce_scatter: with fp8_communication the FP8 hook already all-reduces gradients in FP8.
@takes_plugin_options(positional=("use_fp8", "fp8_communication"),
                      without=("fp8_reduce_scatter", "initial_scale", "growth_interval"))
class TorchDDPPlugin(Plugin):
    """Data parallelism with PyTorch DDP: full replicas, gradients all-reduced in buckets.

    Args:
        use_fp8: run eligible linear layers' GEMMs in FP8 (``convert_to_fp8``).
        fp8_communication: all-reduce gradients with FP8 payloads
            (``fp8boost.parallel.ddp.hooks.fp8_allreduce_hook``).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (BF16/FP16 keep FP32 master weights in
            the optimizer; FP16 adds dynamic loss scaling). None (default) takes
            ``Booster(mixed_precision=...)``, FP32 if that is unset too.
        max_norm: clip gradients to this global norm at every step (0 disables).
        broadcast_buffers, bucket_cap_mb, find_unused_parameters, gradient_as_bucket_view,
        static_graph: passed to ``DistributedDataParallel`` (``gradient_as_bucket_view``
            defaults to True here, False in Colossal-AI: it saves one gradient copy).
        fp8_config: FP8 recipe for ``use_fp8`` (default ``Fp8Config()``).
        comm_config: ``Fp8CommConfig`` for ``fp8_communication``.

    Colossal-AI's ``check_reduction`` is taken by
    ``fp8boost.colossal.booster.plugin.TorchDDPPlugin``.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import TorchDDPPlugin
        >>> booster = Booster(plugin=TorchDDPPlugin(precision="bf16", use_fp8=True))
        >>> # model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
    """

    def __init__(self, *, precision: Optional[str] = None, broadcast_buffers: bool = True,
                 bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 gradient_as_bucket_view: bool = True, static_graph: bool = False,
                 **options) -> None:
        # precision=None: Booster(mixed_precision=...) decides (set_precision), else FP32.
        super().__init__(precision="fp32" if precision is None else precision, **options)
        self._user_precision = precision is not None
        for name, value in (("broadcast_buffers", broadcast_buffers),
                            ("find_unused_parameters", find_unused_parameters),
                            ("gradient_as_bucket_view", gradient_as_bucket_view),
                            ("static_graph", static_graph)):
            check_bool(name, value)
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if self.fp8_communication:
            from fp8boost.parallel.ddp import hooks as ddp_hooks  # noqa: F401 - fail now, not mid-boost
        self.ddp_kwargs = dict(bucket_cap_mb=bucket_cap_mb,
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view,
                               static_graph=static_graph)
        if not broadcast_buffers:  # only pass the non-default: torch >= 2.13 warns on the kwarg
            self.ddp_kwargs["broadcast_buffers"] = False

    def __repr__(self) -> str:
        return (f"TorchDDPPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, max_norm={self.max_norm})")

    def control_precision(self) -> bool:
        return self._user_precision

    def set_precision(self, mixed_precision: str) -> None:
        if self._user_precision:
            super().set_precision(mixed_precision)
        check_precision(mixed_precision, MIXED_PRECISIONS)
        fp8 = mixed_precision == "fp8"
        self.options = dataclasses.replace(self.options, precision="bf16" if fp8 else mixed_precision,
                                           use_fp8=self.use_fp8 or fp8)

    comm_engine = "ddp"  # the plan: gradients through the FP8 hook, nothing to gather

    # configure's steps (Plugin.configure): the defaults but for DDP itself.
    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  process_group=self.topology().group("dp"), **self.ddp_kwargs)
        if self.comm_plan.grad_reduce.fp8:  # averages over DDP's own group
            register_fp8_comm_hook(ddp, config=self.comm_plan.config)
        return ddp

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        if not isinstance(model, ModelWrapper) or not isinstance(model.module, DDP):
            raise ValueError("TorchDDPPlugin.no_sync needs the model returned by booster.boost()")
        stack = contextlib.ExitStack()
        stack.enter_context(model.module.no_sync())
        if optimizer is not None:
            stack.enter_context(optimizer.no_sync())
        return stack

