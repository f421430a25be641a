"""``colossalai.pipeline.schedule.v_schedule``: ``PipelineGraph`` with Colossal-AI's constructor.

Colossal-AI scripts build a ``PipelineGraph(n_stage=..., n_micro=..., f_cost=..., ...)``, call
``get_v_schedule()`` and pass the result as ``HybridParallelPlugin(pp_style="zbv",
scheduler_nodes=...)``. fp8boost's zbv runs ``torch.distributed.pipelining``'s own zero-bubble
V schedule (``ScheduleZBVZeroBubble``: the same V placement, chunk 0 on ranks 0..n-1 and chunk 1
back from n-1 to 0, with split B/W), so the nodes are accepted but not replayed (the plugin
says so once at INFO).

``get_v_schedule`` here is **not** Colossal-AI's zero-bubble search: it returns a simple valid
order over the same nodes (every F/B/W of both chunks of every micro-batch, each after what it
depends on): all chunk-0 forwards, then chunk-1 forwards, chunk-1 B then W, chunk-0 B then W,
micro-batch by micro-batch (GPipe-like; its bubble is larger than zero-bubble's). Start and
completion times come from a simulation with the given costs (``c_cost`` between ranks). There
are no communication nodes, and ``max_mem`` is kept but not enforced.

Example:
    >>> g = PipelineGraph(n_stage=2, n_micro=2, f_cost=1, b_cost=1, w_cost=1, c_cost=0,
    ...                   f_mem=1, b_mem=-1, w_mem=0)
    >>> nodes = g.get_v_schedule()
    >>> len(nodes), len(nodes[0]), nodes[0][0].type
    (2, 12, 'F')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(eq=True, frozen=True)
class ScheduledNode:
    """One computation of one pipeline rank (Colossal-AI's fields)."""

    type: str
    """``"F"`` (forward), ``"B"`` (input gradient) or ``"W"`` (weight gradient)."""
    chunk: int
    """Model chunk: 0 runs ranks 0..n-1, 1 runs back from n-1 to 0 (the V)."""
    stage: int
    """Pipeline rank that runs it."""
    minibatch: int
    """Micro-batch index."""
    start_time: int = 0
    """Simulated start, in the cost units."""
    completion_time: int = 0
    """Simulated end, in the cost units."""
    rollback: bool = False
    """Colossal-AI's optimizer-rollback marker; always False here."""


class PipelineGraph:
    """Colossal-AI's ZBV schedule builder signature over a simple valid order (module docs).

    Args:
        n_stage: pipeline ranks. n_micro: micro-batches per step.
        f_cost, b_cost, w_cost: time of one F, B, W of one chunk. c_cost: time of one P2P.
        f_mem, b_mem, w_mem: memory each leaves allocated (kept for Colossal-AI's signature).
        max_mem: memory budget (default ``f_mem * n_stage * 2``; not enforced).
    """

    def __init__(self, n_stage, n_micro, f_cost, b_cost, w_cost, c_cost, f_mem, b_mem, w_mem,
                 max_mem=None) -> None:
        for name, value in (("n_stage", n_stage), ("n_micro", n_micro)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("f_cost", f_cost), ("b_cost", b_cost), ("w_cost", w_cost),
                            ("c_cost", c_cost)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        self.n_stage, self.n_micro = n_stage, n_micro
        self.f_cost, self.b_cost, self.w_cost, self.c_cost = f_cost, b_cost, w_cost, c_cost
        self.f_mem, self.b_mem, self.w_mem = f_mem, b_mem, w_mem
        self.fbw_cost = [f_cost, b_cost, w_cost]
        self.fbw_mem = [f_mem, b_mem, w_mem]
        self.max_mem = max_mem or f_mem * n_stage * 2

    def _phases(self) -> list[tuple[str, int, list[int]]]:
        up, down = list(range(self.n_stage)), list(reversed(range(self.n_stage)))
        return [("F", 0, up), ("F", 1, down), ("B", 1, up), ("W", 1, up), ("B", 0, down),
                ("W", 0, down)]

    def _dependency(self, kind: str, chunk: int, stage: int, m: int) -> Optional[tuple]:
        last = self.n_stage - 1
        if kind == "W":
            return ("B", chunk, stage, m)
        if kind == "F":
            if chunk == 0:
                return ("F", 0, stage - 1, m) if stage > 0 else None
            return ("F", 0, last, m) if stage == last else ("F", 1, stage + 1, m)
        if chunk == 1:
            return ("F", 1, 0, m) if stage == 0 else ("B", 1, stage - 1, m)
        return ("B", 1, last, m) if stage == last else ("B", 0, stage + 1, m)

    def get_v_schedule(self) -> list[list[ScheduledNode]]:
        """One list of :class:`ScheduledNode` per pipeline rank, in execution order."""
        cost = {"F": self.f_cost, "B": self.b_cost, "W": self.w_cost}
        done: dict[tuple, tuple[float, int]] = {}
        free = [0] * self.n_stage
        schedule: list[list[ScheduledNode]] = [[] for _ in range(self.n_stage)]
        for kind, chunk, stages in self._phases():
            for m in range(self.n_micro):
                for s in stages:
                    start = free[s]
                    dep = self._dependency(kind, chunk, s, m)
                    if dep is not None:
                        end, where = done[dep]
                        start = max(start, end + (self.c_cost if where != s else 0))
                    end = start + cost[kind]
                    done[(kind, chunk, s, m)] = (end, s)
                    free[s] = end
                    schedule[s].append(ScheduledNode(type=kind, chunk=chunk, stage=s,
                                                     minibatch=m, start_time=start,
                                                     completion_time=end))
        return schedule
