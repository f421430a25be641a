"""What a plugin puts on the wire in FP8, and why not where it does not: one typed report.

ZeRO (``LowLevelZeroPlugin``, ``HybridParallelPlugin`` over dp) and FSDP (``TorchFSDPPlugin``,
``GeminiPlugin``) describe the same two data-parallel collectives, the parameter all-gather and
the gradient reduction, so they fill the same :class:`CommReport`. Each field is the union of
what the two reported as differently keyed dicts before:

* ``fp8_param_all_gather``: ZeRO ``"fp8_param_all_gather"``; FSDP
  ``bool(report["fp8_all_gather"])``;
* ``fp8_all_gather_modules``: FSDP ``"fp8_all_gather"`` (module names); ZeRO had none;
* ``fp8_grad_reduce``: ZeRO ``"fp8_grad_reduce"``; FSDP ``"fp8_reduce_scatter"``;
* ``why_not[PARAM_ALL_GATHER]``: FSDP ``why_not["all_gather"]``; ZeRO had none;
* ``why_not[GRAD_REDUCE]``: ZeRO ``why_not["grad_reduce"]``; FSDP ``why_not["reduce_scatter"]``.

A plugin's report is derived from its communication plan (:meth:`~.plan.CommPlan.report`,
``plugin.comm_report``), never filled by the engines. Tensor parallelism
(``TpState.comm_report``) and pipeline boundaries
(``BoundaryPlan.report``) report per region / per boundary and keep their own string maps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CommReport", "PARAM_ALL_GATHER", "GRAD_REDUCE"]

PARAM_ALL_GATHER = "param_all_gather"
"""``CommReport.why_not`` key: the parameter (weight) all-gather."""
GRAD_REDUCE = "grad_reduce"
"""``CommReport.why_not`` key: the gradient reduce-scatter / all-reduce."""
_COLLECTIVES = (PARAM_ALL_GATHER, GRAD_REDUCE)


@dataclass
class CommReport:
    """Which data-parallel collectives travel in FP8, and why the others do not.

    Example:
        >>> from fp8boost.parallel.comm.report import GRAD_REDUCE, CommReport
        >>> report = CommReport(fp8_param_all_gather=True)
        >>> report.not_fp8(GRAD_REDUCE, "fp8_reduce_scatter=False")
        >>> report.fp8_grad_reduce, report.why_not
        (False, {'grad_reduce': 'fp8_reduce_scatter=False'})
    """

    fp8_param_all_gather: bool = False
    """Parameters are all-gathered with FP8 payloads (ZeRO: the FP8 layers' weights, or those
    chosen by ``fp8_param_gather``; FSDP: the modules in ``fp8_all_gather_modules``)."""

    fp8_all_gather_modules: list[str] = field(default_factory=list)
    """FSDP: qualified names of the modules whose weights are all-gathered as FP8. ZeRO gathers
    flat parameter buckets and leaves this empty."""

    fp8_grad_reduce: bool = False
    """Gradients are reduced (reduce-scatter, or all-reduce) with FP8 payloads."""

    why_not: dict[str, str] = field(default_factory=dict)
    """Collective (:data:`PARAM_ALL_GATHER`, :data:`GRAD_REDUCE`) -> why it stays in the
    training dtype; only collectives that do are listed."""

    def __post_init__(self) -> None:
        unknown = set(self.why_not) - set(_COLLECTIVES)
        if unknown:
            raise ValueError(f"CommReport.why_not keys must be in {_COLLECTIVES}, got "
                             f"{sorted(unknown)}")

    def not_fp8(self, collective: str, why: str) -> None:
        """Record that ``collective`` stays in the training dtype, and why."""
        if collective not in _COLLECTIVES:
            raise ValueError(f"unknown collective {collective!r}; use one of {_COLLECTIVES}")
        self.why_not[collective] = why

    def as_dict(self) -> dict[str, Any]:
        """A plain, JSON-ready copy (for logs and benchmark results)."""
        return {"fp8_param_all_gather": self.fp8_param_all_gather,
                "fp8_all_gather_modules": list(self.fp8_all_gather_modules),
                "fp8_grad_reduce": self.fp8_grad_reduce, "why_not": dict(self.why_not)}

    def __str__(self) -> str:
        on = [name for name, fp8 in ((PARAM_ALL_GATHER, self.fp8_param_all_gather),
                                     (GRAD_REDUCE, self.fp8_grad_reduce)) if fp8]
        lines = [f"fp8boost FP8 communication: {', '.join(on) or 'none'}"]
        lines += [f"  {name} stays in the training dtype: {why}"
                  for name, why in self.why_not.items()]
        return "\n".join(lines)
