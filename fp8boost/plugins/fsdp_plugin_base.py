"""What GeminiPlugin and TorchFSDPPlugin share: FSDP2 over the mesh's dp dimension.

FP32 master parameters are the sharded FSDP2 parameters themselves (1/dp per rank), so the
user's optimizer, rebuilt on them, keeps its state sharded 1/dp too. Forward and backward run
in ``precision`` through ``MixedPrecisionPolicy``; gradients reduce-scatter in FP32.
"""
from __future__ import annotations

import logging
from typing import ContextManager

import torch
from torch import nn

from fp8boost import _state
from fp8boost.fp8 import is_fp8_layer
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.expert_gather import report_expert_gather
from fp8boost.parallel.comm.report import GRAD_REDUCE, PARAM_ALL_GATHER, CommReport
from fp8boost.parallel.fsdp import wiring
from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather, set_fp8_reduce_scatter
from fp8boost.parallel.fsdp.optimizer import FsdpOptimizer

from .checkpoint_io.dcp import DTensorCheckpointIO
from .checkpoint_io.pretrained import load_remembered
from .colossal_args_fsdp import apply_param_init_fn
from .delayed_amax import reduce_delayed_amax
from .distributed import broadcast_module
from .granular_comm import block_gathered, is_granular, report_granular_gather
from .plugin_base import Plugin
from .precision import make_loss_scaler
from .wrappers import DTYPES, cast_buffers_, cast_params_

logger = logging.getLogger("fp8boost.plugins")

#: Why gradients do not reduce-scatter in FP8 by default (BENCHMARKS.md section 5).
# (2xH200 NVLink: 0.11x at 16 MB, 0.52x at 256 MB, casts included.) One line: every comm
# report prints it.
FP8_RS_REASON = ("gradients reduce-scatter in FP32: FP8 reduce-scatter measured slower on "
                 "NVLink (BENCHMARKS.md 5); the plugin's fp8_reduce_scatter=True is for slow "
                 "links")


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
        return DTensorCheckpointIO(self)

    # configure's steps (Plugin.configure)
    def validate(self, model: nn.Module, optimizer) -> None:
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
        cast_params_(model, torch.float32)
        # FSDP2 casts the parameters to the compute dtype for each forward, never the buffers:
        # they go there now (a BatchNorm's statistics must match its input; rotary tables and
        # FP8 scaling state stay FP32, see cast_buffers_).
        if self.precision != "fp32":
            cast_buffers_(model, DTYPES[self.precision])

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        mesh = self.topology().submesh("dp")
        # Buffers (FP8 amax histories) stay whole on every rank: reduce them to one history.
        reduce_delayed_amax(model, self.dp_group)
        self.comm_report = self._fp8_all_gather(model)
        param_dtype = None if self.precision == "fp32" else DTYPES[self.precision]
        wiring.apply_fsdp(model, mesh, param_dtype, self.reshard_after_forward, self.cpu_offload)
        if self._lazy and getattr(self, "param_init_fn", None) is not None:
            apply_param_init_fn(model, self.param_init_fn)  # FSDP1's meaning (TorchFSDPPlugin)
        elif self._lazy:
            wiring.materialize(model, torch.device("cpu") if self.cpu_offload else device,
                               shard_rank=mesh.get_local_rank())
        if self._lazy:  # from_pretrained in LazyInitContext: each rank reads its shards' slices
            load_remembered(model)
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

        # rowwise/blockwise layers: training dtype, except blockwise weights whose even shards
        # hold whole blocks, gathered with their block scales (granular_comm.py)
        ranks = self.topology().submesh("dp").size()
        names = enable_fp8_all_gather(
            model, self.comm_config or Fp8CommConfig(),
            lambda mod, fqn: is_fp8_layer(mod) and (
                not is_granular(mod) or block_gathered(mod, ranks, self.comm_config)))
        report.fp8_all_gather_modules = names
        report.fp8_param_all_gather = bool(names)
        report_expert_gather(report, type(self).__name__, model)  # experts: training dtype
        if not report_granular_gather(report, type(self).__name__, model, ranks,
                                      self.comm_config) and not names:
            why = ("no Fp8Linear layers (use_fp8=False or none converted): FP8 all-gather is for "
                   "weights whose consumer is an FP8 GEMM")
            report.not_fp8(PARAM_ALL_GATHER, why)
            _state.log_once(logger, ("fsdp-ag", why), f"fp8boost: {why}")
        return report

    def _fp8_reduce_scatter(self, model: nn.Module) -> None:
        if not self.fp8_communication:
            return
        if self.fp8_reduce_scatter:
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

