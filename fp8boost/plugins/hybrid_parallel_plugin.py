"""HybridParallelPlugin: pipeline x tensor (+ sequence) parallelism in a replica, ZeRO across.

The mesh is ``("dp", "pp", "tp")`` (``parallel/mesh.py``). Within a replica the model is split
by a :class:`~fp8boost.parallel.tp.TpPlan` (built from the HF module structure, or the user's
``custom_policy``); across replicas our ZeRO optimizer (stage 0, 1 or 2) averages gradients and
shards FP32 master weights and optimizer state over the ``dp`` group. FP8 GEMMs run on each
rank's shard with scales taken from the whole tensor (amax all-reduced over tp where the
operand is split), so a tp run casts exactly as one process would.

Order of application (fixed, as in torchtitan): [pipeline split: each rank keeps its stages'
layers, see ``hybrid_pipeline.py``] -> move/cast to ``precision`` -> FP8 conversion (layer
choice on the full layer, so it does not depend on tp) -> broadcast (from rank 0; with pp from
each stage's lowest rank) -> tensor parallel split -> ZeRO over dp.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.fp8.config import Fp8Config
from fp8boost.parallel.zero import ZeroOptimizer

from .hybrid_pipeline import (PipelineModel, broadcast_stage, build_runner, check_pipeline_args,
                              pipeline_layout, stage_plan, strip_model)
from .plugin_base import Boosted, Plugin, check_bool, check_boost_args, default_device, \
    init_distributed, shard_dataloader
from .precision import check_comm_config, check_fp8_config, check_max_norm, check_precision, \
    make_loss_scaler, prepare_model
from .wrappers import DTYPES, ModelWrapper

logger = logging.getLogger("fp8boost.plugins")
_MIB = 1024 * 1024
SP_MODES = ("split_gather",)
PIPELINE_ARGS = ("num_microbatches", "microbatch_size", "num_layers_per_stage")


def _check_int(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


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
        sequence_parallelism_mode: ``"split_gather"`` (Megatron-style; the default, and the only
            mode, when sequence parallelism is on).
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
        initial_scale, growth_interval: fp16 dynamic loss scaling.
        num_microbatches: micro-batches per ``execute_pipeline`` step (must divide the batch),
            or microbatch_size: rows per micro-batch (must divide the batch). One is required
            with pp_size > 1.
        pp_style: ``"1f1b"`` (one chunk per rank), ``"interleaved"`` (num_model_chunks > 1,
            stage s on rank s % pp) or ``"zbv"`` (zero-bubble V, num_model_chunks == 2).
        num_model_chunks: model chunks (stages) per pipeline rank.
        num_layers_per_stage: decoder layers of each of the pp_size x num_model_chunks stages
            in pipeline order (default: equal; the layer count must then divide evenly).

    The model's ``logits`` output is this rank's vocabulary slice (``[..., vocab / tp_size]``);
    the HF ``loss`` is computed from the slices without gathering them.

    Example:
        >>> from fp8boost.booster import Booster
        >>> from fp8boost.plugins import HybridParallelPlugin
        >>> plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, use_fp8=True)
        >>> booster = Booster(plugin=plugin)
        >>> # under torchrun: model, optimizer, *_ = booster.boost(model, optimizer)
    """

    supported_precisions = ("fp32", "bf16", "fp16")

    def __init__(self, tp_size: int = 1, pp_size: int = 1, precision: str = "bf16",
                 zero_stage: int = 0, enable_sequence_parallelism: bool = False,
                 sequence_parallelism_mode: Optional[str] = None, max_norm: float = 0.0,
                 custom_policy=None, use_fp8: bool = False, fp8_communication: bool = False,
                 fp8_config: Optional[Fp8Config] = None, *, comm_config=None,
                 overlap_communication: bool = True,
                 reduce_bucket_size_in_m: Optional[float] = None, cpu_offload: bool = False,
                 initial_scale: float = 2.0 ** 16, growth_interval: int = 1000,
                 num_microbatches: Optional[int] = None, microbatch_size: Optional[int] = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1,
                 num_layers_per_stage: Optional[list] = None,
                 fp8_reduce_scatter: bool = False) -> None:
        self.tp_size = _check_int("tp_size", tp_size, 1)
        self.pp_size = _check_int("pp_size", pp_size, 1)
        check_precision(precision, self.supported_precisions)
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2 (ZeRO-3 is GeminiPlugin), got "
                             f"{zero_stage!r}")
        for name, value in (("enable_sequence_parallelism", enable_sequence_parallelism),
                            ("use_fp8", use_fp8), ("fp8_communication", fp8_communication),
                            ("overlap_communication", overlap_communication),
                            ("cpu_offload", cpu_offload),
                            ("fp8_reduce_scatter", fp8_reduce_scatter)):
            check_bool(name, value)
        if fp8_reduce_scatter and not fp8_communication:
            raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
        self.fp8_reduce_scatter = fp8_reduce_scatter
        self.comm_report: dict = {}
        self.sequence_parallelism_mode = self._check_sp(enable_sequence_parallelism,
                                                        sequence_parallelism_mode)
        self.pipeline = check_pipeline_args(self.pp_size, zero_stage, num_microbatches,
                                            microbatch_size, pp_style, num_model_chunks,
                                            num_layers_per_stage)
        if custom_policy is not None and not callable(custom_policy):
            from fp8boost.parallel.tp import TpPlan
            if not isinstance(custom_policy, TpPlan):
                raise TypeError("custom_policy must be a fp8boost.parallel.tp.TpPlan or a function "
                                f"model -> TpPlan, got {type(custom_policy).__name__}")
        if reduce_bucket_size_in_m is None:
            reduce_bucket_size_in_m = 64 if fp8_communication else 12
        if isinstance(reduce_bucket_size_in_m, bool) or \
                not isinstance(reduce_bucket_size_in_m, (int, float)) or reduce_bucket_size_in_m <= 0:
            raise ValueError("reduce_bucket_size_in_m must be > 0 (millions of elements), got "
                             f"{reduce_bucket_size_in_m!r}")
        if not isinstance(initial_scale, (int, float)) or initial_scale <= 0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale!r}")
        _check_int("growth_interval", growth_interval, 1)
        self.precision, self.zero_stage = precision, zero_stage
        self.enable_sequence_parallelism = enable_sequence_parallelism
        self.max_norm = check_max_norm(max_norm)
        self.custom_policy = custom_policy
        self.use_fp8, self.fp8_communication = use_fp8, fp8_communication
        self.fp8_config = check_fp8_config(fp8_config)
        self.comm_config = check_comm_config(comm_config)
        self.overlap_communication, self.cpu_offload = overlap_communication, cpu_offload
        self.reduce_bucket_numel = max(1, int(reduce_bucket_size_in_m * _MIB))
        self.initial_scale, self.growth_interval = float(initial_scale), growth_interval
        self.fp8_report = None
        self.tp_state = None
        self.pp_state = None
        self.input_guard = None  # ReplicaInputGuard, set by boost when a replica spans ranks
        self.tp_within_node = True

    def _check_sp(self, enabled: bool, mode: Optional[str]) -> Optional[str]:
        if not enabled:
            if mode is not None:
                raise ValueError(f"sequence_parallelism_mode={mode!r} needs "
                                 "enable_sequence_parallelism=True")
            return None
        if self.tp_size == 1:
            raise ValueError("enable_sequence_parallelism=True splits the sequence over the "
                             "tensor-parallel ranks: set tp_size > 1")
        mode = "split_gather" if mode is None else mode
        if mode not in SP_MODES:
            raise ValueError(f"sequence_parallelism_mode={mode!r} is not supported; use "
                             f"{SP_MODES} (Megatron-style split/gather)")
        return mode

    def __repr__(self) -> str:
        return (f"HybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.pp_size}, "
                f"pp_style={self.pipeline.pp_style if self.pipeline else None!r}, "
                f"zero_stage={self.zero_stage}, precision={self.precision!r}, "
                f"sp={self.enable_sequence_parallelism}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication})")

    # ------------------------------------------------------------------------------ boost
    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        from fp8boost.parallel.tp import apply_tp, check_plan, resolve_plan
        from fp8boost.parallel.tp.input_guard import debug_every_step

        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        if optimizer is not None:
            ZeroOptimizer.validate(optimizer)
        debug_inputs = debug_every_step()  # a bad value raises before any collective
        plan = resolve_plan(model, self.custom_policy) if self.tp_size > 1 else None
        if plan is not None:
            check_plan(model, plan, self.tp_size)  # before any collective
        layout = pipeline_layout(model, self.pp_size, self.pipeline) if self.pipeline else None
        init_distributed()
        dims = self.dims  # raises ValueError when tp * pp does not divide the world
        device = torch.device(device) if device is not None else default_device()
        self._topology = None
        topo = self.topology(device)
        self.pp_state = strip_model(model, optimizer, layout, topo) if layout else None
        self.fp8_report = prepare_model(model, self.precision, self.use_fp8, self.fp8_config,
                                        device)
        if self.pp_state is not None:
            broadcast_stage(model, self.pp_state)
        elif dims.world_size > 1:
            _broadcast_module(model)
        self._check_tp_placement(dims)
        if plan is not None:
            if self.pp_state is not None:
                plan = stage_plan(plan, model)
            self.tp_state = apply_tp(model, plan, topo.group("tp"),
                                     sequence_parallel=self.enable_sequence_parallelism,
                                     fp8_communication=self.fp8_communication)
        _delayed_amax_over_world(model, self.pp_state.stage_group if self.pp_state else None)
        if self.pp_state is not None:
            build_runner(model, self.pp_state, self.pipeline, device=device,
                         act_dtype=DTYPES[self.precision], tp_size=self.tp_size,
                         sequence_parallel=self.enable_sequence_parallelism,
                         fp8_communication=self.fp8_communication, comm_config=self.comm_config)
        opt = self._wrap_optimizer(model, optimizer, topo) if optimizer is not None else None
        if opt is not None:
            opt.bind_fp8_layers(model)
            self.comm_report = opt.comm_report
        self._boosted_module, self._boosted_optimizer = model, opt  # for save_optimizer
        wrapper = PipelineModel if self.pp_state is not None else ModelWrapper
        wrapped = wrapper(model, DTYPES[self.precision])
        wrapped._fp8boost_optimizers = [opt] if opt is not None else []
        self.input_guard = self._make_input_guard(topo, device, debug_inputs)
        if self.input_guard is not None and self.pp_state is None:
            self.input_guard.attach(wrapped)  # pipelines check in execute_pipeline
        loader = shard_dataloader(dataloader, dims.dp, self.dp_rank)
        return wrapped, opt, criterion, loader, lr_scheduler

    def _make_input_guard(self, topo, device: torch.device,
                          every_step: bool) -> Optional["ReplicaInputGuard"]:
        """A check that the tp/pp ranks of a replica are fed the same batch (None: one rank).

        Cheap: one tiny all-gather per group at the first forward; at every forward with
        ``FP8BOOST_DEBUG_TP_INPUTS=1`` (``fp8boost/parallel/tp/input_guard.py``).
        """
        from fp8boost.parallel.tp.input_guard import ReplicaInputGuard

        if self.tp_size * self.pp_size == 1:
            return None
        return ReplicaInputGuard([topo.group("tp"), topo.group("pp")], device, every_step)

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
        from .hybrid_pipeline import execute_pipeline

        if self.pp_state is None:
            raise ValueError("execute_pipeline needs pp_size > 1 and a boosted model; with "
                             "pp_size=1 call model(...) and booster.backward(loss, optimizer)")
        if self.input_guard is not None and self.input_guard.active:
            # Every rank of the pipeline reads its own copy of the batch: compare them.
            data_iter = data_iter if isinstance(data_iter, dict) else next(data_iter)
            if isinstance(data_iter, dict):  # else execute_pipeline raises its own error
                self.input_guard.check((), data_iter)
        return execute_pipeline(self, self.pp_state, data_iter, model, criterion, optimizer,
                                return_loss, return_outputs)

    def _wrap_optimizer(self, model: nn.Module, optimizer, topo) -> ZeroOptimizer:
        sharded = set(self.tp_state.shard_dims) if self.tp_state is not None else set()
        replicated = [p for n, p in model.named_parameters() if n not in sharded]
        return ZeroOptimizer(
            optimizer, dp_group=topo.group("dp"), stage=self.zero_stage,
            overlap_communication=self.overlap_communication,
            reduce_bucket_numel=self.reduce_bucket_numel, max_norm=self.max_norm,
            cpu_offload=self.cpu_offload,
            loss_scaler=make_loss_scaler(self.precision, self.initial_scale, self.growth_interval),
            fp8_communication=self.fp8_communication, comm_config=self.comm_config,
            fp8_reduce_scatter=self.fp8_reduce_scatter,
            fp8_params=_fp8_weights(model), tp_group=topo.group("tp") if self.tp_size > 1 else None,
            tp_replicated=replicated, pp_group=topo.group("pp") if self.pp_size > 1 else None,
            pp_counted_elsewhere=self._tied_copy())

    def _tied_copy(self) -> list:
        """The last stage's copy of a tied embedding (the first stage counts it in the norm)."""
        st = self.pp_state
        if st is None or st.tied is None or st.rank == st.layout.rank_of(0):
            return []
        return [st.tied]

    def get_checkpoint_io(self):
        """``HybridCheckpointIO``: HF exports gathered over tp, re-shardable DCP state."""
        from .checkpoint_io.hybrid import HybridCheckpointIO
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


def _fp8_weights(model: nn.Module) -> list:
    from fp8boost.fp8.linear import Fp8Linear

    return [m.weight for m in model.modules() if isinstance(m, Fp8Linear)]


def _broadcast_module(model: nn.Module) -> None:
    """Every rank starts from global rank 0's full weights, before the tensor-parallel split."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                dist.broadcast(t.view(torch.uint8), 0)  # gloo has no FP8 type
            else:
                dist.broadcast(t, 0)


def _delayed_amax_over_world(model: nn.Module, group=None) -> None:
    """Delayed scaling: one amax history for every rank (shards must share their scales).

    ``group``: the ranks that hold the same layers (with pp, one stage's dp x tp ranks; other
    stages run other layers, so their reductions must not be matched against ours).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    from fp8boost.fp8.linear import Fp8Linear

    def reduce_max(a: torch.Tensor) -> None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)

    for m in model.modules():
        if isinstance(m, Fp8Linear) and m._delayed:
            m.set_amax_reduce_fn(reduce_max)
