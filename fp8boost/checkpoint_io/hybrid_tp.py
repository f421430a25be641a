"""The tensor-parallel split of ``HybridParallelPlugin`` models, as its checkpoints see it.

Under tensor parallelism every split parameter is a plain tensor holding this rank's equal
chunk along one dim (``plugin.tp_state.shard_dims``). ``hybrid`` and ``hybrid_pp`` use
:class:`TpLayout` for the full shapes, the box of the full tensor a rank holds, and the full
tensor gathered over tp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpLayout:
    """How tensor parallelism split the boosted model, seen from this rank (size 1: no split)."""

    shard_dims: dict[str, int] = field(default_factory=dict)  # parameter name -> split dim
    group: object = None  # the tp process group (None without a split)
    size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, plugin) -> "TpLayout":
        """The split of ``plugin``'s boosted model (none when the plugin has no tp)."""
        st = plugin.tp_state
        if st is None or st.size == 1:
            return cls()
        return cls(dict(st.shard_dims), st.group, st.size, st.rank)

    def full_shape(self, name: str, t: torch.Tensor) -> tuple[int, ...]:
        """The shape of the whole tensor ``name`` whose local shard is ``t``."""
        shape = list(t.shape)
        dim = self.shard_dims.get(name)
        if dim is not None:
            shape[dim] *= self.size
        return tuple(shape)

    def box(self, name: str, full_shape: tuple) -> tuple[slice, ...]:
        """This rank's box of the split tensor ``name`` (equal chunks along its dim)."""
        dim = self.shard_dims[name]
        box = [slice(0, n) for n in full_shape]
        n = full_shape[dim] // self.size
        box[dim] = slice(self.rank * n, (self.rank + 1) * n)
        return tuple(box)

    def gather(self, name: str, t: torch.Tensor, dst: int) -> Optional[torch.Tensor]:
        """The full tensor ``name`` on global rank ``dst`` (None elsewhere): one
        ``dist.gather`` over tp of every rank's shard ``t``."""
        local = t.detach().contiguous()
        me = dist.get_rank() == dst
        parts = [torch.empty_like(local) for _ in range(self.size)] if me else None
        dist.gather(local, parts, dst=dst, group=self.group)
        return torch.cat(parts, dim=self.shard_dims[name]) if me else None
