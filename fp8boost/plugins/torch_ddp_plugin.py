"""TorchDDPPlugin: ``torch.nn.parallel.DistributedDataParallel`` (+ an FP8 gradient comm hook)."""
from __future__ import annotations

import contextlib
from typing import ContextManager, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fp8boost.fp8.config import Fp8Config

from .plugin_base import Boosted, Plugin, check_bool, check_boost_args, default_device, \
    init_distributed, shard_dataloader
from .precision import MIXED_PRECISIONS, check_comm_config, check_fp8_config, check_max_norm, \
    check_precision, prepare_model, wrap_optimizer
from .wrappers import DTYPES, ModelWrapper


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
        static_graph: passed to ``DistributedDataParallel``.
        fp8_config: FP8 recipe for ``use_fp8`` (default ``Fp8Config()``).
        comm_config: ``Fp8CommConfig`` for ``fp8_communication``.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import TorchDDPPlugin
        >>> booster = Booster(plugin=TorchDDPPlugin(precision="bf16", use_fp8=True))
        >>> # model, optimizer, _, loader, _ = booster.boost(model, optimizer, dataloader=loader)
    """

    supported_precisions = ("fp32", "bf16", "fp16")

    def __init__(self, use_fp8: bool = False, fp8_communication: bool = False, *,
                 precision: Optional[str] = None, max_norm: float = 0.0,
                 broadcast_buffers: bool = True, bucket_cap_mb: int = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = True,
                 static_graph: bool = False, fp8_config: Optional[Fp8Config] = None,
                 comm_config=None) -> None:
        for name, value in (("use_fp8", use_fp8), ("fp8_communication", fp8_communication),
                            ("broadcast_buffers", broadcast_buffers),
                            ("find_unused_parameters", find_unused_parameters),
                            ("gradient_as_bucket_view", gradient_as_bucket_view),
                            ("static_graph", static_graph)):
            check_bool(name, value)
        if precision is not None:
            check_precision(precision, self.supported_precisions)
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.use_fp8, self.fp8_communication = use_fp8, fp8_communication
        self._user_precision = precision is not None
        self.precision = precision or "fp32"
        self.max_norm = check_max_norm(max_norm)
        self.fp8_config = check_fp8_config(fp8_config)
        self.comm_config = check_comm_config(comm_config)
        if fp8_communication:
            from fp8boost.parallel.ddp import hooks as ddp_hooks  # noqa: F401 - fail now, not mid-boost
        self.ddp_kwargs = dict(bucket_cap_mb=bucket_cap_mb,
                               find_unused_parameters=find_unused_parameters,
                               gradient_as_bucket_view=gradient_as_bucket_view,
                               static_graph=static_graph)
        if not broadcast_buffers:  # only pass the non-default: torch >= 2.13 warns on the kwarg
            self.ddp_kwargs["broadcast_buffers"] = False
        self.fp8_report = None

    def __repr__(self) -> str:
        return (f"TorchDDPPlugin(precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication}, max_norm={self.max_norm})")

    def control_precision(self) -> bool:
        return self._user_precision

    def set_precision(self, mixed_precision: str) -> None:
        if self._user_precision:
            super().set_precision(mixed_precision)
        check_precision(mixed_precision, MIXED_PRECISIONS)
        if mixed_precision == "fp8":
            self.precision, self.use_fp8 = "bf16", True
        else:
            self.precision = mixed_precision

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        if optimizer is not None and self.precision != "fp32":
            from fp8boost.parallel.zero import ZeroOptimizer
            ZeroOptimizer.validate(optimizer)
        init_distributed()
        device = torch.device(device) if device is not None else default_device()
        self._topology = None  # a fresh mesh for this run's process group
        group = self.topology(device).group("dp")
        self.fp8_report = prepare_model(model, self.precision, self.use_fp8, self.fp8_config, device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  process_group=group, **self.ddp_kwargs)
        if self.fp8_communication:
            self._register_fp8_hook(ddp)
        wrapped = ModelWrapper(ddp, DTYPES[self.precision])
        opt = wrap_optimizer(optimizer, self.precision, self.max_norm)
        wrapped.boosted_optimizers = [opt] if opt is not None else []
        loader = shard_dataloader(dataloader, self.dp_world_size, self.dp_rank)
        return wrapped, opt, criterion, loader, lr_scheduler

    def _register_fp8_hook(self, ddp: DDP) -> None:
        from fp8boost.parallel.ddp.hooks import register_fp8_comm_hook
        register_fp8_comm_hook(ddp, config=self.comm_config)  # averages over DDP's own group

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        if not isinstance(model, ModelWrapper) or not isinstance(model.module, DDP):
            raise ValueError("TorchDDPPlugin.no_sync needs the model returned by booster.boost()")
        stack = contextlib.ExitStack()
        stack.enter_context(model.module.no_sync())
        if optimizer is not None:
            stack.enter_context(optimizer.no_sync())
        return stack

