"""What GeminiPlugin and TorchFSDPPlugin share: FSDP2 over the mesh's dp dimension.

FP32 master parameters are the sharded FSDP2 parameters themselves (1/dp per rank), so the
user's optimizer, rebuilt on them, keeps its state sharded 1/dp too. Forward and backward run
in ``precision`` through ``MixedPrecisionPolicy``; gradients reduce-scatter in FP32.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import ContextManager, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.parallel.comm.report import GRAD_REDUCE, PARAM_ALL_GATHER, CommReport
from fp8boost.parallel.zero.loss_scaler import DynamicLossScaler
from fp8boost.parallel.zero.optimizer import OptimizerProxy

from .delayed_amax import reduce_delayed_amax
from .distributed import broadcast_module
from .plugin_base import Plugin
from .precision import make_loss_scaler
from .wrappers import DTYPES, cast_params_

logger = logging.getLogger("fp8boost.plugins")

#: Why gradients do not reduce-scatter in FP8 by default (BENCHMARKS.md section 5).
FP8_RS_REASON = ("FP8 reduce-scatter measured slower than FP32/BF16 on 2xH200 NVLink at every "
                 "size up to 256 MB (0.11x at 16 MB, 0.52x at 256 MB; casts included), so "
                 "gradients reduce-scatter in FP32; pass fp8_reduce_scatter=True for slow links")


class FsdpOptimizer(OptimizerProxy):
    """The user's optimizer over FSDP2's sharded FP32 parameters, plus backward/clipping/no_sync.

    Args:
        optimizer: the user's torch optimizer, already rebuilt on the sharded parameters.
        model: the sharded model (for ``no_sync`` and FP8 all-gather scales).
        max_norm, norm_type: clip the global gradient norm in ``step`` (0: off).
        loss_scaler: dynamic loss scaling (fp16), or None.
        fp8_scales: refresh the FP8 all-gather scales of every weight in one all-reduce after
            each step (``fp8_communication``).
        allow_no_sync: whether ``no_sync`` may skip the reduce-scatter (GeminiPlugin:
            ``enable_gradient_accumulation``).
        group: the shard (dp) process group, over which fp16 overflow checks agree; None for
            a single process.
        comm_device: where the overflow flag is all-reduced (the mesh's device: under CPU
            offload the gradients live on the CPU, but NCCL needs a CUDA tensor).

    Example:
        >>> from fp8boost.booster import Booster                               # doctest: +SKIP
        >>> from fp8boost.plugins import GeminiPlugin                          # doctest: +SKIP
        >>> booster = Booster(plugin=GeminiPlugin(max_norm=1.0))               # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters())                        # doctest: +SKIP
        >>> model, opt, *_ = booster.boost(model, opt)                         # doctest: +SKIP
        >>> opt.backward(model(**batch).loss); opt.step(); opt.zero_grad()     # doctest: +SKIP
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module, max_norm: float = 0.0,
                 norm_type: float = 2.0, loss_scaler: Optional[DynamicLossScaler] = None,
                 fp8_scales: bool = False, allow_no_sync: bool = True, group=None,
                 comm_device: Optional[torch.device] = None) -> None:
        self.optim = optimizer
        self.model = model
        self.group = group  # the shard (dp) group: overflow checks agree across it
        self.comm_device = comm_device
        self.max_norm, self.norm_type = float(max_norm), float(norm_type)
        self.loss_scaler = loss_scaler
        self.fp8_scales = fp8_scales
        self.allow_no_sync = allow_no_sync
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self._unscaled = False  # this step's gradients are unscaled already (fp16)
        self._found_inf = False

    def __repr__(self) -> str:
        return f"FsdpOptimizer({self.optim!r}, max_norm={self.max_norm})"

    #: set by ``Booster.boost``: skips steps with a NaN/Inf loss or gradient (``parallel/nonfinite``)
    nonfinite_guard = None
    _skip_step: Optional[bool] = None  # this step's guard verdict (checked once per step)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.observe_loss(loss)
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward(retain_graph=retain_graph)

    def _guard_skips(self) -> bool:
        """The non-finite guard's verdict on this step (fp16: the loss scaler decides)."""
        if self.nonfinite_guard is None or self.loss_scaler is not None:
            return False
        if self._skip_step is None:
            self._skip_step = self.nonfinite_guard.check([p.grad for p in self.params],
                                                         self.params)
        return self._skip_step

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduce-scatter) inside the block."""
        if not self.allow_no_sync:
            raise ValueError("gradient accumulation with no_sync needs "
                             "GeminiPlugin(enable_gradient_accumulation=True)")
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def _unscale(self) -> bool:
        """Unscale fp16 gradients once per step; True when every rank's gradients are finite."""
        if self.loss_scaler is None:
            return True
        if self._unscaled:  # clip_grad_norm_ ran first: keep its verdict
            return not self._found_inf
        grads = self._grads()
        inv = 1.0 / self.loss_scaler.scale
        device = self.comm_device or self.params[0].device
        bad = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = g._local_tensor if hasattr(g, "_local_tensor") else g
            local.mul_(inv)
            bad = torch.maximum(bad, (~torch.isfinite(local)).any().float().to(device))
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self._unscaled = True
        self._found_inf = bool(bad.item())
        return not self._found_inf

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over all shards (DTensor gradients); returns the norm before."""
        if not self._unscale() or self._guard_skips():
            return torch.tensor(math.inf)
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def step(self, closure=None) -> None:
        ok = self._unscale()
        if self._guard_skips():  # the same verdict on every rank: nobody steps
            self.optim.zero_grad(set_to_none=True)
            ok = False
        self._skip_step = None
        if ok:
            if self.max_norm > 0:
                self.clip_grad_norm_(self.max_norm, self.norm_type)
            self.optim.step(closure)
        if self.loss_scaler is not None:
            self.loss_scaler.update(not ok)
        self._unscaled = False
        if self.fp8_scales:
            from fp8boost.parallel.fsdp.fp8_all_gather import precompute_fp8_all_gather_scales
            precompute_fp8_all_gather_scales(self.model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
        self._unscaled = False
        self._skip_step = None


def rebind_optimizer(optimizer: torch.optim.Optimizer, old: dict[int, str],
                     model: nn.Module) -> None:
    """Point ``optimizer``'s param groups at the sharded parameters that replaced the old ones."""
    new = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [new[old[id(p)]] for p in group["params"]]


class FsdpPluginBase(Plugin):
    """configure's steps for the FSDP2 plugins; subclasses validate and keep their own options
    (``reshard_after_forward``, ``cpu_offload``, ``norm_type``, ``allow_no_sync``)."""

    norm_type = 2.0
    reshard_after_forward, cpu_offload = True, False
    allow_no_sync = True

    def get_checkpoint_io(self):
        from .checkpoint_io.dcp import DTensorCheckpointIO
        return DTensorCheckpointIO(self)

    # configure's steps (Plugin.configure)
    def validate(self, model: nn.Module, optimizer) -> None:
        from fp8boost.parallel.fsdp import wiring

        if optimizer is not None and len(optimizer.state) > 0:
            raise ValueError("the optimizer already has state; build a fresh optimizer on "
                             "model.parameters() and boost it before the first step")
        self._lazy = wiring.on_meta(model)  # a meta model is materialized shard by shard
        if self._lazy:
            wiring.check_meta_model(model)  # before any process group is touched

    def build_model(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """FP32 masters (sharded in ``parallelize``) on ``device``, equal on every rank; a meta
        model stays on meta until FSDP2 shards it."""
        # The names let wrap_optimizer rebind the user's optimizer to the sharded parameters.
        self._param_names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        if not self._lazy:
            model.to(device)
            broadcast_module(model, self.dp_group)
        # Buffers keep their dtype: rotary tables, FP8 histories.
        cast_params_(model, torch.float32)

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        from fp8boost.parallel.fsdp import wiring

        mesh = self.topology().submesh("dp")
        # Buffers (FP8 amax histories) stay whole on every rank: reduce them to one history.
        reduce_delayed_amax(model, self.dp_group)
        self.comm_report = self._fp8_all_gather(model)
        param_dtype = None if self.precision == "fp32" else DTYPES[self.precision]
        wiring.apply_fsdp(model, mesh, param_dtype, self.reshard_after_forward, self.cpu_offload)
        if self._lazy:
            wiring.materialize(model, torch.device("cpu") if self.cpu_offload else device,
                               shard_rank=mesh.get_local_rank())
        self._fp8_reduce_scatter(model)
        return model

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device) -> "FsdpOptimizer":
        rebind_optimizer(optimizer, self._param_names, model)
        return FsdpOptimizer(optimizer, model, self.max_norm, self.norm_type,
                             make_loss_scaler(self.precision, self.initial_scale,
                                              self.growth_interval),
                             fp8_scales=self.comm_report.fp8_param_all_gather,
                             allow_no_sync=self.allow_no_sync,
                             group=self.topology().submesh("dp").get_group(), comm_device=device)

    def _fp8_all_gather(self, model: nn.Module) -> CommReport:
        report = CommReport()
        if not self.fp8_communication:
            report.not_fp8(PARAM_ALL_GATHER, "fp8_communication=False")
            return report
        from fp8boost.fp8 import is_fp8_layer
        from fp8boost.parallel.comm.config import Fp8CommConfig
        from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather

        names = enable_fp8_all_gather(model, self.comm_config or Fp8CommConfig(),
                                      lambda mod, fqn: is_fp8_layer(mod))
        report.fp8_all_gather_modules = names
        report.fp8_param_all_gather = bool(names)
        if not names:
            why = ("no Fp8Linear layers (use_fp8=False or none converted): FP8 all-gather is for "
                   "weights whose consumer is an FP8 GEMM")
            report.not_fp8(PARAM_ALL_GATHER, why)
            _state.log_once(logger, ("fsdp-ag", why), f"fp8boost: {why}")
        return report

    def _fp8_reduce_scatter(self, model: nn.Module) -> None:
        if not self.fp8_communication:
            return
        if self.fp8_reduce_scatter:
            from fp8boost.parallel.fsdp.fp8_all_gather import set_fp8_reduce_scatter
            set_fp8_reduce_scatter(model, self.comm_config)
            self.comm_report.fp8_grad_reduce = True
            return
        self.comm_report.not_fp8(GRAD_REDUCE, FP8_RS_REASON)
        _state.log_once(logger, ("fsdp-rs", "slower"), f"fp8boost: {FP8_RS_REASON}")

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        if optimizer is None:
            raise ValueError(f"{type(self).__name__}.no_sync needs the optimizer returned by "
                             "booster.boost()")
        return optimizer.no_sync()

