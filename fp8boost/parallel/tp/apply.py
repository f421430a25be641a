"""Apply a :class:`~fp8boost.parallel.tp.policy.TpPlan`: shard weights, install the collectives.

Parameters stay plain tensors holding this rank's shard (the same ``nn.Parameter`` objects, so
an optimizer built before ``boost`` keeps working): everything downstream (``Fp8Linear``, the
ZeRO optimizer, DDP hooks, ``torch.compile``) sees ordinary tensors. The collectives live at
the borders of the plan's regions (see ``functional.py``); DTensor enters only at the
checkpoint boundary, where :class:`TpState` says how each parameter is split.

With sequence parallelism the residual stream between regions is split along the sequence
(dim 1): the first decoder layer splits it, every region gathers it at entry and reduce-
scatters at exit, and ``lm_head`` gathers it again. Replicated parameters that see only part
of the data (norms on sequence shards; per-head norms inside attention) get partial
gradients: a gradient hook sums them over the tp group before they accumulate.
"""
from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fp8boost import _state
from fp8boost.fp8.config import GRANULAR_RECIPES
from fp8boost.fp8.record import recorded_linear
from fp8boost.fp8.scaling import E4M3
from fp8boost.parallel.comm.plan import CommPlan

from .fp8_gather import gather_seq_fp8
from .functional import copy_to_tp, gather_seq, reduce_from_tp, reduce_scatter_seq, split_seq
from .lora_plan import peft_base
from .loss import HfVocabParallelLoss
from .policy import TpPlan, check_plan

__all__ = ["TpState", "apply_tp"]

logger = logging.getLogger("fp8boost.parallel.tp")
# Measured on 2xH200 NVLink (BENCHMARKS.md, bench/comm.py): FP8 reduce-scatter with its casts
# ran at 0.21x (64 MB) to 0.52x (256 MB) of BF16; an SP region exit at 7B shapes moves 128 MB.
HIGH_PRECISION_WHY = ("the region-exit reduce-scatter/all-reduce of partial sums and the "
                      "backward collectives stay in the training dtype: FP8 reduce-scatter "
                      "including its casts measured 0.21-0.52x of BF16 at 64-256 MB on 2xH200")


@dataclass
class TpState:
    """What ``apply_tp`` did: the split of every parameter (for checkpoints and norms)."""

    group: object
    size: int
    rank: int
    sequence_parallel: bool
    shard_dims: dict[str, int] = field(default_factory=dict)
    """Parameter name -> the dimension split over tp (others are replicated)."""
    partial_grads: list[str] = field(default_factory=list)
    """Replicated parameters whose gradients are summed over tp by a hook."""
    vocab_start: int = 0
    fp8_layers: int = 0
    """Fp8Linear layers among the split linears (their amaxes are reduced over tp)."""
    fp8_gathers: int = 0
    """Regions whose sequence-parallel all-gather moves FP8 bytes into their FP8 GEMMs."""
    comm_report: dict[str, str] = field(default_factory=dict)
    """Why each tp collective does or does not travel in FP8."""

    def is_sharded(self, name: str) -> bool:
        return name in self.shard_dims


def _shard_(module: nn.Module, attr: str, dim: int, n: int, r: int, done: set) -> bool:
    p = getattr(module, attr, None)
    if p is None or id(p) in done:
        return False
    done.add(id(p))
    with torch.no_grad():
        p.data = p.data.chunk(n, dim=dim)[r].clone()  # same Parameter object, local storage
    return True


def _replace_first(args: tuple, kwargs: dict, key: str, fn):
    if key in kwargs:
        kwargs = dict(kwargs)
        kwargs[key] = fn(kwargs[key])
        return args, kwargs
    return (fn(args[0]),) + tuple(args[1:]), kwargs


def _map_output(out, fn):
    if isinstance(out, tuple):
        return (fn(out[0]),) + out[1:]
    return fn(out)


def _region_hooks(module: nn.Module, group, sp: bool, fp8_layer=None) -> None:
    if fp8_layer is not None:
        def enter(x):
            return gather_seq_fp8(x, group, fp8_layer)
    else:
        enter = (lambda x: gather_seq(x, group)) if sp else (lambda x: copy_to_tp(x, group))
    leave = (lambda x: reduce_scatter_seq(x, group)) if sp else (lambda x: reduce_from_tp(x, group))
    module.register_forward_pre_hook(
        lambda m, args, kwargs: _replace_first(args, kwargs, "hidden_states", enter),
        with_kwargs=True)
    module.register_forward_hook(lambda m, args, out: _map_output(out, leave))


def _vocab_parallel_embedding(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    start, n = self._tp_vocab_start, self.weight.shape[0]
    inside = (ids >= start) & (ids < start + n)
    local = torch.where(inside, ids - start, torch.zeros_like(ids))
    out = F.embedding(local, self.weight, self._tp_padding_idx)
    out = out * inside.unsqueeze(-1).to(out.dtype)
    return reduce_from_tp(out, self._tp_group)


def _parallel_embedding(emb: nn.Module, group, n: int, r: int, done: set) -> int:
    if not isinstance(emb, nn.Embedding):
        raise ValueError(f"the vocabulary-parallel embedding must be an nn.Embedding, got "
                         f"{type(emb).__name__}")
    if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
        raise ValueError("a vocabulary-parallel nn.Embedding cannot use max_norm, sparse or "
                         "scale_grad_by_freq")
    local = emb.num_embeddings // n
    start = r * local
    pad = emb.padding_idx
    _shard_(emb, "weight", 0, n, r, done)
    emb.num_embeddings = local
    emb._tp_vocab_start, emb._tp_group = start, group
    emb._tp_padding_idx = pad - start if pad is not None and start <= pad < start + local else None
    emb.forward = types.MethodType(_vocab_parallel_embedding, emb)
    return start


def _parallel_lm_head(model: nn.Module, head: nn.Module, group, sp: bool, n: int, r: int,
                      done: set) -> int:
    if not isinstance(head, nn.Linear):
        raise ValueError(f"the vocabulary-parallel lm_head must be an nn.Linear, got "
                         f"{type(head).__name__}")
    local = head.out_features // n
    _shard_(head, "weight", 0, n, r, done)
    _shard_(head, "bias", 0, n, r, done)
    head.out_features = local
    enter = (lambda x: gather_seq(x, group)) if sp else (lambda x: copy_to_tp(x, group))
    head.register_forward_pre_hook(lambda m, args: (enter(args[0]),) + tuple(args[1:]))
    start = r * local
    if hasattr(type(model), "loss_function"):  # HF: the loss sees vocabulary-parallel logits
        model.loss_function = HfVocabParallelLoss(group, start, head_input=enter)
    return start


def _fp8_amax_groups(module: nn.Module, roles: tuple[str, ...], group) -> bool:
    """Tensorwise FP8 layers scale split operands from an amax over ``group``; rowwise layers
    reduce the per-row amaxes of the operands whose rows span the shards, blockwise layers
    nothing (shard-local tiles and blocks): ``fp8/linear_granular.py``."""
    if not recorded_linear(module):
        return False
    module.set_amax_groups({role: group for role in roles})
    return True


def apply_tp(model: nn.Module, plan: TpPlan, group, *, sequence_parallel: bool = False,
             comm_plan: Optional[CommPlan] = None) -> TpState:
    """Split ``model`` in place over the tensor-parallel ``group`` as ``plan`` says.

    Every rank must hold the same full weights before the call (broadcast them first). With
    ``sequence_parallel`` and ``comm_plan.tp_activations.fp8`` (the plugin's
    :class:`~fp8boost.parallel.comm.plan.CommPlan`; None: nothing in FP8), a region whose
    column-parallel linears
    are all tensorwise e4m3 ``Fp8Linear`` all-gathers its input as FP8 bytes that feed those
    GEMMs directly (``fp8_gather.py``); why any other collective stays in the training dtype
    is logged once and kept in ``TpState.comm_report``.

    Example:
        >>> from fp8boost.parallel.tp import apply_tp, hf_decoder_plan      # doctest: +SKIP
        >>> state = apply_tp(model, hf_decoder_plan(model), tp_group)       # doctest: +SKIP
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    check_plan(model, plan, n)
    modules = dict(model.named_modules())
    state = TpState(group=group, size=n, rank=r, sequence_parallel=sequence_parallel)
    done: set[int] = set()
    for names, dim, roles in ((plan.colwise, 0, ("weight", "grad")),
                              (plan.rowwise, 1, ("input", "weight"))):
        for name in names:
            lin = modules[name]
            _shard_(lin, "weight", dim, n, r, done)
            if dim == 0:
                _shard_(lin, "bias", 0, n, r, done)
                lin.out_features //= n
            else:
                lin.in_features //= n
            state.fp8_layers += _fp8_amax_groups(lin, roles, group)
    if plan.embedding is not None:
        state.vocab_start = _parallel_embedding(modules[plan.embedding], group, n, r, done)
    if plan.lm_head is not None:
        hf = peft_base(model)  # a peft LoRA model: the HF model inside computes the loss
        state.vocab_start = _parallel_lm_head(hf[1] if hf else model, modules[plan.lm_head],
                                              group, sequence_parallel, n, r, done)
    comm = comm_plan if comm_plan is not None else CommPlan()
    for name in plan.regions:
        layer = None
        if comm.tp_activations.fp8 and sequence_parallel:
            layer, why = _fp8_gather_consumer(name, plan, modules)
            if layer is None:
                state.comm_report[f"{name}.gather"] = why
                _state.log_once(logger, ("tp-fp8-gather", why),
                                f"fp8boost: a sequence-parallel all-gather stays in the training "
                                f"dtype: {why}")
            state.fp8_gathers += layer is not None
        _region_hooks(modules[name], group, sequence_parallel, layer)
    if comm.requested:  # what stays in the training dtype even with fp8_communication
        state.comm_report["exits_and_backward"] = HIGH_PRECISION_WHY
        _state.log_once(logger, ("tp-fp8-exit",), f"fp8boost: {HIGH_PRECISION_WHY}")
    if sequence_parallel and plan.layers and plan.split_sequence:
        modules[plan.layers[0]].register_forward_pre_hook(
            lambda m, args, kwargs: _replace_first(args, kwargs, "hidden_states",
                                                   lambda x: split_seq(x, group)),
            with_kwargs=True)
    _record_params(model, plan, state, done, sequence_parallel)
    return state


def _fp8_gather_consumer(region: str, plan: TpPlan, modules: dict):
    """(the Fp8Linear whose recipe casts the region's gathered input, None) or (None, why)."""
    consumers = [modules[n] for n in plan.colwise if n.startswith(region + ".")]
    if not consumers or not all(recorded_linear(m) for m in consumers):
        return None, f"{region}'s column-parallel linears are not all Fp8Linear"
    cfgs = {(m.fp8_config.fwd_dtype, m.fp8_config.margin, m.fp8_config.power_of_2_scale,
             m.fp8_config.recipe, m.fp8_config.backend) for m in consumers}
    fwd, _, _, recipe, _ = next(iter(cfgs))
    if len(cfgs) > 1:
        return None, f"{region}'s FP8 linears use different recipes"
    if recipe in GRANULAR_RECIPES:
        # region-free text: logged once for all regions
        return None, (f"the FP8 linears are {recipe}: the FP8 all-gather carries one "
                      f"scale per tensor and {recipe} re-quantizes per row/tile, so it would "
                      "round the input twice (a gather with row/tile scales is not implemented)")
    if fwd != E4M3 or recipe == "delayed":
        return None, f"{region}'s FP8 linears are not tensorwise e4m3 (recipe {recipe})"
    return consumers[0], None


def _record_params(model: nn.Module, plan: TpPlan, state: TpState, sharded: set,
                   sp: bool) -> None:
    """Fill ``shard_dims`` and hook the replicated parameters that get partial gradients."""
    dims = {}
    for name in plan.colwise + ([plan.lm_head] if plan.lm_head else []) + \
            ([plan.embedding] if plan.embedding else []):
        dims[f"{name}.weight"] = 0
        dims[f"{name}.bias"] = 0
    for name in plan.rowwise:
        dims[f"{name}.weight"] = 1
    zones = plan.regions + ((plan.layers + plan.sequence_sharded) if sp else [])
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in sharded:
            state.shard_dims[name] = dims[name] if name in dims else _tied_dim(name, p, dims, model)
            continue
        if id(p) in seen or not any(name.startswith(z + ".") for z in zones):
            continue
        seen.add(id(p))
        if p.requires_grad and state.size > 1:
            p.register_hook(_sum_over(state.group))
            state.partial_grads.append(name)


def _tied_dim(name: str, p: torch.Tensor, dims: dict, model: nn.Module) -> int:
    for other, q in model.named_parameters(remove_duplicate=False):
        if q is p and other in dims:
            return dims[other]
    raise RuntimeError(f"{name} was split but the plan does not say along which dim")


def _sum_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        # Before accumulation (a tensor hook, not a post-accumulate one), so micro-batches
        # that accumulate into .grad are each summed exactly once.
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out
    return hook
