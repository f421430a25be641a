"""Colossal-AI's ``TorchFSDPPlugin`` arguments: FSDP1 policy objects mapped onto FSDP2.

Colossal-AI's ``TorchFSDPPlugin`` wraps ``FullyShardedDataParallel`` (FSDP1) and takes its
keyword arguments; fp8boost's runs FSDP2 (``fully_shard`` per decoder block + root). What has an
FSDP2 equivalent is mapped (``mixed_precision`` -> ``precision``, ``cpu_offload=CPUOffload(...)``
-> ``CPUOffloadPolicy``, ``sharding_strategy`` -> ``reshard_after_forward``; fp8boost's
plugin takes ``param_init_fn`` itself); what tunes FSDP1 internals is accepted with one INFO
line (:mod:`.common`'s rules); what FSDP2 here cannot do raises ``ValueError`` naming the
alternative. Nothing here touches a process group. :class:`TorchFSDPPlugin` takes them by
keyword.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

from fp8boost import plugins

from .common import check_bools, log_info, log_tuning, takes_colossal_args

PLUGIN = "torch_fsdp"
_PRECISION = MappingProxyType({torch.bfloat16: "bf16", torch.float16: "fp16",
                               torch.float32: "fp32", None: "fp32"})


@dataclass(frozen=True, kw_only=True)
class FsdpColossalArgs:
    """What ``fsdp_args`` maps the FSDP1 arguments to."""

    precision: Optional[str] = None
    """From ``mixed_precision.param_dtype`` (None: no ``mixed_precision`` given)."""
    reshard_after_forward: Optional[bool] = None
    """From ``sharding_strategy`` (None: none given)."""
    cpu_offload: bool = False
    """From ``cpu_offload=CPUOffload(offload_params=True)`` (or fp8boost's bool)."""


def _mixed_precision(mp: Any) -> Optional[str]:
    if mp is None:
        return None
    if not isinstance(mp, MixedPrecision):
        raise TypeError("mixed_precision must be a torch.distributed.fsdp.MixedPrecision or None "
                        f"(or pass precision='bf16'), got {type(mp).__name__}")
    if mp.param_dtype not in _PRECISION:
        raise ValueError(f"mixed_precision.param_dtype={mp.param_dtype} is not supported; use "
                         "torch.bfloat16, torch.float16 or torch.float32")
    precision = _PRECISION[mp.param_dtype]
    if mp.reduce_dtype not in (None, torch.float32):
        log_info(PLUGIN, "reduce_dtype", f"mixed_precision.reduce_dtype={mp.reduce_dtype} is not "
              "used: fp8boost reduce-scatters gradients in FP32 (at least as accurate; "
              "fp8_reduce_scatter=True puts FP8 on the wire)")
    if mp.buffer_dtype not in (None, torch.float32):
        log_info(PLUGIN, "buffer_dtype", f"mixed_precision.buffer_dtype={mp.buffer_dtype} is not "
              "used: buffers keep their own dtype (rotary tables, FP8 histories)")
    if getattr(mp, "keep_low_precision_grads", False):
        log_info(PLUGIN, "keep_low_precision_grads", "mixed_precision.keep_low_precision_grads="
              "True is not used: gradients of the FP32 master parameters stay FP32")
    return precision


def _sharding(strategy: Any) -> Optional[bool]:
    if strategy is None:
        return None
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError("sharding_strategy must be a torch.distributed.fsdp.ShardingStrategy or "
                        f"None, got {strategy!r}")
    if strategy == ShardingStrategy.NO_SHARD:
        raise ValueError("sharding_strategy=NO_SHARD is plain data parallelism: use "
                         "TorchDDPPlugin (or LowLevelZeroPlugin for sharded optimizer state)")
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return strategy == ShardingStrategy.FULL_SHARD
    raise ValueError(f"sharding_strategy={strategy.name} (sharding within a node, replicas "
                     "across) is not supported: use FULL_SHARD or SHARD_GRAD_OP, or "
                     "HybridParallelPlugin(tp_size=..., zero_stage=...) for sharding over part "
                     "of the ranks")


def _cpu_offload(cpu_offload: Any) -> bool:
    if isinstance(cpu_offload, bool):
        return cpu_offload
    if cpu_offload is None:
        return False
    if not isinstance(cpu_offload, CPUOffload):
        raise TypeError("cpu_offload must be True/False or a torch.distributed.fsdp.CPUOffload, "
                        f"got {type(cpu_offload).__name__}")
    return bool(cpu_offload.offload_params)


def fsdp_args(*, precision: str, reshard_after_forward: bool, process_group: Any,
              sharding_strategy: Any, cpu_offload: Any, auto_wrap_policy: Any,
              backward_prefetch: Any, mixed_precision: Any, ignored_modules: Any,
              sync_module_states: bool, forward_prefetch: bool,
              limit_all_gathers: bool, use_orig_params: bool, device_id: Any) -> FsdpColossalArgs:
    """Validate and map Colossal-AI's (FSDP1) ``TorchFSDPPlugin`` arguments (no collectives).

    ``precision`` and ``reshard_after_forward`` are fp8boost's own values, checked against what
    ``mixed_precision`` and ``sharding_strategy`` map to.
    """
    check_bools(sync_module_states=sync_module_states, forward_prefetch=forward_prefetch,
                 limit_all_gathers=limit_all_gathers, use_orig_params=use_orig_params)
    if process_group is not None:
        if process_group is not dist.group.WORLD:
            raise ValueError("process_group: fp8boost's TorchFSDPPlugin shards over every rank; "
                             "use process_group=None, or HybridParallelPlugin(tp_size=..., "
                             "zero_stage=...) to shard over part of the ranks")
    if ignored_modules:
        raise ValueError("ignored_modules is not supported: every parameter is sharded; use "
                         "ignored_modules=None (freeze a module with requires_grad_(False))")
    mapped = _mixed_precision(mixed_precision)
    if mapped is not None and precision not in ("bf16", mapped):
        raise ValueError(f"precision={precision!r} and mixed_precision (param_dtype -> "
                         f"{mapped!r}) disagree: pass one")
    reshard = _sharding(sharding_strategy)
    if reshard is not None and not reshard_after_forward and reshard:
        raise ValueError("reshard_after_forward=False and sharding_strategy=FULL_SHARD disagree: "
                         "pass one (SHARD_GRAD_OP is reshard_after_forward=False)")
    log_tuning(PLUGIN, [
        ("auto_wrap_policy", auto_wrap_policy, None,
         "fp8boost wraps each decoder block (and the root) in fully_shard"),
        ("backward_prefetch", backward_prefetch, None,
         "FSDP2 prefetches the next block's all-gather in backward itself"),
        ("forward_prefetch", forward_prefetch, False,
         "FSDP2 prefetches the next block's all-gather in forward itself"),
        ("limit_all_gathers", limit_all_gathers, True,
         "FSDP2 limits in-flight all-gathers by its own stream synchronisation"),
        ("use_orig_params", use_orig_params, False,
         "FSDP2 always keeps the original parameters (as DTensor shards)"),
        ("device_id", device_id, None, "the Booster places the model on this rank's device"),
    ])
    return FsdpColossalArgs(precision=mapped, reshard_after_forward=reshard,
                            cpu_offload=_cpu_offload(cpu_offload))


@takes_colossal_args(positional=("precision", "max_norm"))
class TorchFSDPPlugin(plugins.TorchFSDPPlugin):
    """fp8boost's ``TorchFSDPPlugin`` that also takes Colossal-AI's (FSDP1) arguments.

    Args:
        cpu_offload: True, or FSDP1's ``CPUOffload(offload_params=True)``.
        mixed_precision: FSDP1's ``MixedPrecision``: ``param_dtype`` bf16/fp16/fp32 sets
            ``precision``; gradients reduce in FP32 whatever ``reduce_dtype`` (INFO otherwise).
        sharding_strategy: FSDP1's ``ShardingStrategy``: FULL_SHARD (reshard_after_forward
            True), SHARD_GRAD_OP (False); NO_SHARD raises (use TorchDDPPlugin), HYBRID_* raise.
        process_group (None or the world group), ignored_modules (None or empty): others raise.
        auto_wrap_policy, backward_prefetch, forward_prefetch, limit_all_gathers,
            use_orig_params, device_id, sync_module_states: FSDP1 tuning: accepted; a
            non-default value logs once what FSDP2 here does instead (ranks always start
            from rank 0's weights, so ``sync_module_states`` is honoured either way).
        **native: ``fp8boost.plugins.TorchFSDPPlugin``'s arguments.
    """

    def __init__(self, *, cpu_offload=False, process_group=None, sharding_strategy=None,
                 auto_wrap_policy=None, backward_prefetch=None, mixed_precision=None,
                 ignored_modules=None, sync_module_states: bool = False,
                 forward_prefetch: bool = False, limit_all_gathers: bool = True,
                 use_orig_params: bool = False, device_id=None, **native) -> None:
        # mapped before the plugin checks anything, as FSDP1's objects decide its values
        fsdp1 = fsdp_args(
            precision=native["precision"], reshard_after_forward=native["reshard_after_forward"],
            process_group=process_group, sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload, auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=backward_prefetch, mixed_precision=mixed_precision,
            ignored_modules=ignored_modules, sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params, device_id=device_id)
        if fsdp1.precision is not None:
            native["precision"] = fsdp1.precision
        if fsdp1.reshard_after_forward is not None:
            native["reshard_after_forward"] = fsdp1.reshard_after_forward
        super().__init__(cpu_offload=fsdp1.cpu_offload, **native)
