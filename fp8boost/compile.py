"""Compile a model for training the way fp8boost's measurements do: each repeated block on its
own, no KV cache, and a loud error instead of a silent fall-back to eager.

Why each block (not the whole model): the blocks share one graph, so compiling costs one block's
trace, and FP8 conversion, tensor parallelism and FSDP2 keep working on the module tree
(``Module.compile`` compiles in place: parameter names stay). Why the limits: dynamo compiles a
new graph whenever a guard fails and, past ``recompile_limit`` graphs of one function (8), runs
it eager with a log line only; with a KV cache every HF decoder block guards on its own cache
layer, so blocks 9+ of a 12-block model ran eager. Here the cache is off, the limit leaves room
for one graph per block (models whose blocks differ, e.g. sliding-window layers), and hitting it
raises.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .hf_model import disable_kv_cache, find_blocks

SPARE_RECOMPILES = 8
"""Graphs allowed beyond one per block (shape changes before dynamo marks a dim dynamic)."""


def compile_blocks(model: nn.Module, *, backend: str = "inductor", mode: Optional[str] = None,
                   fullgraph: bool = False, dynamic: Optional[bool] = None) -> int:
    """``torch.compile`` each repeated block of ``model`` in place, for training.

    Call it before or after ``booster.boost`` (compilation is lazy: the first step traces the
    FP8 layers the plugin swapped in) and after ``gradient_checkpointing_enable()`` if used.
    Sets ``use_cache=False`` on the model's configs, raises dynamo's per-function recompile
    limit to the number of blocks + ``SPARE_RECOMPILES`` (it never lowers it), and turns
    ``torch._dynamo.config.fail_on_recompile_limit_hit`` on, so a block that would silently
    run eager raises instead. These two dynamo settings are process-wide.

    Args:
        model: the model; its blocks are the children of its first ``nn.ModuleList``.
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` compiles fast).
        mode: ``torch.compile`` mode (e.g. ``"max-autotune-no-cudagraphs"``).
        fullgraph: fail on any graph break inside a block.
        dynamic: ``torch.compile``'s ``dynamic``.

    Returns:
        The number of blocks compiled.

    Raises:
        ValueError: the model has no ``nn.ModuleList`` of blocks.

    Example:
        >>> import torch
        >>> from fp8boost.compile import compile_blocks
        >>> model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8)] * 2))
        >>> compile_blocks(model, backend="eager")
        2
    """
    blocks = find_blocks(model)
    if not blocks:
        raise ValueError(f"compile_blocks compiles each repeated block, but "
                         f"{type(model).__name__} has no nn.ModuleList of blocks; call "
                         "torch.compile(model) yourself")
    disable_kv_cache(model)
    cfg = torch._dynamo.config
    limit = len(blocks) + SPARE_RECOMPILES
    if cfg.recompile_limit < limit:
        cfg.recompile_limit = limit
    if cfg.accumulated_recompile_limit < limit:
        cfg.accumulated_recompile_limit = limit
    cfg.fail_on_recompile_limit_hit = True
    for block in blocks:
        _compile_block(block, backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    return len(blocks)


def _compile_block(block: nn.Module, **options) -> None:
    """``block.compile(**options)``; a block whose class is torch's own (``nn.Sequential`` and
    the other containers) gets its ``forward`` compiled through a frame of ours instead: dynamo
    does not trace a frame of ``torch.nn``'s files at the top, only inlined (torch 2.13:
    ``fullgraph=True`` raised "found no compiled frames"; without it each FP8 layer compiled as
    a graph of its own and the rest ran eager). Its hooks stay outside the graph, as with
    ``Module.compile`` (whose ``_call_impl`` frame dynamo skips the same way)."""
    if not type(block).__module__.startswith("torch.nn."):
        block.compile(**options)
        return
    forward = block.forward

    def block_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    block.forward = torch.compile(block_forward, **options)
