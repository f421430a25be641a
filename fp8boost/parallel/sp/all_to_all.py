"""The Ulysses all-to-alls: sequence-sharded heads <-> head-sharded sequence, with autograd.

Layout is HF's attention layout ``[batch, heads, seq, head_dim]``. Each of the ``sp`` ranks of
the group holds ``seq / sp`` consecutive tokens (rank ``r`` the ``r``-th chunk):

* :func:`seq_to_heads` ``[b, h, s/sp, d] -> [b, h/sp, s, d]``: rank ``r`` keeps head chunk
  ``r`` and receives every rank's tokens for it (sequence chunks in rank order);
* :func:`heads_to_seq` ``[b, h/sp, s, d] -> [b, h, s/sp, d]``: the inverse.

The backward of each is the other one. With ``fp8=True`` the forward payload goes on the wire
as e4m3 bytes with one scale per destination chunk (``all_to_all_fp8``); gradients always move
in their own dtype (no measurement on GPU yet says FP8 gradients pay off here, and e5m2's
2-bit mantissa on attention gradients is a numerics risk worth measuring first).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from fp8boost.parallel.fp8_comm import all_to_all_fp8

__all__ = ["seq_to_heads", "heads_to_seq"]


def _exchange(send: torch.Tensor, group, fp8: bool, config) -> torch.Tensor:
    """All-to-all along dim 0 (one equal chunk per rank), in FP8 bytes when ``fp8``."""
    out = torch.empty_like(send)
    if fp8:
        all_to_all_fp8(out, send, group=group, config=config)
    else:
        dist.all_to_all_single(out, send, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, fp8: bool, config) -> torch.Tensor:
    b, h, s_loc, d = x.shape
    sp = dist.get_world_size(group)
    # dim 0 = destination rank (its head chunk); received dim 0 = source rank (its seq chunk)
    send = x.reshape(b, sp, h // sp, s_loc, d).transpose(0, 1).contiguous()
    recv = _exchange(send, group, fp8, config)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s_loc, d)


def _heads_to_seq(y: torch.Tensor, group, fp8: bool, config) -> torch.Tensor:
    b, h_loc, s, d = y.shape
    sp = dist.get_world_size(group)
    # dim 0 = destination rank (its seq chunk); received dim 0 = source rank (its head chunk)
    send = y.reshape(b, h_loc, sp, s // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _exchange(send, group, fp8, config)
    return recv.transpose(0, 1).reshape(b, sp * h_loc, s // sp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, fp8, config):
        ctx.group = group
        return _seq_to_heads(x, group, fp8, config)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, False, None), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, fp8, config):
        ctx.group = group
        return _heads_to_seq(y, group, fp8, config)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, False, None), None, None, None


def _check(x: torch.Tensor, group, dim: int, what: str) -> None:
    sp = dist.get_world_size(group)
    if x.dim() != 4 or x.shape[dim] % sp:
        raise ValueError(f"{what}: expected [batch, heads, seq, head_dim] with dim {dim} "
                         f"divisible by the sequence-parallel size {sp}, got {tuple(x.shape)}")


def seq_to_heads(x: torch.Tensor, group, fp8: bool = False,
                 config: Optional[object] = None) -> torch.Tensor:
    """``[b, h, s/sp, d]`` (this rank's tokens, all heads) -> ``[b, h/sp, s, d]`` (all tokens,
    this rank's heads). Differentiable; the backward is :func:`heads_to_seq` in the gradient's
    dtype.

    Args:
        x: this rank's query/key/value, heads divisible by the group size.
        group: the sequence-parallel process group.
        fp8: send the forward payload as FP8 bytes (``fp8_communication``).
        config: ``Fp8CommConfig`` for the FP8 wire (default config when None).

    Example:
        >>> q_full_seq = seq_to_heads(q, sp_group)          # doctest: +SKIP
    """
    _check(x, group, 1, "seq_to_heads")
    return _SeqToHeads.apply(x, group, fp8, config)


def heads_to_seq(y: torch.Tensor, group, fp8: bool = False,
                 config: Optional[object] = None) -> torch.Tensor:
    """``[b, h/sp, s, d]`` -> ``[b, h, s/sp, d]``: the inverse of :func:`seq_to_heads`.

    Example:
        >>> out_local = heads_to_seq(attn_out, sp_group)     # doctest: +SKIP
    """
    _check(y, group, 2, "heads_to_seq")
    return _HeadsToSeq.apply(y, group, fp8, config)
