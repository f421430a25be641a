"""Which decoder layers each pipeline stage holds, and which rank runs each stage.

A pipeline of ``pp`` ranks with ``num_chunks`` model chunks per rank has ``pp * num_chunks``
*stages* (torch's ``stage_index``), numbered in pipeline order: stage 0 embeds the tokens, the
last stage applies the final norm and ``lm_head``. Stages map to ranks by style:

* ``"1f1b"``: one chunk per rank, stage ``s`` on rank ``s``;
* ``"interleaved"`` (loop): stage ``s`` on rank ``s % pp``, so rank ``r`` holds stages
  ``r, r + pp, r + 2 pp, ...`` (Megatron's interleaved 1F1B);
* ``"zbv"`` (V shape, two chunks): stage ``s < pp`` on rank ``s``, stage ``s >= pp`` on rank
  ``2 pp - 1 - s``: rank 0 holds the first and the last stage.

Example:
    >>> from fp8boost.parallel.pipeline.layout import make_layout
    >>> lay = make_layout(8, pp=2, num_chunks=2, style="zbv")
    >>> lay.layers, lay.stages_of(0)
    (((0, 1), (2, 3), (4, 5), (6, 7)), [0, 3])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

PP_STYLES = ("1f1b", "interleaved", "zbv")


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """Stages of one pipeline: their layers (global indices) and their ranks."""

    pp: int
    """Pipeline ranks."""

    num_chunks: int = 1
    """Model chunks (stages) per rank."""

    style: str = "1f1b"
    """``"1f1b"``, ``"interleaved"`` or ``"zbv"`` (see the module docstring)."""

    layers: tuple[tuple[int, ...], ...] = ()
    """Decoder layer indices of every stage, in pipeline order."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.num_chunks

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs ``stage``."""
        if self.style == "zbv":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, ascending."""
        return [s for s in range(self.num_stages) if self.rank_of(s) == rank]

    @property
    def last_rank(self) -> int:
        """The rank of the last stage (where the loss is computed)."""
        return self.rank_of(self.num_stages - 1)


def check_pipeline_options(pp: int, style: str, num_chunks: int,
                           num_layers_per_stage: Optional[Sequence[int]]) -> None:
    """Colossal-AI's rules that need no model; raises ``ValueError`` naming the fix."""
    if style not in PP_STYLES:
        raise ValueError(f"pp_style={style!r} is not supported; use one of {PP_STYLES}")
    if style == "zbv" and num_chunks != 2:
        raise ValueError(f"pp_style='zbv' runs a V of exactly two model chunks per rank: set "
                         f"num_model_chunks=2 (got {num_chunks})")
    if style == "interleaved" and num_chunks < 2:
        raise ValueError("pp_style='interleaved' needs num_model_chunks > 1 (use '1f1b' for "
                         "one chunk per rank)")
    if style == "1f1b" and num_chunks != 1:
        raise ValueError(f"pp_style='1f1b' holds one model chunk per rank; got "
                         f"num_model_chunks={num_chunks}: use pp_style='interleaved' or 'zbv'")
    if num_layers_per_stage is not None:
        ok = isinstance(num_layers_per_stage, (list, tuple)) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1
            for n in num_layers_per_stage)
        if not ok or len(num_layers_per_stage) != pp * num_chunks:
            raise ValueError(f"num_layers_per_stage must list {pp * num_chunks} ints >= 1 "
                             f"(pp_size x num_model_chunks stages, in pipeline order), got "
                             f"{num_layers_per_stage!r}")


def make_layout(num_layers: int, pp: int, *, num_chunks: int = 1, style: str = "1f1b",
                num_layers_per_stage: Optional[Sequence[int]] = None) -> PipelineLayout:
    """Assign ``num_layers`` decoder layers to ``pp * num_chunks`` stages.

    Without ``num_layers_per_stage`` every stage gets the same number of layers.

    Raises:
        ValueError: the layers cannot be split that way (with the fix in the message).
    """
    check_pipeline_options(pp, style, num_chunks, num_layers_per_stage)
    stages = pp * num_chunks
    if num_layers_per_stage is None:
        if num_layers % stages:
            raise ValueError(
                f"{num_layers} decoder layers do not split evenly over pp_size x "
                f"num_model_chunks = {stages} stages: pass num_layers_per_stage (a list of "
                f"{stages} counts summing to {num_layers}) or change pp_size/num_model_chunks")
        counts = [num_layers // stages] * stages
    else:
        counts = list(num_layers_per_stage)
        if sum(counts) != num_layers:
            raise ValueError(f"num_layers_per_stage={counts} sums to {sum(counts)}, but the "
                             f"model has {num_layers} decoder layers")
    layers, start = [], 0
    for n in counts:
        layers.append(tuple(range(start, start + n)))
        start += n
    return PipelineLayout(pp=pp, num_chunks=num_chunks, style=style, layers=tuple(layers))
