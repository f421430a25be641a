"""Each FP8 weight cast once for all the forwards of one step: :func:`weights_cast_once`.

A pipeline step runs every stage's forward and backward once per micro-batch, with the same
weights. Eager ``Fp8Linear`` layers keep their weight cast from the second forward on
(``Fp8Config.cache_weight_cast``), but a compiled block cannot read that cache's key without a
graph break, so it casts the weight again in every micro-batch's forward, and with
``recompute_weight_cast`` once more in every backward: 2 x micro-batches casts of each weight
per step where one would do.

:func:`weights_cast_once` casts each eligible weight (and its transpose for dgrad) once, before
the step's first forward, and hands the result to the layer as its prequantized operand
(:meth:`~fp8boost.fp8.linear.Fp8Linear.set_prequantized_weight`), which eager and compiled
forwards both use as it is; on exit it drops what it set, so a forward after the optimizer step
casts the new weight again. The FP8 copy and its transpose (2 bytes per weight element) live
for the step.

Eligible: a tensorwise ``Fp8Linear`` with current scaling (the operand is the weight's own
cast, so the result is bit-identical to casting it in each forward) whose weight is a plain,
whole (not tensor-parallel) tensor that trains, with ``cache_weight_cast`` on and no
prequantized operand of another producer (ZeRO's FP8 all-gather sets its own). Delayed
scaling updates its amax history per forward, and the rowwise and blockwise recipes' operands
are not a single prequantized weight with one scale, so those layers cast as before.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn

from .linear import Fp8Linear
from .operands import OperandSource
from .recompute import compiling

__all__ = ["weights_cast_once"]


def _eligible(layer: nn.Module) -> bool:
    if not isinstance(layer, Fp8Linear) or type(layer.operands) is not OperandSource:
        return False  # Fp8Conv1D's source casts a transposed weight: not a [N, K] operand
    cfg = layer.fp8_config
    w = layer.weight
    # type(w): a plain tensor or Parameter (not FSDP's FP8 carrier or a DTensor); its shape the
    # layer's (a tensor-parallel layer's local shard is not an operand set_prequantized takes)
    return (cfg.recipe == "tensorwise" and cfg.cache_weight_cast  # "delayed" is its own recipe
            and layer.operands.prequantized is None
            and type(w) in (torch.Tensor, nn.Parameter) and tuple(w.shape) == layer.operands.shape
            and w.requires_grad and w.device.type != "meta")


@contextlib.contextmanager
def weights_cast_once(modules: Iterable[nn.Module]) -> Iterator[int]:
    """Cast each eligible FP8 weight of ``modules`` once for the forwards run inside.

    Call it where no optimizer step runs before the block ends (one pipeline schedule, one
    accumulation window): the operands are trusted as they are under ``torch.compile``.
    Not inside a compiled region (it casts eagerly).

    Args:
        modules: the modules whose ``Fp8Linear`` layers run in the block (shared layers once).

    Yields:
        How many weights were cast.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, Fp8Linear
        >>> from fp8boost.fp8.cast_once import weights_cast_once
        >>> layer = Fp8Linear(64, 32, config=Fp8Config(backend="emulated"))
        >>> with weights_cast_once([layer]) as n:
        ...     for _ in range(2):  # two micro-batches, one weight cast
        ...         layer(torch.randn(4, 64)).sum().backward()
        >>> n, layer.operands.prequantized is None
        (1, True)
    """
    if compiling():
        raise RuntimeError("weights_cast_once casts eagerly: enter it outside torch.compile")
    layers, seen = [], set()
    for module in modules:
        for layer in module.modules():
            if id(layer) not in seen and _eligible(layer):
                seen.add(id(layer))
                layers.append(layer)
    done = []
    try:
        with torch.no_grad():
            for layer in layers:
                layer.resolve_backend(layer.weight.device)  # "auto" picks it at first use
                src = layer.operands
                op = src.weight_operand(layer.weight, with_transpose=True)
                layer.set_prequantized_weight(op.data, op.inv_scale)
                src.prequantized.data_t = op.data_t  # dgrad's copy, made here and not again
                done.append((layer, src.prequantized))
        yield len(done)
    finally:
        for layer, pre in done:
            if layer.operands.prequantized is pre:  # not replaced by another producer meanwhile
                layer.set_prequantized_weight(None)
