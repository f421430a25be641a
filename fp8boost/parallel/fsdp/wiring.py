"""FSDP2 wiring in small steps: find the blocks, shard them, materialise a meta-device model.

Applied by the FSDP plugins (``GeminiPlugin``, ``TorchFSDPPlugin``) in torchtitan's order:
FP8 conversion → FP8 all-gather weights → ``fully_shard`` per block → ``fully_shard(root)`` →
(meta models) allocate only the local shards and initialise them.

Example:
    >>> from fp8boost.hf_model import find_blocks
    >>> import torch
    >>> blocks = find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)])))
    >>> len(blocks)
    1
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from fp8boost import _state
from fp8boost.fp8.record import recorded_linears
from fp8boost.hf_model import find_blocks

logger = logging.getLogger("fp8boost.parallel.fsdp")

#: Attributes of FP8 delayed-scaling layers that a meta-device model gets fresh (no checkpoint).
_FP8_HISTORY = ("fp8_amax_history", "fp8_scale")
_META_HELP = ("build the model under accelerate's init_empty_weights() (it keeps buffers real) "
              "instead of torch.device('meta')")


def fully_shard_fn():
    """``fully_shard`` and ``MixedPrecisionPolicy``/``CPUOffloadPolicy`` of the installed torch."""
    try:
        # lazy: FSDP2's home depends on the torch version (fallback below)
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
    if not blocks:
        _state.log_once(logger, ("fsdp-no-blocks", type(model).__name__),
                        f"fp8boost: {type(model).__name__} has no nn.ModuleList of blocks, so the "
                        "whole model is one fully_shard unit: every parameter is all-gathered at "
                        "once (no per-block overlap, peak memory = the full model in "
                        "param_dtype)")
    for layer in recorded_linears(model):
        # A frozen weight's (LoRA base) cached FP8 cast would keep the whole unsharded weight
        # between steps: exactly the memory resharding after forward frees.
        layer.keep_frozen_cast = False
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks) + 1


def on_meta(model: nn.Module) -> bool:
    """True when any parameter lives on the meta device (built without memory)."""
    return any(p.is_meta for p in model.parameters())


def _rebuildable(mod: nn.Module) -> bool:
    """Buffers of this module can be made again without a checkpoint: FP8 scaling history, or a
    module built from a ``config`` (HF rotary embeddings: ``inv_freq``, ``original_inv_freq``)."""
    return hasattr(mod, _FP8_HISTORY[0]) or hasattr(mod, "config")


def check_meta_model(model: nn.Module) -> None:
    """Raise (before any communication) if a meta-device model cannot be materialised exactly:
    some parameters are real (``to_empty`` would wipe them), or a meta buffer could not be
    rebuilt after sharding.

    Raises:
        ValueError: naming the tensors and what to do.
    """
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"parameters {real[:5]} are real while others are on the meta device; "
                         "build the whole model on the meta device (or none of it)")
    bad = [f"{name}.{b}" if name else b for name, mod in model.named_modules()
           if not _rebuildable(mod)
           for b, buf in mod.named_buffers(recurse=False) if buf.is_meta]
    if bad:
        raise ValueError(f"buffers {bad[:5]} are on the meta device and fp8boost cannot rebuild "
                         f"them (no checkpoint holds non-persistent buffers); {_META_HELP}")


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, shard_rank: int = 0) -> None:
    """Allocate a sharded meta-device model on ``device`` and initialise it.

    Each rank allocates only its shards (``to_empty`` after ``fully_shard``). Buffers that were
    real (accelerate's ``init_empty_weights()``) keep their values. Parameters get the model's
    own initialisation (the nearest HF ``_init_weights``, else ``reset_parameters``). Meta
    buffers no checkpoint holds are rebuilt as a normal construction makes them: rotary
    ``inv_freq`` by building the module again from its config; FP8 delayed-scaling histories
    zero, scales one.

    Args:
        model: the model after ``fully_shard``, parameters on the meta device.
        device: where the shards live (the CPU under CPU offload).
        shard_rank: this rank's index in the shard group (seeds the init where DTensor random
            ops cannot, see :func:`_init_rng`).

    Raises:
        ValueError: see :func:`check_meta_model`.
    """
    check_meta_model(model)
    meta_buffers = {name for name, b in model.named_buffers() if b.is_meta}
    real = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)  # replaces every tensor, real buffers too: restore them
    for name, value in real.items():
        _buffer_owner(model, name).copy_(value)
    with _init_rng(device, shard_rank):
        _init_parameters(model)
    for name, mod in model.named_modules():
        prefix = f"{name}." if name else ""
        own = {prefix + b for b, _ in mod.named_buffers(recurse=False)}
        if hasattr(mod, _FP8_HISTORY[0]):
            getattr(mod, _FP8_HISTORY[0]).zero_()
            getattr(mod, _FP8_HISTORY[1]).fill_(1.0)
        elif own & meta_buffers:
            _rebuild_buffers(mod, device)  # HF rotary embeddings (inv_freq)


@torch.no_grad()
def apply_param_init_fn(model: nn.Module, param_init_fn: Callable[[nn.Module], None]) -> None:
    """FSDP1's ``param_init_fn`` on a sharded meta-device model: call it on every module that
    holds meta tensors of its own (e.g. ``m.to_empty(device=..., recurse=False)`` then an
    init), parents first, as FSDP1 materialises them (instead of :func:`materialize`).

    Raises:
        ValueError: tensors are still on the meta device afterwards.
    """
    for mod in model.modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if any(t.is_meta for t in own):
            param_init_fn(mod)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"param_init_fn left {left[:5]} on the meta device; it must "
                         "materialise the module it is given (e.g. module.to_empty(device=..., "
                         "recurse=False)), or pass no param_init_fn (fp8boost then initialises "
                         "with the model's own _init_weights)")


def _buffer_owner(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, bname = name.rpartition(".")
    return model.get_submodule(mod_name)._buffers[bname]


@contextlib.contextmanager
def _init_rng(device: torch.device, shard_rank: int) -> Iterator[None]:
    """Make random init differ between shards.

    On CUDA, DTensor's offset-based RNG tracker gives every shard its own slice of one random
    stream. It does not cover CPU tensors (CPU meshes, CPU offload): there every rank would draw
    the same numbers for its shard, repeating row blocks across ranks (a rank-deficient random
    matrix). There each rank draws from its own seed instead (derived from the global RNG, so
    ranks seeded alike stay reproducible), and the global RNG state is restored afterwards.
    """
    if device.type == "cuda":
        yield
        return
    _state.log_once(logger, "fsdp-cpu-init-seed",
                    "fp8boost: DTensor random ops do not cover CPU tensors, so each rank "
                    "initialises its shards of the meta-device model from its own seed: random "
                    "weights differ from a one-process init (load a checkpoint for exact "
                    "weights)", level=logging.INFO)
    base = int(torch.randint(0, 2 ** 62, (1,)).item())
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # torch's own warning says the same as the log line above, once per parameter.
        warnings.filterwarnings("ignore", message="DTensor random operators may not have")
        torch.manual_seed(base + 1_000_003 * shard_rank)
        yield


def _init_parameters(model: nn.Module) -> None:
    """Run each module's initialiser: the ``_init_weights`` of the nearest enclosing HF
    pretrained model (composite models nest several), else the module's ``reset_parameters``.

    ``_init_weights`` is called directly, not through HF's ``initialize_weights``: that one skips
    modules flagged ``_is_hf_initialized`` during construction, whose tensors ``to_empty`` has
    just replaced.
    """
    def visit(mod: nn.Module, init: Optional[Callable[[nn.Module], None]]) -> None:
        own = getattr(mod, "_init_weights", None)
        init = own if callable(own) else init
        for child in mod.children():
            visit(child, init)
        if init is not None:
            init(mod)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()

    visit(model, None)


def _rebuild_buffers(mod: nn.Module, device: torch.device) -> None:
    """Construct the module again on the CPU from its config; copy its buffers and scalars.

    Covers HF rotary embeddings across transformers versions (``LlamaRotaryEmbedding(config)``
    computes ``inv_freq`` in ``__init__``; 5.x registers ``original_inv_freq`` as a buffer, 4.x
    keeps it as a plain attribute that ``to_empty`` does not reach).
    """
    try:
        with torch.device("cpu"):
            fresh = type(mod)(config=mod.config)
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise ValueError(f"cannot rebuild the meta buffers of {type(mod).__name__} from its "
                         f"config ({exc}); {_META_HELP}") from exc
    for bname, buf in fresh.named_buffers(recurse=False):
        mod._buffers[bname] = buf.to(device)
    for attr in ("attention_scaling", "original_inv_freq"):
        if attr in fresh._buffers or not hasattr(fresh, attr):
            continue
        value = getattr(fresh, attr)
        setattr(mod, attr, value.to(device) if torch.is_tensor(value) else value)
