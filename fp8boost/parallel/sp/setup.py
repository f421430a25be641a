"""The hybrid plugins' sequence-parallel setup: argument checks, Ulysses wiring and groups.

Two modes, as in Colossal-AI:

* ``"split_gather"`` (Megatron-style, the default): the residual stream is split along the
  sequence over the *tensor-parallel* ranks (``parallel/tp``); no mesh axis of its own, so
  ``sp_size`` must be None, 1 or ``tp_size``.
* ``"all_to_all"`` (DeepSpeed-Ulysses): its own mesh axis ``sp`` of ``sp_size`` ranks
  (``parallel/mesh.py``; dp = world / (pp x sp x tp)). Parameters are replicated over sp and
  gradients averaged over dp x sp (ZeRO's group is the flattened dp x sp group, which also
  shards the FP32 masters); each sp rank reads the same batch as the others (the dataloader
  is sharded over dp only) and runs its ``seq / sp`` tokens (``parallel/sp``).

``"ring_attn"``/``"ring"`` are refused (ValueError naming all_to_all). Without
``enable_sequence_parallelism`` the mode is ignored with one INFO line, as Colossal-AI does.
The functions take sizes and a topology, not a plugin (``HybridParallelPlugin`` and
``MoeHybridParallelPlugin`` call them in their setup).

Example:
    >>> check_sp_args(True, "all_to_all", 2, tp_size=1, pp_size=1)
    ('all_to_all', 2)
    >>> check_sp_args(True, None, None, tp_size=2, pp_size=1)
    ('split_gather', 1)
"""
from __future__ import annotations

import logging
from typing import Optional

import torch.distributed as dist

from fp8boost import _state
from .model import apply_ulysses, check_ulysses

# The plugins' logger: these lines are about a plugin's arguments (and keep their name).
logger = logging.getLogger("fp8boost.plugins")

SP_MODES = ("split_gather", "all_to_all")


def _check_sp_size(sp_size: object) -> Optional[int]:
    if sp_size is not None and (isinstance(sp_size, bool) or not isinstance(sp_size, int)
                                or sp_size < 1):
        raise ValueError(f"sp_size must be None or an int >= 1, got {sp_size!r}")
    return sp_size


def check_sp_args(enabled: bool, mode: Optional[str], sp_size: Optional[int], tp_size: int,
                  pp_size: int, plugin: str = "HybridParallelPlugin") -> tuple[Optional[str], int]:
    """Validate the sequence-parallel arguments; returns ``(mode or None, sp mesh size)``.

    ``plugin`` names the caller in the INFO line (``MoeHybridParallelPlugin`` shares the rules).

    Raises:
        ValueError: a mode that does not exist here, sizes that contradict the mode, or
            all_to_all with pipeline parallelism.
    """
    sp_size = _check_sp_size(sp_size)
    if not enabled:
        if mode is not None:
            _state.log_once(logger, ("hybrid-sp-mode-ignored", mode),
                            f"{plugin}: sequence_parallelism_mode={mode!r} is ignored "
                            "because enable_sequence_parallelism=False (as in Colossal-AI)",
                            level=logging.INFO)
        if sp_size not in (None, 1):
            raise ValueError(f"sp_size={sp_size} needs enable_sequence_parallelism=True (with "
                             "sequence_parallelism_mode='all_to_all'); or leave sp_size unset")
        return None, 1
    mode = "split_gather" if mode is None else mode
    if mode in ("ring_attn", "ring"):
        raise ValueError(f"sequence_parallelism_mode={mode!r} (ring attention) is not supported; "
                         "use 'all_to_all' (DeepSpeed-Ulysses, sp_size independent of tp_size) or "
                         "'split_gather' (over the tp ranks)")
    if mode not in SP_MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r} is not supported; use one of "
                         f"{SP_MODES}")
    if mode == "split_gather":
        if tp_size == 1:
            raise ValueError("enable_sequence_parallelism=True with split_gather splits the "
                             "sequence over the tensor-parallel ranks: set tp_size > 1, or use "
                             "sequence_parallelism_mode='all_to_all' with sp_size > 1")
        if sp_size not in (None, 1, tp_size):
            raise ValueError(f"split_gather runs on the tp ranks, so sp_size must be None, 1 or "
                             f"tp_size ({tp_size}), got {sp_size}; for an sp axis of its own use "
                             "sequence_parallelism_mode='all_to_all'")
        return mode, 1
    if pp_size > 1 and (sp_size or 1) > 1:
        raise ValueError("sequence_parallelism_mode='all_to_all' with pp_size > 1 is not "
                         "supported: use all_to_all with pp_size=1, or split_gather with pp")
    return mode, sp_size or 1


def validate_ulysses(model, sp_size: int, tp_size: int, pp_size: int) -> None:
    """Before any collective: the model's heads split over tp x sp, sp divides the world."""
    if sp_size == 1:
        return
    check_ulysses(model, sp_size, tp_size)
    world = dist.get_world_size() if dist.is_initialized() else None
    inner = pp_size * sp_size * tp_size
    if world is not None and world % inner:
        raise ValueError(f"pp_size x sp_size x tp_size = {inner} must divide the world size "
                         f"({world}); launch a multiple of {inner} processes")


def apply_ulysses_to(model, topo, sp_size: int, comm_plan) -> None:
    """Route ``model``'s attention through the sp all-to-alls (after the tp split)."""
    if sp_size > 1:
        apply_ulysses(model, topo.group("sp"), comm_plan)


def zero_group(topo, sp_size: int):
    """The group ZeRO reduces gradients and shards masters over: dp, times sp under Ulysses
    (sp ranks hold the same parameters and different tokens of one batch)."""
    return topo.flat_group("dp", "sp") if sp_size > 1 else topo.group("dp")


def replica_groups(topo, tp_size: int, pp_size: int, sp_size: int) -> list:
    """The groups whose ranks must be fed the same batch (for ``ReplicaInputGuard``)."""
    return [topo.group(n) for n, size in (("tp", tp_size), ("pp", pp_size), ("sp", sp_size))
            if size > 1]
