"""Colossal-AI's DDP and FSDP communication hooks, over fp8boost's FP8 collectives.

* DDP (``ddp_model.register_comm_hook(process_group, hook)``): each gradient bucket is averaged
  with :func:`fp8boost.parallel.fp8_comm.all_reduce_fp8` (FP8 reduce-scatter + FP8 all-gather,
  FP32 sums). The ``_async`` hook is fp8boost's DDP hook
  (:func:`fp8boost.parallel.ddp.hooks.fp8_allreduce_hook`), which on CUDA runs on a side stream
  so communication overlaps the rest of backward; the ``_sync`` hook runs inline on the current
  stream (for debugging, as in Colossal-AI). On CPU both run inline.
* FSDP (``torch.distributed.fsdp.FullyShardedDataParallel``, FSDP1): the gradient hook
  reduce-scatters with FP8 on the wire; the parameter hook all-gathers the flat parameter with
  FP8 on the wire (it needs :func:`fp8boost.colossal.quantization.utils.
  patch_fsdp_params_comm_hook`, since FSDP has no parameter hook of its own).

Gradients are averaged over the group, as DDP's and FSDP's own reductions do (FSDP leaves the
division to a registered hook). Colossal-AI's FSDP gradient hook and its public
``all_reduce_fp8`` sum instead, so its gradients came out ``world_size`` times larger than its own
tests' references. The wire carries FP8 at any size (:func:`.fp8_collectives.comm_config`).
"""
# No ``from __future__ import annotations``: DDP compares the hook's annotations with
# dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from typing import Any, Optional

import torch
import torch.distributed as dist

from fp8boost import _state
from fp8boost.parallel.ddp.hooks import Fp8CommHookState, fp8_allreduce_hook
from fp8boost.parallel.fp8_comm import all_gather_into_tensor_fp8, all_reduce_fp8
from fp8boost.parallel.fp8_comm import reduce_scatter_tensor_fp8

from .fp8_cast import check_floating, fp8_dtype_of
from .fp8_collectives import comm_config

__all__ = ["fp8_compress_ddp_grad_comm_hook_async", "fp8_compress_ddp_grad_comm_hook_sync",
           "fp8_compress_fsdp_grad_comm_hook", "fp8_compress_fsdp_params_comm_hook"]


def _hook_state(group: Optional[dist.ProcessGroup], fp8_format: str) -> Fp8CommHookState:
    """One fp8boost hook state per (group, format), kept for the process: DDP passes the same
    ``process_group`` every call, and the state owns the CUDA side stream to reuse."""
    dtype = fp8_dtype_of(fp8_format)
    states = _state.cache("colossal-fp8-ddp-hook-states")
    key = (group, dtype)
    if key not in states:
        states[key] = Fp8CommHookState(group=group, config=comm_config().replace(grad_dtype=dtype))
    return states[key]


def _group_of(state: Any, group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The group to reduce over: ``group``, else the hook state if it is one (DDP's usual
    ``register_comm_hook(process_group, hook)``), else its ``process_group`` (torch's FSDP
    ``DefaultState``), else WORLD (None)."""
    if group is not None:
        return group
    if isinstance(state, dist.ProcessGroup):
        return state
    return getattr(state, "process_group", None)


def fp8_compress_ddp_grad_comm_hook_async(
        process_group: dist.ProcessGroup, bucket: dist.GradBucket,
        fp8_format: str = "e5m2") -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average each gradient bucket with FP8 on the wire, overlapping backward.

    Args:
        process_group: the hook state DDP passes: the group to average over (None: WORLD).
        bucket: DDP's gradient bucket, averaged in place.
        fp8_format: wire format, ``"e5m2"`` (gradients want its range) or ``"e4m3"``.

    Returns:
        A future completed with the averaged bucket buffer.

    Example:
        >>> ddp_model.register_comm_hook(None, fp8_compress_ddp_grad_comm_hook_async)  # doctest: +SKIP
    """
    return fp8_allreduce_hook(_hook_state(_group_of(process_group, None), fp8_format), bucket)


def fp8_compress_ddp_grad_comm_hook_sync(
        process_group: dist.ProcessGroup, bucket: dist.GradBucket,
        fp8_format: str = "e5m2") -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: as the ``_async`` one, but inline on the current stream (debugging).

    Example:
        >>> ddp_model.register_comm_hook(None, fp8_compress_ddp_grad_comm_hook_sync)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    all_reduce_fp8(buf, _group_of(process_group, None), op="avg",
                   fp8_dtype=fp8_dtype_of(fp8_format), config=comm_config())
    fut = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
    fut.set_result(buf)
    return fut


def fp8_compress_fsdp_grad_comm_hook(state: object, unsharded_gradient_flattened: torch.Tensor,
                                     sharded_gradient: Optional[torch.Tensor] = None, group=None,
                                     fp8_format: str = "e5m2") -> None:
    """FSDP gradient hook: reduce-scatter (average) the flat gradient with FP8 on the wire.

    Args:
        state: the hook state: a process group, an object with ``process_group`` (torch's
            ``DefaultState``) or None (WORLD); ``group`` overrides it.
        unsharded_gradient_flattened: the full flat gradient of this FSDP unit.
        sharded_gradient: receives this rank's averaged shard. None (FSDP's ``NO_SHARD``, which
            calls the hook with the gradient only): the gradient is averaged in place.
        group: process group (default: from ``state``).
        fp8_format: wire format.

    Example:
        >>> fsdp_model.register_comm_hook(None, fp8_compress_fsdp_grad_comm_hook)  # doctest: +SKIP
    """
    check_floating(unsharded_gradient_flattened, "unsharded_gradient_flattened")
    group, dtype = _group_of(state, group), fp8_dtype_of(fp8_format)
    if sharded_gradient is None:
        all_reduce_fp8(unsharded_gradient_flattened, group, op="avg", fp8_dtype=dtype,
                       config=comm_config())
        return
    check_floating(sharded_gradient, "sharded_gradient")
    reduce_scatter_tensor_fp8(sharded_gradient, unsharded_gradient_flattened, group, op="avg",
                              fp8_dtype=dtype, config=comm_config())


def fp8_compress_fsdp_params_comm_hook(state: object, padded_unsharded_flat_param: torch.Tensor,
                                       sharded_flat_param: torch.Tensor, group=None,
                                       fp8_format: str = "e5m2") -> None:
    """FSDP parameter hook: all-gather the flat parameter with FP8 on the wire.

    Register it with ``fsdp_model.register_params_comm_hook(None, hook)`` after
    :func:`fp8boost.colossal.quantization.utils.patch_fsdp_params_comm_hook`. The forward then
    runs on FP8-rounded weights (each rank's shard scaled by its own amax); the sharded master
    parameters stay exact.

    Args:
        state: hook state (a process group, an object with ``process_group``, or None).
        padded_unsharded_flat_param: destination, ``world_size`` times the shard's numel.
        sharded_flat_param: this rank's shard.
        group: process group (default: from ``state``).
        fp8_format: wire format (Colossal-AI's default e5m2; ``"e4m3"`` is the more precise).

    Example:
        >>> fsdp_model.register_params_comm_hook(None, fp8_compress_fsdp_params_comm_hook)  # doctest: +SKIP
    """
    check_floating(sharded_flat_param, "sharded_flat_param")
    check_floating(padded_unsharded_flat_param, "padded_unsharded_flat_param")
    all_gather_into_tensor_fp8(padded_unsharded_flat_param, sharded_flat_param,
                               _group_of(state, group), fp8_dtype=fp8_dtype_of(fp8_format),
                               config=comm_config())
