"""Fp8Linear: an ``nn.Linear`` whose three GEMMs run in FP8.

The layer is three parts, each in its own file:

* the GEMMs: :class:`~fp8boost.fp8.matmul.Fp8Matmul`, a stateless autograd function
  (tensorwise and delayed), or :func:`~fp8boost.fp8.granular.granular_linear` (rowwise and
  blockwise; ``linear_granular.py`` says what they do not use);
* the recipe's strategy, chosen at construction: :mod:`fp8boost.fp8.casts` (how each operand
  is scaled; delayed scaling's amax history lives in this layer's buffers, so checkpoints keep
  it);
* the operand source the layer owns: :class:`~fp8boost.fp8.operands.OperandSource` (the
  cached weight cast, FSDP's FP8 carrier, ZeRO's pre-quantized bytes, an FP8 input).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .backend_base import Fp8Backend
from .backends import get_backend
from .casts import ROLES, TensorwiseCasts, make_casts
from .config import Fp8Config
from .linear_granular import granular_forward
from .matmul import Fp8Matmul
from .operands import OperandSource
from .prequantized import Fp8WeightTensor, PrequantizedWeight
from .recompute import compiling as _compiling


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
            mod.operands.invalidate()


def weights_loaded(model: nn.Module) -> None:
    """Tell every FP8 layer of ``model`` that a loader bypassing ``load_state_dict`` (a sharded
    reader copying into parameters) wrote its weights and buffers in place: as after
    ``load_state_dict``, cached casts are dropped and loaded amax histories kept (exact resume)."""
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            mod.reset_after_load([bool(h.any()) for h in mod.fp8_amax_history]
                                if mod.casts.delayed else None)


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

    source_cls = OperandSource
    """The class of :attr:`operands` (``Fp8Conv1D``'s transposed weight has its own)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, *, config: Optional[Fp8Config] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(config if config is not None else Fp8Config())
        self.resolve_backend()

    def _init_fp8(self, config: Fp8Config) -> None:
        if not isinstance(config, Fp8Config):
            raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
        self.fp8_config = config
        self.casts: TensorwiseCasts = make_casts(config)
        """The recipe's strategy (``fp8/casts.py``), chosen once here."""
        self.operands: OperandSource = self.source_cls(
            self.casts, (self.out_features, self.in_features))
        """Where the FP8 operands come from (``fp8/operands.py``)."""
        self._backend_device: Optional[torch.device] = None
        if self.casts.delayed:
            # Buffers, so the history moves with .to() and is saved in state_dict (exact resume).
            dev = self.weight.device if self.weight.device.type != "meta" else None
            self.register_buffer("fp8_amax_history",
                                 torch.zeros(3, config.amax_history_len, device=dev))
            self.register_buffer("fp8_scale", torch.ones(3, device=dev))
        self.bind_delayed_buffers()

    def bind_delayed_buffers(self) -> None:
        """Delayed scaling: hand the strategy the current amax buffers (``.to()`` and
        ``from_linear`` replace them; the same pattern as ``DelayedScalingState.bind``)."""
        if self.casts.delayed:
            self.casts.bind(self.fp8_amax_history, self.fp8_scale)

    def delayed_buffers_on(self, device: torch.device) -> None:
        """Delayed scaling: fresh (zero history, unit scale) amax buffers on ``device``, for a
        layer built on the meta device around existing Parameters (``from_linear``,
        ``Fp8Conv1D.from_conv1d``); other recipes keep no buffers."""
        if self.casts.delayed:
            self.fp8_amax_history = torch.zeros_like(self.fp8_amax_history, device=device)
            self.fp8_scale = torch.ones_like(self.fp8_scale, device=device)
            self.bind_delayed_buffers()

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
        new.delayed_buffers_on(linear.weight.device)
        new.train(linear.training)
        new.resolve_backend()
        return new

    @property
    def fp8_backend(self) -> Optional[Fp8Backend]:
        """The resolved backend (None until :meth:`resolve_backend` picks one)."""
        return self.casts.backend

    @property
    def keep_frozen_cast(self) -> bool:
        """Whether a frozen weight's cast is kept (False: FSDP frees unsharded weights)."""
        return self.operands.keep_frozen_cast

    @keep_frozen_cast.setter
    def keep_frozen_cast(self, keep: bool) -> None:
        self.operands.keep_frozen_cast = keep

    def set_amax_reduce_fn(self, fn) -> None:
        """Distribution hook for delayed scaling: ``fn(amax)`` reduces a fresh amax in place
        (held by the recipe's strategy, ``self.casts``, which calls it)."""
        self.casts.set_amax_reduce_fn(fn)

    def set_amax_groups(self, groups: dict[str, object]) -> None:
        """Tensor parallelism hook: ``{role: process_group}`` for operands split over a group.

        Tensorwise: an operand whose rows or columns are split over ``group`` (``"input"``,
        ``"weight"`` or ``"grad"``) is scaled from the whole tensor's amax, all-reduced (MAX),
        as one process would cast it (as Transformer Engine does). Delayed scaling reduces
        through :meth:`set_amax_reduce_fn`. Rowwise reduces only the per-row amaxes of the
        operands whose rows span shards; blockwise reduces nothing (shard-local tiles and
        blocks): see :func:`~fp8boost.fp8.linear_granular.row_groups`.
        """
        bad = set(groups) - set(ROLES)
        if bad:
            raise ValueError(f"unknown FP8 operand role(s) {sorted(bad)}; use {ROLES}")
        self.casts.set_amax_groups(groups)
        self.operands.invalidate()

    def amax_group(self, role: str):
        """The process group ``role``'s amax is all-reduced over (see :meth:`set_amax_groups`)."""
        return self.casts.amax_groups.get(role)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        loaded = self.casts.delayed and prefix + "fp8_amax_history" in state_dict
        self.reset_after_load([True] * len(ROLES) if loaded else None)

    def reset_after_load(self, initialized: Optional[list[bool]]) -> None:
        """After a load: cached casts and a prequantized operand describe the old weight;
        ``initialized`` (delayed scaling, per role): whether its history now holds a loaded one
        (kept, not re-seeded from the next input). None leaves the states as they are."""
        self.operands.loaded()
        self.casts.loaded(initialized)

    @property
    def prequantized_weight(self) -> Optional[PrequantizedWeight]:
        """The operand set by :meth:`set_prequantized_weight`, until it is dropped."""
        return self.operands.prequantized

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
        if self.casts.backend is None or self._backend_device != device:
            self.use_backend(get_backend(self.fp8_config.backend, device), device)
        return self.casts.backend

    def use_backend(self, backend: Fp8Backend, device: torch.device) -> None:
        """Run this layer's casts and GEMMs with ``backend`` for inputs on ``device`` (tests and
        benches inject a counting or forced backend here)."""
        self.casts.use_backend(backend, device)
        self._backend_device = device

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / to_empty(): the weight may now sit on the device that decides.
        out = super()._apply(fn, *args, **kwargs)
        self.bind_delayed_buffers()
        self.resolve_backend()
        return out

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
        self.operands.set_prequantized(self.weight, data_fp8, inv_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Fp8Linear expected last dim {self.in_features}, got {tuple(x.shape)}")
        self.resolve_backend(x.device)
        x2d = x.reshape(-1, self.in_features)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        self.bind_delayed_buffers()  # the buffers may have been replaced since the last forward
        y = self._gemms(x, x2d, bias)
        # A 2-D input gets the GEMM output itself, not a view of it: FSDP2 warns about modules
        # returning views (an in-place op on one would drop its pre-backward hook).
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _gemms(self, x: torch.Tensor, x2d: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``[M, K] -> [M, N]``: the granular recipes' function, else :class:`Fp8Matmul`
        (eager layers reading one tensor share its input cast, every recipe but delayed:
        ``share_input_casts``)."""
        casts, ops, weight = self.casts, self.operands, self.weight
        if casts.granular:
            frozen = ops.frozen_granular_operands(weight, casts.row_groups)
            return granular_forward(x2d, weight, bias, self.fp8_config, casts.backend, frozen,
                                    casts.row_groups, share_src=x)
        casts.begin_forward()
        grad = torch.is_grad_enabled()
        if (_compiling() or not self.fp8_config.share_input_casts or casts.delayed
                or isinstance(x, Fp8WeightTensor)):
            return Fp8Matmul.apply(x2d, weight, bias, ops, grad)
        with ops.sharing_input(x):
            return Fp8Matmul.apply(x2d, weight, bias, ops, grad)

    def extra_repr(self) -> str:
        c = self.fp8_config
        extra = (f", block_size={c.block_size}" if c.recipe == "blockwise" else "") + \
            (", wgrad_high_precision=True" if c.wgrad_high_precision else "")
        return (f"{super().extra_repr()}, recipe={c.recipe}{extra}, format={c.fp8_format}, "
                f"backend={c.backend}")
