"""FSDP2 wiring in small steps: find the blocks, shard them, materialise a meta-device model.

Applied by the FSDP plugins (``GeminiPlugin``, ``TorchFSDPPlugin``) in torchtitan's order:
FP8 conversion → FP8 all-gather weights → ``fully_shard`` per block → ``fully_shard(root)`` →
(meta models) allocate only the local shards and initialise them.

Example:
    >>> from fp8boost.parallel.fsdp.wiring import find_blocks
    >>> import torch
    >>> blocks = find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])))
    >>> len(blocks)
    1
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: the children of the first ``nn.ModuleList``
    (HF decoders: ``model.model.layers``); empty when the model has none."""
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return list(mod)
    return []


def fully_shard_fn():
    """``fully_shard`` and ``MixedPrecisionPolicy``/``CPUOffloadPolicy`` of the installed torch."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import (CPUOffloadPolicy,  # type: ignore
                                                        MixedPrecisionPolicy, fully_shard)
    return fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy


def apply_fsdp(model: nn.Module, mesh, param_dtype: Optional[torch.dtype],
               reshard_after_forward: bool = True, cpu_offload: bool = False) -> int:
    """``fully_shard`` every block, then the root; FP32 gradient reduction.

    Returns the number of FSDP units (blocks + root).
    """
    fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy = fully_shard_fn()
    kwargs: dict = dict(mesh=mesh, reshard_after_forward=reshard_after_forward)
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                   reduce_dtype=torch.float32)
    if cpu_offload:
        # Pinned host memory needs a CUDA context; a CPU-only machine cannot pin.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    blocks = find_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks) + 1


def on_meta(model: nn.Module) -> bool:
    """True when any parameter lives on the meta device (built without memory)."""
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate a sharded meta-device model on ``device`` and initialise it.

    Each rank allocates only its shards (``to_empty`` after ``fully_shard``). Parameters get
    the model's own initialisation (HF ``_init_weights``, else ``reset_parameters``). Buffers
    no checkpoint holds are rebuilt as a normal construction makes them: rotary ``inv_freq``
    from the module's ``rope_init_fn``; FP8 delayed-scaling histories zero, scales one.

    Raises:
        ValueError: a buffer would stay uninitialised (build with accelerate's
            ``init_empty_weights()``, which keeps buffers real, instead).
    """
    meta_buffers = {name for name, b in model.named_buffers() if b.is_meta}
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    for mod in model.modules():
        if init is not None and callable(init):
            init(mod)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    fixed: set[str] = set()
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        own = {prefix + b for b, _ in mod.named_buffers(recurse=False)}
        if hasattr(mod, "fp8_amax_history"):
            mod.fp8_amax_history.zero_()
            mod.fp8_scale.fill_(1.0)
            fixed.update({prefix + "fp8_amax_history", prefix + "fp8_scale"})
        elif own & meta_buffers and hasattr(mod, "config"):
            _rebuild_buffers(mod, device)  # e.g. HF rotary embeddings (inv_freq)
            fixed.update(own)
    left = sorted(meta_buffers - fixed)
    if left:
        raise ValueError(f"buffers {left[:5]} were on the meta device and fp8boost cannot rebuild "
                         "them; build the model under accelerate's init_empty_weights() (it keeps "
                         "buffers real) instead of torch.device('meta')")


def _rebuild_buffers(mod: nn.Module, device: torch.device) -> None:
    """Construct the module again on the CPU from its config; copy its buffers and scalars.

    Covers HF rotary embeddings across transformers versions (``LlamaRotaryEmbedding(config)``
    computes ``inv_freq`` in ``__init__``; 4.x also takes ``device``).
    """
    with torch.device("cpu"):
        fresh = type(mod)(config=mod.config)
    for bname, buf in fresh.named_buffers(recurse=False):
        mod._buffers[bname] = buf.to(device)
    for attr in ("attention_scaling",):
        if hasattr(fresh, attr):
            setattr(mod, attr, getattr(fresh, attr))
