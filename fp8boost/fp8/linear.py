"""Fp8Linear: an ``nn.Linear`` whose three GEMMs run in FP8.

The three GEMMs, all in "NT" form (both operands K-major: row-major with the reduced dim last),
as Hopper FP8 tensor cores require:

    fprop  y[M,N]  = x[M,K]  . W[N,K]^T    mm(xq,      wq)       x e4m3 [M,K],  W e4m3 [N,K]
    dgrad  dx[M,K] = dy[M,N] . W[N,K]      mm(dyq,     wq_t)     dy e5m2 [M,N], W^T e4m3 [K,N]
    wgrad  dW[N,K] = dy^T    . x           mm(dyq_t,   xq_t)     dy^T e5m2 [N,M], x^T e4m3 [K,M]

So each cast emits the row-major copy and, when backward needs it, the transposed copy in one
pass. Backward saves ``xq_t`` (1 byte/element), never the BF16 input. Bias stays in high
precision. The rowwise and blockwise recipes run :func:`~fp8boost.fp8.granular.granular_linear`
instead (``linear_granular.py`` says what they do not use). From the second forward of an
unchanged weight on (micro-batches, gradient accumulation, recomputation) its cast is cached;
with one forward per step nothing is kept. An optimizer step (a global ``torch.optim`` step
hook), an in-place write to the Parameter (its version counter) or a new storage invalidates
it; writes through ``.data`` are invisible: call :func:`invalidate_weight_caches`. A frozen
weight (LoRA's base layer) is cast once, with its transpose, and reused until written/loaded.

A weight that is already FP8 (an :class:`~fp8boost.fp8.prequantized.Fp8WeightTensor`, e.g.
FSDP2's FP8 all-gather) is the GEMM operand as is: no amax, no cast, no cache; its transpose
for dgrad is made in backward. The weight gradient is a plain tensor of the weight's dtype.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from fp8boost import _state

from . import shared_cast
from .backend_base import Fp8Backend
from .backends import get_backend
from .config import GRANULAR_RECIPES, Fp8Config
from .linear_granular import (RowGroups, granular_forward, prepare_granular,
                              prequantized_block_operands, row_groups, weight_operands)
from .recompute import DelayedReplayLog, compiling as _compiling, recomputing
from .prequantized import (Fp8WeightTensor, PrequantizedWeight, dequantize_weight,
                           fp8_input_operand, fp8_operand_mismatch, fp8_weight_operand,
                           fp8_weight_transpose, transpose_fp8)
from .scaling import DelayedScalingState, Fp8Tensor, amax, cast_result, scale_from_amax

_ROLES = ("input", "weight", "grad")


def invalidate_weight_caches(model: nn.Module) -> None:
    """Drop every cached FP8 weight cast in ``model`` (after writing weights through ``.data``).

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, Fp8Linear
        >>> from fp8boost.fp8.linear import invalidate_weight_caches
        >>> layer = Fp8Linear(32, 32, config=Fp8Config(backend="emulated"))
        >>> invalidate_weight_caches(layer)
    """
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod._w_cache = None


def weights_loaded(model: nn.Module) -> None:
    """Tell every FP8 layer of ``model`` that a loader bypassing ``load_state_dict`` (a sharded
    reader copying into parameters) wrote its weights and buffers in place: as after
    ``load_state_dict``, cached casts are dropped and loaded amax histories kept (exact resume)."""
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod._weights_loaded([bool(h.any()) for h in mod.fp8_amax_history]
                                if mod._delayed else None)


class Fp8LinearFunction(torch.autograd.Function):
    """Fp8Linear's three FP8 GEMMs: ``apply(x2d, weight [out, in], bias, layer)``."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, layer: "Fp8Linear"):
        backend, cfg = layer._fp8_backend, layer.fp8_config
        # Grad mode is off inside forward: needs_input_grad says what backward will need.
        need_dgrad, need_wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        xq = layer._input_fp8(x2d, with_transpose=need_wgrad)
        # A prequantized weight's transpose is made in backward from the bytes (re-)gathered
        # then: saving it would pin what FSDP's reshard-after-forward frees.
        direct = layer._prequantized_ok(weight)
        want_t = need_dgrad and not direct
        recompute = want_t and cfg.recompute_weight_cast
        wq = layer._weight_fp8(want_t and not recompute, recompute=recompute)
        y = backend.mm(xq.data, wq.data, xq.inv_scale, wq.inv_scale, bias=bias,
                       out_dtype=x2d.dtype, use_fast_accum=cfg.fast_accum_fprop)
        ctx.layer = layer
        ctx.need_wgrad, ctx.need_dgrad = need_wgrad, need_dgrad
        ctx.direct = direct
        # dgrad's W^T is re-cast in backward from the Parameter with the forward's amax (same
        # bytes, no N*K FP8 bytes held). Decided by the recipe alone, never by the cache's state:
        # activation checkpointing requires the same saved tensors in forward and recomputation.
        # Backward takes a still-valid cached transpose (same bytes).
        ctx.recast = recompute and wq.amax is not None
        w_amax = wq.amax
        if ctx.recast and _compiling():
            # dynamo refuses to save a tensor that aliases another output of the traced forward
            w_amax = w_amax.clone()
        ctx.has_bias = bias is not None
        ctx.x_dtype, ctx.w_dtype = x2d.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        w_saved = (weight if direct or ctx.recast else wq.data_t) if need_dgrad else None
        ctx.save_for_backward(xq.data_t if need_wgrad else None, xq.inv_scale,
                              w_saved, w_amax if ctx.recast else wq.inv_scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        xq_t, x_inv, wq_t, w_inv = ctx.saved_tensors
        layer = ctx.layer
        if ctx.direct and ctx.need_dgrad:  # the Fp8WeightTensor itself was saved
            wq_t, w_inv = fp8_weight_transpose(wq_t), wq_t.inv_scale
        elif ctx.recast:  # the Parameter and its amax (in w_inv's slot) were saved
            if _compiling() and dy.numel():
                # AOTAutograd's partitioner moves work that needs no gradient into the forward
                # and saves its result: it would cast W^T there and keep it (the very copy the
                # re-cast avoids). One element of dy, made an exact 0, ties the re-cast to
                # backward; amax + 0 is the same amax, so the same scale and bytes.
                d0 = dy.reshape(-1)[:1].float().nan_to_num(0.0, 0.0, 0.0)
                w_inv = w_inv + (d0 * 0.0).reshape(())
            cached = None if _compiling() else layer._cached_weight_t()
            if cached is not None:
                wq_t, w_inv = cached.data_t, cached.inv_scale
            else:
                wq = layer._recast_weight_t(wq_t, w_inv)
                wq_t, w_inv = wq.data, wq.inv_scale
        backend, cfg = layer._fp8_backend, layer.fp8_config
        dy = dy.contiguous()
        dyq = layer._quantize("grad", dy, cfg.grad_dtype, with_transpose=ctx.need_wgrad)
        dx = dw = db = None
        if ctx.need_dgrad:
            dx = backend.mm(dyq.data, wq_t, dyq.inv_scale, w_inv, out_dtype=ctx.x_dtype,
                            use_fast_accum=cfg.fast_accum_dgrad)
        if ctx.need_wgrad:
            dw = backend.mm(dyq.data_t, xq_t, dyq.inv_scale, x_inv, out_dtype=ctx.w_dtype,
                            use_fast_accum=cfg.fast_accum_wgrad)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = cast_result(dy.float().sum(0), ctx.b_dtype)  # no no-op .to: see cast_result
        return dx, dw, db, None


class Fp8Linear(nn.Linear):
    """``nn.Linear`` running forward, dgrad and wgrad GEMMs in FP8 (scaled per tensor, row or block).

    Accepts any number of leading batch dims; works under ``torch.no_grad()``.

    Example:
        >>> import torch
        >>> from fp8boost.fp8 import Fp8Config, Fp8Linear
        >>> layer = Fp8Linear(64, 32, config=Fp8Config(backend="emulated"))
        >>> layer(torch.randn(4, 8, 64)).shape
        torch.Size([4, 8, 32])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, config: Optional[Fp8Config] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(config if config is not None else Fp8Config())
        self.resolve_backend()

    def _init_fp8(self, config: Fp8Config) -> None:
        if not isinstance(config, Fp8Config):
            raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
        self.fp8_config = config
        self._fp8_backend: Optional[Fp8Backend] = None
        self._backend_device: Optional[torch.device] = None
        self._w_cache: Optional[tuple] = None
        self.keep_frozen_cast = True  # False: FSDP frees unsharded weights (fsdp/wiring.py)
        self.amax_reduce_fn = None
        self._amax_groups: dict[str, object] = {}
        self._row_groups: Optional[RowGroups] = None  # rowwise under tp: see set_amax_groups
        self._delayed: dict[str, DelayedScalingState] = {}
        self._replay_log = DelayedReplayLog()
        if config.recipe == "delayed":
            # Buffers, so the history moves with .to() and is saved in state_dict (exact resume).
            dev = self.weight.device if self.weight.device.type != "meta" else None
            self.register_buffer("fp8_amax_history",
                                 torch.zeros(3, config.amax_history_len, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
            dtypes = (config.fwd_dtype, config.fwd_dtype, config.grad_dtype)
            for role, dt in zip(_ROLES, dtypes):
                self._delayed[role] = DelayedScalingState(
                    dt, config.amax_history_len, config.amax_compute_algo, config.margin,
                    config.power_of_2_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Optional[Fp8Config] = None) -> "Fp8Linear":
        """Build an Fp8Linear that shares ``linear``'s Parameter objects (no copy).

        The new module is created on the meta device, so nothing is allocated or initialised.
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                      config=config if config is not None else Fp8Config())
        new.weight = linear.weight
        new.bias = linear.bias
        if config is not None and config.recipe == "delayed":
            new.fp8_amax_history = torch.zeros_like(new.fp8_amax_history, device=linear.weight.device)
            new.fp8_scale = torch.ones_like(new.fp8_scale, device=linear.weight.device)
        new.train(linear.training)
        new.resolve_backend()
        return new

    def set_amax_reduce_fn(self, fn) -> None:
        """Distribution hook for delayed scaling: ``fn(amax)`` reduces a fresh amax in place."""
        self.amax_reduce_fn = fn
        for state in self._delayed.values():
            state.amax_reduce_fn = fn

    def set_amax_groups(self, groups: dict[str, object]) -> None:
        """Tensor parallelism hook: ``{role: process_group}`` for operands split over a group.

        Tensorwise: an operand whose rows or columns are split over ``group`` (``"input"``,
        ``"weight"`` or ``"grad"``) is scaled from the whole tensor's amax, all-reduced (MAX),
        as one process would cast it (as Transformer Engine does). Delayed scaling reduces
        through :meth:`set_amax_reduce_fn`. Rowwise reduces only the per-row amaxes of the
        operands whose rows span shards; blockwise reduces nothing (shard-local tiles and
        blocks): see :func:`~fp8boost.fp8.linear_granular.row_groups`.
        """
        bad = set(groups) - set(_ROLES)
        if bad:
            raise ValueError(f"unknown FP8 operand role(s) {sorted(bad)}; use {_ROLES}")
        granular = self.fp8_config.recipe in GRANULAR_RECIPES
        self._row_groups = row_groups(groups, self.fp8_config.recipe)
        self._amax_groups = {} if granular else {
            k: g for k, g in groups.items() if g is not None}
        self._w_cache = None

    def amax_group(self, role: str):
        """The process group ``role``'s amax is all-reduced over (see :meth:`set_amax_groups`)."""
        return self._amax_groups.get(role)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        loaded = self._delayed and prefix + "fp8_amax_history" in state_dict
        self._weights_loaded([True] * len(_ROLES) if loaded else None)

    def _weights_loaded(self, initialized: Optional[list[bool]]) -> None:
        """After a load: cached casts and a prequantized operand describe the old weight;
        ``initialized`` (delayed scaling, per role): whether its history now holds a loaded one
        (kept, not re-seeded from the next input). None leaves the states as they are."""
        self._w_cache = self._pre_w = None
        for role, init in zip(_ROLES, initialized or ()):
            self._delayed[role].initialized = init

    @property
    def prequantized_weight(self) -> Optional[PrequantizedWeight]:
        """The operand set by :meth:`set_prequantized_weight`, until it is dropped."""
        return self.__dict__.get("_pre_w")

    def resolve_backend(self, device: Optional[torch.device] = None) -> Optional[Fp8Backend]:
        """This layer's FP8 backend for inputs on ``device`` (picked on first use, then kept).

        Without ``device``: pick it now where the weight's device decides it (a GPU weight, or
        the emulated backend on a real device), else None (a CPU weight under "auto": the model
        may move). Resolved lazily in a compiled forward, dynamo guards on it: the second
        forward recompiled (3 graphs, ~6 s more warm-up on an H100 Llama)."""
        if device is None:
            dev = self.weight.device
            if dev.type != "cuda" and (self.fp8_config.backend != "emulated" or
                                       dev.type == "meta"):
                return None
            device = dev
        if self._fp8_backend is None or self._backend_device != device:
            self._fp8_backend = get_backend(self.fp8_config.backend, device)
            self._backend_device = device
            if self.fp8_config.recipe in GRANULAR_RECIPES:  # eagerly, not in a traced forward
                prepare_granular(self._fp8_backend, self.fp8_config.recipe, device)
        return self._fp8_backend

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / to_empty(): the weight may now sit on the device that decides.
        out = super()._apply(fn, *args, **kwargs)
        self.resolve_backend()
        return out

    def _cast_fn(self):
        """The backend's cast, or under ``torch.compile`` with ``compiled_casts="inductor"``
        the reference torch-op cast, which inductor fuses into the producing kernels."""
        backend = self._fp8_backend
        if self.fp8_config.compiled_casts == "inductor" and _compiling():
            return functools.partial(Fp8Backend.quantize, backend)
        return backend.quantize

    def _quantize(self, role: str, x: torch.Tensor, dtype: torch.dtype,
                  with_transpose: bool, replay_scale: Optional[torch.Tensor] = None) -> Fp8Tensor:
        """Every FP8 cast of this layer (tests spy on it). With current scaling the result's
        ``.amax`` is the amax its scale came from (``scale_from_amax`` of it is the very scale,
        bit for bit); delayed scaling leaves it None. ``replay_scale`` (delayed scaling,
        recomputation): the scale a forward used, to cast with again without recording."""
        cfg, cast = self.fp8_config, self._cast_fn()
        if not self._delayed:
            group = self._amax_groups.get(role)
            if group is not None:  # a shard: scale from the whole tensor's amax
                a = amax(x)
                torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
                scale = scale_from_amax(a, dtype, cfg.margin, cfg.power_of_2_scale)
                q, _ = cast(x, dtype, scale=scale, with_transpose=with_transpose)
            else:
                q, a = cast(x, dtype, margin=cfg.margin, power_of_2=cfg.power_of_2_scale,
                            with_transpose=with_transpose)
            q.amax = a
            return q
        i = _ROLES.index(role)
        state = self._delayed[role].bind(self.fp8_amax_history[i], self.fp8_scale[i])
        if replay_scale is not None or (role == "input" and recomputing()):
            # Activation checkpointing: cast with the scale the forward used (the history has
            # moved on since), and record nothing: the forward did.
            scale = replay_scale if replay_scale is not None else self._replay_log.replay(role)
            if scale is not None:
                q, _ = cast(x, dtype, scale=scale, with_transpose=with_transpose)
                return q
        if not state.initialized:
            state.seed(state.reduce(amax(x)))
        scale = state.scale.clone()
        q, a = cast(x, dtype, scale=scale, with_transpose=with_transpose)
        state.record(state.reduce(a))
        if role != "grad":
            self._replay_log.remember(role, scale)
        return q

    def _input_fp8(self, x2d: torch.Tensor, with_transpose: bool) -> Fp8Tensor:
        """The input operand: the bytes of an FP8 carrier as they are (e.g. the sequence-
        parallel FP8 all-gather's output: no amax, no cast), else a cast of ``x2d``."""
        if isinstance(x2d, Fp8WeightTensor):
            why = fp8_operand_mismatch(x2d, "input", self.fp8_config.fwd_dtype,
                                       bool(self._delayed))
            if why is None:
                return fp8_input_operand(x2d, with_transpose)
            _state.warn_once(("fp8-linear-prequantized-input", why),
                             f"fp8boost: Fp8Linear dequantizes and re-quantizes an FP8 input: {why}")
            x2d = dequantize_weight(x2d)
        src = None if _compiling() else self.__dict__.get("_share_src")
        if src is None:
            return self._quantize("input", x2d, self.fp8_config.fwd_dtype,
                                  with_transpose=with_transpose)
        cfg = self.fp8_config
        key = (cfg.fwd_dtype, cfg.margin, cfg.power_of_2_scale, self._fp8_backend.name,
               self._amax_groups.get("input"), tuple(x2d.shape), x2d.stride())
        return shared_cast.cast_once(src, key, with_transpose, lambda: self._quantize(
            "input", x2d, cfg.fwd_dtype, with_transpose=with_transpose))

    def _prequantized_ok(self, w: torch.Tensor) -> bool:
        """Whether ``w`` is an :class:`Fp8WeightTensor` whose bytes are the weight operand this
        layer would make (forward format, its shape, tensorwise); else re-quantized, warned."""
        if not isinstance(w, Fp8WeightTensor):
            return False
        why = fp8_operand_mismatch(w, "weight", self.fp8_config.fwd_dtype, bool(self._delayed),
                                   (self.out_features, self.in_features))
        if why is not None:
            _state.warn_once(("fp8-linear-prequantized", why),
                             f"fp8boost: Fp8Linear dequantizes and re-quantizes an FP8 weight: "
                             f"{why}")
            return False
        return True

    def set_prequantized_weight(self, data_fp8: Optional[torch.Tensor],
                                inv_scale: Optional[torch.Tensor] = None) -> None:
        """Use ``data_fp8`` / ``inv_scale`` as the FP8 weight operand while the weight is unchanged.

        For producers that already hold this layer's weight cast (ZeRO's FP8 all-gather): the
        following forwards skip the weight's amax and cast. ``None`` drops the operand now.
        Validity and ``torch.compile``: :class:`~fp8boost.fp8.prequantized.PrequantizedWeight`.

        Args:
            data_fp8: ``[out_features, in_features]`` contiguous tensor in the forward FP8
                format (e4m3); not copied, so the caller must not change it while it is valid.
            inv_scale: FP32 0-dim tensor, ``data_fp8.float() * inv_scale`` is the weight; for a
                blockwise layer FP32 ``[ceil(N/b), ceil(K/b)]``, one per ``b`` x ``b`` block.

        Raises:
            ValueError: neither tensorwise nor blockwise (delayed: the weight scale follows the
                layer's amax history; rowwise: the dgrad operand needs other scales), wrong
                format or shape.
        """
        if data_fp8 is None:
            self._pre_w = None
            return
        pre = PrequantizedWeight.of(self.weight, data_fp8, inv_scale, self.fp8_config,
                                    (self.out_features, self.in_features))
        self._w_cache = None  # an older cast of the same weight would only pin memory
        self._pre_w = pre

    def _recast_weight_t(self, weight: torch.Tensor, w_amax: torch.Tensor) -> Fp8Tensor:
        """Backward: W^T cast with the scale of the forward's cast (same amax, same bytes)."""
        cfg = self.fp8_config
        scale = scale_from_amax(w_amax, cfg.fwd_dtype, cfg.margin, cfg.power_of_2_scale)
        q, _ = self._cast_fn()(weight.detach().t(), cfg.fwd_dtype, scale=scale,
                               with_transpose=False)
        # K-major, as the GEMMs take it (under compile the copy fuses into the cast)
        return Fp8Tensor(q.data.contiguous(), q.inv_scale)

    def _weight_fp8(self, with_transpose: bool, recompute: bool = False) -> Fp8Tensor:
        """The FP8 weight operand, with its K-major transpose when ``with_transpose``.

        ``recompute``: backward wants the transpose but may re-cast it itself; then it comes
        without it where possible (current scaling, no cache entry, a plain Parameter)."""
        w = self.weight
        if isinstance(w, Fp8WeightTensor):
            self._w_cache = None  # a cast of an earlier plain weight would only pin memory
            if self._prequantized_ok(w):
                return fp8_weight_operand(w, with_transpose)  # no cast, no cache
            return self._quantize("weight", dequantize_weight(w), self.fp8_config.fwd_dtype,
                                  with_transpose=with_transpose or recompute)
        pre = self.__dict__.get("_pre_w")  # from set_prequantized_weight
        if pre is not None:
            # Under torch.compile the key cannot be read without a graph break: a set operand
            # is trusted (its producer re-sets it after each step; eager runs check it).
            why = None if _compiling() or pre.matches(w) else \
                "the weight was written or an optimizer step ran since it was set"
            if why is None:
                return pre.operand(with_transpose or recompute)
            _state.warn_once(("fp8-linear-prequantized-dropped", why),
                             f"fp8boost: Fp8Linear casts its weight itself instead of using the "
                             f"prequantized FP8 weight: {why}")
            self._pre_w = None
        if self._delayed and recomputing():  # repeat what the forward cast with (or used)
            item = self._replay_log.replay("weight")
            if isinstance(item, Fp8Tensor):
                return item
            if item is not None:
                return self._quantize("weight", w.detach(), self.fp8_config.fwd_dtype,
                                      with_transpose=with_transpose or recompute,
                                      replay_scale=item)
        use_cache = self.fp8_config.cache_weight_cast and not _compiling()
        keep = use_cache and not w.requires_grad and self.keep_frozen_cast  # frozen: kept
        if use_cache:
            key = self._weight_cache_key()
            if self._w_cache is not None and self._w_cache[0] == key:
                if self._w_cache[1] is not None:
                    if self._delayed:
                        self._replay_log.remember("weight", self._w_cache[1])
                    return self._w_cache[1]  # cached casts always carry the transpose
                # A second forward (micro-batches, accumulation): the kept cast now pays for
                # its memory. A recomputation is none: its backward follows at once.
                keep = keep or not recomputing()
        # Always emit the transpose when caching: the next backward will want it.
        wq = self._quantize("weight", w.detach(), self.fp8_config.fwd_dtype,
                            with_transpose=with_transpose or keep)
        self._w_cache = (key, wq if keep else None) if use_cache else None
        if recompute and wq.data_t is None and wq.amax is None:  # delayed: no re-cast scale
            wq = Fp8Tensor(wq.data, wq.inv_scale, transpose_fp8(wq.data))
        return wq

    def _weight_cache_key(self) -> tuple:
        w = self.weight  # no optimizer steps a frozen weight: the step epoch is left out
        return (w.data_ptr(), w._version, _state.step_epoch() if w.requires_grad else None,
                w.dtype, w.device, self._fp8_backend.name)

    def _cached_weight_t(self) -> Optional[Fp8Tensor]:
        """The cached weight cast (with its transpose) if it is still valid, else None."""
        entry = self._w_cache
        if entry is None or entry[1] is None or isinstance(self.weight, Fp8WeightTensor):
            return None
        return entry[1] if entry[0] == self._weight_cache_key() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expected last dim {self.in_features}, got {tuple(x.shape)}")
        self.resolve_backend(x.device)
        x2d = x.reshape(-1, self.in_features)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.fp8_config.recipe in GRANULAR_RECIPES:  # rowwise/blockwise: linear_granular.py
            y = granular_forward(x2d, self.weight, bias, self.fp8_config, self._fp8_backend,
                                 self._frozen_granular_operands(), self._row_groups)
        else:
            y = self._tensorwise_forward(x, x2d, bias)
        # A 2-D input gets the GEMM output itself, not a view of it: FSDP2 warns about modules
        # returning views (an in-place op on one would drop its pre-backward hook).
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _tensorwise_forward(self, x, x2d, bias) -> torch.Tensor:
        if not _compiling():  # whether a backward (perhaps a recomputation) follows: read here
            self._replay_log.active = torch.is_grad_enabled()
        if _compiling() or not self.fp8_config.share_input_casts or self._delayed \
                or isinstance(x, Fp8WeightTensor):
            return Fp8LinearFunction.apply(x2d, self.weight, bias, self)
        self._share_src = x  # eager tensorwise layers reading one tensor share its cast
        try:
            return Fp8LinearFunction.apply(x2d, self.weight, bias, self)
        finally:
            self._share_src = None

    def _frozen_granular_operands(self) -> Optional[tuple]:
        """The weight's blockwise operands set by :meth:`set_prequantized_weight` while valid,
        else a frozen weight's rowwise/blockwise FP8 operands, made once and kept (eager)."""
        pre = self.__dict__.get("_pre_w")
        if pre is not None and pre.block:
            if _compiling() or pre.matches(self.weight):  # as in _weight_fp8
                return prequantized_block_operands(pre)
            _state.warn_once(("fp8-linear-prequantized-dropped", "blockwise"),
                             "fp8boost: Fp8Linear casts its blockwise weight itself instead of "
                             "using the prequantized FP8 weight: the weight was written or an "
                             "optimizer step ran since it was set")
            self._pre_w = None
        w = self.weight
        if (_compiling() or w.requires_grad or not self.keep_frozen_cast
                or not self.fp8_config.cache_weight_cast or isinstance(w, Fp8WeightTensor)):
            return None
        key = self._weight_cache_key()
        if self._w_cache is None or self._w_cache[0] != key:
            self._w_cache = (key, weight_operands(w, self.fp8_config, self._row_groups))
        return self._w_cache[1]

    def extra_repr(self) -> str:
        c = self.fp8_config
        extra = (f", block_size={c.block_size}" if c.recipe == "blockwise" else "") + \
            (", wgrad_high_precision=True" if c.wgrad_high_precision else "")
        return (f"{super().extra_repr()}, recipe={c.recipe}{extra}, format={c.fp8_format}, "
                f"backend={c.backend}")
