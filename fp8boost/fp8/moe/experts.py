"""``Fp8Experts``: a transformers fused-expert module whose expert GEMMs run in FP8.

It holds the very same ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` Parameters,
under the same names, so ``state_dict`` keys and shapes, ``save_pretrained`` /
``from_pretrained`` and optimizers built before the conversion are unaffected. The HF module it
replaces is kept aside (not a submodule: no duplicate state) for its activation
(``_apply_gate`` / ``act_fn``), for any other attribute the model reads (``num_experts``,
``config``, ...) and for :meth:`Fp8Experts.to_hf` (``convert_from_fp8``).

Forward, as HF's experts: the (token, choice) pairs are sorted by expert once
(:func:`~fp8boost.fp8.moe.routing.route`), then one grouped FP8 GEMM for gate_up, the model's
own activation in high precision, one grouped FP8 GEMM for down, and the routing-weighted sum
over each token's k choices (in the product's dtype, then cast to the input's, as
transformers' ``grouped_mm`` experts do). Expert ids outside ``[0, E)`` (HF's expert-parallel
sentinel) contribute nothing, as in HF's loop.

``torch.compile`` (e.g. ``fp8boost.compile.compile_blocks``): the whole forward, routing,
both grouped GEMMs with their backward, and the combine, traces into the block's graph with
no graph break and no host sync. Shapes depend on the token count alone (the routing pads to a
bound, :mod:`~fp8boost.fp8.moe.routing`), so new routings reuse the graph; a new token count
recompiles once (dynamo then marks it dynamic). The options (backend probe, one-time logs,
which take a lock dynamo cannot trace) are resolved at construction and on ``.to()``, never in
a traced forward (:meth:`Fp8Experts.resolve_options`). Measured on CPU (tests/fp8/
test_moe_compile.py): ``aot_eager`` is bit-identical to eager; ``inductor`` within an FP32 ulp.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from fp8boost import _state

from ..config import Fp8Config
from .choice import choose
from .detect import ExpertSpec
from .function import GroupedOptions, grouped_linear, grouped_mm_hp
from .gemm import resolve_backend
from .quantize import ScaleOptions
from .routing import route

_LOG = logging.getLogger("fp8boost.fp8")


def _device_key(device: torch.device) -> torch.device:
    """``device`` with its index filled in: ``cuda`` and ``cuda:0`` are one cache entry.

    Tensors always report an indexed CUDA device, callers often pass a bare ``cuda``; keyed
    apart, the forward would find a cache miss and resolve the options again, which under
    ``torch.compile`` constructs :class:`ScaleOptions` inside the trace (dynamo cannot: a
    graph break, an error with ``fullgraph=True``).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def scale_options(config: Fp8Config) -> ScaleOptions:
    """The experts' scaling from a run's config: rowwise, e4m3 (see :class:`Fp8Experts`)."""
    if config.recipe != "rowwise":
        _state.log_once(_LOG, f"moe-rowwise-{config.recipe}",
                        f"fp8boost: FP8 experts scale rowwise (per token, per expert row) under "
                        f"recipe={config.recipe!r} too: the grouped FP8 GEMM takes row scales "
                        "only", level=logging.INFO)
    return ScaleOptions(config.fwd_dtype, torch.float8_e4m3fn, config.margin,
                        config.power_of_2_scale)


class Fp8Experts(nn.Module):
    """FP8 grouped-GEMM replacement of an HF fused-expert module (same Parameters).

    Scales are rowwise whatever the recipe (the grouped FP8 GEMM takes row scales only): one
    per token row for activations and gradients, one per expert row for weights, one per
    (expert, column) along the tokens for the weight gradient; e4m3 throughout (the kernel
    takes no e5m2); ``margin`` and ``power_of_2_scale`` as configured.

    Example:
        >>> import torch
        >>> from transformers import MixtralConfig
        >>> from transformers.models.mixtral.modeling_mixtral import MixtralExperts
        >>> from fp8boost.fp8.moe.detect import find_expert_spec
        >>> hf = MixtralExperts(MixtralConfig(hidden_size=64, intermediate_size=32,
        ...                                   num_local_experts=4))
        >>> _ = [torch.nn.init.normal_(p, std=0.02) for p in hf.parameters()]
        >>> fp8 = Fp8Experts(hf, find_expert_spec(hf), Fp8Config(backend="emulated"))
        >>> fp8.gate_up_proj is hf.gate_up_proj
        True
        >>> idx, w = torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
        >>> fp8(torch.randn(5, 64), idx, w).shape
        torch.Size([5, 64])
    """

    def __init__(self, hf_module: nn.Module, spec: ExpertSpec, config: Fp8Config):
        super().__init__()
        if not isinstance(config, Fp8Config):
            raise TypeError(f"config must be an Fp8Config, got {type(config).__name__}")
        self.spec = spec
        self.fp8_config = config
        self.register_parameter(spec.gate_up, getattr(hf_module, spec.gate_up))
        self.register_parameter(spec.down, getattr(hf_module, spec.down))
        object.__setattr__(self, "hf_module", hf_module)  # not a submodule: no duplicate state
        act = getattr(hf_module, "act_fn", None)
        if isinstance(act, nn.Module):
            self.act_fn = act
        self.train(hf_module.training)
        self._grouped_options: Optional[tuple[torch.device, GroupedOptions]] = None
        self.precision = "fp8"
        """What the experts train in on their device: ``fp8``, ``fp8_wgrad_hp`` or ``bf16``
        (the HF module's own forward), from :func:`fp8boost.fp8.moe.choice.choose`."""
        self.resolve_options()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            hf = self.__dict__.get("hf_module")
            if hf is None or name.startswith("__"):
                raise
            return getattr(hf, name)

    def to_hf(self) -> nn.Module:
        """The HF module back, holding this module's current Parameters (the same objects)."""
        hf = self.hf_module
        for name in (self.spec.gate_up, self.spec.down):
            setattr(hf, name, getattr(self, name))
        hf.train(self.training)
        return hf

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        apply_gate = getattr(self.hf_module, "_apply_gate", None)
        if apply_gate is not None:
            return apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # HF's own experts loop: act(gate) * up
        return self.hf_module.act_fn(gate) * up

    def resolve_options(self, device: Optional[torch.device] = None
                        ) -> Optional[GroupedOptions]:
        """The grouped GEMMs' options for inputs on ``device``, resolved once, then kept.

        Without ``device``: resolve now where the weights' device decides the backend (CUDA
        weights, or the emulated backend off the meta device), else None (CPU weights under
        ``auto``: the model may still move). Called at construction and on every ``.to()`` /
        ``.cuda()``, so that a compiled forward finds the options already there: resolved in a
        traced forward, the backend probe and the one-time log (a lock) break the graph, and
        storing the result changes an attribute dynamo guards on (one recompile). That is
        left only to CPU weights under ``auto`` (they run emulated, with a warning): their
        first forward resolves, and compiled, breaks once at that warning.
        """
        if device is None:
            dev = getattr(self, self.spec.gate_up).device
            if dev.type == "meta" or (dev.type != "cuda" and
                                      self.fp8_config.backend != "emulated"):
                return None
            device = dev
        device = _device_key(device)
        cached = self._grouped_options
        if cached is None or cached[0] != device:
            backend = resolve_backend(self.fp8_config, device)
            self.precision = choose(self, device, backend, forward_with)
            self._grouped_options = cached = (device, _options(self.fp8_config, backend,
                                                                self.precision))
        return cached[1]

    def options(self, device: torch.device) -> GroupedOptions:
        """The grouped GEMMs' options on ``device`` (backend resolved once per device)."""
        return self.resolve_options(torch.device(device))

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / to_empty(): the weights may now sit on the device that decides.
        out = super()._apply(fn, *args, **kwargs)
        self.resolve_options()
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        opts = self.options(hidden_states.device)
        # precision "bf16": FP8 measured slower at this shape (fp8.moe.choice)
        return self._routed_forward(hidden_states, top_k_index, top_k_weights,
                                    None if self.precision == "bf16" else opts)

    def _routed_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor,
                        opts: Optional[GroupedOptions]) -> torch.Tensor:
        """The forward over the routing's row layout: grouped FP8 GEMMs under ``opts``, or
        (None) BF16 ``torch._grouped_mm``, transformers' ``grouped_mm`` experts' GEMM, on the
        module's current Parameters (whatever a plugin swapped in)."""
        spec = self.spec
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, spec.hidden)
        t, k = x.shape[0], top_k_index.shape[-1]
        if top_k_index.numel() != t * k or top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"Fp8Experts: top_k_index {tuple(top_k_index.shape)} and "
                             f"top_k_weights {tuple(top_k_weights.shape)} must both be "
                             f"[tokens={t}, k] for hidden_states {tuple(shape)}")
        ids = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1, 1)
        valid = (ids >= 0) & (ids < spec.num_experts)
        weights = torch.where(valid.unsqueeze(1), weights, 0)
        r = route(torch.where(valid, ids, 0), spec.num_experts)
        rows = x.new_zeros(r.rows, spec.hidden).index_copy(0, r.pos, x.repeat_interleave(k, 0))
        if opts is None:
            h = grouped_mm_hp(rows, getattr(self, spec.gate_up), r)
            h = grouped_mm_hp(self._gate(h), getattr(self, spec.down), r)
        else:
            h = grouped_linear(rows, getattr(self, spec.gate_up), r, opts)
            h = grouped_linear(self._gate(h), getattr(self, spec.down), r, opts)
        out = (h[r.pos] * weights).view(t, k, spec.hidden).sum(dim=1)
        return out.to(hidden_states.dtype).view(shape)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"experts={s.num_experts}, hidden={s.hidden}, intermediate={s.intermediate}, "
                f"recipe=rowwise, precision={self.precision}, "
                f"backend={self.fp8_config.backend}, "
                f"from={type(self.hf_module).__name__}")


def _options(cfg: Fp8Config, backend: str, precision: str) -> GroupedOptions:
    return GroupedOptions(scale_options(cfg), backend, cfg.fast_accum_fprop,
                          cfg.fast_accum_dgrad, cfg.fast_accum_wgrad, precision == "fp8")


def forward_with(experts: Fp8Experts, x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, precision: str,
                 device: torch.device) -> torch.Tensor:
    """``experts``' forward in ``precision`` (one of ``fp8.moe.choice.PRECISIONS``), whatever
    the module chose: what the precision probe times."""
    backend = resolve_backend(experts.fp8_config, device)
    opts = None if precision == "bf16" else _options(experts.fp8_config, backend, precision)
    return experts._routed_forward(x, top_k_index, top_k_weights, opts)


def is_fp8_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an :class:`Fp8Experts` (FP8 grouped-GEMM experts).

    Example:
        >>> is_fp8_experts(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module, Fp8Experts)


def fp8_experts(model: nn.Module) -> list[Fp8Experts]:
    """Every :class:`Fp8Experts` of ``model``, in ``modules()`` order."""
    return [m for m in model.modules() if isinstance(m, Fp8Experts)]


def hf_experts_of(module: nn.Module) -> Optional[nn.Module]:
    """The HF module an :class:`Fp8Experts` replaced (None for any other module)."""
    return module.hf_module if isinstance(module, Fp8Experts) else None
