"""MoeHybridParallelPlugin: expert (ep) x pipeline (pp) x tensor (tp) x data parallelism for HF
MoE models.

``world = dp x pp x tp`` ranks, ``dp = moe_dp x ep``, in Colossal-AI's layout (the
topology's ``ep`` axis: :class:`~fp8boost.parallel.mesh.ParallelDims` with ``ep`` and
``moe_dp_outside``; every group comes from its :class:`~fp8boost.parallel.mesh.Topology`),
``zero_stage`` 0/1/2 (ZeRO over the moe-dp group: :meth:`MoeHybridParallelPlugin.wrap_optimizer`;
<= 1 with pp). Within a replica the tp ranks split attention, dense MLPs, embedding and LM
head by ``HybridParallelPlugin``'s :class:`~fp8boost.parallel.tp.TpPlan` (``apply_tp``) and
keep every MoE block (router, experts, shared experts) whole (``TpPlan.replicated_moe``); over
``ep`` the fused experts are sliced, ``E/ep`` per rank, with the token dispatch and combine
over the ep group of the rank's tp index (:mod:`fp8boost.parallel.ep`). Gradient scaling:
:mod:`fp8boost.parallel.ep.grads`. With ``pp_size > 1`` the pipeline is
``HybridParallelPlugin``'s (``parallel/pipeline/hybrid.py``: the stage split, the runner,
``execute_pipeline``), each stage's experts sliced over its own ep group.

This file is the strategy: which step runs when, over which group; the steps live in
``parallel/`` (``ep``, ``tp``, ``zero``, ``pipeline``) and the shared plugin helpers.

Order of application: [pipeline split: this rank's stages] -> move/cast -> FP8 conversion ->
broadcast (from rank 0; with pp from each stage's lowest rank) -> tensor-parallel split ->
expert slicing over ep -> [pipeline runner] -> optimizer wrapper.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from types import MappingProxyType
from typing import ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.checkpoint_io.moe import MoeCheckpointIO
from fp8boost.parallel.distributed import broadcast_module
from fp8boost.parallel.ep import (Stage0Optimizer, average_over_ep, check_expert_split,
                                  counted_elsewhere, expert_params, full_expert_weights,
                                  reduce_moe_gradients, register_ep_hooks, shard_experts)
from fp8boost.parallel.mesh import ParallelDims
from fp8boost.parallel.pipeline.hybrid import (PipelineModel, broadcast_stage, build_runner,
                                               check_pipeline_args, checked_execute_pipeline,
                                               pipeline_layout, stage_plan, strip_model)
from fp8boost.parallel.pipeline.stage_manager import PipelineStageManager
from fp8boost.parallel.sp.setup import replica_groups
from fp8boost.parallel.tp import apply_tp, check_plan, resolve_plan
from fp8boost.parallel.tp.input_guard import ReplicaInputGuard, debug_every_step
from fp8boost.parallel.wrappers import DTYPES, ModelWrapper
from fp8boost.parallel.zero import ZeroOptimizer

from .grad_ckpt import apply_checkpointing, check_ckpt_config, plan_checkpointing
from .hybrid_parallel_plugin import check_custom_policy
from .options import check_bool, check_bucket_size, takes_plugin_options
from .plugin_base import Plugin
from .precision import make_loss_scaler


def _world_hint() -> int:
    """The world size before the process group exists (``WORLD_SIZE``, else 1)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_moe_layout(*, tp_size: int, pp_size: int, ep_size: int, zero_stage: int,
                     moe_dp_outside: bool) -> None:
    """Sizes and layout: positive ints, ZeRO 0/1/2 (before any collective).

    Raises:
        ValueError: a bad size or ``zero_stage`` outside 0/1/2.
        TypeError: ``moe_dp_outside`` is not a bool.
    """
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("ep_size", ep_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
        raise ValueError(f"MoeHybridParallelPlugin: zero_stage must be 0, 1 or 2, got "
                         f"{zero_stage!r}")
    check_bool("moe_dp_outside", moe_dp_outside)


def check_moe_pipeline(pp_size: int, zero_stage: int, pipeline: dict):
    """``HybridParallelPlugin``'s pipeline rules (``check_pipeline_args``: INFO for options at
    ``pp_size=1``), less ``pp_style="zbv"``; the ``PipelineOptions`` (None at ``pp_size=1``).

    Raises:
        ValueError: bad pipeline options, or ``pp_style="zbv"``.
    """
    options = check_pipeline_args(pp_size, zero_stage, **pipeline)
    if options is not None and options.pp_style == "zbv":
        # torch's ZBV splits each backward into an input and a weight pass; through the
        # expert dispatch (EpExperts) the weight pass meets freed saved tensors (measured:
        # RuntimeError "backward through the graph a second time", at ep_size 1 and 2)
        raise ValueError("MoeHybridParallelPlugin(pp_style='zbv') is not supported: the "
                         "zero-bubble schedule's split weight-gradient pass fails through the "
                         "expert dispatch; use pp_style='1f1b' or 'interleaved'")
    return options


@takes_plugin_options(positional=("tp_size", "pp_size", "ep_size", "precision", "zero_stage"))
class MoeHybridParallelPlugin(Plugin):
    """Expert parallelism over ``ep_size`` ranks x tensor parallelism x data parallelism.

    Colossal-AI v0.5.0's ``MoeHybridParallelPlugin`` arguments (sequence-parallel switches,
    ``zero_bucket_size_in_m``, loss-scaling details, Shardformer, DDP and P2P tuning) are taken
    by ``fp8boost.colossal.booster.plugin.MoeHybridParallelPlugin``, which maps them onto these.

    Args:
        tp_size: tensor-parallel ranks per replica (consecutive ranks); as in
            ``HybridParallelPlugin``, it must divide the attention heads, kv heads, dense FFN
            size and vocabulary. The MoE blocks stay whole on the tp ranks.
        pp_size: pipeline ranks, as in ``HybridParallelPlugin``: train with
            ``booster.execute_pipeline``; ``zero_stage`` <= 1; one of num_microbatches /
            microbatch_size; ``pp_style`` "1f1b" or "interleaved" ("zbv" raises). A model
            that adds its router aux loss
            (``config.output_router_logits=True``) raises ``ValueError`` at ``boost``: the
            last stage never sees the other stages' router logits.
        ep_size: ranks an MoE layer's experts are split over; divides
            ``world / (pp_size x tp_size)`` and every MoE layer's expert count.
        zero_stage: 0 (whole optimizer state on every rank; gradients all-reduced), 1 or 2
            (ZeRO over the moe-dp group, ``world/(ep x tp)`` ranks: see :meth:`wrap_optimizer`).
        precision: ``"bf16"`` (default; Colossal-AI defaults to ``"fp16"``), ``"fp16"`` or
            ``"fp32"``.
        use_fp8: FP8 GEMMs for linear layers (on their tp shards) and FP8 grouped-GEMM experts.
        fp8_communication: the dispatch all-to-all carries e4m3 rows with one FP32 scale per
            row (per token choice); with pp the stage boundaries go FP8 as under
            ``HybridParallelPlugin`` (``comm_config``); the combine, every gradient all-to-all,
            the gradient reductions and ZeRO's gathers stay in their dtype.
        moe_dp_outside: Colossal-AI's layout switch: ``(moe_dp, pp, ep, tp)`` (True) or
            ``(pp, moe_dp, ep, tp)``; with ``pp_size=1`` both are one layout
            (``parallel/mesh.py``).
        custom_policy, gradient_checkpoint_config, reduce_bucket_size_in_m, cpu_offload: as
            in ``HybridParallelPlugin``.
        num_microbatches, microbatch_size, pp_style, num_model_chunks, num_layers_per_stage:
            as in ``HybridParallelPlugin``; ignored at ``pp_size=1`` (INFO).
        **options: the shared plugin options (``max_norm``: the global norm over every
            expert of every rank, every stage, tp shards, and the replicated parameters once).

    Checkpoints (:mod:`~fp8boost.checkpoint_io.moe`): ``save_model`` writes the HF
    layout with every expert (all-gathered over ep) and every tp shard (gathered over tp);
    ``load_model`` reads such a file (or ``save_pretrained``'s) at any ep and tp size.
    Optimizer state (``save_optimizer``, in ``save_checkpoint``: one directory per ep rank and
    tp rank) is re-shardable over ep, dp and ZeRO stage; loading it at another tp size raises
    ``ValueError``. With ``pp_size > 1`` ``save_model`` gathers the stages too (the file loads
    at any pp, ep and tp size); optimizer state is saved per stage and loads at the saved
    pp size (another pp size raises ``ValueError``).

    Example:
        >>> from fp8boost.plugins import MoeHybridParallelPlugin
        >>> plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2)  # doctest: +SKIP
        >>> plugin = MoeHybridParallelPlugin(pp_size=2, ep_size=2, num_microbatches=4)  # doctest: +SKIP
        >>> # out = booster.execute_pipeline(iter(loader), model, optimizer=opt)
    """

    #: more fp16 ``DynamicLossScaler`` keywords (``min_scale``, ...; Colossal-AI's class sets
    #: them from its arguments); empty: the scaler's defaults
    loss_scale_kwargs: Mapping[str, float] = MappingProxyType({})

    def __init__(self, tp_size: int = 1, pp_size: int = 1, ep_size: int = 1,
                 zero_stage: int = 0, *, moe_dp_outside: bool = True, custom_policy=None,
                 cpu_offload: bool = False, reduce_bucket_size_in_m: Optional[float] = None,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1,
                 num_layers_per_stage: Optional[list] = None, gradient_checkpoint_config=None,
                 **options) -> None:
        super().__init__(**options)
        check_moe_layout(tp_size=tp_size, pp_size=pp_size, ep_size=ep_size,
                         zero_stage=zero_stage, moe_dp_outside=moe_dp_outside)
        check_bool("cpu_offload", cpu_offload)
        self.pipeline = check_moe_pipeline(pp_size, zero_stage, dict(
            num_microbatches=num_microbatches, microbatch_size=microbatch_size,
            pp_style=pp_style, num_model_chunks=num_model_chunks,
            num_layers_per_stage=num_layers_per_stage))
        self.gradient_checkpoint_config = check_ckpt_config(gradient_checkpoint_config)
        check_custom_policy(custom_policy)
        if self.fp8_reduce_scatter:  # a shared option this plugin has no FP8 path for yet
            raise ValueError("MoeHybridParallelPlugin(fp8_reduce_scatter=True) is not supported "
                             "yet: its gradients are all-reduced in their dtype; use "
                             "fp8_reduce_scatter=False (fp8_communication still puts the "
                             "token dispatch in FP8)")
        self.reduce_bucket_numel = check_bucket_size(reduce_bucket_size_in_m,
                                                     self.fp8_communication)
        self.tp_size, self.pp_size, self.ep_size = tp_size, pp_size, ep_size
        self.zero_stage = zero_stage
        self.enable_sequence_parallelism = False  # Colossal-AI's attribute (sp is refused)
        self.moe_dp_outside, self.custom_policy, self.cpu_offload = \
            moe_dp_outside, custom_policy, cpu_offload
        self.ep_group = self.moe_dp_group = self.norm_group = None
        self.tp_state = self.input_guard = self.pp_state = None
        self._layout = None
        self._expert_ids: set[int] = set()
        self._sync = True

    def __repr__(self) -> str:
        return (f"MoeHybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.pp_size}, "
                f"ep_size={self.ep_size}, "
                f"zero_stage={self.zero_stage}, precision={self.precision!r}, "
                f"use_fp8={self.use_fp8}, fp8_communication={self.fp8_communication})")

    # ------------------------------------------------------------------ boost
    def validate(self, model: nn.Module, optimizer) -> None:
        super().validate(model, optimizer)
        world, ep, tp, pp = _world_hint(), self.ep_size, self.tp_size, self.pp_size
        if world % (pp * ep * tp):
            sizes = f"pp_size={pp} x ep_size={ep} x tp_size={tp}" if pp > 1 else \
                f"ep_size={ep} x tp_size={tp}"
            raise ValueError(f"{sizes} does not divide the world size {world}: use sizes "
                             "whose product divides the number of ranks")
        check_expert_split(model, ep)
        self._debug_inputs = debug_every_step()
        self._plan = resolve_plan(model, self.custom_policy) if tp > 1 else None
        if self._plan is not None:
            check_plan(model, self._plan, tp)  # before any collective
        # the HF decoder structure and no router aux loss (the last stage never sees the
        # router logits of the others: check_pipeline_model refuses it, naming the fix)
        self._layout = pipeline_layout(model, pp, self.pipeline) if pp > 1 else None
        self._ckpt_flags = plan_checkpointing(model, self.gradient_checkpoint_config,
                                              self._layout)

    def build_model(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """``gradient_checkpoint_config`` picks the decoder layers that recompute; with
        ``pp_size > 1`` keep this rank's pipeline stages (``parallel.pipeline.hybrid.strip_model``,
        dropping the others' parameters from ``optimizer``); then move and cast
        (``Plugin.build_model``)."""
        apply_checkpointing(model, self._ckpt_flags)
        self.pp_state = strip_model(model, optimizer, self._layout, self.topology()) \
            if self._layout is not None else None
        super().build_model(model, optimizer, device)

    comm_engine = "moe"  # the plan: FP8 token dispatch; ZeRO and gradients in their dtype

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        topo = self.topology(device)
        if self.pp_state is not None:  # each stage from its lowest rank (and the tied weight)
            broadcast_stage(model, self.pp_state)
        else:
            broadcast_module(model, None)  # every rank starts from rank 0's full model
        # the expert axes' groups (collective: every rank, this order); the norm spans pp x ep:
        # its ranks hold different stages and experts, together one copy of every parameter
        self.ep_group, self.moe_dp_group = topo.group("ep"), topo.group("moe_dp")
        self.norm_group = topo.flat_group("pp", "ep")
        if self._plan is not None:  # attention/dense MLPs split; MoE blocks stay whole
            plan = stage_plan(self._plan, model) if self.pp_state is not None else self._plan
            self.tp_state = apply_tp(model, plan, topo.group("tp"), comm_plan=self.comm_plan)
        shard_experts(model, self.ep_group, self.comm_plan)  # FP8 dispatch: the plan's ep route
        self._expert_ids = expert_params(model)
        self._model = model
        if self.pp_state is not None:
            build_runner(model, self.pp_state, self.pipeline, device=device,
                         act_dtype=DTYPES[self.precision], tp_size=self.tp_size,
                         sequence_parallel=False, comm_plan=self.comm_plan)
        # the tp and pp ranks of a replica read one batch
        groups = replica_groups(topo, self.tp_size, self.pp_size, self.sp_size)
        self.input_guard = ReplicaInputGuard(groups, device, self._debug_inputs) \
            if groups else None
        return model

    def wrap_model(self, module: nn.Module, optimizer) -> ModelWrapper:
        wrapper = PipelineModel if self.pp_state is not None else ModelWrapper
        wrapped = wrapper(module, DTYPES[self.precision])
        if self.input_guard is not None and self.pp_state is None:
            self.input_guard.attach(wrapped)  # pipelines check in execute_pipeline
        return wrapped

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device) -> ZeroOptimizer:
        """The optimizer wrapper; FP32 master weights unless ``fp32``.

        ``zero_stage=0``: whole optimizer state on every rank, gradients reduced by
        :meth:`reduce_gradients` after each synchronised backward. ``zero_stage`` 1/2:
        ``ZeroOptimizer`` over the moe-dp group (master weights, optimizer state and, at
        stage 2, gradients sharded moe-dp ways). Before its reduction, each non-expert
        gradient is averaged over the ep group (a post-accumulate hook, registered first) and
        each expert gradient is divided by ep (a gradient hook), so its moe-dp average is the
        dp average. The global gradient norm (``max_norm``) and the FP16 overflow flag span
        the tp group (tp shards; replicated parameters weighted 1/tp) and the pp x ep group
        (its ranks hold different stages and experts; a stage's non-expert parameters counted
        on its ep rank 0 only, a tied embedding on the first stage only)."""
        topo = self.topology()
        shared = counted_elsewhere(model, self._expert_ids, self.ep_group)
        st = self.pp_state  # the last stage's tied embedding copy: the first stage counts it
        if st is not None and st.tied is not None and st.rank != st.layout.rank_of(0):
            shared.append(st.tied)
        sharded = set(self.tp_state.shard_dims) if self.tp_state is not None else set()
        replicated = [p for n, p in model.named_parameters() if n not in sharded]
        zero = self.zero_stage > 0
        if zero and self.ep_size > 1:  # the hooks wait while _sync is off (no_sync, pipeline)
            register_ep_hooks(model, self._expert_ids, self.ep_group, self.ep_size,
                              lambda: self._sync)
        cls = ZeroOptimizer if zero else Stage0Optimizer
        extra = {} if zero else {"reduce_fn": self.reduce_gradients}
        return cls(
            optimizer, **extra, dp_group=self.moe_dp_group if zero else None,
            stage=self.zero_stage if zero else 2, master_weights=self.precision != "fp32",
            overlap_communication=False, reduce_bucket_numel=self.reduce_bucket_numel,
            max_norm=self.max_norm, cpu_offload=self.cpu_offload,
            tp_group=topo.group("tp") if self.tp_size > 1 else None, tp_replicated=replicated,
            pp_group=self.norm_group, pp_counted_elsewhere=shared,
            loss_scaler=make_loss_scaler(self.precision, self.initial_scale,
                                         self.growth_interval, **self.loss_scale_kwargs),
            fused_master_step=self.fused_master_step, comm_plan=self.comm_plan)

    # ------------------------------------------------------------------ pipeline
    @property
    def dims(self) -> ParallelDims:
        """The (dp, pp, tp, ep) cut in Colossal-AI's MoE rank layout (``parallel/mesh.py``:
        dp = moe-dp x ep; initialises the process group if needed)."""
        return replace(super().dims, ep=self.ep_size, moe_dp_outside=self.moe_dp_outside)

    _stage_manager = None

    @property
    def stage_manager(self):
        """Colossal-AI's ``plugin.stage_manager``: None when ``pp_size == 1``, else this
        rank's ``PipelineStageManager`` (as ``HybridParallelPlugin.stage_manager``, on this
        plugin's rank layout; built on first access)."""
        if self.pp_size == 1:
            return None
        if self._stage_manager is None:
            self._stage_manager = PipelineStageManager(
                self.dims, dist.get_rank(), self.pipeline.num_model_chunks,
                self.pipeline.pp_style)
        return self._stage_manager

    def execute_pipeline(self, data_iter, model, criterion=None, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """One pipeline step (``pp_size > 1``), as ``HybridParallelPlugin.execute_pipeline``
        (same arguments and result; the micro-batches' tokens are dispatched over each
        stage's ep group). Gradients are then reduced as at ``pp_size=1``, per stage: by
        :meth:`reduce_gradients` at ``zero_stage=0``; at ``zero_stage=1`` the non-expert ones
        averaged over ep (:func:`~fp8boost.parallel.ep.average_over_ep`, once, not in
        every micro-batch's backward), then ZeRO's reduction over moe-dp."""
        def reduce() -> None:
            if self.zero_stage == 0:
                self.reduce_gradients()
                optimizer.gradients_reduced = True
                return
            if self.ep_size > 1:
                average_over_ep(self._model.parameters(), self._expert_ids, self.ep_group,
                                self.ep_size)
            optimizer.reduce_gradients()

        old, self._sync = self._sync, False  # the per-parameter ep hooks wait for reduce()
        try:
            # no sequence parallelism here: any sequence length splits into micro-batches
            return checked_execute_pipeline(self.pp_state, self.input_guard, 1, data_iter,
                                            model, criterion, optimizer, return_loss,
                                            return_outputs, reduce)
        finally:
            self._sync = old

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """Average gradients over dp (``parallel/ep/grads.py``; collective over every rank)."""
        topo = self.topology()
        reduce_moe_gradients(self._model.parameters(), self._expert_ids, topo.group("dp"),
                             self.moe_dp_group, topo.dims.dp)

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
        """Every expert Parameter whole (all-gathered over the ep group): collective. Inside
        ``parallel.ep.gathered_experts`` they are whole already and are taken as they are."""
        out = super().exact_weights(model)
        out.update(full_expert_weights(self.unwrap_model(model)))
        return out

    def get_checkpoint_io(self):
        """Checkpoint IO: HF-layout model files with every expert (save and load, at any
        ep and tp size); optimizer state per ep (and tp) rank."""
        return MoeCheckpointIO(self)
