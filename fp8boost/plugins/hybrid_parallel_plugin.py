"""HybridParallelPlugin: tensor (+ sequence) parallelism inside a replica, ZeRO across replicas.

The mesh is ``("dp", "pp", "tp")`` (``parallel/mesh.py``). Within a replica the model is split
by a :class:`~fp8boost.parallel.tp.TpPlan` (built from the HF module structure, or the user's
``custom_policy``); across replicas our ZeRO optimizer (stage 0, 1 or 2) averages gradients and
shards FP32 master weights and optimizer state over the ``dp`` group. FP8 GEMMs run on each
rank's shard with scales taken from the whole tensor (amax all-reduced over tp where the
operand is split), so a tp run casts exactly as one process would.

Order of application (fixed, as in torchtitan): move/cast to ``precision`` -> FP8 conversion
(layer choice on the full layer, so it does not depend on tp) -> broadcast from rank 0 ->
tensor parallel split -> ZeRO over dp.
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
        pp_size: pipeline stages. Only 1 is supported in this release (pipeline parallelism
            with ``execute_pipeline`` is the next step); > 1 raises ``NotImplementedError``.
        precision: ``"bf16"`` (default; Colossal-AI defaults to ``"fp16"``, which FP8 training
            does not need), ``"fp16"`` (dynamic loss scaling) or ``"fp32"``.
        zero_stage: 0 (gradients all-reduced over dp, state replicated), 1 (optimizer state
            and FP32 masters sharded over dp) or 2 (gradients reduce-scattered too).
        enable_sequence_parallelism: split the residual stream along the sequence between
            tensor-parallel regions (activation memory / tp); needs tp_size > 1 and a sequence
            length divisible by tp_size.
        sequence_parallelism_mode: ``"split_gather"`` (Megatron-style; the default, and the only
            mode, when sequence parallelism is on).
        max_norm: clip the global gradient norm (over tp x dp) at every step; 0 disables.
        custom_policy: a ``fp8boost.parallel.tp.TpPlan``, or a function ``model -> TpPlan``, for
            models the built-in HF policy (Llama, Mistral, Qwen2 and same-structured) misses.
        use_fp8: run eligible linear layers' three GEMMs in FP8 on each rank's shard.
        fp8_communication: FP8 on the wire. Over dp: the ZeRO gradient reduction and the
            parameter all-gather (FP8 weights feed their GEMMs directly), as
            ``LowLevelZeroPlugin``. Over tp with sequence parallelism: each region's input
            all-gather moves e4m3 bytes (one scale from the amax all-reduced over tp) that
            q/k/v and gate/up consume without a second cast. Region exits and backward
            collectives stay in the training dtype (FP8 reduce-scatter measured slower at
            these sizes); the reasons are logged once and kept in ``plugin.tp_state.comm_report``.
        fp8_config: FP8 recipe (``Fp8Config``). comm_config: ``Fp8CommConfig``.
        overlap_communication, reduce_bucket_size_in_m, cpu_offload: ZeRO options, as in
            ``LowLevelZeroPlugin``.
        initial_scale, growth_interval: fp16 dynamic loss scaling.
        num_microbatches, microbatch_size, pp_style, num_model_chunks, num_layers_per_stage:
            pipeline options (accepted for Colossal-AI compatibility; need pp_size > 1).

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
                 num_layers_per_stage: Optional[list] = None) -> None:
        self.tp_size = _check_int("tp_size", tp_size, 1)
        self.pp_size = _check_int("pp_size", pp_size, 1)
        check_precision(precision, self.supported_precisions)
        if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage must be 0, 1 or 2 (ZeRO-3 is GeminiPlugin), got "
                             f"{zero_stage!r}")
        for name, value in (("enable_sequence_parallelism", enable_sequence_parallelism),
                            ("use_fp8", use_fp8), ("fp8_communication", fp8_communication),
                            ("overlap_communication", overlap_communication),
                            ("cpu_offload", cpu_offload)):
            check_bool(name, value)
        self.sequence_parallelism_mode = self._check_sp(enable_sequence_parallelism,
                                                        sequence_parallelism_mode)
        self._check_pipeline(num_microbatches, microbatch_size, pp_style, num_model_chunks,
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

    def _check_pipeline(self, num_microbatches, microbatch_size, pp_style, num_model_chunks,
                        num_layers_per_stage) -> None:
        given = {k: v for k, v in (("num_microbatches", num_microbatches),
                                   ("microbatch_size", microbatch_size),
                                   ("num_layers_per_stage", num_layers_per_stage)) if v is not None}
        if pp_style not in ("1f1b", "interleaved", "zbv"):
            raise ValueError(f"pp_style={pp_style!r} is not supported; use '1f1b', "
                             "'interleaved' or 'zbv'")
        _check_int("num_model_chunks", num_model_chunks, 1)
        if self.pp_size > 1:
            raise NotImplementedError(
                f"pp_size={self.pp_size}: pipeline parallelism is not implemented yet in "
                "fp8boost's HybridParallelPlugin; use pp_size=1 (tensor parallel x ZeRO)")
        if given or num_model_chunks != 1 or pp_style != "1f1b":
            raise ValueError(f"pipeline options {sorted(given) or ['pp_style/num_model_chunks']} "
                             "need pp_size > 1")

    def __repr__(self) -> str:
        return (f"HybridParallelPlugin(tp_size={self.tp_size}, pp_size={self.pp_size}, "
                f"zero_stage={self.zero_stage}, precision={self.precision!r}, "
                f"sp={self.enable_sequence_parallelism}, use_fp8={self.use_fp8}, "
                f"fp8_communication={self.fp8_communication})")

    # ------------------------------------------------------------------------------ boost
    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        from fp8boost.parallel.tp import apply_tp, check_plan, resolve_plan

        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        if optimizer is not None:
            ZeroOptimizer.validate(optimizer)
        plan = resolve_plan(model, self.custom_policy) if self.tp_size > 1 else None
        if plan is not None:
            check_plan(model, plan, self.tp_size)  # before any collective
        init_distributed()
        dims = self.dims  # raises ValueError when tp * pp does not divide the world
        device = torch.device(device) if device is not None else default_device()
        self._topology = None
        topo = self.topology(device)
        self.fp8_report = prepare_model(model, self.precision, self.use_fp8, self.fp8_config,
                                        device)
        if dims.world_size > 1:
            _broadcast_module(model)
        tp_group = topo.group("tp")
        self.tp_within_node = tp_within_node(self.tp_size, dims.world_size)
        if not self.tp_within_node:
            _state.warn_once(("hybrid-tp-across-nodes", self.tp_size),
                             f"HybridParallelPlugin: tp_size={self.tp_size} does not divide the "
                             f"{os.environ.get('LOCAL_WORLD_SIZE')} processes per node torchrun "
                             "started, so tensor-parallel groups span nodes and every layer's "
                             "collectives cross the network: choose a tp_size that divides the "
                             "GPUs per node")
        if plan is not None:
            self.tp_state = apply_tp(model, plan, tp_group,
                                     sequence_parallel=self.enable_sequence_parallelism,
                                     fp8_communication=self.fp8_communication)
        _delayed_amax_over_world(model)
        opt = self._wrap_optimizer(model, optimizer, topo) if optimizer is not None else None
        if opt is not None:
            opt.bind_fp8_layers(model)
        self._boosted_module, self._boosted_optimizer = model, opt  # for save_optimizer
        wrapped = ModelWrapper(model, DTYPES[self.precision])
        wrapped._fp8boost_optimizers = [opt] if opt is not None else []
        loader = shard_dataloader(dataloader, dims.dp, self.dp_rank)
        return wrapped, opt, criterion, loader, lr_scheduler

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
            fp8_params=_fp8_weights(model), tp_group=topo.group("tp") if self.tp_size > 1 else None,
            tp_replicated=replicated)

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


def _delayed_amax_over_world(model: nn.Module) -> None:
    """Delayed scaling: one amax history for every rank (shards must share their scales)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from fp8boost.fp8.linear import Fp8Linear

    def reduce_max(a: torch.Tensor) -> None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX)

    for m in model.modules():
        if isinstance(m, Fp8Linear) and m._delayed:
            m.set_amax_reduce_fn(reduce_max)
