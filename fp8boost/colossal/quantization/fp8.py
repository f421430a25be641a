"""``colossalai.quantization.fp8``: Colossal-AI's FP8 API, implemented by fp8boost.

Same names, signatures and return conventions as Colossal-AI's module, so its callers (and its
tests, after the import edit) run unchanged; the work is done by fp8boost's FP8 core
(:mod:`fp8boost.fp8`) and FP8 collectives (:mod:`fp8boost.parallel.fp8_comm`):

* casts: :func:`cast_to_fp8` / :func:`cast_from_fp8` (per tensor or per channel), and the
  pipeline pair :func:`cast_to_fp8_pipeline` / :func:`cast_from_fp8_pipeline`;
* collectives with FP8 bytes on the wire: :func:`all_reduce_fp8`, :func:`all_to_all_single_fp8`,
  :func:`all_to_all_fp8`, :func:`all_gather_fp8`, :func:`all_gather_into_tensor_flat_fp8`,
  :func:`reduce_scatter_fp8`; async calls return a :class:`Handle`;
* communication hooks: :func:`fp8_compress_ddp_grad_comm_hook_async` / ``_sync`` (DDP),
  :func:`fp8_compress_fsdp_grad_comm_hook`, :func:`fp8_compress_fsdp_params_comm_hook` (FSDP1);
* :func:`linear_fp8`, an FP8 ``F.linear`` with autograd (``fp8_hook.FP8Hook`` applies it).

Where Colossal-AI differs (each documented at the function): its public all-reduce, reduce-
scatter, all-gather and all-to-all quietly run the plain collective (always, or within a node);
here they always send FP8. Its gradient hooks sum; here they average, as DDP and FSDP do.
Unknown ``fp8_format`` strings raise instead of meaning e5m2. ``linear_fp8`` runs every shape in
FP8 instead of falling back to ``F.linear``. Colossal-AI's underscore names that its tests import
(``_all_gather_fp8``, ``_all_to_all_fp8``, ...) name the same functions.

Example:
    >>> import torch
    >>> from fp8boost.colossal.quantization.fp8 import cast_from_fp8, cast_to_fp8
    >>> x = torch.randn(8, 16)
    >>> q, inv = cast_to_fp8(x, fp8_format="e4m3", per_channel_scale=True)
    >>> bool(((cast_from_fp8(q, inv, x.dtype, per_channel_scale=True) - x).abs()
    ...       <= x.abs() / 16 + 1e-4).all())
    True
"""
from __future__ import annotations

from .fp8_cast import cast_from_fp8, cast_from_fp8_pipeline, cast_to_fp8, cast_to_fp8_pipeline
from .fp8_collectives import (Handle, all_gather_fp8, all_gather_into_tensor_flat_fp8,
                              all_reduce_fp8, all_to_all_fp8, all_to_all_single_fp8,
                              process_group_is_intranode, reduce_scatter_fp8)
from .fp8_comm_hooks import (fp8_compress_ddp_grad_comm_hook_async,
                             fp8_compress_ddp_grad_comm_hook_sync, fp8_compress_fsdp_grad_comm_hook,
                             fp8_compress_fsdp_params_comm_hook)
from .fp8_linear import linear_fp8

# Colossal-AI keeps its FP8 implementations under underscore names (its public names wrap them
# with fallbacks) and its tests import those; here both names are the one implementation.
# all_gather_fp8_lagacy (sic) and all_gather_fp8_ring are its other all-gather algorithms.
_all_reduce_fp8 = all_reduce_fp8
_all_to_all_fp8 = all_to_all_fp8
_all_to_all_single_fp8 = all_to_all_single_fp8
_all_gather_fp8 = all_gather_fp8
_reduce_scatter_fp8 = reduce_scatter_fp8
_linear_fp8 = linear_fp8
all_gather_fp8_lagacy = all_gather_fp8
all_gather_fp8_ring = all_gather_fp8

__all__ = ["Handle", "process_group_is_intranode", "cast_to_fp8", "cast_from_fp8",
           "cast_to_fp8_pipeline", "cast_from_fp8_pipeline", "all_reduce_fp8",
           "all_to_all_single_fp8", "all_to_all_fp8", "all_gather_fp8",
           "all_gather_fp8_lagacy", "all_gather_fp8_ring", "all_gather_into_tensor_flat_fp8",
           "reduce_scatter_fp8", "fp8_compress_ddp_grad_comm_hook_async",
           "fp8_compress_ddp_grad_comm_hook_sync", "fp8_compress_fsdp_grad_comm_hook",
           "fp8_compress_fsdp_params_comm_hook", "linear_fp8"]
