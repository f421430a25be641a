"""``PipelineStageManager``: Colossal-AI's view of where this rank sits in the pipeline.

Colossal-AI scripts read ``plugin.stage_manager`` (``None`` when ``pp_size == 1``) and ask it
``is_first_stage()`` / ``is_last_stage()`` (e.g. to print the loss on the last stage),
``num_stages`` (the pipeline ranks) and ``stage`` (this rank's pipeline index). This class has
those names and meanings, computed from the (dp, pp, tp) rank layout alone (no process group
is created):

* ``num_stages``: pipeline ranks (``pp_size``; with ``num_model_chunks > 1`` a rank holds
  several model chunks, as in Colossal-AI);
* ``stage``: this rank's pipeline index; ``prev_rank`` / ``next_rank``: the global ranks of
  the neighbouring pipeline ranks (a ring, as in Colossal-AI);
* ``is_first_stage(ignore_chunk=False)`` / ``is_last_stage(ignore_chunk=False)``: with one
  chunk per rank (or ``ignore_chunk=True``), ``stage == 0`` / ``stage == num_stages - 1``.
  With several chunks, whether this rank holds the model's first / last chunk (for
  ``"zbv"`` the last chunk is on stage 0); ``model_chunk_id`` narrows it to one chunk when set
  (Colossal-AI sets it inside its schedules; fp8boost's schedules do not, so it stays None).

fp8boost broadcasts ``execute_pipeline``'s loss to every pipeline rank, so the
``is_last_stage()`` guard Colossal-AI scripts put around printing the loss is still right,
just no longer needed.

Example:
    >>> from fp8boost.parallel.mesh import ParallelDims
    >>> sm = PipelineStageManager(ParallelDims(dp=1, pp=2, tp=2, world_size=4), rank=3)
    >>> sm.stage, sm.num_stages, sm.is_first_stage(), sm.is_last_stage(), sm.prev_rank
    (1, 2, False, True, 1)
"""
from __future__ import annotations

from typing import Optional

from fp8boost.parallel.mesh import ParallelDims


def rank_with(dims: ParallelDims, rank: int, **changes: int) -> int:
    """The global rank whose coordinates are ``rank``'s with ``changes`` applied.

    Found through ``dims.coords`` alone, so it holds for any rank layout a ``ParallelDims``
    (sub)class defines (``MoeHybridParallelPlugin`` lays ep between pp and tp, as Colossal-AI).

    Raises:
        ValueError: no rank has those coordinates.
    """
    want = {**dims.coords(rank), **changes}
    for r in range(dims.world_size):
        if dims.coords(r) == want:
            return r
    raise ValueError(f"no rank has the coordinates {want}")


class PipelineStageManager:
    """This rank's place in the pipeline (see the module docstring)."""

    def __init__(self, dims: ParallelDims, rank: int, num_model_chunks: int = 1,
                 pp_style: str = "1f1b") -> None:
        if dims.pp < 2:
            raise ValueError(f"a stage manager needs pp_size > 1, got {dims.pp}")
        self.dims = dims
        self.rank = rank
        coords = dims.coords(rank)
        self.num_stages = dims.pp
        self.stage = coords["pp"]
        self.num_model_chunks = num_model_chunks
        self.is_interleave = num_model_chunks > 1
        self.use_zbv = pp_style == "zbv"
        self.model_chunk_id: Optional[int] = None

        def global_rank(pp_index: int) -> int:
            return rank_with(dims, rank, pp=pp_index)

        self.prev_rank = global_rank((self.stage - 1) % dims.pp)
        self.next_rank = global_rank((self.stage + 1) % dims.pp)
        self.pipeline_ranks = [global_rank(i) for i in range(dims.pp)]

    def __repr__(self) -> str:
        return (f"PipelineStageManager(stage={self.stage}, num_stages={self.num_stages}, "
                f"num_model_chunks={self.num_model_chunks})")

    def _chunks(self, chunk: int) -> bool:
        return self.model_chunk_id is None or self.model_chunk_id == chunk

    def is_first_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank runs the model's first stage (embeddings)."""
        if not self.is_interleave or ignore_chunk:
            return self.stage == 0
        return self.stage == 0 and self._chunks(0)

    def is_last_stage(self, ignore_chunk: bool = False) -> bool:
        """Whether this rank runs the model's last stage (norm, lm_head, loss)."""
        if not self.is_interleave or ignore_chunk:
            return self.stage == self.num_stages - 1
        last = 0 if self.use_zbv else self.num_stages - 1
        return self.stage == last and self._chunks(self.num_model_chunks - 1)

    def get_rank(self) -> int:
        """This process's global rank."""
        return self.rank

    def get_prev_rank(self) -> int:
        return self.prev_rank

    def get_next_rank(self) -> int:
        return self.next_rank
