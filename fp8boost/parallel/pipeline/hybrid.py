"""Pipeline parallelism inside the hybrid plugins: options, setup, ``execute_pipeline``.

``HybridParallelPlugin`` and ``MoeHybridParallelPlugin`` call these steps; they take the
plugin's sizes and state, not the plugin.

Setup order at ``boost`` (pp_size > 1):

1. checks that need no process group (model structure, layer split, plan) -> ``ValueError``;
2. strip the model to this pipeline rank's stages (``parallel/pipeline/split.py``) and drop the
   removed parameters from the optimizer;
3. cast / FP8-convert the kept modules (``prepare_model``), then make every rank of a stage
   start from that stage's lowest rank's weights (broadcast over the ranks sharing the stage),
   and the tied embedding of the last stage from the first stage's;
4. tensor-parallel split of the kept modules (the plan filtered to them);
5. stage modules and the :class:`~fp8boost.parallel.pipeline.PipelineRunner`;
6. ZeRO (stage 0/1) over dp, with the gradient norm over tp x pp x dp.

``execute_pipeline`` runs the schedule under the optimizer's ``no_sync`` (micro-batch
backwards accumulate locally), then sums the tied embedding gradient of the first and last
stage, then reduces gradients over dp once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state

from ..comm.config import Fp8CommConfig
from ..comm.plan import CommPlan
from ..distributed import broadcast_module
from ..wrappers import ModelWrapper
from .boundary import BoundaryPlan
from .layout import PipelineLayout, check_pipeline_options, make_layout
from .runner import PipelineRunner
from .split import (CausalLMOutputs, build_stage_modules, check_pipeline_model, strip_to_rank,
                    tied_embedding)
from .stage_manager import rank_with


def _positive(name: str, value) -> Optional[int]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """The plugin's pipeline arguments, checked (see ``HybridParallelPlugin``)."""

    num_microbatches: Optional[int] = None
    microbatch_size: Optional[int] = None
    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    num_layers_per_stage: Optional[tuple[int, ...]] = None


def check_pipeline_args(pp_size: int, zero_stage: int, num_microbatches, microbatch_size,
                        pp_style, num_model_chunks, num_layers_per_stage) -> Optional[PipelineOptions]:
    """Colossal-AI's rules, checked before any process group exists; None when pp_size == 1."""
    _positive("num_microbatches", num_microbatches)
    _positive("microbatch_size", microbatch_size)
    _positive("num_model_chunks", num_model_chunks)
    if pp_size == 1:
        given = [k for k, v in (("num_microbatches", num_microbatches),
                                ("microbatch_size", microbatch_size),
                                ("num_layers_per_stage", num_layers_per_stage)) if v is not None]
        given += [k for k, v, d in (("pp_style", pp_style, "1f1b"),
                                    ("num_model_chunks", num_model_chunks, 1)) if v != d]
        if given:  # Colossal-AI ignores them without a pipeline: so does fp8boost
            _state.log_once(logging.getLogger("fp8boost.plugins"),
                            "colossal-args.hybrid.pipeline-options",
                            f"fp8boost: pipeline options {given} are ignored with pp_size=1 (as "
                            "in Colossal-AI)", level=logging.INFO)
        return None
    if zero_stage > 1:
        raise ValueError(f"pp_size > 1 needs zero_stage <= 1 (got {zero_stage}): ZeRO-2 "
                         "reduce-scatters gradients inside each backward, and a pipeline runs "
                         "one backward per micro-batch; use zero_stage=1")
    if (num_microbatches is None) == (microbatch_size is None):
        raise ValueError("pp_size > 1 needs exactly one of num_microbatches (micro-batches per "
                         "step) or microbatch_size (rows per micro-batch)")
    check_pipeline_options(pp_size, pp_style, num_model_chunks, num_layers_per_stage)
    if pp_style == "1f1b" and num_microbatches is not None and num_microbatches < pp_size:
        raise ValueError(f"pp_style='1f1b' needs num_microbatches >= pp_size ({pp_size}), got "
                         f"{num_microbatches}: every stage must have a micro-batch in flight")
    if pp_style == "interleaved" and num_microbatches is not None:
        rounds = max(1, num_microbatches // pp_size)
        if num_microbatches % rounds:
            raise ValueError(f"pp_style='interleaved' needs num_microbatches to be a multiple "
                             f"of max(1, num_microbatches // pp_size) = {rounds}; use a "
                             f"multiple of pp_size={pp_size}")
    return PipelineOptions(num_microbatches=num_microbatches, microbatch_size=microbatch_size,
                           pp_style=pp_style, num_model_chunks=num_model_chunks,
                           num_layers_per_stage=None if num_layers_per_stage is None
                           else tuple(num_layers_per_stage))


def pipeline_layout(model: nn.Module, pp: int, opts: PipelineOptions) -> PipelineLayout:
    """The layout for ``model``; ``ValueError`` (no collective) if it cannot be split so."""
    n = check_pipeline_model(model)
    return make_layout(n, pp, num_chunks=opts.num_model_chunks, style=opts.pp_style,
                       num_layers_per_stage=opts.num_layers_per_stage)


@dataclass
class PipelineState:
    """What the plugin keeps for ``execute_pipeline`` and checkpoints."""

    layout: PipelineLayout
    rank: int
    group: object
    stage_group: object
    """Ranks that hold this rank's stages (the dp x tp ranks of one pipeline rank)."""
    tied: Optional[torch.Tensor] = None
    """This rank's tied embedding weight when the first and last stage are on different ranks."""
    tied_group: object = None
    tied_src: int = 0
    """Global rank of the first stage in ``tied_group`` (its weight is the reference)."""
    runner: Optional[PipelineRunner] = None
    boundaries: Optional[BoundaryPlan] = None


def new_groups(dims, key) -> object:
    """``dist.new_group`` for every class of ranks with equal ``key(coords)`` (None: in no
    group); returns ours. Every rank creates every group in the same order (collective).
    """
    classes: dict = {}
    for r in range(dims.world_size):
        k = key(dims.coords(r))
        if k is not None:
            classes.setdefault(k, []).append(r)
    mine = None
    for k in sorted(classes, key=str):
        g = dist.new_group(classes[k])
        if dist.get_rank() in classes[k]:
            mine = g
    return mine


def strip_model(model: nn.Module, optimizer, layout: PipelineLayout, topo) -> PipelineState:
    """Step 2 (collective: creates the stage and tied-embedding groups)."""
    dims = topo.dims
    rank = topo.rank("pp")
    tied = tied_embedding(model)
    strip_to_rank(model, layout, rank)
    if optimizer is not None:  # removed layers must not stay alive through the optimizer
        kept = {id(p) for p in model.parameters()}
        for g in optimizer.param_groups:
            g["params"] = [p for p in g["params"] if id(p) in kept]
    state = PipelineState(layout=layout, rank=rank, group=topo.group("pp"),
                          stage_group=new_groups(dims, lambda c: c["pp"]))
    first, last = layout.rank_of(0), layout.last_rank
    if tied and first != last:
        ends = (first, last)
        g = new_groups(dims, lambda c: (c["dp"], c["tp"]) if c["pp"] in ends else None)
        if rank in ends:
            state.tied_group = g
            state.tied_src = rank_with(dims, dist.get_rank(), pp=first)
            state.tied = (model.model.embed_tokens.weight if rank == first
                          else model.lm_head.weight)
    return state


def broadcast_stage(model: nn.Module, state: PipelineState) -> None:
    """Step 3: ranks of a stage start equal; the last stage's tied weight equals the first's."""
    broadcast_module(model, state.stage_group)  # from the stage's lowest rank
    if state.tied is not None:
        with torch.no_grad():
            dist.broadcast(state.tied.data, state.tied_src, group=state.tied_group)


def stage_plan(plan, model: nn.Module):
    """The tensor-parallel plan restricted to the modules this rank kept."""
    modules = dict(model.named_modules())
    names = set(modules)

    def keep(xs):
        return [x for x in xs if x in names]

    # On the last stage a tied embedding is a TiedWeight holder, split with lm_head's weight.
    embedding = plan.embedding if isinstance(modules.get(plan.embedding), nn.Embedding) else None
    return dataclasses.replace(
        plan, regions=keep(plan.regions), colwise=keep(plan.colwise), rowwise=keep(plan.rowwise),
        embedding=embedding,
        lm_head=plan.lm_head if plan.lm_head in names else None, layers=keep(plan.layers),
        sequence_sharded=keep(plan.sequence_sharded),
        split_sequence=bool(plan.layers) and plan.layers[0] in names)


def build_runner(model: nn.Module, state: PipelineState, opts: PipelineOptions, *, device,
                 act_dtype: torch.dtype, tp_size: int, sequence_parallel: bool,
                 comm_plan: CommPlan) -> PipelineRunner:
    """Step 5. The boundaries carry FP8 where ``comm_plan.pipeline_p2p`` says (and, per
    boundary, where ``BoundaryPlan`` finds a wire and a payload worth the casts)."""
    lay = state.layout
    same = {s: lay.rank_of(s) == lay.rank_of(s + 1) for s in range(lay.num_stages - 1)}
    state.boundaries = BoundaryPlan(enabled=comm_plan.pipeline_p2p.fp8,
                                    cfg=comm_plan.config or Fp8CommConfig(), same_rank=same)
    mods = build_stage_modules(model, lay, state.rank, state.boundaries, act_dtype,
                               tp_size if sequence_parallel else 1)
    vocab = model.config.vocab_size // tp_size
    # The criterion gets the model's own HF output; built after the tp split, whose
    # vocabulary-parallel loss_function it then uses.
    state.runner = PipelineRunner(mods, lay, state.group, device, vocab_local=vocab,
                                  make_outputs=CausalLMOutputs(model),
                                  num_microbatches=opts.num_microbatches,
                                  microbatch_size=opts.microbatch_size)
    return state.runner


class PipelineModel(ModelWrapper):
    """The boosted model under pipeline parallelism: run it with ``booster.execute_pipeline``."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("with pp_size > 1 the model is split over pipeline ranks: call "
                           "booster.execute_pipeline(data_iter, model, criterion, optimizer) "
                           "instead of model(...)")


def hf_causal_lm_criterion(outputs, inputs: dict) -> torch.Tensor:
    """The default criterion: ``outputs.loss``, the model's own causal-LM loss on
    ``inputs["labels"]`` (vocabulary-parallel under tp), computed by ``CausalLMOutputs``.

    Raises:
        ValueError: the micro-batch has no ``labels`` (then ``outputs.loss`` is None).
    """
    if inputs.get("labels") is None:
        raise ValueError("the default criterion needs inputs['labels'] (the HF causal-LM "
                         "loss); pass labels in the batch or a criterion(outputs, inputs)")
    return outputs.loss


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def checked_execute_pipeline(state: Optional[PipelineState], input_guard, seq_divisor: int,
                             data_iter, model, criterion, optimizer, return_loss: bool,
                             return_outputs: bool, reduce_gradients=None) -> dict:
    """A hybrid plugin's ``execute_pipeline``: refuses a plugin without pipeline (``state``
    None), compares the batch of the replica's ranks when ``input_guard`` is active, then runs
    :func:`execute_pipeline`.

    Raises:
        ValueError: ``state`` is None (pp_size=1 or not boosted).
    """
    if state is None:
        raise ValueError("execute_pipeline needs pp_size > 1 and a boosted model; with "
                         "pp_size=1 call model(...) and booster.backward(loss, optimizer)")
    if input_guard is not None and input_guard.active:
        # Every rank of the pipeline reads its own copy of the batch: compare them.
        data_iter = data_iter if isinstance(data_iter, dict) else next(data_iter)
        if isinstance(data_iter, dict):  # else execute_pipeline raises its own error
            input_guard.check((), data_iter)
    return execute_pipeline(state, seq_divisor, data_iter, model, criterion, optimizer,
                            return_loss, return_outputs, reduce_gradients)


def execute_pipeline(state: PipelineState, seq_divisor: int, data_iter, model, criterion,
                     optimizer, return_loss: bool, return_outputs: bool,
                     reduce_gradients=None) -> dict:
    """``HybridParallelPlugin.execute_pipeline`` (see there).

    ``seq_divisor``: what the sequence length must divide by (tp_size under sequence
    parallelism, else 1). ``reduce_gradients``: called once after the schedule (and the
    tied-embedding sum) to reduce the accumulated gradients over dp; None:
    ``optimizer.reduce_gradients``.
    """
    batch = data_iter if isinstance(data_iter, dict) else next(data_iter)
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("execute_pipeline: the data iterator must yield dicts of model inputs "
                         f"with 'input_ids' (and 'labels' for the default criterion), got "
                         f"{type(batch).__name__}")
    seq = batch["input_ids"].shape[1]
    if seq % seq_divisor:
        raise ValueError(f"sequence parallelism needs the sequence length ({seq}) divisible "
                         f"by tp_size={seq_divisor}")
    batch = _to_device(batch, state.runner.device)
    backward = optimizer is not None and torch.is_grad_enabled()
    if criterion is None:
        criterion = hf_causal_lm_criterion
    scaler = getattr(optimizer, "loss_scaler", None) if backward else None
    ctx = optimizer.no_sync() if backward else contextlib.nullcontext()
    with ctx:
        loss, outputs = state.runner.run(batch, criterion, backward=backward,
                                         return_outputs=return_outputs,
                                         loss_scale=scaler.scale if scaler is not None else 1.0)
    if backward:
        guard = getattr(optimizer, "nonfinite_guard", None)
        if guard is not None and loss is not None:  # the last stage's loss; others see grads
            guard.observe_loss(loss)
        if state.tied is not None and state.tied.grad is not None:
            dist.all_reduce(state.tied.grad, group=state.tied_group)  # embed + lm_head parts
        (reduce_gradients or optimizer.reduce_gradients)()
    return {"loss": state.runner.broadcast_loss(loss) if return_loss else None,
            "outputs": outputs}
