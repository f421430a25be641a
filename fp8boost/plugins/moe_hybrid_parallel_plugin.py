"""MoeHybridParallelPlugin: expert parallelism (ep) x data parallelism for transformers MoE models.

First version: ``world = dp x ep`` ranks, ``tp_size = pp_size = 1``, ``zero_stage`` 0/1/2
(ZeRO over the moe-dp group: :meth:`MoeHybridParallelPlugin.wrap_optimizer`). Every rank
holds the non-expert parameters whole (replicated; gradients averaged over all ranks) and
``E/ep`` experts of every fused-expert MoE layer (:mod:`~fp8boost.plugins.moe_dispatch`); the
ranks holding the same experts (the "moe dp" group, size ``world/ep``) average their expert
gradients. Rank layout as Colossal-AI's ``moe_dp_outside=True``: the ep groups are runs of
``ep`` consecutive ranks, the moe-dp groups take one rank of each run.

Gradient scaling: each rank's loss is the mean over its own batch, the reference is the mean
over the global batch (``world`` equal batches). A non-expert gradient is averaged over the
world. An expert's gradient on a rank already sums the contributions of every rank of its ep
group (they reach it through the combine all-to-all's backward), so it is summed over the moe
dp group and divided by the world size.
"""
from __future__ import annotations

import contextlib
import os
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.parallel.zero import ZeroOptimizer

from .checkpoint_io.moe import MoeCheckpointIO
from .distributed import broadcast_module
from .moe_dispatch import EpExperts, expert_params, expert_spec_of, find_experts, shard_experts
from .options import takes_plugin_options
from .plugin_base import Plugin
from .precision import make_loss_scaler

_UNSUPPORTED = "supported: tp_size=1, pp_size=1, sp_size 1/None, moe_dp_outside=True"


def _world_hint() -> int:
    """The world size before the process group exists (``WORLD_SIZE``, else 1)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_sizes(tp_size, pp_size, ep_size, sp_size, zero_stage, moe_dp_outside) -> None:
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if tp_size != 1 or pp_size != 1 or sp_size not in (None, 1):
        raise ValueError(f"MoeHybridParallelPlugin: tp_size={tp_size}, pp_size={pp_size}, "
                         f"sp_size={sp_size} with expert parallelism is not implemented yet "
                         f"({_UNSUPPORTED}); use HybridParallelPlugin for tp/pp on dense models")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
        raise ValueError(f"MoeHybridParallelPlugin: zero_stage must be 0, 1 or 2, got "
                         f"{zero_stage!r}")
    if moe_dp_outside is not True:
        raise ValueError(f"MoeHybridParallelPlugin: moe_dp_outside={moe_dp_outside!r} is not "
                         f"implemented ({_UNSUPPORTED})")


class Stage0Optimizer(ZeroOptimizer):
    """``zero_stage=0``'s optimizer: the plugin reduces gradients after a synchronised
    ``booster.backward``; after a plain ``loss.backward()`` (which no hook of stage 0 sees)
    ``step()`` reduces them first, so training does not depend on which one the script called.
    Collective-safe: every rank calls ``step()``."""

    def __init__(self, optimizer, *, reduce_fn, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.reduce_fn = reduce_fn
        self.gradients_reduced = False

    def step(self, closure=None) -> None:
        if not self.gradients_reduced:
            self.reduce_fn()
        self.gradients_reduced = False
        super().step(closure)


@takes_plugin_options(positional=("tp_size", "pp_size", "ep_size", "sp_size", "precision",
                                  "zero_stage"))
class MoeHybridParallelPlugin(Plugin):
    """Expert parallelism over ``ep_size`` ranks x data parallelism over the rest.

    Args:
        tp_size, pp_size: must be 1 in this version (ValueError otherwise).
        ep_size: ranks an MoE layer's experts are split over; divides the world size and
            every MoE layer's expert count.
        sp_size: None or 1.
        zero_stage: 0 (whole optimizer state on every rank; gradients all-reduced), 1 or 2
            (ZeRO over the moe-dp group, ``world/ep`` ranks: see :meth:`wrap_optimizer`).
        precision: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"`` (shared option).
        use_fp8: FP8 GEMMs for linear layers and FP8 grouped-GEMM experts (``convert_to_fp8``).
        fp8_communication: the dispatch all-to-all carries e4m3 rows with one FP32 scale per
            row (per token choice); the combine and every gradient all-to-all stay in their
            dtype; gradients are all-reduced, and ZeRO's parameters all-gathered, in their
            dtype (``comm_report`` is not filled in yet).
        moe_dp_outside: only True (Colossal-AI's default layout).
        **options: the shared plugin options (``max_norm``: the global norm over every
            expert of every rank and the replicated parameters once).

    Checkpoints (:mod:`~fp8boost.plugins.checkpoint_io.moe`): ``save_model`` writes the HF
    layout with every expert (all-gathered over the ep group per parameter); ``load_model``
    reads such a file (or ``save_pretrained``'s) at any ep size. ``save_optimizer`` writes one
    re-shardable optimizer directory per ep rank (atomically, with checksums);
    ``load_optimizer`` restores it exactly (master weights, moments, loss scaler) at any ep
    size, dp size and ZeRO stage: each rank reads only the ranges of its own shards, an
    expert's from the saved ep ranks that held it. ``save_checkpoint``/``load_checkpoint``
    (model, optimizer, LR scheduler, ``extra``) and ``save_lr_scheduler`` work as for the
    other plugins.

    Example:
        >>> from fp8boost.plugins import MoeHybridParallelPlugin
        >>> plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2)  # doctest: +SKIP
    """

    def __init__(self, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1,
                 sp_size: Optional[int] = None, zero_stage: int = 0, *,
                 moe_dp_outside: bool = True, **options) -> None:
        super().__init__(**options)
        _check_sizes(tp_size, pp_size, ep_size, sp_size, zero_stage, moe_dp_outside)
        if self.fp8_reduce_scatter:  # a shared option this plugin has no FP8 path for yet
            raise ValueError("MoeHybridParallelPlugin(fp8_reduce_scatter=True) is not supported "
                             "yet: its gradients are all-reduced in their dtype; use "
                             "fp8_reduce_scatter=False (fp8_communication still puts the "
                             "token dispatch in FP8)")
        self.ep_size, self.zero_stage = ep_size, zero_stage
        self.moe_dp_outside = moe_dp_outside
        self.ep_group = self.moe_dp_group = None
        self._expert_ids: set[int] = set()
        self._sync = True

    def __repr__(self) -> str:
        return (f"MoeHybridParallelPlugin(ep_size={self.ep_size}, zero_stage={self.zero_stage}, "
                f"precision={self.precision!r}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication})")

    def validate(self, model: nn.Module, optimizer) -> None:
        super().validate(model, optimizer)
        world, ep = _world_hint(), self.ep_size
        if world % ep:
            raise ValueError(f"ep_size={ep} does not divide the world size {world}: use an "
                             "ep_size that divides the number of ranks")
        experts = find_experts(model)
        if ep > 1 and not experts:
            raise ValueError("ep_size > 1 but the model has no fused-expert MoE module "
                             "(3-D gate_up_proj/down_proj Parameters): use ep_size=1")
        for name, module in experts:
            n = expert_spec_of(module).num_experts
            if n % ep:
                raise ValueError(f"ep_size={ep} does not divide the {n} experts of {name}: "
                                 "use an ep_size that divides the expert count")

    def _build_groups(self) -> None:
        world, rank, ep = dist.get_world_size(), dist.get_rank(), self.ep_size
        for start in range(0, world, ep):  # every rank creates every group, in one order
            group = dist.new_group(list(range(start, start + ep)))
            if start <= rank < start + ep:
                self.ep_group = group
        for first in range(ep):
            group = dist.new_group(list(range(first, world, ep)))
            if rank % ep == first:
                self.moe_dp_group = group

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        broadcast_module(model, None)  # every rank starts from rank 0's full model
        self._build_groups()
        shard_experts(model, self.ep_group, fp8=self.fp8_communication)
        self._expert_ids = expert_params(model)
        self._model = model
        return model

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device) -> ZeroOptimizer:
        """The optimizer wrapper; FP32 master weights unless ``fp32``.

        ``zero_stage=0``: whole optimizer state on every rank, gradients reduced by
        :meth:`reduce_gradients` after each synchronised backward. ``zero_stage`` 1/2:
        ``ZeroOptimizer`` over the moe-dp group (master weights, optimizer state and, at
        stage 2, gradients sharded dp ways). Before its reduction, each non-expert gradient
        is averaged over the ep group (a post-accumulate hook, registered first) and each
        expert gradient is divided by ep (a gradient hook), so its dp average is the world's.
        The global gradient norm (``max_norm``) and the FP16 overflow flag span the ep group
        (its ranks hold different experts); the replicated gradients count once."""
        shared = [] if dist.get_rank(self.ep_group) == 0 else \
            [p for p in model.parameters() if id(p) not in self._expert_ids]
        zero = self.zero_stage > 0
        if zero and self.ep_size > 1:
            self._register_ep_hooks(model)
        cls = ZeroOptimizer if zero else Stage0Optimizer
        extra = {} if zero else {"reduce_fn": self.reduce_gradients}
        return cls(
            optimizer, **extra, dp_group=self.moe_dp_group if zero else None,
            stage=self.zero_stage if zero else 2, master_weights=self.precision != "fp32",
            overlap_communication=False, max_norm=self.max_norm, pp_group=self.ep_group,
            pp_counted_elsewhere=shared,
            loss_scaler=make_loss_scaler(self.precision, self.initial_scale,
                                         self.growth_interval),
            fused_master_step=self.fused_master_step)

    def _register_ep_hooks(self, model: nn.Module) -> None:
        ep, group = self.ep_size, self.ep_group

        def average(p: torch.Tensor) -> None:
            if self._sync and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(ep)

        for p in model.parameters():
            if not p.requires_grad:
                continue
            if id(p) in self._expert_ids:
                p.register_hook(lambda g: g / ep)
            else:
                p.register_post_accumulate_grad_hook(average)

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """Average gradients as the module docstring says (collective over every rank): one
        flat all-reduce per (group, dtype), the expert gradients over the moe-dp group."""
        world = dist.get_world_size()
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p in self._model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:  # an expert that got no token here: its peers still reduce
                p.grad = torch.zeros_like(p)
            buckets.setdefault((id(p) in self._expert_ids, p.grad.dtype), []).append(p.grad)
        for (expert, _), grads in sorted(buckets.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.moe_dp_group if expert else None)
            flat.div_(world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        optimizer.backward(loss)
        if self._sync and self.zero_stage == 0:
            self.reduce_gradients()
            optimizer.gradients_reduced = True

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        @contextlib.contextmanager
        def block():
            old, self._sync = self._sync, False
            try:
                with optimizer.no_sync() if optimizer is not None else contextlib.nullcontext():
                    yield
            finally:
                self._sync = old
        return block()

    # ------------------------------------------------------------------ checkpoints
    def is_expert_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` holds this rank's share of some MoE layer's experts."""
        return id(param) in self._expert_ids

    def exact_weights(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """Every expert Parameter whole (all-gathered over the ep group): collective."""
        out = super().exact_weights(model)
        for module in self.unwrap_model(model).modules():
            if isinstance(module, EpExperts):
                for name in module.names:
                    out[id(getattr(module, name))] = module.full_param(name)
        return out

    def get_checkpoint_io(self):
        """Checkpoint IO: HF-layout model files with every expert (save and load, at any
        ep size); optimizer state per ep rank (see the class docstring)."""
        return MoeCheckpointIO(self)

