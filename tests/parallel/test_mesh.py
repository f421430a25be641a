"""ParallelDims validation, and the named mesh on 4 gloo ranks: groups, coordinates, and the
ZeRO optimizer and DDP working over a dp group that is not the world."""
from __future__ import annotations

import pytest
import torch

from fp8boost.parallel.mesh import ParallelDims
from tests.dist_utils import run_distributed


def test_dims_validate_and_infer():
    assert ParallelDims(dp=2, pp=2, tp=2, world_size=8).coords(5) == {
        "dp": 1, "pp": 0, "sp": 0, "tp": 1, "ep": 0, "moe_dp": 1}  # ep = 1: moe_dp is dp
    assert ParallelDims.for_world(8, pp=2, tp=2).dp == 2
    with pytest.raises(ValueError, match=r"dp \(2\) x pp \(1\) x tp \(3\) = 6 must equal the world size \(4\)"):
        ParallelDims(dp=2, tp=3, world_size=4)
    with pytest.raises(ValueError, match="must divide the world size"):
        ParallelDims.for_world(6, tp=4)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="tp must be an int >= 1"):
            ParallelDims(tp=bad, world_size=1)
    with pytest.raises(ValueError, match="outside"):
        ParallelDims(world_size=2, dp=2).coords(2)
    with pytest.raises(Exception):  # frozen
        ParallelDims().dp = 2  # type: ignore[misc]


def _mesh_worker(rank: int, world: int):
    import torch.distributed as dist
    import torch.nn.functional as F

    from fp8boost.parallel.zero import ZeroOptimizer
    from tests.plugins.helpers import global_batch, make_mlp

    topo = ParallelDims(dp=2, pp=1, tp=2, world_size=4).build_mesh("cpu")
    # tp innermost: {0,1} and {2,3} are tp groups, {0,2} and {1,3} dp groups.
    assert dist.get_process_group_ranks(topo.group("tp")) == [rank - rank % 2, rank - rank % 2 + 1]
    assert dist.get_process_group_ranks(topo.group("dp")) == [rank % 2, rank % 2 + 2]
    assert (topo.rank("dp"), topo.rank("tp")) == (rank // 2, rank % 2)
    assert topo.size("dp") == 2 and topo.size("pp") == 1
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        topo.group("cp")  # ep and moe_dp are axes too: tests/parallel/test_mesh_ep.py

    dp_group, dp_rank = topo.group("dp"), topo.rank("dp")
    # ZeRO-2 over the dp group only: each dp rank takes half of the global batch. The two dp
    # groups train side by side; both must equal one process on the whole batch.
    model = make_mlp(seed=3)
    ref = make_mlp(seed=3)
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), dp_group=dp_group, stage=2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = global_batch(step)
        half = x.shape[0] // 2
        loss = F.mse_loss(model(x[dp_rank * half:(dp_rank + 1) * half]),
                          y[dp_rank * half:(dp_rank + 1) * half])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        # FP32 throughout: only the order of the two half-batch gradient sums differs.
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)

    # DDP over the dp group through the plugin's own mesh (the plugin builds it itself).
    from fp8boost.booster import Booster
    from fp8boost.plugins import TorchDDPPlugin

    plugin = TorchDDPPlugin(precision="fp32")
    assert (plugin.dp_size, plugin.dp_rank) == (4, rank)  # a DDP plugin's dp is the world
    booster = Booster(plugin=plugin, device="cpu")
    ddp_model = make_mlp(seed=4)
    m, o, *_ = booster.boost(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1))
    assert dist.get_process_group_ranks(plugin.dp_group) == [0, 1, 2, 3]
    loader = plugin.prepare_dataloader(list(range(16)), batch_size=2)
    assert [int(v) for b in loader for v in b] == list(range(rank, 16, 4))
    return True


def test_mesh_groups_and_dp_subgroup_training_4_ranks():
    assert all(run_distributed(_mesh_worker, 4))
