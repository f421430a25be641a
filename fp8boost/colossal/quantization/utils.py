"""``colossalai.quantization.utils``: a parameter communication hook for torch's FSDP (FSDP1).

FSDP1 has ``register_comm_hook`` for the gradient reduce-scatter but no hook for the parameter
all-gather. :func:`patch_fsdp_params_comm_hook` adds ``FullyShardedDataParallel.
register_params_comm_hook(state, hook)``: a unit whose hook is set all-gathers its flat
parameter through ``hook(state, padded_unsharded_flat_param, sharded_flat_param, group)``
(e.g. :func:`~fp8boost.colossal.quantization.fp8.fp8_compress_fsdp_params_comm_hook`); every
other unit keeps torch's own all-gather, which the patch calls unchanged.

This patches torch classes for the whole process (as Colossal-AI does). fp8boost's own FP8
parameter all-gather is FSDP2's (``GeminiPlugin`` / ``fp8boost.parallel.fsdp``), which needs
no patch.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

__all__ = ["patch_fsdp_params_comm_hook"]


def _fsdp_classes() -> tuple[type, type]:
    try:
        # lazy: FSDP1 internals, whose home depends on the torch version
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._flat_param import FlatParamHandle
    except ImportError as exc:  # torch < 2.1 kept FSDP's internals elsewhere
        raise RuntimeError(f"patch_fsdp_params_comm_hook needs torch >= 2.2's FSDP ({exc}); "
                           "upgrade torch, or use fp8boost's FSDP2 FP8 all-gather "
                           "(GeminiPlugin)") from exc
    return FullyShardedDataParallel, FlatParamHandle


def patch_fsdp_params_comm_hook() -> None:
    """Give torch's ``FullyShardedDataParallel`` a ``register_params_comm_hook`` method.

    Idempotent: calling it again changes nothing.

    Example:
        >>> patch_fsdp_params_comm_hook()
        >>> from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        >>> callable(FSDP.register_params_comm_hook)
        True
    """
    fsdp_cls, handle_cls = _fsdp_classes()
    original = handle_cls._all_gather_flat_param
    if getattr(original, "fp8boost_params_hook_patch", False):
        return

    def all_gather_flat_param(self, padded_unsharded_flat_param: Tensor) -> Tensor:
        hook = getattr(self, "_fp8boost_params_hook", None)
        if hook is None or self._use_fake_all_gather:
            return original(self, padded_unsharded_flat_param)
        hook(self._fp8boost_params_hook_state, padded_unsharded_flat_param,
             self.flat_param.data, self.process_group)
        return padded_unsharded_flat_param

    all_gather_flat_param.fp8boost_params_hook_patch = True
    handle_cls._all_gather_flat_param = all_gather_flat_param
    fsdp_cls.register_params_comm_hook = _register_params_comm_hook


def _register_params_comm_hook(self, state: Any, hook: Callable) -> None:
    """Register ``hook`` for the parameter all-gather of every FSDP unit under this root.

    Call it on the root FSDP module, once, before the first forward. ``hook(state,
    padded_unsharded_flat_param, sharded_flat_param, group)`` must fill the first argument.
    """
    if not callable(hook):
        raise TypeError(f"the parameter communication hook must be callable, got {hook!r}")
    if not self.check_is_root():
        raise ValueError("register_params_comm_hook must be called on the root FSDP module "
                         "(it applies to every FSDP unit below it)")
    from torch.distributed.fsdp import _traversal_utils  # torch's own walk over the units

    handles = _traversal_utils._get_fsdp_handles(self)
    if any(getattr(h, "_fp8boost_params_hook", None) is not None for h in handles):
        raise ValueError("a parameter communication hook is already registered on this model")
    if any(h._offload_params for h in handles):
        raise ValueError("the parameter communication hook does not support "
                         "CPUOffload(offload_params=True): drop the offload or the hook")
    for h in handles:
        h._fp8boost_params_hook = hook
        h._fp8boost_params_hook_state = state
