"""The communication plan: which collectives carry FP8, which weights, and why not, decided once.

:func:`build_comm_plan` runs once per ``boost``, after the FP8 conversion and before any
engine is wired (``Plugin.configure``'s ``plan_comm`` step). It reads the plugin's options
(``fp8_communication``, ``fp8_reduce_scatter``, ``comm_config``), the topology
(:class:`~fp8boost.parallel.mesh.ParallelDims`) and the converted model (which layers are
``Fp8Linear``, under which recipe, and the FP8 experts), and returns one frozen
:class:`CommPlan`. The engines read it and decide nothing themselves: ZeRO
(``ZeroOptimizer(comm_plan=...)``), FSDP2 (the weights ``enable_fp8_all_gather`` wraps, the
reduce-scatter), tensor and Ulysses sequence parallelism (``apply_tp``, ``apply_ulysses``), the
pipeline boundaries (``BoundaryPlan``), the DDP hook and the expert dispatch
(``shard_experts``). ``plugin.comm_report`` is :meth:`CommPlan.report`.

Some choices stay with the engine because they depend on what only it sees, and each says so
in its own report: a sequence-parallel region's consumers (``TpState.comm_report``), a
pipeline payload's size (``BoundaryPlan.report``), a weight's consumer for ZeRO's direct
gather (``direct_plan.py``). The plan switches them on; the engine can only keep a part off.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from fp8boost import _state
from fp8boost.fp8.record import fp8_entry, fp8_record, recorded_linear
from fp8boost.parallel.mesh import ParallelDims

from .config import Fp8CommConfig
from .expert_gather import report_expert_gather
from .granular import block_gathered, report_granular_gather
from .report import GRAD_REDUCE, PARAM_ALL_GATHER, CommReport

__all__ = ["CommRoute", "CommPlan", "build_comm_plan", "ENGINES", "PARAM_GATHER",
           "GRAD_RS_WHY", "FP8_RS_REASON", "OFF"]

ENGINES = ("none", "ddp", "zero", "fsdp", "moe")
"""What moves parameters and gradients over dp: nothing (one process), DDP, ZeRO 0/1/2,
FSDP2, or the MoE plugin's ZeRO (training dtype; its FP8 is the expert dispatch)."""
PARAM_GATHER = ("fp8_linear", "all", "none")
"""``LowLevelZeroPlugin(fp8_param_gather=...)``: which parameters ZeRO gathers in FP8."""

OFF = "fp8_communication=False"
# One line each: every comm report prints them (the figures are in BENCHMARKS.md 4d and 5).
GRAD_RS_WHY = ("gradients reduce in their own dtype: FP8 reduce-scatter measured slower on "
               "NVLink (BENCHMARKS.md 4d); the plugin's fp8_reduce_scatter=True is for slow "
               "links")
"""ZeRO: why gradients do not reduce in FP8 by default (0.21-0.52x BF16 at 64-256 MB)."""
FP8_RS_REASON = ("gradients reduce-scatter in FP32: FP8 reduce-scatter measured slower on "
                 "NVLink (BENCHMARKS.md 5); the plugin's fp8_reduce_scatter=True is for slow "
                 "links")
"""FSDP2: why gradients do not reduce-scatter in FP8 by default (0.11x at 16 MB)."""
NO_FP8_LAYERS = ("no Fp8Linear layers (use_fp8=False or none converted): FP8 all-gather is for "
                 "weights whose consumer is an FP8 GEMM")

_ZERO_LOG = logging.getLogger("fp8boost.parallel.zero")
_FSDP_LOG = logging.getLogger("fp8boost.plugins")  # where FSDP2's reasons were always logged


@dataclass(frozen=True, kw_only=True)
class CommRoute:
    """One collective kind: FP8 on the wire or not, and why not.

    Example:
        >>> CommRoute(fp8=False, why_not="fp8_communication=False").why_not
        'fp8_communication=False'
    """

    fp8: bool = False
    """The collective carries FP8 payloads (where the engine's own fit checks allow)."""
    why_not: str = OFF
    """Why it stays in the training dtype; with ``fp8``, why a part of it does (e.g. the
    weights of rowwise layers), or empty."""

    def __post_init__(self) -> None:
        if not isinstance(self.fp8, bool) or not isinstance(self.why_not, str):
            raise TypeError(f"CommRoute(fp8: bool, why_not: str), got {self.fp8!r}, "
                            f"{self.why_not!r}")
        if not self.fp8 and not self.why_not:
            raise ValueError("a CommRoute that is not FP8 must say why (why_not)")


_ON = CommRoute(fp8=True, why_not="")


def _off(why: str) -> CommRoute:
    return CommRoute(fp8=False, why_not=why)


@dataclass(frozen=True, kw_only=True)
class CommPlan:
    """Which collectives of one boosted model go FP8, and why not (see the module docstring).

    Built by :func:`build_comm_plan`; every route defaults to off (``fp8_communication=False``),
    so ``CommPlan()`` is the plan of plain collectives and an engine test can switch one on.

    Example:
        >>> plan = CommPlan(requested=True, grad_reduce=CommRoute(fp8=True, why_not=""))
        >>> plan.grad_reduce.fp8, plan.param_all_gather.fp8, plan.report().fp8_grad_reduce
        (True, False, True)
    """

    requested: bool = False
    """``fp8_communication`` was asked for (the tensor-parallel report notes what stays in
    the training dtype even then)."""
    engine: str = "none"
    """What reduces gradients and gathers parameters over dp (one of :data:`ENGINES`)."""
    param_all_gather: CommRoute = CommRoute()
    """ZeRO's post-step parameter all-gather or FSDP2's weight all-gather."""
    fp8_gather_modules: Optional[tuple[str, ...]] = ()
    """With ``param_all_gather.fp8``: qualified names of the FP8 layers whose ``weight`` the
    all-gather sends as FP8 (None: every parameter, ``fp8_param_gather='all'``)."""
    grad_reduce: CommRoute = CommRoute()
    """Gradient reduction over dp: ZeRO's bucketed reduce-scatter / all-reduce, FSDP2's
    reduce-scatter, the DDP comm hook's all-reduce."""
    tp_activations: CommRoute = CommRoute()
    """Tensor parallelism: the sequence-parallel all-gather into column-parallel FP8 GEMMs
    (each region's fit is checked by ``apply_tp``, kept in ``TpState.comm_report``)."""
    sp_all_to_all: CommRoute = CommRoute()
    """Ulysses sequence parallelism: the sequence <-> heads all-to-alls of the attention."""
    pipeline_p2p: CommRoute = CommRoute()
    """Activations and gradients across pipeline stage boundaries (per boundary and payload
    size: ``BoundaryPlan.report``)."""
    ep_dispatch: CommRoute = CommRoute()
    """Expert parallelism: the token dispatch all-to-all (rows with a scale per row)."""
    config: Optional[Fp8CommConfig] = None
    """The plugin's ``comm_config``, handed to every FP8 collective (None: the defaults)."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"CommPlan.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.config is not None and not isinstance(self.config, Fp8CommConfig):
            raise TypeError(f"CommPlan.config must be an Fp8CommConfig or None, got "
                            f"{type(self.config).__name__}")
        for f in dataclasses.fields(self):
            if f.type == "CommRoute" and not isinstance(getattr(self, f.name), CommRoute):
                raise TypeError(f"CommPlan.{f.name} must be a CommRoute")

    def fp8_gather_params(self, model: nn.Module) -> Optional[list[torch.Tensor]]:
        """The parameters ZeRO all-gathers as FP8 (None: all of them), looked up in ``model``
        now (after a tensor-parallel split replaced the weights)."""
        if not self.param_all_gather.fp8:
            return []
        if self.fp8_gather_modules is None:
            return None
        return [model.get_submodule(name).weight for name in self.fp8_gather_modules]

    def report(self) -> CommReport:
        """The plan as the :class:`CommReport` the plugins publish (``plugin.comm_report``)."""
        names = [f"{n}.weight" if n else "weight" for n in self.fp8_gather_modules or ()] \
            if self.engine == "fsdp" and self.param_all_gather.fp8 else []
        report = CommReport(fp8_param_all_gather=self.param_all_gather.fp8,
                            fp8_all_gather_modules=names, fp8_grad_reduce=self.grad_reduce.fp8)
        for key, route in ((PARAM_ALL_GATHER, self.param_all_gather),
                           (GRAD_REDUCE, self.grad_reduce)):
            if route.why_not:
                report.not_fp8(key, route.why_not)
        return report


def build_comm_plan(model: nn.Module, options, dims: ParallelDims, *, engine: str,
                    where: str, zero_stage: int = 1, param_gather: Optional[str] = None,
                    sequence_parallel: Optional[str] = None,
                    tp_colwise: Iterable[str] = ()) -> CommPlan:
    """Decide, once, after FP8 conversion, which of ``model``'s collectives go FP8.

    Args:
        model: the converted model (this rank's pipeline stages), before any engine wraps,
            shards or splits it.
        options: the plugin's options (``fp8_communication``, ``fp8_reduce_scatter``,
            ``comm_config``: a ``PluginOptions``).
        dims: the topology's sizes (dp, pp, sp, tp, ep).
        engine: what moves parameters and gradients over dp (:data:`ENGINES`).
        where: the plugin's name, for the one-time warnings.
        zero_stage: ZeRO's stage (0: whole parameters on every rank, nothing to gather).
        param_gather: ``LowLevelZeroPlugin``'s ``fp8_param_gather`` (None: ``"fp8_linear"``,
            without its advice when the model has no FP8 layer).
        sequence_parallel: the hybrid plugin's mode (``"split_gather"``, ``"all_to_all"``).
        tp_colwise: the column-parallel layers the tensor-parallel split will cut (their
            rows decide whether a blockwise weight's ZeRO chunks hold whole blocks).

    Raises:
        ValueError, TypeError: unknown engine or ``param_gather``; options without the FP8
            communication fields. Nothing here touches a process group.

    Example:
        >>> from types import SimpleNamespace
        >>> opts = SimpleNamespace(fp8_communication=True, fp8_reduce_scatter=False,
        ...                        comm_config=None)
        >>> plan = build_comm_plan(nn.Linear(4, 4), opts, ParallelDims(dp=2, world_size=2),
        ...                        engine="ddp", where="TorchDDPPlugin")
        >>> plan.grad_reduce.fp8, plan.param_all_gather.why_not
        (True, 'DDP replicates parameters: nothing to gather')
    """
    fc, frs, cfg = _check(options, engine, param_gather)
    param, modules = _param_all_gather(model, fc, cfg, dims, engine, where, zero_stage,
                                       param_gather, frozenset(tp_colwise))
    return CommPlan(
        requested=fc, engine=engine, param_all_gather=param,
        fp8_gather_modules=modules if param.fp8 else (), config=cfg,
        grad_reduce=_grad_reduce(fc, frs, dims, engine),
        tp_activations=_tp_activations(fc, dims, sequence_parallel),
        sp_all_to_all=_only_if(fc, dims.sp > 1, "sp_size=1: no Ulysses all-to-all"),
        pipeline_p2p=_only_if(fc, dims.pp > 1, "pp_size=1: no stage boundary"),
        ep_dispatch=_only_if(fc, engine == "moe",
                             "no expert parallelism (MoeHybridParallelPlugin's dispatch)"))


def _check(options, engine: str, param_gather: Optional[str]):
    try:
        fc, frs = options.fp8_communication, options.fp8_reduce_scatter
        cfg = options.comm_config
    except AttributeError as e:
        raise TypeError(f"build_comm_plan needs the plugin's options (fp8_communication, "
                        f"fp8_reduce_scatter, comm_config): {e}") from None
    if not isinstance(fc, bool) or not isinstance(frs, bool):
        raise TypeError("fp8_communication and fp8_reduce_scatter must be bools")
    if frs and not fc:
        raise ValueError("fp8_reduce_scatter=True needs fp8_communication=True")
    if cfg is not None and not isinstance(cfg, Fp8CommConfig):
        raise TypeError(f"comm_config must be an Fp8CommConfig, got {type(cfg).__name__}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if param_gather is not None and param_gather not in PARAM_GATHER:
        raise ValueError(f"fp8_param_gather={param_gather!r} is not supported; use one of "
                         f"{PARAM_GATHER}")
    return fc, frs, cfg


def _only_if(fc: bool, applies: bool, why: str) -> CommRoute:
    if not fc:
        return _off(OFF)
    return _ON if applies else _off(why)


def _tp_activations(fc: bool, dims: ParallelDims, sequence_parallel: Optional[str]) -> CommRoute:
    if not fc:
        return _off(OFF)
    if dims.tp == 1:
        return _off("tp_size=1: no tensor-parallel collective")
    if sequence_parallel != "split_gather":
        return _off("no split_gather sequence parallelism: the tensor-parallel collectives "
                    "are all-reduces of partial sums, kept in the training dtype")
    return _ON


def _grad_reduce(fc: bool, frs: bool, dims: ParallelDims, engine: str) -> CommRoute:
    if engine == "none":
        return _off("one process: no gradient reduction")
    if not fc:
        return _off(OFF)
    if engine == "ddp":  # the FP8 hook is what fp8_communication means for DDP
        return _ON
    if engine == "moe":
        return _off("MoeHybridParallelPlugin reduces gradients in their own dtype")
    if engine == "zero" and dims.dp * dims.sp == 1:
        return _off("one data-parallel rank: nothing to reduce")
    if frs:
        return _ON
    if engine == "zero":
        _state.log_once(_ZERO_LOG, "zero-grad-rs-high", f"fp8boost ZeRO: {GRAD_RS_WHY}")
        return _off(GRAD_RS_WHY)
    _state.log_once(_FSDP_LOG, ("fsdp-rs", "slower"), f"fp8boost: {FP8_RS_REASON}")
    return _off(FP8_RS_REASON)


def _param_all_gather(model: nn.Module, fc: bool, cfg, dims: ParallelDims, engine: str,
                      where: str, zero_stage: int, param_gather: Optional[str],
                      tp_colwise: frozenset) -> tuple[CommRoute, Optional[tuple]]:
    if engine == "none":
        return _off("one process: nothing to gather"), ()
    if engine == "ddp":
        return _off("DDP replicates parameters: nothing to gather"), ()
    if not fc:
        return _off(OFF), ()
    if engine == "moe":
        return _off("MoeHybridParallelPlugin's ZeRO gathers parameters in their own dtype "
                    "(its FP8 path is the token dispatch)"), ()
    if engine == "fsdp":
        return _fsdp_gather(model, cfg, dims.dp, where)
    ranks = dims.dp * dims.sp  # ZeRO's group: dp, times sp under Ulysses
    if ranks == 1:
        return _off("one data-parallel rank: nothing to gather"), ()
    if zero_stage == 0:
        return _off("zero_stage=0 keeps whole parameters on every rank: nothing to gather"), ()
    if param_gather == "none":
        return _off("fp8_param_gather='none'"), ()
    if param_gather == "all":
        return _ON, None
    # a blockwise weight's ZeRO chunks are cut from the rows the tensor-parallel split leaves
    rows = {id(m): m.weight.shape[0] // dims.tp for n, m in model.named_modules()
            if dims.tp > 1 and n in tp_colwise and recorded_linear(m)}
    modules = _selected(model, ranks, cfg, lambda m: rows.get(id(m)))
    scratch = CommReport()  # the helpers' reasons and warnings, in ZeRO's order
    report_granular_gather(scratch, where, model, ranks, cfg, lambda m: rows.get(id(m)))
    report_expert_gather(scratch, where, model)
    if not modules and not _has_fp8_layers(model):
        if param_gather is not None:  # LowLevelZeroPlugin's own option names the way out
            _state.warn_once("zero_fp8_gather_none",
                             f"{where}(fp8_communication=True): the model has no Fp8Linear "
                             "layers (use_fp8=False), so only gradients travel in FP8 and "
                             "parameters are all-gathered in their own dtype; pass "
                             "fp8_param_gather='all' to send every parameter in FP8")
        return _off(NO_FP8_LAYERS), ()
    return _route(bool(modules), scratch.why_not.get(PARAM_ALL_GATHER, "")), tuple(modules)


def _fsdp_gather(model: nn.Module, cfg, ranks: int, where: str):
    if cfg is not None and not cfg.enabled:
        return _off("Fp8CommConfig.enabled=False (deprecated: use fp8_communication=False)"), ()
    modules = _selected(model, ranks, cfg, lambda m: None)
    scratch = CommReport()  # the helpers' reasons and warnings, in FSDP2's order
    report_expert_gather(scratch, where, model)
    granular = report_granular_gather(scratch, where, model, ranks, cfg)
    why = scratch.why_not.get(PARAM_ALL_GATHER, "")
    if not granular and not modules:
        why = NO_FP8_LAYERS
        _state.log_once(_FSDP_LOG, ("fsdp-ag", why), f"fp8boost: {why}")
    return _route(bool(modules), why), tuple(modules)


def _route(fp8: bool, why: str) -> CommRoute:
    return CommRoute(fp8=fp8, why_not=why) if fp8 or why else _off(NO_FP8_LAYERS)


def _has_fp8_layers(model: nn.Module) -> bool:
    return bool(fp8_record(model).linears)


def _selected(model: nn.Module, ranks: int, cfg, rows_of) -> list[str]:
    """The FP8 layers whose weights travel as FP8: tensorwise ones, and blockwise ones whose
    shards hold whole blocks (with their block scales); one name per weight (tied ones once,
    as FSDP2 wraps them)."""
    names, seen = [], set()
    for name, m in model.named_modules():
        if not recorded_linear(m) or id(m.weight) in seen:
            continue
        if fp8_entry(m).granular and not block_gathered(m, ranks, cfg, rows_of(m)):
            continue
        seen.add(id(m.weight))
        names.append(name)
    return names
