"""Colossal-AI's gradient checkpointing configs (``colossalai/shardformer/shard/grad_ckpt_config.py``,
v0.5.0): how many decoder layers of each pipeline stage recompute their activations. Defined
here, beside the plugins that read them; ``fp8boost.colossal.shardformer`` gives them
Colossal-AI's import path.

They only say *how many*: activation checkpointing itself is switched on by the user, as in
Colossal-AI, with HF's ``model.gradient_checkpointing_enable()``. At ``boost``,
``HybridParallelPlugin(gradient_checkpoint_config=...)`` keeps checkpointing on for the first
``get_num_ckpt_layers(...)`` decoder layers of every stage and turns it off for the rest
(``fp8boost/plugins/grad_ckpt.py``); with ``pp_size=1`` the whole model is one stage.

Example:
    >>> cfg = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[4, 2])
    >>> cfg.get_num_ckpt_layers(stage=1, num_stages=2, num_layers=6)
    2
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Optional


def _check_int(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")


@dataclass(frozen=True)
class GradientCheckpointConfig:
    """Checkpoint a fraction of the decoder layers (Colossal-AI's base config).

    Example:
        >>> GradientCheckpointConfig(0.25).get_num_ckpt_layers(8)
        2
    """

    gradient_checkpointing_ratio: Optional[float] = 0.0
    """Fraction in [0, 1] of the layers (of each stage) that recompute activations; the count
    is ``int(ratio * layers)``, the first layers of the stage."""

    def __post_init__(self) -> None:
        ratio = self.gradient_checkpointing_ratio
        if ratio is None:
            return
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise TypeError(f"gradient_checkpointing_ratio must be a number in [0, 1], got "
                            f"{ratio!r}")
        if not 0.0 <= ratio <= 1.0:
            raise ValueError("gradient_checkpointing_ratio should be in 0% to 100% ([0, 1]), "
                             f"got {ratio!r}")

    def get_num_ckpt_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers are checkpointed."""
        return int((self.gradient_checkpointing_ratio or 0.0) * num_layers)


@dataclass(frozen=True)
class PipelineGradientCheckpointConfig(GradientCheckpointConfig):
    """Checkpointed layers per pipeline stage: a ratio, or a count for every stage.

    ``num_ckpt_layers_per_stage`` takes precedence over ``gradient_checkpointing_ratio``. With
    model chunks (interleaved/zbv), entry ``stage + chunk * num_stages`` is the count of that
    chunk of pipeline rank ``stage``, as in Colossal-AI. ``num_stages``, ``num_model_chunks``
    and ``num_model_layers`` (Colossal-AI's older sanity-check fields) are checked against
    the model and plugin at ``boost`` when given.

    Example:
        >>> PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5).get_num_ckpt_layers(
        ...     stage=0, num_stages=2, num_layers=5)
        2
    """

    num_ckpt_layers_per_stage: Optional[list[int]] = None
    """Checkpointed layers of each stage (``num_stages * num_model_chunks`` entries, >= 0);
    None: use the ratio."""
    _: KW_ONLY
    num_stages: Optional[int] = None
    """Pipeline ranks (a sanity check against ``pp_size``); None: not checked."""
    num_model_chunks: Optional[int] = None
    """Model chunks per pipeline rank (a sanity check); None: not checked."""
    num_model_layers: Optional[int] = None
    """Decoder layers of the model (a sanity check); None: not checked."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_stages", "num_model_chunks", "num_model_layers"):
            _check_int(name, getattr(self, name))
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            return
        if not isinstance(counts, (list, tuple)) or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise ValueError("num_ckpt_layers_per_stage must be a list of ints >= 0, got "
                             f"{counts!r}")
        object.__setattr__(self, "num_ckpt_layers_per_stage", list(counts))
        if self.num_stages is not None and self.num_model_chunks is not None and \
                len(counts) != self.num_stages * self.num_model_chunks:
            raise ValueError(f"num_ckpt_layers_per_stage has {len(counts)} entries; "
                             f"num_stages * num_model_chunks = "
                             f"{self.num_stages * self.num_model_chunks}")

    def get_num_ckpt_layers(self, stage: int, num_stages: int, num_layers: int,
                            model_chunk_id: int = 0, num_model_chunks: int = 1) -> int:
        """Checkpointed layers of chunk ``model_chunk_id`` on pipeline rank ``stage``, which
        holds ``num_layers`` layers.

        Raises:
            ValueError: the per-stage list does not match the pipeline, or asks for more
                layers than the stage holds; or neither a ratio nor counts are given.
        """
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            if self.gradient_checkpointing_ratio is None:
                raise ValueError("PipelineGradientCheckpointConfig: give "
                                 "gradient_checkpointing_ratio or num_ckpt_layers_per_stage")
            return int(self.gradient_checkpointing_ratio * num_layers)
        if len(counts) != num_stages * num_model_chunks:
            raise ValueError(f"num_ckpt_layers_per_stage has {len(counts)} entries; the pipeline "
                             f"has {num_stages} ranks x {num_model_chunks} chunks = "
                             f"{num_stages * num_model_chunks} stages")
        n = counts[stage + model_chunk_id * num_stages]
        if n > num_layers:
            raise ValueError(f"num_ckpt_layers_per_stage asks {n} checkpointed layers of stage "
                             f"{stage} (chunk {model_chunk_id}), which holds {num_layers}")
        return n
