"""Colossal-AI's FP8 collectives, with its signatures, over fp8boost's FP8 collectives.

Each function is a thin adapter: it checks the Colossal-AI-style arguments (``fp8_format=``
strings, list-of-tensors forms), then calls :mod:`fp8boost.parallel.fp8_comm`, which casts,
sends FP8 bytes (as ``torch.uint8``) with one FP32 scale per chunk and decodes. Unlike
Colossal-AI, whose public ``all_reduce_fp8`` / ``reduce_scatter_fp8`` (always) and all-gather /
all-to-all (within one node) quietly run the plain collective, these always put FP8 on the
wire when the group has more than one rank: the caller chose an FP8 collective. fp8boost's
payload-size threshold is therefore off here (:func:`comm_config`); a group of one rank does
the exact local result, logged once.

Return convention (Colossal-AI's): ``None``, or with ``async_op=True`` a :class:`Handle` whose
``wait()`` finishes communication and decoding. Inputs must not change before ``wait()``.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from fp8boost import _state
from fp8boost.parallel.fp8_comm import Fp8CommConfig
from fp8boost.parallel.fp8_comm import all_gather_into_tensor_fp8 as _gather_into
from fp8boost.parallel.fp8_comm import all_reduce_fp8 as _all_reduce
from fp8boost.parallel.fp8_comm import all_to_all_fp8 as _all_to_all_single
from fp8boost.parallel.fp8_comm import reduce_scatter_tensor_fp8 as _reduce_scatter

from .fp8_cast import FormatLike, check_floating, fp8_dtype_of

__all__ = ["Handle", "comm_config", "process_group_is_intranode", "all_reduce_fp8",
           "all_to_all_single_fp8", "all_to_all_fp8", "all_gather_fp8",
           "all_gather_into_tensor_flat_fp8", "reduce_scatter_fp8"]


class Handle:
    """Colossal-AI's handle of an asynchronous FP8 collective.

    ``wait()`` waits for every handle in ``handles`` (fp8boost's ``Fp8Work`` decodes inside its
    own ``wait()``), then runs ``remain_ops`` (e.g. copying into an output list).

    Example:
        >>> h = Handle([], remain_ops=lambda: print("decoded"))
        >>> h.wait()
        decoded
    """

    def __init__(self, handles: Sequence[Any] = (), remain_ops: Optional[Callable[[], None]] = None
                 ) -> None:
        self.handles = list(handles)
        self.remain_ops = remain_ops

    def wait(self) -> None:
        """Finish the communication and the decoding (the output is ready afterwards)."""
        for handle in self.handles:
            handle.wait()
        self.handles = []
        if self.remain_ops is not None:
            ops, self.remain_ops = self.remain_ops, None  # a second wait() does nothing
            ops()

    def is_completed(self) -> bool:
        """True once :meth:`wait` ran (decoding happens in ``wait()`` only)."""
        return not self.handles and self.remain_ops is None


def comm_config() -> Fp8CommConfig:
    """The :class:`Fp8CommConfig` of these collectives: fp8boost's defaults, FP8 at any size.

    ``min_payload_numel=0`` because a Colossal-AI caller picked an ``*_fp8`` collective on
    purpose (and Colossal-AI's tests use tensors of a few elements); the wire format comes from
    each call's ``fp8_format``.
    """
    return _state.probe("colossal-fp8-comm-config", lambda: Fp8CommConfig(min_payload_numel=0))


def _handle(work: Any, async_op: bool, remain_ops: Optional[Callable[[], None]] = None
            ) -> Optional[Handle]:
    if async_op:
        return Handle([work] if work is not None else [], remain_ops)
    if remain_ops is not None:
        remain_ops()
    return None


def process_group_is_intranode(pg: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether every rank of ``pg`` (None: WORLD) runs on this rank's node.

    Ranks are placed node by node (rank // local world size). The local world size comes from
    ``LOCAL_WORLD_SIZE`` (torchrun) or ``OMPI_COMM_WORLD_LOCAL_SIZE``, else the CUDA device
    count; it is read at call time.

    Example:
        >>> process_group_is_intranode()  # doctest: +SKIP
        True
    """
    local = None
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit() and int(os.environ[var]) > 0:
            local = int(os.environ[var])
            break
    if local is None:
        local = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not local:
        raise ValueError("cannot tell the ranks per node: set LOCAL_WORLD_SIZE (torchrun does) "
                         "or run where CUDA devices are visible")
    ranks = dist.get_process_group_ranks(pg if pg is not None else dist.group.WORLD)
    return len({r // local for r in ranks}) == 1


def all_reduce_fp8(tensor: torch.Tensor, fp8_format: FormatLike = "e4m3", op=ReduceOp.SUM,
                   group=None, async_op: bool = False) -> Optional[Handle]:
    """In-place all-reduce with FP8 on the wire (FP8 reduce-scatter + FP8 all-gather).

    Args:
        tensor: float32/bfloat16/float16, any shape; reduced in place.
        fp8_format: wire format, ``"e4m3"`` or ``"e5m2"``.
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        group: process group (None: WORLD).
        async_op: return a :class:`Handle` instead of finishing now.

    Each element errs by at most one FP8 rounding per other rank's addend (the own chunk is
    added in full precision), summed in FP32, plus one rounding of the result for the gather.

    Example:
        >>> g = torch.randn(1024)                               # doctest: +SKIP
        >>> all_reduce_fp8(g, op=ReduceOp.AVG)                  # doctest: +SKIP
    """
    check_floating(tensor, "tensor")
    work = _all_reduce(tensor, group, op=op, fp8_dtype=fp8_dtype_of(fp8_format),
                       async_op=async_op, config=comm_config())
    return _handle(work, async_op)


def all_to_all_single_fp8(output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Optional[Sequence[int]] = None,
                          input_split_sizes: Optional[Sequence[int]] = None,
                          fp8_format: FormatLike = "e5m2", group=None,
                          async_op: bool = False) -> Optional[Handle]:
    """``dist.all_to_all_single`` with FP8 on the wire (one scale per chunk sent).

    Same contract as ``dist.all_to_all_single``: dim 0 is split by the split sizes (evenly
    without them); the chunk a rank keeps is copied in full precision.

    Example:
        >>> out = torch.empty(8, 16)                            # doctest: +SKIP
        >>> all_to_all_single_fp8(out, torch.randn(8, 16))      # doctest: +SKIP
    """
    check_floating(input, "input")
    check_floating(output, "output")
    work = _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group,
                              fp8_dtype=fp8_dtype_of(fp8_format), async_op=async_op,
                              config=comm_config())
    return _handle(work, async_op)


def _check_list(tensors: Any, name: str, ws: int,
                like: Optional[tuple[torch.Tensor, str]] = None) -> list[torch.Tensor]:
    """One floating tensor per rank; with ``like=(ref, ref_name)``, each of ``ref``'s size."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != ws:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ValueError(f"{name} must be a list of one tensor per rank ({ws}), got {got}")
    for i, t in enumerate(tensors):
        check_floating(t, f"{name}[{i}]")
    if like is not None:
        ref, ref_name = like
        bad = [i for i, t in enumerate(tensors) if t.numel() != ref.numel()]
        if bad:
            raise ValueError(f"{name}[{bad[0]}] has {tensors[bad[0]].numel()} elements, "
                             f"{ref_name} {ref.numel()}: every {name.split('_')[0]} must "
                             f"match the {ref_name.rstrip('_')}'s size")
    return list(tensors)


def _world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialized: call colossalai.launch(...) or "
                         "torch.distributed.init_process_group(...) first")
    return dist.get_world_size(group), dist.get_rank(group)


def _scatter_into(flat: torch.Tensor, outputs: list[torch.Tensor]) -> Callable[[], None]:
    """A remain_ops copying consecutive pieces of ``flat`` into ``outputs``."""
    def copy_out() -> None:
        for piece, out in zip(flat.split([o.numel() for o in outputs]), outputs):
            out.copy_(piece.view(out.shape))
    return copy_out


def all_to_all_fp8(output_list: list, input_list: list, group=None, fp8_format: FormatLike = "e5m2",
                   async_op: bool = False) -> Optional[Handle]:
    """``dist.all_to_all`` (lists of tensors) with FP8 on the wire, one scale per tensor sent.

    ``input_list[j]`` goes to rank j; ``output_list[j]`` receives rank j's tensor. Tensors may
    differ in shape (non-contiguous ones too); all inputs share one dtype.

    Example:
        >>> ins = [torch.randn(4, 8) for _ in range(world)]           # doctest: +SKIP
        >>> outs = [torch.empty(4, 8) for _ in range(world)]          # doctest: +SKIP
        >>> all_to_all_fp8(outs, ins)                                 # doctest: +SKIP
    """
    ws, _ = _world(group)
    ins = _check_list(input_list, "input_list", ws)
    outs = _check_list(output_list, "output_list", ws)
    if len({t.dtype for t in ins}) > 1:
        raise ValueError(f"input_list mixes dtypes {sorted({str(t.dtype) for t in ins})}; send "
                         "one dtype per all_to_all_fp8 call")
    # One FP8 all-to-all of the flattened tensors: chunk j is input_list[j] with its own scale.
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    flat_out = torch.empty(sum(o.numel() for o in outs), dtype=ins[0].dtype, device=ins[0].device)
    work = _all_to_all_single(flat_out, flat_in, [o.numel() for o in outs],
                              [t.numel() for t in ins], group, fp8_dtype=fp8_dtype_of(fp8_format),
                              async_op=async_op, config=comm_config())
    return _handle(work, async_op, _scatter_into(flat_out, outs))


def all_gather_fp8(output_list: list, input_: torch.Tensor, group=None,
                   fp8_format: FormatLike = "e5m2", async_op: bool = False) -> Optional[Handle]:
    """``dist.all_gather`` (a list of outputs) with FP8 on the wire.

    Each rank casts ``input_`` with its own scale; the scale travels with the bytes in one
    all-gather. ``output_list[r]`` (rank r's tensor) must have ``input_``'s numel; its dtype
    may differ (decoding writes it directly). Colossal-AI's ``_all_gather_fp8``,
    ``all_gather_fp8_lagacy`` and ``all_gather_fp8_ring`` are other algorithms for this same
    result: here they are this function.

    Example:
        >>> outs = [torch.empty(3, 16) for _ in range(world)]         # doctest: +SKIP
        >>> all_gather_fp8(outs, torch.randn(3, 16))                  # doctest: +SKIP
    """
    ws, _ = _world(group)
    check_floating(input_, "input_")
    outs = _check_list(output_list, "output_list", ws, like=(input_, "input_"))
    flat = torch.empty(ws * input_.numel(), dtype=outs[0].dtype, device=input_.device)
    work = _gather_into(flat, input_, group, fp8_dtype=fp8_dtype_of(fp8_format),
                        async_op=async_op, config=comm_config())
    return _handle(work, async_op, _scatter_into(flat, outs))


def all_gather_into_tensor_flat_fp8(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                                    output_shape: Sequence[int], group,
                                    fp8_format: FormatLike = "e4m3",
                                    async_op: bool = False) -> Optional[Handle]:
    """All-gather flat shards of a (padded) flat parameter with FP8 on the wire.

    ``output_tensor`` (1-D) receives the ``world_size`` 1-D ``input_tensor`` shards back to back;
    only its first ``prod(output_shape)`` elements (the unpadded parameter) are written.
    Scales: one per rank's shard (fp8boost's wire format), where Colossal-AI shares one scale
    per row of a 2-D ``output_shape`` over the group; both are FP8 roundings of the same values,
    a shard-wide scale gives less precision to rows much smaller than the shard's largest.

    Example:
        >>> out = torch.empty(world * 64)                                      # doctest: +SKIP
        >>> all_gather_into_tensor_flat_fp8(out, shard, torch.Size([8, 15]), None)  # doctest: +SKIP
    """
    check_floating(input_tensor, "input_tensor")
    check_floating(output_tensor, "output_tensor")
    ws, _ = _world(group)
    if input_tensor.dim() != 1 or output_tensor.dim() != 1:
        raise ValueError("all_gather_into_tensor_flat_fp8 takes flattened (1-D) input and output "
                         f"tensors, got {input_tensor.dim()}-D and {output_tensor.dim()}-D")
    if output_tensor.numel() != ws * input_tensor.numel():
        raise ValueError(f"output_tensor must hold world_size * input numel = {ws} * "
                         f"{input_tensor.numel()} elements, got {output_tensor.numel()}")
    numel = math.prod(output_shape)
    if numel > output_tensor.numel():
        raise ValueError(f"output_shape {tuple(output_shape)} holds {numel} elements, more than "
                         f"output_tensor's {output_tensor.numel()}")
    # Colossal-AI leaves the padding after prod(output_shape) untouched: gather aside then.
    full = numel == output_tensor.numel()
    dst = output_tensor if full else torch.empty_like(output_tensor)
    work = _gather_into(dst, input_tensor, group, fp8_dtype=fp8_dtype_of(fp8_format),
                        async_op=async_op, config=comm_config())
    copy = None if full else (lambda: output_tensor[:numel].copy_(dst[:numel]))
    return _handle(work, async_op, copy)


def reduce_scatter_fp8(output: torch.Tensor, input_list: list, group,
                       fp8_format: FormatLike = "e5m2", async_op: bool = False
                       ) -> Optional[Handle]:
    """``dist.reduce_scatter`` (SUM, list form) with FP8 on the wire.

    ``output = sum over ranks r of rank r's input_list[this rank]``. Each tensor bound for
    another rank is cast with its own scale; the receiver sums in FP32, its own tensor in full
    precision.

    Example:
        >>> ins = [torch.randn(4, 8) for _ in range(world)]           # doctest: +SKIP
        >>> out = torch.empty(4, 8)                                   # doctest: +SKIP
        >>> reduce_scatter_fp8(out, ins, group=None)                  # doctest: +SKIP
    """
    ws, _ = _world(group)
    check_floating(output, "output")
    ins = _check_list(input_list, "input_list", ws, like=(output, "output"))
    flat = torch.cat([t.reshape(-1).to(output.dtype) for t in ins])
    work = _reduce_scatter(output, flat, group, op="sum", fp8_dtype=fp8_dtype_of(fp8_format),
                           async_op=async_op, config=comm_config())
    return _handle(work, async_op)
