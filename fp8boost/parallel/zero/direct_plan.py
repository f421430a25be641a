"""ZeRO's FP8 parameter all-gather feeding ``Fp8Linear``'s FP8 GEMM directly.

Without this plan, ZeRO (stage 1/2, ``fp8_communication``) gathers an updated weight as FP8 with
one scale per rank, decodes it to the working BF16 parameter, and the layer then takes that
parameter's amax and casts it to FP8 again: two roundings and an extra amax + cast per weight
per step. With it, for every weight consumed by a tensorwise ``Fp8Linear``:

1. each rank takes the amax of its FP32 master chunk; ONE all-reduce(MAX) of the vector of all
   these amaxes gives every weight its global amax;
2. each chunk is cast to e4m3 with its weight's single scale (the layer's own rule:
   ``scale_from_amax`` with the layer's margin and power-of-two setting), so the gathered bytes
   are bit-identical to one cast of the full master weight;
3. the bytes travel as plain uint8, one all-gather per weight, in place: each rank casts into
   its slot of the weight's persistent buffer, whose e4m3 ``[N, K]`` view is handed to the
   layer (:meth:`Fp8Linear.set_prequantized_weight`) as its weight operand, with no copy;
4. the working parameter is still decoded from the same bytes (checkpoints, other consumers and
   the optimizer rely on it), so no extra collective is needed.

The layer keys a handed-over operand on the weight's storage and version and on the process-wide
optimizer step count (``_state.step_epoch``), so that any step drops it. Any step means also
another optimizer's: a second model trained in the same process (an uninterrupted run beside a
resumed one, a teacher, an EMA copy) would make the layer cast its FP8-decoded working weight
itself, whose bytes and scale differ from the cast of the FP32 master, and the two runs would
drift apart. So each direct layer carries a forward pre-hook that hands the same bytes over again
when steps were counted since the hand-over but the weight itself was not written (same storage,
same version): the operand then lives exactly as long as the weight it describes.

Which weights qualify reuses the FSDP rule (:func:`fp8boost.parallel.fsdp.gather_plan.choose_plan`);
the others keep the per-rank-scale FP8 gather, with the reason logged once. Blockwise weights
whose ZeRO chunks hold whole 128-row blocks take the block variant (:mod:`.direct_blocks`):
bytes and block scales cast per chunk, no amax all-reduce.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost import _state
from fp8boost.fp8.linear import Fp8Linear
from fp8boost.fp8.recompute import compiling
from fp8boost.fp8.record import recorded_linear
from fp8boost.fp8.scaling import aligned_scalars, amax, scale_from_amax

from fp8boost.parallel.comm._utils import resolve_cast_impl
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.comm.wire import cast_rows_into, decode_rows_into

from .direct_blocks import BlockWeight

logger = logging.getLogger("fp8boost.parallel.zero")

__all__ = ["DirectWeight", "ZeroDirectPlan", "weight_owners", "build_direct_plan"]


@dataclass
class DirectWeight:
    """One weight on the direct path: its parameter index, consumer layer and byte buffer."""

    index: int
    layer: Fp8Linear
    plan: object  # fsdp.gather_plan.GatherPlan (direct=True): FP8 dtype and the layer's scale rule
    # persistent uint8 [world * chunk]: the weight's all-gather output, allocated on first use
    wire: Optional[torch.Tensor] = None
    buffer: Optional[torch.Tensor] = None  # FP8 [N, K]: a view of ``wire`` (padding dropped)
    inv_scale: Optional[torch.Tensor] = None  # FP32 0-dim: ``buffer.float() * inv_scale`` = weight
    # (weight data_ptr, weight version, step epoch) when the operand was last handed to the
    # layer; None: nothing handed over, or the weight was written since (the operand is stale).
    handed: Optional[tuple[int, int, int]] = None


def weight_owners(model: nn.Module) -> dict[int, list[nn.Module]]:
    """``{id(parameter): [modules holding it directly]}``; more than one owner means tied."""
    owners: dict[int, list[nn.Module]] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(mod)
    return owners


def _choose(config: Fp8CommConfig, mods: list[nn.Module], shape: torch.Size,
            world: Optional[int] = None):
    """The FSDP plan rule plus ZeRO's extra conditions; returns a ``GatherPlan``."""
    # Imported here: the fsdp package pulls in FSDP2, which ZeRO users may never need.
    from fp8boost.parallel.fsdp.gather_plan import GatherPlan, choose_plan
    layer = mods[0] if len(mods) == 1 else None
    why = None
    if not config.enabled:
        why = "Fp8CommConfig.enabled is False (parameters are not gathered in FP8)"
    elif recorded_linear(layer) and layer.fp8_config.fwd_dtype != torch.float8_e4m3fn:
        why = f"the layer's forward FP8 format {layer.fp8_config.fwd_dtype} is not e4m3"
    elif recorded_linear(layer) and layer.amax_group("weight") is not None:
        why = "the weight is tensor-parallel: its scale comes from an amax over the tp group"
    if why is not None:
        return GatherPlan(False, config.param_dtype, 0, config.power_of_2_wire_scale, why)
    module = layer if layer is not None else (mods[0] if mods else None)
    plan = choose_plan(config, len(mods) > 1, module, shape, world)
    if plan.block and not world:
        # choose_plan leaves the shard check to a known world; without one the chunks' rows
        # are unknown, so the block variant cannot be laid out.
        why = ("blockwise weight, but the ZeRO world size was not given (DirectGather(..., "
               "world=...)): whether its chunks hold whole blocks is unknown")
        return GatherPlan(False, config.param_dtype, 0, config.power_of_2_wire_scale, why)
    return plan


def build_direct_plan(params: list[torch.Tensor], shapes: list[torch.Size], fp8_mask: list[bool],
                      owners: dict[int, list[nn.Module]],
                      config: Optional[Fp8CommConfig],
                      world: Optional[int] = None) -> "ZeroDirectPlan":
    """Decide, for every FP8-gathered parameter, whether its bytes feed its layer directly.

    Args:
        params: the optimizer's working parameters, in index order.
        shapes: each parameter's full shape.
        fp8_mask: which parameters are all-gathered in FP8 at all.
        owners: :func:`weight_owners` of the model.
        config: the ZeRO optimizer's ``Fp8CommConfig`` (None: the default one).
        world: the ZeRO ranks (blockwise weights qualify when their chunks hold whole blocks;
            None: none do, the reason logged once).
    """
    cfg = config if config is not None else Fp8CommConfig()
    weights, blocks = [], []
    for i, (p, shape, fp8) in enumerate(zip(params, shapes, fp8_mask)):
        if not fp8:
            continue
        mods = [m for m in owners.get(id(p), []) if m._parameters.get("weight") is p] or \
            owners.get(id(p), [])
        plan = _choose(cfg, mods, shape, world)
        if plan.direct and plan.block:
            blocks.append(BlockWeight(i, mods[0], plan, shape[0] // world, shape[1]))
        elif plan.direct:
            weights.append(DirectWeight(i, mods[0], plan))
        elif (bool(mods) and recorded_linear(mods[0])) or len(mods) > 1:
            # Only weights an Fp8Linear would have consumed are worth a word; biases and
            # plain modules' parameters are expected to take the regular FP8 gather.
            _state.log_once(logger, ("zero-fp8-ag-regular", plan.reason),
                            "fp8boost: ZeRO FP8 all-gather decodes a weight to its working "
                            f"dtype and the layer re-casts it: {plan.reason}")
    if weights:
        _state.log_once(logger, "zero-fp8-ag-direct",
                        "fp8boost: ZeRO FP8 all-gather feeds Fp8Linear's FP8 GEMM directly "
                        "(one amax all-reduce per step, no re-quantize of the weight)",
                        level=logging.INFO)
    if blocks:
        _state.log_once(logger, "zero-fp8-ag-blocks",
                        "fp8boost: ZeRO FP8 all-gather sends blockwise weights with their block "
                        "scales, cast per chunk, straight into the blockwise GEMMs",
                        level=logging.INFO)
    return ZeroDirectPlan(weights, cfg, blocks)


class ZeroDirectPlan:
    """The direct-path weights of one ZeRO optimizer, and the per-step math on them.

    Per step and weight: one amax (``_foreach_norm(inf)`` over all chunks at once where the
    backend has it), one fused cast of the master chunk into bytes, one fused decode of the
    gathered bytes into the working parameter (Triton on FP8 GPUs, ``comm_config.cast_impl``;
    torch ops elsewhere, bit-identical); the scales of all weights come from a few vector ops.
    """

    def __init__(self, weights: list[DirectWeight], config: Optional[Fp8CommConfig] = None,
                 blocks: tuple = ()) -> None:
        self.weights = weights
        self.blocks = list(blocks)  # direct_blocks.BlockWeight: no shared scale
        self.config = config if config is not None else Fp8CommConfig()
        self.slot = {w.index: j for j, w in enumerate(weights)}  # param index -> amax entry
        # This step's inverse scales, one aligned 0-dim tensor per weight (made once per
        # global_scales result, not one reciprocal launch per weight at every step's end).
        self._invs: tuple = (None, ())
        self.block_slot = {w.index: w for w in self.blocks}
        # Weights sharing a scale rule get their scales from one vectorised call.
        self._rules: dict[tuple, list[int]] = {}
        for j, w in enumerate(weights):
            rule = (w.plan.fp8_dtype, w.plan.margin, w.plan.power_of_2)
            self._rules.setdefault(rule, []).append(j)

    def __bool__(self) -> bool:
        return bool(self.weights or self.blocks)

    def attach(self) -> list:
        """Register each direct layer's re-hand-over hook (see the module docstring).

        Returns the hook handles (``.remove()`` detaches them).
        """
        return [w.layer.register_forward_pre_hook(_rehand_hook(w))
                for w in (*self.weights, *self.blocks)]

    def global_scales(self, masters: list[torch.Tensor], device: torch.device,
                      group) -> torch.Tensor:
        """One FP32 scale per direct weight, from ONE all-reduce(MAX) of the chunk amaxes.

        Padding in a master chunk is zero, so it never raises the amax.
        """
        local = _amaxes([masters[w.index] for w in self.weights], device)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        if len(self._rules) == 1:
            (dtype, margin, pow2), _ = next(iter(self._rules.items()))
            return scale_from_amax(local, dtype, margin, pow2)
        scales = torch.empty_like(local)
        for (dtype, margin, pow2), idx in self._rules.items():
            at = torch.tensor(idx, device=local.device)
            scales[at] = scale_from_amax(local[at], dtype, margin, pow2)
        return scales

    def cast_chunk(self, index: int, master: torch.Tensor, scales: torch.Tensor,
                   out_u8: torch.Tensor) -> None:
        """Cast one master chunk with its weight's scale into ``out_u8`` (uint8 bytes)."""
        w = self.weights[self.slot[index]]
        j = self.slot[index]
        src = master.to(out_u8.device, non_blocking=True).reshape(1, -1)
        cast_rows_into(src, scales[j:j + 1], out_u8.view(1, -1), w.plan.fp8_dtype,
                       power_of_2=w.plan.power_of_2,
                       impl=resolve_cast_impl(self.config, out_u8.device))

    def _inverse(self, j: int, scales: torch.Tensor) -> torch.Tensor:
        """Weight ``j``'s inverse scale from this step's ``scales`` (all made at first use)."""
        if self._invs[0] is not scales:
            self._invs = (scales, aligned_scalars(scales.reciprocal()))
        return self._invs[1][j]

    def gather_buffers(self, index: int, param: torch.Tensor, chunk: int, world: int,
                       rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight's all-gather output (uint8 ``[world * chunk]``, persistent) and this rank's
        slot of it, the in-place input: the gathered bytes land in the layer's FP8 operand
        (``buffer``, a view) with no copy."""
        w = self.weights[self.slot[index]]
        if w.wire is None or w.wire.device != param.device or w.wire.numel() != world * chunk:
            w.wire = torch.empty(world * chunk, dtype=torch.uint8, device=param.device)
            w.buffer = w.wire[:param.numel()].view(w.plan.fp8_dtype).view(param.shape)
        return w.wire, w.wire[rank * chunk:(rank + 1) * chunk]

    def receive(self, index: int, param: torch.Tensor, scales: torch.Tensor) -> None:
        """Decode a gathered weight's bytes (in ``buffer``, see :meth:`gather_buffers`) into
        the working param and hand both to the layer."""
        w = self.weights[self.slot[index]]
        data = w.buffer.view(torch.uint8).view(1, -1)
        j = self.slot[index]
        inv = self._inverse(j, scales)
        impl = resolve_cast_impl(self.config, param.device)
        if param.is_contiguous():
            decode_rows_into(data, inv.reshape(1), w.plan.fp8_dtype, param.detach().view(1, -1),
                             power_of_2=w.plan.power_of_2, impl=impl)
            _bump_version(param)  # a kernel's write does not; the weight-cast caches key on it
        else:
            tmp = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            decode_rows_into(data, inv.reshape(1), w.plan.fp8_dtype, tmp.view(1, -1),
                             power_of_2=w.plan.power_of_2, impl=impl)
            param.copy_(tmp)
        w.inv_scale = inv
        w.layer.set_prequantized_weight(w.buffer, w.inv_scale)
        w.handed = (param.data_ptr(), param._version, _state.step_epoch())


def _rehand_hook(w: DirectWeight):
    """Forward pre-hook of ``w.layer``: hand ``w``'s bytes over again if only the step count moved.

    Another optimizer's step (nothing wrote this weight) would otherwise drop the operand and
    the layer would cast its decoded working weight: other bytes than the master's cast.
    """
    def hook(layer: nn.Module, _args) -> None:
        # Compiled layers never check the key (they use a set operand as is): nothing to do.
        # Tested first, so dynamo reads nothing of ``w`` (a guard on its version and step
        # count would recompile the layer at every step).
        if compiling() or w.handed is None:
            return
        epoch = _state.step_epoch()
        if w.handed[2] == epoch:
            return  # no optimizer step since the hand-over: the layer's operand is still valid
        weight = layer.weight
        if (weight.data_ptr(), weight._version) != w.handed[:2]:
            w.handed = None  # the weight was written (or replaced): its bytes are stale for good
            return
        layer.set_prequantized_weight(w.buffer, w.inv_scale)
        w.handed = (w.handed[0], w.handed[1], epoch)
    return hook


def _amaxes(chunks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """FP32 ``[len(chunks)]`` of max |x| per chunk (NaN propagates), in as few launches as the
    backend allows: ``torch._foreach_norm(inf)`` on GPU, one amax per chunk elsewhere."""
    if chunks and all(c.is_cuda and c.numel() > 0 and c.dtype == chunks[0].dtype
                      for c in chunks):
        return torch.stack(torch._foreach_norm(chunks, float("inf"))).float().to(device)
    return torch.stack([amax(c).to(device) for c in chunks])


def _bump_version(t: torch.Tensor) -> None:
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        bump(t)
    else:  # older torch: an in-place no-op through the dispatcher bumps it
        t.detach().mul_(1)
