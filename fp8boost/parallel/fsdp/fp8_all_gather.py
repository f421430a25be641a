"""FSDP2 (``fully_shard``) with FP8 parameter all-gather and FP8 gradient reduce-scatter.

Two independent pieces (no silent fallback: a missing torch feature raises, naming what is
needed):

* **FP8 parameter all-gather** -- :class:`Fp8AllGatherWeight`, a weight tensor subclass with
  FSDP2's all-gather extension hooks. ``fsdp_pre_all_gather`` casts the local shard to e4m3 with
  a scale shared by the shard group (all-reduce(MAX) of the shard amaxes, or a scale
  precomputed for all weights at once by :func:`precompute_fp8_all_gather_scales`) and hands
  FSDP the bytes as ``uint8`` (NCCL and gloo reject float8). ``fsdp_post_all_gather`` then
  takes one of three paths, fixed per weight at its first all-gather (:class:`GatherPlan`):

  - *direct* (the weight of a tensorwise-scaled ``Fp8Linear`` whose forward format is the
    comm config's ``param_dtype``): the gathered bytes and their scale become the unsharded
    parameter itself, an :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor` that presents
    FSDP's ``param_dtype``, and ``Fp8Linear`` feeds them to its FP8 GEMM: no dequantize, no
    re-quantize, bit-identical to casting the full weight once with that scale. The scale then
    follows the layer's rule (its ``margin`` and ``power_of_2_scale``), not the comm config's.
    Later all-gathers (``out=``) only rebind the scale: FSDP copies the bytes into the same
    buffer.
  - *block* (the weight of a blockwise ``Fp8Linear`` whose even shards hold whole 128-row
    blocks): each rank casts its shard per block, no shared scale, and FSDP gathers the bytes
    with their block scales into a block-scaled ``Fp8WeightTensor`` that the layer's blockwise
    GEMMs take as is (:mod:`.block_gather`).
  - *dequantize* (anything else: delayed scaling, a plain ``nn.Linear`` or other consumer, a
    ``param_dtype`` that is not the GEMM's format, tied weights, tensor-parallel DTensors;
    logged once per reason): decode into a plain parameter in ``param_dtype``.

  The scale is shared
  because FSDP requires every all-gather input of an unevenly sharded parameter to have the
  padded shard shape (no room for a per-rank scale), and one scale makes the gathered bytes
  one FP8 tensor. Install with
  :func:`enable_fp8_all_gather` *before* ``fully_shard``. Hooks used:
  ``fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)`` (the 5-argument
  form, torch >= 2.5) and ``fsdp_post_all_gather(..., out=None)``. Only dim-0 sharding (FSDP's
  default) is supported.
* **FP8 gradient reduce-scatter** -- :class:`Fp8ReduceScatter`, installed on every FSDP module
  by :func:`set_fp8_reduce_scatter` through ``FSDPModule.set_custom_reduce_scatter`` (added by
  pytorch/pytorch#155189, mid-2025). It runs :func:`reduce_scatter_tensor_fp8` (e5m2 by
  default) with FSDP's op (AVG, SUM or PREMUL_SUM).

Torch versions: tested on 2.13 (CPU, gloo: bit-exact FP8 weights, gradient parity, 2 and 4
ranks). Both extension points predate 2.11, the GPU machine's version, but 2.11 was not run
here; ``set_custom_reduce_scatter`` is feature-detected when used.

Example:
    >>> from torch.distributed.fsdp import fully_shard                       # doctest: +SKIP
    >>> enable_fp8_all_gather(model)                                          # doctest: +SKIP
    >>> for block in model.layers: fully_shard(block)                         # doctest: +SKIP
    >>> fully_shard(model); set_fp8_reduce_scatter(model)                     # doctest: +SKIP
    >>> # after each optimizer.step(): one all-reduce for every weight's scale
    >>> precompute_fp8_all_gather_scales(model)                               # doctest: +SKIP
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
from collections import Counter
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from fp8boost import _state
from fp8boost.fp8.scaling import aligned_scalars, amax

from ..comm.config import Fp8CommConfig
from ..comm._utils import resolve_cast_impl
from ..comm.collectives import reduce_scatter_tensor_fp8
from ..comm.wire import cast_rows_into, decode_rows_into
from .block_gather import post_all_gather_blocks, pre_all_gather_blocks
from .gather_plan import GatherPlan, choose_plan, log_plan, post_all_gather_direct

__all__ = ["Fp8AllGatherWeight", "GatherPlan", "Fp8ReduceScatter", "enable_fp8_all_gather",
           "set_fp8_reduce_scatter", "precompute_fp8_all_gather_scales"]

logger = logging.getLogger("fp8boost.parallel.fsdp")
aten = torch.ops.aten
# Ops through which the subclass survives: FSDP pads, slices, views and copies the local shard
# (and moves it between devices) and must still find the hooks on the result.
_PRESERVE_OPS = frozenset({aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor,
                           aten.copy_.default, aten.view.default, aten.as_strided.default,
                           aten._to_copy.default, aten._pin_memory.default, aten.split.Tensor,
                           aten.clone.default, aten.detach.default})

try:  # the abstract base of FSDP2 custom comms (torch with set_custom_reduce_scatter)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # older torch: set_fp8_reduce_scatter raises before this class is used
    _ReduceScatterBase = object


class Fp8AllGatherWeight(torch.Tensor):
    """A parameter's data that FSDP2 all-gathers as FP8 (see the module docstring).

    Behaves as its inner high-precision tensor for every op (optimizer updates modify the inner
    tensor in place); only FSDP's all-gather extension hooks differ.

    Example:
        >>> import torch
        >>> from fp8boost.parallel.comm.config import Fp8CommConfig
        >>> w = Fp8AllGatherWeight(torch.ones(4, 4), Fp8CommConfig())
        >>> (w * 2).sum().item()
        32.0
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, config: Fp8CommConfig, tied: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, config: Fp8CommConfig, tied: bool = False) -> None:
        self._tensor = tensor
        self._config = config
        self._tied = tied  # shared by several modules: keep the plain (dequantize) path
        # (scale, inverse scale, version of _tensor, plan) from
        # precompute_fp8_all_gather_scales().
        self._precomputed: Optional[tuple[torch.Tensor, torch.Tensor, int, GatherPlan]] = None
        self._plan: Optional[GatherPlan] = None  # fixed at the first all-gather

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def inner_tensor(self) -> torch.Tensor:
        """The high-precision tensor this wraps: it owns the rank's data (e.g. to save it)."""
        return self._tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        src: list[Fp8AllGatherWeight] = []

        def unwrap(t: "Fp8AllGatherWeight") -> torch.Tensor:
            src.append(t)
            return t._tensor

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor,
                                    lambda t: cls(t, src[0]._config, src[0]._tied), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"config": self._config, "tied": self._tied}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner["_tensor"], meta["config"], meta["tied"])

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._tensor!r}, wire={self._config.param_dtype})"

    def _shared_scale(self, owner: "Fp8AllGatherWeight", plan: GatherPlan,
                      mesh) -> tuple[torch.Tensor, torch.Tensor]:
        """The (scale, inverse scale) every shard of this weight is cast with."""
        pre = owner._precomputed
        if pre is not None and pre[2] == owner._tensor._version and pre[3] == plan:
            return pre[0], pre[1]
        _state.log_once(logger, "fsdp-fp8-ag-scale-allreduce",
                        "fp8boost: FP8 all-gather without a precomputed scale: one amax "
                        "all-reduce per weight (slower); call precompute_fp8_all_gather_scales"
                        "(model) after each optimizer step", level=logging.INFO)
        a = amax(self._tensor)
        _all_reduce_max_over_mesh(a, mesh)
        scale = plan.scale(a)
        return scale, scale.reciprocal()

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Cast the local shard (padded to FSDP's padded shard shape) to FP8 bytes."""
        local = self._tensor
        ws = mesh.size()
        if tuple(local.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError("Fp8AllGatherWeight supports FSDP's dim-0 sharding only; "
                                      f"got shard {tuple(local.shape)} of {tuple(outer_size)}")
        owner = _owner(self, module)
        plan = owner._plan
        if plan is None:  # decided once per weight, so every gather takes the same path
            plan = owner._plan = choose_plan(owner._config, owner._tied, module, outer_size, ws)
            log_plan(plan)
        rows = -(-outer_size[0] // ws)  # FSDP pads every shard to ceil(dim0 / world) rows
        if plan.block:  # blockwise: bytes + block scales, cast per shard, nothing shared
            return pre_all_gather_blocks(local, rows, plan.fp8_dtype, plan.block, plan.margin,
                                         plan.power_of_2), (None, plan)
        # Every launch here runs once per weight per all-gather, on the CPU path that feeds the
        # GPU: FSDP's padded shard rows are zeroed only where the shard does not reach (the
        # all-gather sends them), and the inverse scale comes precomputed with the scale.
        data = torch.empty((rows, *local.shape[1:]), dtype=torch.uint8, device=local.device)
        n = local.numel()
        if n < data.numel():
            data.view(-1)[n:].zero_()
        # the owner lives on the CPU under FSDP's CPU offload, the shard copy on the device
        scale, inv = (t.to(local.device) for t in self._shared_scale(owner, plan, mesh))
        if n:
            cast_rows_into(local.contiguous().view(1, n), scale.reshape(1),
                           data.view(-1)[:n].view(1, n), plan.fp8_dtype,
                           power_of_2=plan.power_of_2,
                           impl=resolve_cast_impl(self._config, local.device))
        return (data,), (inv, plan)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """Wrap (direct plan) or dequantize the gathered FP8 bytes as the unsharded parameter."""
        inv, plan = metadata
        if plan.block:
            return post_all_gather_blocks(all_gather_outputs, plan.fp8_dtype, plan.block,
                                          param_dtype, out)
        (data,) = all_gather_outputs
        if inv.is_cuda:  # made on FSDP's copy-in stream, read on this one: no early reuse
            inv.record_stream(torch.cuda.current_stream(inv.device))
        if plan.direct:
            return post_all_gather_direct(data, inv, plan, param_dtype, out)
        impl = resolve_cast_impl(self._config, data.device)
        if out is not None:
            target = getattr(out, "_local_tensor", out)  # DTensor (FSDP + TP) or plain
            rows = target.shape[0]
            row = math.prod(target.shape[1:])
            # Refill in place without bumping the version counter: autograd saved this tensor
            # in forward and would otherwise reject it in backward.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(target):
                _decode_into(data[:rows].reshape(rows, row), inv, target, plan, impl)
            return None
        full = torch.empty(data.shape, dtype=param_dtype, device=data.device)
        with torch.no_grad():
            _decode_into(data.reshape(data.shape[0], -1), inv, full, plan, impl)
        return full, (full,)


class _PreAllGatherHook:
    """``fsdp_pre_all_gather`` as seen on an instance: a partial that carries its signature.

    FSDP2 calls ``inspect.signature(tensor.fsdp_pre_all_gather)`` before every all-gather of
    every weight, to tell its two hook forms apart. On a bound method that rebuilds the
    signature each time: ~100-160 us of CPU, most of this hook's cost per weight (measured on
    CPU, 2 gloo ranks), paid 2 x 224 times per LLaMA2-7B step. ``inspect`` returns a callable's
    ``__signature__`` as is.
    """

    def __init__(self, func: Callable) -> None:
        self.func = func
        self.signature = inspect.signature(func)
        self.signature = self.signature.replace(parameters=list(
            self.signature.parameters.values())[1:])  # bound: without self

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self.func
        bound = functools.partial(self.func, obj)
        bound.__signature__ = self.signature
        return bound


Fp8AllGatherWeight.fsdp_pre_all_gather = _PreAllGatherHook(
    Fp8AllGatherWeight.fsdp_pre_all_gather)


def _owner(weight: Fp8AllGatherWeight, module: Optional[nn.Module]) -> Fp8AllGatherWeight:
    """The persistent sharded weight behind ``weight`` (FSDP hands the hooks a device copy of it
    under CPU offload); it keeps the plan and the precomputed scale across steps."""
    w = getattr(module, "weight", None)
    local = getattr(w, "_local_tensor", w)
    if isinstance(local, Fp8AllGatherWeight) and local.shape == weight.shape:
        return local
    return weight


def _decode_into(data2d: torch.Tensor, inv: torch.Tensor, target: torch.Tensor,
                 plan: GatherPlan, impl: str) -> None:
    n = data2d.numel()
    dst = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype,
                                                            device=target.device)
    decode_rows_into(data2d.reshape(1, n), inv.reshape(1).float(), plan.fp8_dtype,
                     dst.view(1, n), power_of_2=plan.power_of_2, impl=impl)
    if dst is not target:
        target.copy_(dst)


def _all_reduce_max_over_mesh(t: torch.Tensor, mesh) -> None:
    if mesh is None or mesh.size() == 1:
        return
    for dim in range(mesh.ndim):  # HSDP meshes: one scale across the whole mesh is still valid
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


class Fp8ReduceScatter(_ReduceScatterBase):
    """FSDP2 custom reduce-scatter running :func:`reduce_scatter_tensor_fp8`."""

    def __init__(self, config: Optional[Fp8CommConfig] = None) -> None:
        self.config = config or Fp8CommConfig()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Plain caching-allocator buffers (FSDP's default)."""
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        return reduce_scatter_tensor_fp8(output_tensor, input_tensor, group, op=op,
                                         fp8_dtype=self.config.grad_dtype, async_op=async_op,
                                         config=self.config)


def _default_filter(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def enable_fp8_all_gather(model: nn.Module, config: Optional[Fp8CommConfig] = None,
                          module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None
                          ) -> list[str]:
    """Wrap the weights of selected modules in :class:`Fp8AllGatherWeight`, in place.

    Call before ``fully_shard``. Tied weights stay tied (the one Parameter is replaced
    everywhere it appears).

    Args:
        model: the model.
        config: :class:`Fp8CommConfig` (wire format ``param_dtype``; ``enabled=False`` wraps
            nothing).
        module_filter_fn: ``(module, fqn) -> bool``; default: every ``nn.Linear``
            (Fp8Linear included).

    Returns:
        Qualified names of the wrapped weights.

    Example:
        >>> names = enable_fp8_all_gather(model)                         # doctest: +SKIP
    """
    cfg = config or Fp8CommConfig()
    if not isinstance(cfg, Fp8CommConfig):
        raise TypeError(f"config must be an Fp8CommConfig, got {type(cfg).__name__}")
    if not cfg.enabled:
        return []
    keep = module_filter_fn or _default_filter
    replaced: dict[int, nn.Parameter] = {}
    names: list[str] = []
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for fqn, mod in model.named_modules():
        w = mod._parameters.get("weight")
        if w is None or not keep(mod, fqn) or id(w) in replaced:
            continue
        if isinstance(w.data, Fp8AllGatherWeight) or type(w.data) is not torch.Tensor:
            raise ValueError(f"{fqn}.weight is a {type(w.data).__name__}, not a plain tensor: "
                             "call enable_fp8_all_gather once, before fully_shard / "
                             "parallelize_module")
        if not w.is_floating_point():
            continue
        replaced[id(w)] = nn.Parameter(Fp8AllGatherWeight(w.data, cfg, tied=uses[id(w)] > 1),
                                       requires_grad=w.requires_grad)
        names.append(f"{fqn}.weight" if fqn else "weight")
    for mod in model.modules():  # second pass: also swap every tied occurrence
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in replaced:
                mod._parameters[pname] = replaced[id(p)]
    return names


def set_fp8_reduce_scatter(model: nn.Module, config: Optional[Fp8CommConfig] = None) -> int:
    """Install :class:`Fp8ReduceScatter` on every FSDP2 module in ``model``; returns the count.

    Raises:
        NotImplementedError: the installed torch has no ``FSDPModule.set_custom_reduce_scatter``.
        ValueError: ``model`` contains no ``fully_shard`` module.
    """
    from torch.distributed.fsdp import FSDPModule  # noqa: WPS433 (only when FSDP is used)

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise NotImplementedError(
            f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter (added mid-2025"
            ", pytorch/pytorch#155189): upgrade torch, or keep FSDP's BF16/FP32 reduce-scatter")
    comm = Fp8ReduceScatter(config)
    count = 0
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_custom_reduce_scatter(comm)
            count += 1
    if count == 0:
        raise ValueError("set_fp8_reduce_scatter found no fully_shard module: call it after "
                         "fully_shard")
    return count


@torch.no_grad()
def precompute_fp8_all_gather_scales(model: nn.Module) -> int:
    """One all-reduce(MAX) for the all-gather scales of every FP8-gathered weight.

    Call after each optimizer step; without it each weight pays a tiny all-reduce in its own
    ``fsdp_pre_all_gather``. A scale is used only while its weight is unchanged (the version
    counter is checked) and its :class:`GatherPlan` is the one the all-gather uses, so a stale
    or mismatched scale is never applied. Returns the number of weights.
    """
    by_mesh: dict[Any, list[tuple[Fp8AllGatherWeight, GatherPlan]]] = {}
    seen: set[int] = set()
    for mod in model.modules():
        for p in mod._parameters.values():
            local = getattr(p, "_local_tensor", p)
            if not isinstance(local, Fp8AllGatherWeight) or id(local) in seen:
                continue
            seen.add(id(local))
            # The plan fixed by the first all-gather, else a provisional one (kept with the
            # scale: the hook uses the scale only if its plan turns out the same).
            plan = local._plan or choose_plan(local._config, local._tied, mod, None)
            if plan.block:  # block scales are cast per shard: nothing to agree on
                continue
            by_mesh.setdefault(getattr(p, "device_mesh", None), []).append((local, plan))
    for mesh, weights in by_mesh.items():
        amaxes = _stacked_amax([w._tensor for w, _ in weights])
        _all_reduce_max_over_mesh(amaxes, mesh)  # the one all-reduce (per mesh dim)
        # One vector of scales per distinct scale rule (usually one), not a few small kernels
        # per weight: after the optimizer step nothing else is queued, so every launch here
        # is GPU idle time (224 weights of a 7B model cost ~2000 launches before this).
        rules: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        for w, plan in weights:
            key = (plan.fp8_dtype, plan.margin, plan.power_of_2)
            if key not in rules:
                scales = plan.scale(amaxes)
                rules[key] = (aligned_scalars(scales), aligned_scalars(scales.reciprocal()))
        for i, (w, plan) in enumerate(weights):
            scales, invs = rules[(plan.fp8_dtype, plan.margin, plan.power_of_2)]
            w._precomputed = (scales[i], invs[i], w._tensor._version, plan)
    return sum(len(ws) for ws in by_mesh.values())


def _stacked_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """FP32 ``[N]`` of each tensor's max |x|: equal to :func:`amax` of each (NaN propagates,
    0 for an empty tensor), one reduction kernel per tensor and no ``abs`` temporary."""
    parts = [torch.linalg.vector_norm(t.detach(), float("inf")) if t.numel() else
             torch.zeros((), dtype=t.dtype, device=t.device) for t in tensors]
    return torch.stack([p if p.dtype == torch.float32 else p.float() for p in parts])
