"""HybridParallelPlugin: pipeline x tensor (+ sequence) parallelism in a replica, ZeRO across.

The mesh is ``("dp", "pp", "tp")`` (``parallel/mesh.py``). Within a replica the model is split
by a :class:`~fp8boost.parallel.tp.TpPlan` (built from the HF module structure, or the user's
``custom_policy``); across replicas our ZeRO optimizer (stage 0, 1 or 2) averages gradients and
shards FP32 master weights and optimizer state over the ``dp`` group. FP8 GEMMs run on each
rank's shard with scales taken from the whole tensor (amax all-reduced over tp where the
operand is split), so a tp run casts exactly as one process would.

Order of application (fixed, as in torchtitan): [pipeline split: each rank keeps its stages'
layers, see ``parallel/pipeline/hybrid.py``] -> move/cast to ``precision`` -> FP8 conversion (layer
choice on the full layer, so it does not depend on tp) -> broadcast (from rank 0; with pp from
each stage's lowest rank) -> tensor parallel split -> ZeRO over dp.
"""
from __future__ import annotations

import logging
import os
from types import MappingProxyType
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.checkpoint_io.hybrid import HybridCheckpointIO
from fp8boost.fp8.moe.detect import router_aux_loss_on
from fp8boost.parallel.distributed import broadcast_module
from fp8boost.parallel.pipeline.hybrid import (PipelineModel, broadcast_stage, build_runner,
                                               check_pipeline_args, checked_execute_pipeline,
                                               pipeline_layout, stage_plan, strip_model)
from fp8boost.parallel.pipeline.stage_manager import PipelineStageManager
from fp8boost.parallel.sp.setup import (apply_ulysses_to, check_sp_args, replica_groups,
                                        validate_ulysses, zero_group)
from fp8boost.parallel.tp import TpPlan, apply_tp, check_plan, resolve_plan
from fp8boost.parallel.tp.input_guard import ReplicaInputGuard, debug_every_step
from fp8boost.parallel.wrappers import DTYPES, ModelWrapper
from fp8boost.parallel.zero import ZeroOptimizer

from .delayed_amax import reduce_delayed_amax
from .grad_ckpt import apply_checkpointing, check_ckpt_config, plan_checkpointing
from .options import check_bool, check_bucket_size, takes_plugin_options
from .plugin_base import Plugin
from .precision import make_loss_scaler

logger = logging.getLogger("fp8boost.plugins")
PIPELINE_ARGS = ("num_microbatches", "microbatch_size", "num_layers_per_stage")


def check_custom_policy(custom_policy: object) -> None:
    """``custom_policy`` is None, a ``TpPlan`` or a callable (``MoeHybridParallelPlugin`` too).

    Raises:
        TypeError: anything else.
    """
    if custom_policy is not None and not callable(custom_policy):
        if not isinstance(custom_policy, TpPlan):
            raise TypeError("custom_policy must be a fp8boost.parallel.tp.TpPlan or a function "
                            f"model -> TpPlan, got {type(custom_policy).__name__}")


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@takes_plugin_options(positional=("tp_size", "pp_size", "precision", "zero_stage",
                                  "enable_sequence_parallelism", "sequence_parallelism_mode",
                                  "max_norm", "custom_policy", "use_fp8", "fp8_communication",
                                  "fp8_config"))
class HybridParallelPlugin(Plugin):
    """Tensor parallel (+ sequence parallel) x ZeRO data parallel, with FP8 GEMMs on the shards.

    Args:
        tp_size: tensor-parallel ranks per replica (consecutive ranks: keep it within a node).
            Must divide the model's attention heads, kv heads, FFN size and vocabulary.
        pp_size: pipeline ranks (``torch.distributed.pipelining``; HF decoder LMs with the
            Llama/Mistral/Qwen2 structure are split by hand). With pp_size > 1 train with
            ``booster.execute_pipeline`` (the model's own ``forward`` is not usable), zero_stage
            must be 0 or 1, and one of num_microbatches / microbatch_size is required.
        precision: ``"bf16"`` (default; Colossal-AI defaults to ``"fp16"``, which FP8 training
            does not need), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        zero_stage: 0 (gradients all-reduced over dp, state replicated), 1 (optimizer state
            and FP32 masters sharded over dp) or 2 (gradients reduce-scattered too).
        enable_sequence_parallelism: split the residual stream along the sequence between
            tensor-parallel regions (activation memory / tp); needs tp_size > 1 and a sequence
            length divisible by tp_size.
        sequence_parallelism_mode: ``"split_gather"`` (Megatron-style over the tp ranks; the
            default) or ``"all_to_all"`` (DeepSpeed-Ulysses over ``sp_size`` ranks of their own,
            any tp: attention heads / tp and kv heads / tp must divide by sp_size; HF causal
            LMs without padding masks; pp_size must be 1). Ignored (INFO) when sequence
            parallelism is off; ``"ring_attn"`` raises. Rules: ``parallel/sp/setup.py``.
        sp_size: all_to_all ranks per replica (keyword; dp = world / (pp x sp x tp)). Every sp
            rank is fed the same full batch and keeps ``seq / sp_size`` tokens: the returned
            ``loss`` is the global token mean, ``logits`` this rank's chunk. FP8 all-to-all of
            q/k/v and the attention output under ``fp8_communication``; gradients in dtype.
        max_norm: clip the global gradient norm (over tp x pp x dp) at every step; 0 disables.
        custom_policy: a ``fp8boost.parallel.tp.TpPlan``, or a function ``model -> TpPlan``, for
            models the built-in HF policy (Llama, Mistral, Qwen2 and same-structured) misses.
        use_fp8: run eligible linear layers' three GEMMs in FP8 on each rank's shard.
        fp8_communication: FP8 on the wire. Over dp: the ZeRO parameter all-gather (FP8
            weights feed their GEMMs directly) and, with ``fp8_reduce_scatter``, the gradient
            reduction, as ``LowLevelZeroPlugin`` (``plugin.comm_report`` says which). Over tp with sequence parallelism: each region's input
            all-gather moves e4m3 bytes (one scale from the amax all-reduced over tp) that
            q/k/v and gate/up consume without a second cast. Region exits and backward
            collectives stay in the training dtype (FP8 reduce-scatter measured slower at
            these sizes); the reasons are logged once and kept in ``plugin.tp_state.comm_report``.
            Over pp: activations cross stage boundaries as e4m3 bytes + scale and their
            gradients as e5m2 (``parallel/pipeline/boundary.py``); boundaries inside one rank
            (the turn of a V) and payloads below ``comm_config.min_numel`` stay in the training
            dtype, logged once; ``plugin.pp_state.boundaries.report`` says which went FP8.
        fp8_config: FP8 recipe (``Fp8Config``). comm_config: ``Fp8CommConfig``.
        fp8_reduce_scatter: reduce ZeRO gradients over dp in FP8 too (off: measured slower on
            NVLink; for slow links). Needs ``fp8_communication``.
        overlap_communication, reduce_bucket_size_in_m, cpu_offload: ZeRO options, as in
            ``LowLevelZeroPlugin``.
        overlap_allgather: ZeRO's post-step parameter all-gather overlapped with the next
            forward, as in ``LowLevelZeroPlugin``; with ``zero_stage`` 1 or 2 and
            ``pp_size=1`` (else it does not apply, said once at INFO).
        initial_scale, growth_interval: fp16 dynamic loss scaling.
        num_microbatches: micro-batches per ``execute_pipeline`` step (must divide the batch),
            or microbatch_size: rows per micro-batch (must divide the batch). One is required
            with pp_size > 1.
        pp_style: ``"1f1b"`` (one chunk per rank), ``"interleaved"`` (num_model_chunks > 1,
            stage s on rank s % pp) or ``"zbv"`` (zero-bubble V, num_model_chunks == 2).
        num_model_chunks: model chunks (stages) per pipeline rank.
        num_layers_per_stage: decoder layers of each of the pp_size x num_model_chunks stages
            in pipeline order (default: equal; the layer count must then divide evenly).
            Pipeline options with pp_size=1 are ignored (one INFO line), as in Colossal-AI.
        gradient_checkpoint_config: a ``fp8boost.colossal.shardformer``
            ``(Pipeline)GradientCheckpointConfig``: with ``model.gradient_checkpointing_enable()``
            only the first ``get_num_ckpt_layers(...)`` decoder layers of each stage (the whole
            model at pp_size=1) recompute; the others stop (``grad_ckpt.py``).

    Colossal-AI's own arguments (``zero_bucket_size_in_m``, ``communication_dtype``,
    loss-scaling details, ``scheduler_nodes``, ``parallel_output``, Shardformer and DDP
    tuning, ...) are taken by ``fp8boost.colossal.booster.plugin.HybridParallelPlugin``, which
    maps them onto these.

    The model's ``logits`` output is this rank's vocabulary slice (``[..., vocab / tp_size]``);
    the HF ``loss`` is computed from the slices without gathering them.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import HybridParallelPlugin
        >>> plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, use_fp8=True)
        >>> booster = Booster(plugin=plugin)
        >>> # under torchrun: model, optimizer, *_ = booster.boost(model, optimizer)
    """

    #: more fp16 ``DynamicLossScaler`` keywords (``min_scale``, ...; Colossal-AI's class sets
    #: them from its arguments); empty: the scaler's defaults
    loss_scale_kwargs: Mapping[str, float] = MappingProxyType({})

    def __init__(self, tp_size: int = 1, pp_size: int = 1, zero_stage: int = 0,
                 enable_sequence_parallelism: bool = False,
                 sequence_parallelism_mode: Optional[str] = None, custom_policy=None, *,
                 sp_size: Optional[int] = None, overlap_communication: bool = True,
                 reduce_bucket_size_in_m: Optional[float] = None, cpu_offload: bool = False,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1,
                 num_layers_per_stage: Optional[list] = None, gradient_checkpoint_config=None,
                 overlap_allgather: bool = False, **options) -> None:
        super().__init__(**options)  # precision, FP8, clipping, loss scaling: PluginOptions
        self.gradient_checkpoint_config = check_ckpt_config(gradient_checkpoint_config)
        self.tp_size = _check_int("tp_size", tp_size, 1)
        self.pp_size = _check_int("pp_size", pp_size, 1)
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2 (ZeRO-3 is GeminiPlugin), got "
                             f"{zero_stage!r}")
        for name, value in (("enable_sequence_parallelism", enable_sequence_parallelism),
                            ("overlap_communication", overlap_communication),
                            ("cpu_offload", cpu_offload), ("overlap_allgather", overlap_allgather)):
            check_bool(name, value)
        self.sequence_parallelism_mode, self.sp_size = self._check_sp(
            enable_sequence_parallelism, sequence_parallelism_mode, sp_size)
        self.pipeline = check_pipeline_args(self.pp_size, zero_stage, num_microbatches,
                                            microbatch_size, pp_style, num_model_chunks,
                                            num_layers_per_stage)
        check_custom_policy(custom_policy)
        self.reduce_bucket_numel = check_bucket_size(reduce_bucket_size_in_m,
                                                     self.fp8_communication)
        self.zero_stage = zero_stage
        self.enable_sequence_parallelism = enable_sequence_parallelism
        self.custom_policy = custom_policy
        self.overlap_communication, self.cpu_offload = overlap_communication, cpu_offload
        self.overlap_allgather = overlap_allgather and zero_stage > 0 and self.pp_size == 1
        if overlap_allgather and not self.overlap_allgather:
            _state.log_once(logger, "hybrid-overlap-allgather-na",
                            "fp8boost: HybridParallelPlugin(overlap_allgather=True) applies to "
                            "the ZeRO parameter all-gather with zero_stage 1 or 2 and "
                            f"pp_size=1; here (zero_stage={zero_stage}, pp_size={self.pp_size}) "
                            "parameters are gathered after the step", level=logging.INFO)
        self.tp_state = None
        self.pp_state = None
        self.input_guard = None  # ReplicaInputGuard, set by boost when a replica spans ranks
        self.tp_within_node = True

    _stage_manager = None

    @property
    def stage_manager(self):
        """Colossal-AI's ``plugin.stage_manager``: None when ``pp_size == 1``, else a
        ``fp8boost.parallel.pipeline.stage_manager.PipelineStageManager`` for this rank
        (``is_first_stage()``, ``is_last_stage()``, ``num_stages``, ``stage``).

        Colossal-AI builds it in ``__init__`` (its launch comes first); here it is built on
        first access from the (dp, pp, tp) rank layout, so it can be read before ``boost``
        too (that first access initialises the process group from the launcher's
        environment if it is not yet, as ``plugin.dp_rank`` does)."""
        if self.pp_size == 1:
            return None
        if self._stage_manager is None:
            dims = self.dims
            self._stage_manager = PipelineStageManager(
                dims, dist.get_rank(), self.pipeline.num_model_chunks, self.pipeline.pp_style)
        return self._stage_manager

    def _check_sp(self, enabled: bool, mode: Optional[str], sp_size: Optional[int]) -> tuple:
        """(mode, sp mesh size): the rules are in ``parallel/sp/setup.py`` (split_gather on the
        tp ranks, all_to_all on an sp axis of its own)."""
        return check_sp_args(enabled, mode, sp_size, self.tp_size, self.pp_size)

    def __repr__(self) -> str:
        return (f"HybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.pp_size}, "
                f"pp_style={self.pipeline.pp_style if self.pipeline else None!r}, "
                f"zero_stage={self.zero_stage}, precision={self.precision!r}, "
                f"sp={self.enable_sequence_parallelism}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication})")

    # ------------------------------------------------------------------------------ boost
    # configure's steps (Plugin.configure). Order, as in torchtitan: pipeline split -> move /
    # cast -> FP8 conversion -> broadcast -> tensor-parallel split -> ZeRO over dp.
    def validate(self, model: nn.Module, optimizer) -> None:
        if optimizer is not None:
            ZeroOptimizer.validate(optimizer)
        self._debug_inputs = debug_every_step()  # a bad value raises before any collective
        self._plan = resolve_plan(model, self.custom_policy) if self.tp_size > 1 else None
        if self._plan is not None:
            check_plan(model, self._plan, self.tp_size)  # before any collective
            self._check_moe_sequence_parallel(model)
        validate_ulysses(model, self.sp_size, self.tp_size, self.pp_size)
        self._layout = pipeline_layout(model, self.pp_size, self.pipeline) \
            if self.pipeline else None
        self._ckpt_flags = plan_checkpointing(model, self.gradient_checkpoint_config,
                                              self._layout)  # before any collective

    def _check_moe_sequence_parallel(self, model: nn.Module) -> None:
        """Refuse split-gather SP on an MoE model that adds the router aux loss (no collective).

        Each tp rank's router sees its sequence shard, so its aux loss is the model's loss of
        that shard, and the replicated router's gradients are *summed* over tp (as for norms):
        the aux term would weigh tp_size times what the model defines.
        """
        if self.sequence_parallelism_mode == "split_gather" and router_aux_loss_on(model):
            raise ValueError(
                f"{type(model).__name__} adds its router load-balancing loss "
                "(config.output_router_logits=True), which sequence parallelism over tp would "
                f"count tp_size={self.tp_size} times (each rank's aux loss covers its sequence "
                "shard and the replicated router's gradients are summed over tp); set "
                "model.config.output_router_logits=False or enable_sequence_parallelism=False")

    def build_model(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """Keep this rank's pipeline stages (dropping the others' parameters from
        ``optimizer``), then move and cast; first, ``gradient_checkpoint_config`` picks the
        decoder layers that recompute (``grad_ckpt.py``)."""
        apply_checkpointing(model, self._ckpt_flags)
        self.pp_state = strip_model(model, optimizer, self._layout, self.topology()) \
            if self._layout else None
        super().build_model(model, optimizer, device)

    comm_engine = "zero"  # ZeRO over dp (x sp under Ulysses): the plan's dp collectives

    def comm_plan_args(self, model: nn.Module) -> dict:
        # the tp split comes after the plan: its column-parallel layers' rows decide whether
        # a blockwise weight's ZeRO chunks hold whole blocks
        return {"zero_stage": self.zero_stage,
                "sequence_parallel": self.sequence_parallelism_mode,
                "tp_colwise": self._plan.colwise if self._plan is not None else ()}

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        topo = self.topology()
        if self.pp_state is not None:
            broadcast_stage(model, self.pp_state)
        else:
            broadcast_module(model)  # from global rank 0, before the tensor-parallel split
        self._check_tp_placement(topo.dims)
        if self._plan is not None:
            plan = stage_plan(self._plan, model) if self.pp_state is not None else self._plan
            self.tp_state = apply_tp(model, plan, topo.group("tp"),
                                     sequence_parallel=self.sequence_parallelism_mode
                                     == "split_gather", comm_plan=self.comm_plan)
        # all_to_all: attention over the sp ranks
        apply_ulysses_to(model, topo, self.sp_size, self.comm_plan)
        # Delayed scaling: one amax history on every rank that holds the same layers (with pp,
        # one stage's dp x tp ranks: other stages' reductions must not be matched with ours).
        reduce_delayed_amax(model, self.pp_state.stage_group if self.pp_state else None)
        if self.pp_state is not None:
            build_runner(model, self.pp_state, self.pipeline, device=device,
                         act_dtype=DTYPES[self.precision], tp_size=self.tp_size,
                         sequence_parallel=self.enable_sequence_parallelism,
                         comm_plan=self.comm_plan)
        self.input_guard = self._make_input_guard(topo, device, self._debug_inputs)
        return model

    def wrap_optimizer(self, model: nn.Module, optimizer, device: torch.device) -> ZeroOptimizer:
        topo = self.topology()
        sharded = set(self.tp_state.shard_dims) if self.tp_state is not None else set()
        replicated = [p for n, p in model.named_parameters() if n not in sharded]
        opt = ZeroOptimizer(
            optimizer, dp_group=zero_group(topo, self.sp_size), stage=self.zero_stage,
            overlap_communication=self.overlap_communication,
            reduce_bucket_numel=self.reduce_bucket_numel, max_norm=self.max_norm,
            cpu_offload=self.cpu_offload,
            loss_scaler=make_loss_scaler(self.precision, self.initial_scale,
                                         self.growth_interval, **self.loss_scale_kwargs),
            comm_plan=self.comm_plan, fp8_params=self.comm_plan.fp8_gather_params(model),
            tp_group=topo.group("tp") if self.tp_size > 1 else None,
            tp_replicated=replicated, pp_group=topo.group("pp") if self.pp_size > 1 else None,
            pp_counted_elsewhere=self._tied_copy(), overlap_allgather=self.overlap_allgather)
        opt.bind_fp8_layers(model)
        opt.bind_overlap(model)  # overlap_allgather: blocks unpack their own before forward
        return opt

    def bind_checkpoint_io(self, model: nn.Module, optimizer) -> None:
        self._boosted_module, self._boosted_optimizer = model, optimizer  # for save_optimizer

    # The model and optimizer of the last boost (None before one): HybridCheckpointIO's names.
    boosted_module = property(lambda self: getattr(self, "_boosted_module", None))
    boosted_optimizer = property(lambda self: getattr(self, "_boosted_optimizer", None))

    def wrap_model(self, module: nn.Module, optimizer) -> ModelWrapper:
        wrapper = PipelineModel if self.pp_state is not None else ModelWrapper
        wrapped = wrapper(module, DTYPES[self.precision])
        if self.input_guard is not None and self.pp_state is None:
            self.input_guard.attach(wrapped)  # pipelines check in execute_pipeline
        return wrapped

    def _make_input_guard(self, topo, device: torch.device,
                          every_step: bool) -> Optional["ReplicaInputGuard"]:
        """A check that the tp/pp ranks of a replica are fed the same batch (None: one rank).

        Cheap: one tiny all-gather per group at the first forward; at every forward with
        ``FP8BOOST_DEBUG_TP_INPUTS=1`` (``fp8boost/parallel/tp/input_guard.py``).
        """
        # tp, pp and Ulysses sp ranks read one batch
        groups = replica_groups(topo, self.tp_size, self.pp_size, self.sp_size)
        return ReplicaInputGuard(groups, device, every_step) if groups else None

    def _check_tp_placement(self, dims) -> None:
        self.tp_within_node = tp_within_node(self.tp_size, dims.world_size)
        if not self.tp_within_node:
            _state.warn_once(("hybrid-tp-across-nodes", self.tp_size),
                             f"HybridParallelPlugin: tp_size={self.tp_size} does not divide the "
                             f"{os.environ.get('LOCAL_WORLD_SIZE')} processes per node torchrun "
                             "started, so tensor-parallel groups span nodes and every layer's "
                             "collectives cross the network: choose a tp_size that divides the "
                             "GPUs per node")

    def execute_pipeline(self, data_iter, model, criterion=None, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """One pipeline step (pp_size > 1): micro-batched forward and, when training, backward.

        Takes the next batch from ``data_iter`` (a dict of model inputs: ``input_ids`` and,
        for the default criterion, ``labels``; optional ``attention_mask``, ``position_ids``;
        a dict itself is accepted as the batch). Every rank of a pipeline reads its own
        iterator over the same data (``prepare_dataloader`` shards over dp only). The batch is
        split into micro-batches; ``criterion(outputs, inputs)`` gets the last stage's
        ``outputs.logits`` and the micro-batch's dict of inputs and returns its (mean) loss;
        default: the model's HF causal-LM loss (vocabulary-parallel under tp).

        Training runs when ``optimizer`` is given and grad mode is on: gradients of the batch
        mean loss are then ready for ``optimizer.step()`` (reduced over dp, tied embeddings
        summed across first and last stage). Under ``torch.no_grad()`` or with
        ``optimizer=None`` it runs forward only (evaluation).

        Returns:
            ``{"loss": ..., "outputs": ...}``: ``loss`` is the mean over micro-batches of the
            criterion, computed on the last stage and broadcast to every rank of the pipeline
            (a float32 scalar tensor on every rank, so any rank can log it; None with
            ``return_loss=False``). ``outputs`` (``return_outputs=True``) are the logits of the
            whole batch on the rank holding the last stage (vocabulary slice under tp), None
            on the other ranks.

        Example:
            >>> it = iter(dataloader)                                          # doctest: +SKIP
            >>> out = booster.execute_pipeline(it, model, optimizer=optimizer) # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()                        # doctest: +SKIP
        """
        seq_divisor = self.tp_size if self.enable_sequence_parallelism else 1
        return checked_execute_pipeline(self.pp_state, self.input_guard, seq_divisor, data_iter,
                                        model, criterion, optimizer, return_loss, return_outputs)

    def _tied_copy(self) -> list:
        """The last stage's copy of a tied embedding (the first stage counts it in the norm)."""
        st = self.pp_state
        if st is None or st.tied is None or st.rank == st.layout.rank_of(0):
            return []
        return [st.tied]

    def get_checkpoint_io(self):
        """``HybridCheckpointIO``: HF exports gathered over tp, re-shardable DCP state."""
        return HybridCheckpointIO(self)


def tp_within_node(tp: int, world_size: int, env: Optional[dict] = None) -> bool:
    """Whether every tensor-parallel group stays inside one node.

    Ranks are laid out tp-innermost (``parallel/mesh.py``), so a tp group is ``tp`` consecutive
    ranks; torchrun numbers ranks node by node with ``LOCAL_WORLD_SIZE`` per node. The groups
    stay inside nodes when ``tp`` divides ``LOCAL_WORLD_SIZE`` (absent: one node).

    Example:
        >>> tp_within_node(2, 4, {"LOCAL_WORLD_SIZE": "2"}), tp_within_node(4, 4, {"LOCAL_WORLD_SIZE": "2"})
        (True, False)
    """
    env = os.environ if env is None else env
    local = int(env.get("LOCAL_WORLD_SIZE", world_size))
    return local % tp == 0
