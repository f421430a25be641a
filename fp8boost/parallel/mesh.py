"""The topology of a run: data, pipeline, sequence, tensor and expert parallel sizes, and the
named DeviceMeshes.

One object says how the world is cut, as torchtitan's ``ParallelDims`` does. Ranks are laid
out with ``tp`` innermost (consecutive ranks, so a tensor-parallel group stays inside a node
whenever ``tp`` divides the GPUs per node), then ``sp`` (Ulysses sequence parallelism: its
all-to-alls are the next busiest), then ``ep`` (expert parallelism: the token all-to-alls),
then ``pp`` and ``moe_dp``. The data-parallel replicas are ``dp = moe_dp x ep``: the ep ranks
of a replica set hold different experts, the moe-dp ranks the same ones. This is
Colossal-AI's ``MoeHybridParallelPlugin`` layout (its ``ProcessGroupMesh`` axes
``(moe_dp, pp, ep, tp)``, or ``(pp, moe_dp, ep, tp)`` with ``moe_dp_outside=False``)::

    moe_dp_outside=True:  outer = moe_dp_index * pp + pp_index
    moe_dp_outside=False: outer = pp_index * moe_dp + moe_dp_index
    rank = ((outer * ep + ep_index) * sp + sp_index) * tp + tp_index
    dp_index = moe_dp_index * ep + ep_index

``ep`` defaults to 1 and ``moe_dp_outside`` to True, which leaves the (dp, pp, sp, tp)
layout ``rank = ((dp_index * pp + pp_index) * sp + sp_index) * tp + tp_index``; with
``pp == 1`` both switches give that layout too.

Two meshes cover the same world (torchtitan's dense and sparse meshes):

* the dense mesh ``("dp", "pp", "sp", "tp")``: every parameter that is not an expert;
* the expert mesh ``("moe_dp", "ep", "pp", "sp", "tp")``: the dense mesh with dp unflattened
  into moe-dp x ep (it shares the pp, sp and tp groups). Its ep group is the ranks of one
  (moe-dp, pp, sp, tp) index, one stage's ``ep`` expert slices exchanging tokens; its moe-dp
  group the ranks of one (pp, ep, sp, tp) index, which hold the same experts. Built on the
  first request of an expert axis.

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
    >>> moe = ParallelDims(dp=4, pp=2, ep=2, world_size=8)
    >>> moe.moe_dp, moe.coords(5)["ep"], moe.coords(5)["dp"]
    (2, 1, 3)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIM_NAMES = ("dp", "pp", "sp", "tp")
"""The dense mesh's axes, outermost first."""

EXPERT_DIM_NAMES = ("ep", "moe_dp")
"""The axes only the expert mesh has (dp = moe_dp x ep)."""

AXES = DIM_NAMES + EXPERT_DIM_NAMES
"""Every axis a :class:`Topology` answers for."""

EXPERT_MESH_NAMES = ("moe_dp", "ep", "pp", "sp", "tp")
"""The expert mesh's axes: the dense mesh's, dp split into moe_dp (outer) and ep."""


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _bad_axis(name: str):
    raise ValueError(f"unknown mesh dimension {name!r}; use one of {AXES}")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How ``world_size`` ranks are cut into data, pipeline, sequence, tensor and expert
    parallel groups (module docstring: the rank layout)."""

    dp: int = 1
    """Data-parallel replicas (ZeRO/FSDP shard over this dimension); ``moe_dp x ep``."""

    pp: int = 1
    """Pipeline stages."""

    tp: int = 1
    """Tensor-parallel ranks per model replica stage (innermost: consecutive ranks)."""

    sp: int = 1
    """Ulysses sequence-parallel ranks (between ep and tp): each holds a slice of the sequence
    and replicated parameters; gradients are averaged over dp x sp."""

    ep: int = 1
    """Expert-parallel ranks: the dp replicas of one moe-dp index, each holding ``E/ep``
    experts of every MoE layer (between pp and sp); divides ``dp``."""

    moe_dp_outside: bool = True
    """Colossal-AI's switch: the moe-dp axis outside the pp axis (True) or inside it."""

    world_size: int = 1
    """Number of processes; must equal ``dp * pp * sp * tp``."""

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "sp", "tp", "ep", "world_size"):
            _check_size(name, getattr(self, name))
        if not isinstance(self.moe_dp_outside, bool):
            raise ValueError(f"moe_dp_outside must be True or False, got {self.moe_dp_outside!r}")
        if self.dp * self.pp * self.sp * self.tp != self.world_size:
            sp = f" x sp ({self.sp})" if self.sp > 1 else ""  # sp=1 runs read as before
            raise ValueError(
                f"dp ({self.dp}) x pp ({self.pp}){sp} x tp ({self.tp}) = "
                f"{self.dp * self.pp * self.sp * self.tp} must equal the world size "
                f"({self.world_size}): choose sizes whose product is the number of processes")
        if self.dp % self.ep:
            raise ValueError(
                f"ep ({self.ep}) must divide dp ({self.dp}): the data-parallel replicas are "
                "moe_dp x ep (the ep ranks hold different experts, the moe_dp ranks the same "
                f"ones); choose an ep that divides world_size / (pp x sp x tp) = {self.dp}")

    @classmethod
    def for_world(cls, world_size: Optional[int] = None, *, pp: int = 1, tp: int = 1,
                  sp: int = 1, ep: int = 1, moe_dp_outside: bool = True) -> "ParallelDims":
        """The dims for ``world_size`` ranks (default: the initialised world) with dp inferred.

        Raises:
            ValueError: ``pp * sp * tp`` does not divide the world size, or ``ep`` does not
                divide the dp it leaves.
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
        return cls(dp=world_size // inner, pp=pp, sp=sp, tp=tp, ep=ep,
                   moe_dp_outside=moe_dp_outside, world_size=world_size)

    @property
    def moe_dp(self) -> int:
        """Ranks that hold the same experts and shard their optimizer state (``dp / ep``)."""
        return self.dp // self.ep

    @property
    def axis_order(self) -> tuple[str, ...]:
        """The axes in rank-layout order, outermost first (module docstring)."""
        outer = ("moe_dp", "pp") if self.moe_dp_outside else ("pp", "moe_dp")
        return outer + ("ep", "sp", "tp")

    def size(self, name: str) -> int:
        """The size of axis ``name`` (one of :data:`AXES`)."""
        if name not in AXES:
            _bad_axis(name)
        return getattr(self, name)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"dp", "pp", "sp", "tp", "ep", "moe_dp"}`` indices of a global rank (no process
        group needed)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size})")
        index, rest = {}, rank
        for name in reversed(self.axis_order):  # the layout, innermost axis first
            rest, index[name] = divmod(rest, self.size(name))
        return {"dp": index["moe_dp"] * self.ep + index["ep"], "pp": index["pp"],
                "sp": index["sp"], "tp": index["tp"], "ep": index["ep"],
                "moe_dp": index["moe_dp"]}

    def dense_ranks(self) -> torch.Tensor:
        """The ``[dp, pp, sp, tp]`` grid of global ranks: the dense mesh."""
        grid = torch.empty((self.dp, self.pp, self.sp, self.tp), dtype=torch.int64)
        for r in range(self.world_size):
            c = self.coords(r)
            grid[c["dp"], c["pp"], c["sp"], c["tp"]] = r
        return grid

    def build_mesh(self, device_type: Optional[str] = None) -> "Topology":
        """Create the named dense DeviceMesh ``("dp", "pp", "sp", "tp")`` (a collective: every
        rank calls it). The expert mesh follows on the first request of an expert axis.

        Raises:
            RuntimeError: no default process group.

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
        grid = self.dense_ranks()
        if torch.equal(grid.flatten(), torch.arange(self.world_size)):  # dp contiguous
            mesh = init_device_mesh(device_type, tuple(grid.shape), mesh_dim_names=DIM_NAMES)
        else:  # pp splits dp's ranks (Colossal-AI's MoE layouts): no stride pattern
            mesh = DeviceMesh(device_type, grid, mesh_dim_names=DIM_NAMES)
        return Topology(dims=self, mesh=mesh)


@dataclass(frozen=True)
class Topology:
    """A built mesh: sizes, this rank's coordinates and the process group of each axis.

    The dense axes (:data:`DIM_NAMES`) come from ``mesh``; ``ep`` and ``moe_dp`` from the
    expert mesh, which the first request of either (or of a flat group over them) builds: a
    collective, so every rank asks in the same order, as for :meth:`flat_group`.
    """

    dims: ParallelDims
    mesh: object = field(repr=False)  # torch.distributed.device_mesh.DeviceMesh
    _meshes: dict = field(default_factory=dict, repr=False, compare=False)  # built lazily

    def expert_mesh(self):
        """The DeviceMesh ``EXPERT_MESH_NAMES``: the dense mesh with dp unflattened into
        (moe_dp, ep), as dp_index = moe_dp_index * ep + ep_index (built on first call:
        collective; only the moe-dp and ep groups are new)."""
        mesh = self._meshes.get("expert")
        if mesh is None:
            # By index, not by name: torch 2.11's _unflatten rejects every name its mesh has
            # (an inverted check, "dim dp ... is not in ('dp', ...)"); 2.13 takes both.
            dp = tuple(self.mesh.mesh_dim_names).index("dp")
            mesh = self.mesh._unflatten(dp, (self.dims.moe_dp, self.dims.ep), ("moe_dp", "ep"))
            self._meshes["expert"] = mesh
        return mesh

    def _mesh_for(self, names: tuple[str, ...]):
        """The mesh that holds every axis of ``names``, and ``names`` in that mesh's order."""
        for n in names:
            if n not in AXES:
                _bad_axis(n)
        if all(n in DIM_NAMES for n in names):
            return self.mesh, names
        if "dp" in names:
            raise ValueError(f"dp is moe_dp x ep: it cannot be combined with {names}; name "
                             "moe_dp and ep instead")
        return self.expert_mesh(), tuple(sorted(names, key=EXPERT_MESH_NAMES.index))

    def submesh(self, *names: str):
        """The DeviceMesh over the named axes (e.g. ``("dp",)`` for FSDP, ``("tp",)`` for
        DTensor, ``("ep",)`` for the token all-to-alls)."""
        mesh, names = self._mesh_for(names)
        return mesh[names[0]] if len(names) == 1 else mesh[names]

    def group(self, name: str):
        """The process group of axis ``name`` that holds this rank."""
        return self.submesh(name).get_group()

    def flat_group(self, *names: str):
        """One process group over several axes (e.g. ``("dp", "sp")``: the ranks that hold the
        same parameters under Ulysses and average their gradients; ``("pp", "ep")``: one copy
        of every stage's experts); ``group(name)`` for one.

        A size-1 axis adds nothing, so ``flat_group("dp", "sp")`` with ``sp == 1`` is the dp
        group itself (no new group is created)."""
        names = tuple(n for n in names if self.size(n) > 1) or names[:1]
        if len(names) == 1:
            return self.group(names[0])
        mesh, names = self._mesh_for(names)
        # DeviceMesh flattening creates the group collectively on every rank, once per name.
        return mesh[names]._flatten("_".join(names)).get_group()

    def size(self, name: str) -> int:
        """The size of axis ``name``."""
        return self.dims.size(name)

    def rank(self, name: str) -> int:
        """This rank's index along axis ``name``."""
        if name not in AXES:
            _bad_axis(name)
        return self.dims.coords(dist.get_rank())[name]


def device_type_of(device: Optional[torch.device]) -> str:
    """The DeviceMesh device type for a model device (``cuda`` or ``cpu``)."""
    return "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
