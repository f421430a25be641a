"""Colossal-AI's ``gradient_checkpoint_config`` at ``boost``: which decoder layers recompute.

The user switches activation checkpointing on with HF's ``model.gradient_checkpointing_enable()``
(transformers 5: every ``GradientCheckpointingLayer`` gets a ``gradient_checkpointing`` flag),
as in Colossal-AI. A ``GradientCheckpointConfig`` then keeps it on for the first
``get_num_ckpt_layers(...)`` decoder layers of every pipeline stage and turns it off for the
others (Colossal-AI's rule: the first layers of a stage are checkpointed). With ``pp_size=1`` the
whole model is one stage. :func:`plan_checkpointing` decides (no side effect, ``ValueError``
before any collective); :func:`apply_checkpointing` sets the flags.

Example:
    >>> from fp8boost.plugins.grad_ckpt_config import PipelineGradientCheckpointConfig
    >>> import torch.nn as nn
    >>> class Block(nn.Module):
    ...     gradient_checkpointing = True
    >>> layers = [Block() for _ in range(4)]
    >>> cfg = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    >>> plan = plan_checkpointing(layers, cfg)
    >>> apply_checkpointing(layers, plan); [b.gradient_checkpointing for b in layers]
    [True, True, False, False]
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from torch import nn

from fp8boost import _state

from .grad_ckpt_config import GradientCheckpointConfig, PipelineGradientCheckpointConfig

logger = logging.getLogger("fp8boost.plugins")


def check_ckpt_config(config: object) -> Optional[GradientCheckpointConfig]:
    """``gradient_checkpoint_config`` of the hybrid plugins: None or a config.

    Raises:
        TypeError: anything else.
    """
    if config is not None and not isinstance(config, GradientCheckpointConfig):
        raise TypeError("gradient_checkpoint_config must be a fp8boost.colossal.shardformer."
                        "(Pipeline)GradientCheckpointConfig or None, got "
                        f"{type(config).__name__}")
    return config


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointable decoder layers, in order: HF ``model.model.layers`` when it is
    a ``ModuleList``, else every ``GradientCheckpointingLayer`` (transformers >= 4.52)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    try:
        # lazy: transformers takes seconds to import; only HF models get here
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _stages(n_layers: int, layout) -> list[tuple[int, int, list[int]]]:
    """(pipeline rank, chunk on that rank, layer indices) of every stage."""
    if layout is None:
        return [(0, 0, list(range(n_layers)))]
    out = []
    for stage, layer_ids in enumerate(layout.layers):
        rank = layout.rank_of(stage)
        out.append((rank, layout.stages_of(rank).index(stage), list(layer_ids)))
    return out


def _check_sanity(config, n_layers: int, pp: int, chunks: int) -> None:
    for name, actual in (("num_stages", pp), ("num_model_chunks", chunks),
                         ("num_model_layers", n_layers)):
        given = getattr(config, name, None)
        if given is not None and given != actual:
            raise ValueError(f"gradient_checkpoint_config.{name}={given}, but the pipeline has "
                             f"{actual}; fix the config or the plugin's pipeline arguments")


def plan_checkpointing(model_or_layers, config, layout=None) -> Optional[list[bool]]:
    """The ``gradient_checkpointing`` flag of every decoder layer, or None to leave them.

    Args:
        model_or_layers: the (unboosted) model, or its decoder layers in order.
        config: a ``GradientCheckpointConfig`` / ``PipelineGradientCheckpointConfig`` or None.
        layout: the pipeline's ``PipelineLayout`` (None: one stage, pp_size 1).

    Returns:
        None when ``config`` is None or checkpointing is off on every layer (said once at
        INFO: the config only selects among layers the user checkpoints).

    Raises:
        ValueError: the config does not fit the pipeline (counts, sanity fields).
    """
    if config is None:
        return None

    layers = model_or_layers if isinstance(model_or_layers, Sequence) \
        else decoder_layers(model_or_layers)
    if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        _state.log_once(logger, "colossal-args.hybrid.gradient_checkpoint_config",
                        "fp8boost: gradient_checkpoint_config changes nothing: activation "
                        "checkpointing is off on every decoder layer; call "
                        "model.gradient_checkpointing_enable() before boost (as with "
                        "Colossal-AI)", level=logging.INFO)
        return None
    pp = layout.pp if layout is not None else 1
    chunks = layout.num_chunks if layout is not None else 1
    _check_sanity(config, len(layers), pp, chunks)
    flags = [False] * len(layers)
    for rank, chunk, ids in _stages(len(layers), layout):
        if isinstance(config, PipelineGradientCheckpointConfig):
            k = config.get_num_ckpt_layers(rank, pp, len(ids), chunk, chunks)
        else:
            k = config.get_num_ckpt_layers(len(ids))
        for i in ids[:k]:
            flags[i] = True
    return flags


def apply_checkpointing(model_or_layers, flags: Optional[list[bool]]) -> None:
    """Set each decoder layer's ``gradient_checkpointing`` flag (no-op for ``flags=None``)."""
    if flags is None:
        return
    layers = model_or_layers if isinstance(model_or_layers, Sequence) \
        else decoder_layers(model_or_layers)
    if len(layers) != len(flags):
        raise ValueError(f"the model has {len(layers)} decoder layers, the plan {len(flags)}")
    for layer, flag in zip(layers, flags):
        layer.gradient_checkpointing = flag
