"""The ``ep`` axis of ParallelDims (and the moe-dp axis it implies): sizes, validation, rank
coordinates in Colossal-AI's layout for both ``moe_dp_outside`` settings, and the groups of
a built Topology on 4 gloo ranks.

Coordinates are checked against Colossal-AI's ``ProcessGroupMesh`` rank (row-major over
``(moe_dp, pp, ep, tp)``, or ``(pp, moe_dp, ep, tp)`` with ``moe_dp_outside=False``), written
out here independently of ``coords``; groups against the ranks that share every other
coordinate.
"""
from __future__ import annotations

import importlib
import itertools

import pytest

from fp8boost.parallel import ep as ep_package
from fp8boost.parallel.comm import granular
from fp8boost.parallel.mesh import ParallelDims
from tests.dist_utils import run_distributed


def _colossal_layout(moe_dp: int, pp: int, ep: int, tp: int, outside: bool) -> dict:
    """``{rank: coordinates}`` from Colossal-AI's row-major mesh (sp = 1)."""
    out = {}
    for m, p, e, t in itertools.product(range(moe_dp), range(pp), range(ep), range(tp)):
        outer = m * pp + p if outside else p * moe_dp + m
        out[(outer * ep + e) * tp + t] = {"dp": m * ep + e, "pp": p, "sp": 0, "tp": t, "ep": e,
                                          "moe_dp": m}
    return out


def test_ep_sizes_and_defaults():
    dims = ParallelDims(dp=4, pp=2, ep=2, world_size=8)
    assert (dims.ep, dims.moe_dp, dims.moe_dp_outside) == (2, 2, True)
    assert dims.size("ep") == 2 and dims.size("moe_dp") == 2 and dims.size("dp") == 4
    assert dims.axis_order == ("moe_dp", "pp", "ep", "sp", "tp")
    assert ParallelDims(dp=4, pp=2, ep=2, world_size=8,
                        moe_dp_outside=False).axis_order == ("pp", "moe_dp", "ep", "sp", "tp")
    inferred = ParallelDims.for_world(16, pp=2, tp=2, ep=2, moe_dp_outside=False)
    assert (inferred.dp, inferred.moe_dp, inferred.ep, inferred.moe_dp_outside) == (4, 2, 2, False)
    plain = ParallelDims(dp=2, tp=2, world_size=4)
    assert (plain.ep, plain.moe_dp) == (1, 2)  # no expert parallelism: moe-dp is dp


def test_ep_validation_errors():
    with pytest.raises(ValueError, match=r"ep \(3\) must divide dp \(4\).*moe_dp x ep"):
        ParallelDims(dp=4, ep=3, world_size=4)
    with pytest.raises(ValueError, match=r"ep \(4\) must divide dp \(2\)"):
        ParallelDims.for_world(8, pp=2, tp=2, ep=4)  # dp = 8 / (2 x 2) = 2
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ep must be an int >= 1"):
            ParallelDims(ep=bad, world_size=1)
    for bad in (1, None, "yes"):
        with pytest.raises(ValueError, match="moe_dp_outside must be True or False"):
            ParallelDims(moe_dp_outside=bad, world_size=1)
    with pytest.raises(ValueError, match="unknown mesh dimension 'cp'"):
        ParallelDims(world_size=1).size("cp")
    with pytest.raises(ValueError, match="outside"):
        ParallelDims(dp=2, ep=2, world_size=2).coords(2)


@pytest.mark.parametrize("outside", [True, False])
@pytest.mark.parametrize("moe_dp,pp,ep,tp", [(2, 2, 2, 1), (2, 2, 2, 2), (1, 2, 4, 1),
                                             (3, 2, 1, 2), (2, 1, 2, 2)])
def test_ep_coords_follow_colossal_layout(outside, moe_dp, pp, ep, tp):
    world = moe_dp * pp * ep * tp
    dims = ParallelDims(dp=moe_dp * ep, pp=pp, tp=tp, ep=ep, moe_dp_outside=outside,
                        world_size=world)
    want = _colossal_layout(moe_dp, pp, ep, tp, outside)
    assert {r: dims.coords(r) for r in range(world)} == want
    grid = dims.dense_ranks()  # the dense mesh: [dp, pp, sp, tp] -> rank
    for r, c in want.items():
        assert int(grid[c["dp"], c["pp"], 0, c["tp"]]) == r


def test_ep_one_keeps_the_plain_layout():
    """ep = 1 (the default) is the (dp, pp, sp, tp) layout; so is any pp = 1 layout."""
    for dims in (ParallelDims(dp=2, pp=2, sp=2, tp=2, world_size=16),
                 ParallelDims(dp=4, ep=2, tp=2, world_size=8, moe_dp_outside=False)):
        for r in range(dims.world_size):
            c = dims.coords(r)
            assert ((c["dp"] * dims.pp + c["pp"]) * dims.sp + c["sp"]) * dims.tp + c["tp"] == r


def test_sp_lies_between_ep_and_tp():
    dims = ParallelDims(dp=2, ep=2, sp=2, tp=2, world_size=8)
    assert [dims.coords(r)["ep"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.coords(r)["sp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


# (dims, {axis: its group's ranks for each rank}): the 4-rank layouts the worker builds
CASES = {
    "ep4": (dict(dp=4, ep=4), {"ep": [[0, 1, 2, 3]] * 4, "moe_dp": [[0], [1], [2], [3]],
                               "dp": [[0, 1, 2, 3]] * 4}),
    "ep2 x moe_dp2": (dict(dp=4, ep=2), {"ep": [[0, 1], [0, 1], [2, 3], [2, 3]],
                                         "moe_dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                                         "dp": [[0, 1, 2, 3]] * 4}),
    "pp2 x ep2": (dict(dp=2, pp=2, ep=2), {"ep": [[0, 1], [0, 1], [2, 3], [2, 3]],
                                           "pp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                                           "dp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                                           "pp_ep": [[0, 1, 2, 3]] * 4}),
    "pp2 x moe_dp2 outside": (dict(dp=2, pp=2), {"pp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                                                 "moe_dp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                                                 "dp": [[0, 2], [1, 3], [0, 2], [1, 3]]}),
    "pp2 x moe_dp2 inside": (dict(dp=2, pp=2, moe_dp_outside=False),
                             {"pp": [[0, 2], [1, 3], [0, 2], [1, 3]],
                              "moe_dp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                              "dp": [[0, 1], [0, 1], [2, 3], [2, 3]],
                              "ep": [[0], [1], [2], [3]]}),
}


def _groups_worker(rank: int, world: int) -> bool:
    import torch
    import torch.distributed as dist

    for name, (sizes, groups) in CASES.items():
        dims = ParallelDims(world_size=world, **sizes)
        topo = dims.build_mesh("cpu")
        for axis, members in groups.items():
            g = topo.flat_group("pp", "ep") if axis == "pp_ep" else topo.group(axis)
            assert dist.get_process_group_ranks(g) == members[rank], (name, axis, rank)
        for axis in ("dp", "pp", "tp", "ep", "moe_dp"):
            assert topo.rank(axis) == dims.coords(rank)[axis]
            assert topo.size(axis) == dims.size(axis)
        # the groups work: a sum over the ep group is the sum of its members' ranks
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=topo.group("ep"))
        assert t.item() == sum(groups.get("ep", [[rank]] * world)[rank])
        assert topo.submesh("ep").size() == dims.ep
        with pytest.raises(ValueError, match="dp is moe_dp x ep"):
            topo.submesh("dp", "ep")
        with pytest.raises(ValueError, match="unknown mesh dimension 'cp'"):
            topo.group("cp")
    return True


def test_ep_groups_on_4_gloo_ranks():
    assert all(run_distributed(_groups_worker, 4))


def test_old_plugin_paths_are_gone():
    """Expert parallelism and the granular-gather decision live below the plugins (issue 38):
    the re-export modules ``plugins/moe_dispatch.py``, ``plugins/moe_grads.py`` and
    ``plugins/granular_comm.py`` are gone, and every name they carried is defined in
    ``parallel/`` (``MoeDims`` is ``ParallelDims`` with ``ep`` / ``moe_dp_outside``)."""
    for old in ("moe_dispatch", "moe_grads", "granular_comm"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"fp8boost.plugins.{old}")
    for name in ("AllToAll", "EpExperts", "expert_params", "expert_spec_of", "find_experts",
                 "fp8_rows_a2a", "gathered_experts", "shard_experts", "whole_experts",
                 "Stage0Optimizer", "average_over_ep", "reduce_moe_gradients"):
        assert getattr(ep_package, name).__module__.startswith("fp8boost.parallel.ep."), name
    for name in ("block_gathered", "is_granular", "ranks_of", "split_fp8_gather_layers",
                 "report_granular_gather"):
        assert getattr(granular, name).__module__ == "fp8boost.parallel.comm.granular", name
    assert isinstance(granular.GRANULAR_GATHER_WHY, str)
