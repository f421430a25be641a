"""What GeminiPlugin and TorchFSDPPlugin share: FSDP2 over the mesh's dp dimension.

FP32 master parameters are the sharded FSDP2 parameters themselves (1/dp per rank), so the
user's optimizer, rebuilt on them, keeps its state sharded 1/dp too. Forward and backward run
in ``precision`` through ``MixedPrecisionPolicy``; gradients reduce-scatter in FP32.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, ContextManager, Mapping, Optional

import torch
from torch import nn

from fp8boost.checkpoint_io.dcp import DTensorCheckpointIO
from fp8boost.checkpoint_io.pretrained import load_remembered
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.plan import FP8_RS_REASON
from fp8boost.parallel.distributed import broadcast_module
from fp8boost.parallel.fsdp import wiring
from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather, set_fp8_reduce_scatter
from fp8boost.parallel.fsdp.optimizer import FsdpOptimizer
from fp8boost.parallel.wrappers import DTYPES, cast_buffers_, cast_params_

from .delayed_amax import reduce_delayed_amax
from .plugin_base import Plugin
from .precision import make_loss_scaler

__all__ = ["FsdpPluginBase", "rebind_optimizer", "FP8_RS_REASON"]  # the reason: parallel/comm/plan


def rebind_optimizer(optimizer: torch.optim.Optimizer, old: dict[int, str],
                     model: nn.Module) -> None:
    """Point ``optimizer``'s param groups at the sharded parameters that replaced the old ones."""
    new = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [new[old[id(p)]] for p in group["params"]]


class FsdpPluginBase(Plugin):
    """configure's steps for the FSDP2 plugins; subclasses validate and keep their own options
    (``reshard_after_forward``, ``cpu_offload``, ``norm_type``, ``allow_no_sync``,
    ``param_init_fn``, ``loss_scale_kwargs``)."""

    comm_engine = "fsdp"  # the plan: which weights FSDP2 gathers in FP8, the reduce-scatter

    norm_type = 2.0
    reshard_after_forward, cpu_offload = True, False
    allow_no_sync = True
    #: called on each module holding meta tensors instead of fp8boost's init (None: ours)
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    #: more fp16 ``DynamicLossScaler`` keywords (``min_scale``, ...; Colossal-AI's classes set
    #: them from their arguments); empty: the scaler's defaults
    loss_scale_kwargs: Mapping[str, float] = MappingProxyType({})

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
        self._fp8_all_gather(model)
        param_dtype = None if self.precision == "fp32" else DTYPES[self.precision]
        wiring.apply_fsdp(model, mesh, param_dtype, self.reshard_after_forward, self.cpu_offload)
        if self._lazy and self.param_init_fn is not None:
            wiring.apply_param_init_fn(model, self.param_init_fn)  # FSDP1's meaning
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
                                              self.growth_interval, **self.loss_scale_kwargs),
                             fp8_scales=self.comm_plan.param_all_gather.fp8,
                             allow_no_sync=self.allow_no_sync,
                             group=self.topology().submesh("dp").get_group(), comm_device=device)

    def _fp8_all_gather(self, model: nn.Module) -> None:
        """Wrap the weights the plan sends as FP8 (before ``fully_shard``)."""
        plan = self.comm_plan
        if not plan.param_all_gather.fp8:
            return
        chosen = set(plan.fp8_gather_modules)
        names = enable_fp8_all_gather(model, plan.config or Fp8CommConfig(),
                                      lambda mod, fqn: fqn in chosen)
        if names != plan.report().fp8_all_gather_modules:  # same walk: a mismatch is a bug
            raise RuntimeError(f"FP8 all-gather wrapped {names}, the plan chose {sorted(chosen)}")

    def _fp8_reduce_scatter(self, model: nn.Module) -> None:
        if self.comm_plan.grad_reduce.fp8:
            set_fp8_reduce_scatter(model, self.comm_plan.config)

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        if optimizer is None:
            raise ValueError(f"{type(self).__name__}.no_sync needs the optimizer returned by "
                             "booster.boost()")
        return optimizer.no_sync()

