"""Why the weights of FP8 experts are all-gathered in the training dtype (ZeRO, FSDP2).

(A communication decision: it lives in ``parallel/comm/``, beside the report it writes.)

The FP8 parameter all-gathers (``fp8_communication=True``: FSDP2's, ZeRO's) send a weight as
FP8 bytes with one scale per tensor, for layers whose GEMM takes that tensorwise FP8 weight
as it arrives. :class:`~fp8boost.fp8.moe.experts.Fp8Experts` re-quantizes its 3-D weights with
one scale per expert row (the grouped FP8 GEMM takes row scales only, whatever the recipe), so
an FP8 wire would round every expert weight twice and let one expert's outliers coarsen the
others' grid. Until a gather with row scales exists, expert weights travel in the training
dtype; each plugin says so once (a warning) and records it in its ``comm_report``.
"""
from __future__ import annotations

from torch import nn

from fp8boost import _state
from fp8boost.fp8.record import recorded_experts_modules

from .report import PARAM_ALL_GATHER

__all__ = ["EXPERT_GATHER_WHY", "report_expert_gather"]

EXPERT_GATHER_WHY = (
    "weights of Fp8Experts (FP8 grouped-GEMM MoE experts) are all-gathered in the training "
    "dtype: the FP8 all-gather carries one scale per tensor and the experts re-quantize per "
    "expert row, so an FP8 wire would round each expert weight twice (a gather with row "
    "scales is not implemented yet)")


def report_expert_gather(report, where: str, model: nn.Module) -> int:
    """Record in ``report`` (a ``CommReport``) and warn once, naming ``where``, that the
    expert weights of ``model``'s :class:`Fp8Experts` are all-gathered in the training dtype;
    returns how many expert modules that concerns (0: nothing recorded).

    Example:
        >>> from fp8boost.parallel.comm.report import CommReport
        >>> report_expert_gather(CommReport(), "GeminiPlugin", nn.Linear(2, 2))
        0
    """
    n = len(recorded_experts_modules(model))
    if not n:
        return 0
    why = f"{n} {EXPERT_GATHER_WHY}"
    before = report.why_not.get(PARAM_ALL_GATHER)
    # Another reason (e.g. rowwise Fp8Linear weights) may already be recorded: keep both.
    report.not_fp8(PARAM_ALL_GATHER, why if not before else f"{before}; {why}")
    _state.warn_once(("moe-expert-param-gather", where), f"fp8boost {where}: {why}")
    return n
