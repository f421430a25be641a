"""Weights a lazily built ``from_pretrained`` model still has to read (``LazyInitContext``).

Inside ``fp8boost.colossal.lazy.LazyInitContext``, ``from_pretrained`` builds the model on the
meta device and :func:`remember` notes on it the checkpoint folder and the dtype every tensor
was built in. Whatever materializes the model then calls :func:`load_remembered`:
``Plugin.build_model`` (whole replicas: LowLevelZero, DDP, HybridParallel), the FSDP plugins
after their shard-by-shard materialization, ``LazyInitContext.materialize``.

The weights go through ``hf_sharded.read_sharded``, the reader of ``booster.load_model`` for
HF folders: each DTensor parameter (GeminiPlugin/TorchFSDPPlugin) receives only its shard,
read as a slice of the safetensors file, so a rank reads only what it keeps; a replica reads
every tensor whole. Safetensors checkpoints only (``model.safetensors`` or its sharded index).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch
from torch import nn

from fp8boost.fp8.linear import weights_loaded

from .atomic import require
from .formats import MODEL_INDEX, MODEL_SINGLE
from .hf_sharded import read_sharded

__all__ = ["PretrainedSource", "SOURCE_MARK", "remember", "source_of", "load_remembered"]

#: the attribute of a lazily built ``from_pretrained`` model holding its :class:`PretrainedSource`
SOURCE_MARK = "fp8boost_pretrained_source"


@dataclass(frozen=True)
class PretrainedSource:
    """Where a lazily built model's weights are and how ``from_pretrained`` would have cast
    them: ``dtypes`` maps every state-dict key to the dtype the model was built in."""

    directory: str
    dtypes: Mapping[str, torch.dtype]


def remember(model: nn.Module, directory: str) -> PretrainedSource:
    """Note on ``model`` (built on the meta device) that its weights are in ``directory``.

    Raises:
        FileNotFoundError: ``directory`` holds no safetensors checkpoint.
    """
    if not os.path.exists(os.path.join(directory, MODEL_INDEX)):
        require(directory, "safetensors model (LazyInitContext reads safetensors only: convert "
                           "it with save_pretrained, or call from_pretrained outside the "
                           "context)", MODEL_SINGLE)
    dtypes = MappingProxyType({k: t.dtype for k, t in model.state_dict(keep_vars=True).items()})
    source = PretrainedSource(os.fspath(directory), dtypes)
    setattr(model, SOURCE_MARK, source)
    return source


def source_of(model: nn.Module) -> Optional[PretrainedSource]:
    """The :class:`PretrainedSource` :func:`remember` noted on ``model`` (None if none)."""
    return getattr(model, SOURCE_MARK, None)


def load_remembered(model: nn.Module) -> bool:
    """Fill a materialized ``model`` from the folder :func:`remember` noted; True if it did.

    In place, not collective; keys the model lacks (pipeline stages other ranks keep) or the
    files lack (those keep the model's own initialisation, as ``from_pretrained`` does) are
    skipped; a shape mismatch raises before anything is copied. Every tensor is rounded
    through the dtype ``from_pretrained`` built it in, so a plugin that keeps FP32 masters
    holds exactly the upcast of eager ``from_pretrained(torch_dtype=...)``'s weights. The
    note is removed: a model is loaded once.
    """
    source = source_of(model)
    if source is None:
        return False

    read_sharded(model, source.directory, strict=False, dtypes=source.dtypes)
    weights_loaded(model)  # FP8 layers (FSDP converts before materializing): drop stale casts
    delattr(model, SOURCE_MARK)
    return True
