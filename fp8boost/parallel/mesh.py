"""The topology of a run: data, pipeline, sequence and tensor parallel sizes, and the named
DeviceMesh.

One object says how the world is cut, as torchtitan's ``ParallelDims`` does. Ranks are laid
out with ``tp`` innermost (consecutive ranks, so a tensor-parallel group stays inside a node
whenever ``tp`` divides the GPUs per node), then ``sp`` (Ulysses sequence parallelism: its
all-to-alls are the next busiest), then ``pp``, then ``dp``::

    rank = ((dp_index * pp + pp_index) * sp + sp_index) * tp + tp_index

``sp`` defaults to 1, which leaves the (dp, pp, tp) layout as it was.

Plugins build one :class:`ParallelDims`, call :meth:`ParallelDims.build_mesh` once, and take
every process group from the returned :class:`Topology`; nothing below them assumes
``dist.group.WORLD``.

Example:
    >>> from fp8boost.parallel.mesh import ParallelDims
    >>> dims = ParallelDims(dp=2, pp=1, tp=2, world_size=4)
    >>> dims.dp, dims.pp, dims.tp
    (2, 1, 2)
    >>> ParallelDims.for_world(4, tp=2).dp
    2
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

DIM_NAMES = ("dp", "pp", "sp", "tp")


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world_size`` ranks are cut into data, pipeline, sequence and tensor parallel groups."""

    dp: int = 1
    """Data-parallel replicas (ZeRO/FSDP shard over this dimension)."""

    pp: int = 1
    """Pipeline stages."""

    tp: int = 1
    """Tensor-parallel ranks per model replica stage (innermost: consecutive ranks)."""

    sp: int = 1
    """Ulysses sequence-parallel ranks (between pp and tp): each holds a slice of the sequence
    and replicated parameters; gradients are averaged over dp x sp."""

    world_size: int = 1
    """Number of processes; must equal ``dp * pp * sp * tp``."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "sp", "tp", "world_size"):
            _check_size(name, getattr(self, name))
        if self.dp * self.pp * self.sp * self.tp != self.world_size:
            sp = f" x sp ({self.sp})" if self.sp > 1 else ""  # sp=1 runs read as before
            raise ValueError(
                f"dp ({self.dp}) x pp ({self.pp}){sp} x tp ({self.tp}) = "
                f"{self.dp * self.pp * self.sp * self.tp} must equal the world size "
                f"({self.world_size}): choose sizes whose product is the number of processes")

    @classmethod
    def for_world(cls, world_size: Optional[int] = None, *, pp: int = 1,
                  tp: int = 1, sp: int = 1) -> "ParallelDims":
        """The dims for ``world_size`` ranks (default: the initialised world) with dp inferred.

        Raises:
            ValueError: ``pp * sp * tp`` does not divide the world size.
        """
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        _check_size("world_size", world_size)
        for name, value in (("pp", pp), ("sp", sp), ("tp", tp)):
            _check_size(name, value)
        inner = pp * sp * tp
        if world_size % inner:
            sizes = f"pp ({pp}) x sp ({sp}) x tp ({tp})" if sp > 1 else f"pp ({pp}) x tp ({tp})"
            raise ValueError(f"{sizes} = {inner} must divide the world size ({world_size}); "
                             f"launch a multiple of {inner} processes")
        return cls(dp=world_size // inner, pp=pp, sp=sp, tp=tp, world_size=world_size)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp": i, "pp": j, "sp": l, "tp": k}`` of a global rank (no process group needed)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        return {"dp": rank // (self.pp * self.sp * self.tp),
                "pp": rank // (self.sp * self.tp) % self.pp,
                "sp": rank // self.tp % self.sp, "tp": rank % self.tp}

    def build_mesh(self, device_type: Optional[str] = None) -> "Topology":
        """Create the named DeviceMesh ``("dp", "pp", "sp", "tp")`` (a collective: every rank
        calls it).

        Raises:
            ValueError: the default process group's size differs from ``world_size``.
        """
        if not dist.is_initialized():
            raise RuntimeError("build_mesh needs an initialised default process group: call "
                               "fp8boost.plugins.init_distributed() (or run under torchrun) first")
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"ParallelDims is for {self.world_size} processes but "
                             f"{dist.get_world_size()} were launched")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.dp, self.pp, self.sp, self.tp),
                                mesh_dim_names=DIM_NAMES)
        return Topology(dims=self, mesh=mesh)


@dataclass(frozen=True)
class Topology:
    """A built mesh: sizes, this rank's coordinates and the process group of each dimension."""

    dims: ParallelDims
    mesh: object = field(repr=False)  # torch.distributed.device_mesh.DeviceMesh

    def submesh(self, *names: str):
        """The DeviceMesh over the named dims (e.g. ``("dp",)`` for FSDP, ``("tp",)`` for DTensor)."""
        for n in names:
            if n not in DIM_NAMES:
                raise ValueError(f"unknown mesh dimension {n!r}; use one of {DIM_NAMES}")
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def group(self, name: str):
        """The process group of dimension ``name`` that holds this rank."""
        return self.submesh(name).get_group()

    def flat_group(self, *names: str):
        """One process group over several dims (e.g. ``("dp", "sp")``: the ranks that hold the
        same parameters under Ulysses and average their gradients); ``group(name)`` for one.

        A size-1 dim adds nothing, so ``flat_group("dp", "sp")`` with ``sp == 1`` is the dp
        group itself (no new group is created)."""
        names = tuple(n for n in names if self.size(n) > 1) or names[:1]
        if len(names) == 1:
            return self.group(names[0])
        # DeviceMesh flattening creates the group collectively on every rank, once per name.
        return self.submesh(*names)._flatten("_".join(names)).get_group()

    def size(self, name: str) -> int:
        return getattr(self.dims, name) if name in DIM_NAMES else self._bad(name)

    def rank(self, name: str) -> int:
        """This rank's index along dimension ``name``."""
        if name not in DIM_NAMES:
            self._bad(name)
        return self.dims.coords(dist.get_rank())[name]

    @staticmethod
    def _bad(name: str):
        raise ValueError(f"unknown mesh dimension {name!r}; use one of {DIM_NAMES}")


def device_type_of(device: Optional[torch.device]) -> str:
    """The DeviceMesh device type for a model device (``cuda`` or ``cpu``)."""
    return "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
