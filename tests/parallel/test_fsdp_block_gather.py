"""FSDP2's FP8 all-gather of blockwise weights with their block scales (issue 26, item 3).

gloo, 2 ranks, emulated backend. What the block gather promises, and how each is checked:

* the unsharded weight FSDP installs is a block-scaled ``Fp8WeightTensor`` whose bytes and
  scales are exactly the layer's own blockwise cast of the full weight (each rank cast only its
  shard: the blocks never straddle ranks), also with partial blocks along K;
* the layer never casts that weight (forward and backward: the GEMMs take the carrier's bytes
  and their transpose), and no amax all-reduce runs at all;
* the forward output is bit-identical to one process holding the full weights, and training
  matches one process running the ranks' batches as micro-batches (losses to 1e-6 relative,
  gradients and weights to 1e-6: only the FP32 gradient average's order differs);
* later steps refill the same unsharded weight (FSDP's ``out=`` path);
* a weight whose shards would split a block, or that FSDP shards unevenly, is left out, with
  the reason.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from tests.parallel.granular_spy import GranularCastSpy

E4M3 = torch.float8_e4m3fn
BLOCK_LAYERS = (0, 2)  # [256, 200]: 128-row shards, partial K blocks; [512, 256]


def _model(seed: int = 0) -> nn.Sequential:
    from fp8boost.fp8 import Fp8Config, Fp8Linear
    cfg = Fp8Config.from_recipe("blockwise", backend="emulated", min_numel=0)
    torch.manual_seed(seed)
    return nn.Sequential(Fp8Linear(200, 256, config=cfg), nn.Tanh(),
                         Fp8Linear(256, 512, config=cfg), nn.Tanh(),
                         Fp8Linear(512, 100, config=cfg))  # 50-row shards: left out


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 200, generator=g)
    x[:, 9] *= 200.0
    return x, torch.randn(8, 100, generator=g)


def _worker(rank: int, ws: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8boost.fp8.granular import quantize_blocks
    from fp8boost.fp8.prequantized import Fp8WeightTensor
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.block_gather import block_gather_unfit
    from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather

    model = _model()
    ref = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (ws,))
    names = enable_fp8_all_gather(model, Fp8CommConfig(min_payload_numel=0),
                                  lambda mod, fqn: block_gather_unfit(mod, ws) is None)
    for mod in model:
        if mod._parameters.get("weight") is not None:
            fully_shard(mod, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen: dict = {}
    for i in BLOCK_LAYERS:
        model[i].register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(
            i, (m.weight, m.weight.fp8_data.clone(), m.weight.inv_scale.clone())))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, ref))
    out = {"names": names, "bytes": [], "same_object": [], "exact_out": [], "loss_rel": [],
           "grad_rel": [], "weight_casts": [], "reduces": []}
    first: dict = {}
    for step in range(3):
        x, y = _batch(rank, step)
        full = {i: model[i].weight.full_tensor().detach() for i in range(0, 5, 2)}
        single = copy.deepcopy(ref)
        with torch.no_grad():
            for i in full:
                single[i].weight.copy_(full[i])
        with GranularCastSpy() as spy:
            pred = model(x)
            loss = nn.functional.mse_loss(pred, y)
            loss.backward()
        out["weight_casts"].append(spy.weight_casts)  # the left-out layer casts twice
        out["reduces"].append(spy.reduces)
        out["exact_out"].append(torch.equal(pred, single(x)))
        for i in BLOCK_LAYERS:
            w, data, inv = seen[i]
            want = quantize_blocks(full[i], E4M3, block=128)
            nb = want.inv_scale.shape[0]
            out["bytes"].append(isinstance(w, Fp8WeightTensor) and w.block == 128
                                and torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
                                and torch.equal(inv[:nb], want.inv_scale))
            out["same_object"].append(first.setdefault(i, w) is w)
        ref_losses = []
        for r in range(ws):
            xr, yr = _batch(r, step)
            lr_ = nn.functional.mse_loss(ref(xr), yr)
            (lr_ / ws).backward()
            ref_losses.append(lr_.item())
        out["loss_rel"].append(abs(loss.item() - ref_losses[rank]) / ref_losses[rank])
        out["grad_rel"].append(max(
            float((model[i].weight.grad.full_tensor() - ref[i].weight.grad).norm()
                  / ref[i].weight.grad.norm()) for i in range(0, 5, 2)))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["weight_rel"] = max(float((model[i].weight.full_tensor() - ref[i].weight).norm()
                                  / ref[i].weight.norm()) for i in range(0, 5, 2))
    return out


def test_fsdp_gathers_blockwise_weights_with_block_scales_2_ranks():
    for rank, r in enumerate(run_distributed(_worker, 2, timeout=200)):
        assert r["names"] == ["0.weight", "2.weight"], r["names"]
        assert all(r["bytes"]) and all(r["same_object"]) and all(r["exact_out"]), (rank, r)
        # only the left-out layer casts its weight (fprop + dgrad re-cast); no amax all-reduce
        assert r["weight_casts"] == [2, 2, 2] and r["reduces"] == [0, 0, 0], (rank, r)
        assert max(r["loss_rel"]) < 1e-6 and max(r["grad_rel"]) < 1e-6, (rank, r)
        assert r["weight_rel"] < 1e-6, (rank, r)


def test_block_gather_conditions_name_the_reason():
    from fp8boost.fp8 import Fp8Config, Fp8Linear
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.block_gather import block_gather_unfit
    from fp8boost.parallel.fsdp.gather_plan import choose_plan
    model = _model()
    assert block_gather_unfit(model[0], 2) is None and block_gather_unfit(model[2], 2) is None
    assert "straddle" in block_gather_unfit(model[4], 2)
    assert "straddle" in block_gather_unfit(model[0], 4)  # 64-row shards
    assert "evenly" in block_gather_unfit(Fp8Linear(256, 255, config=model[0].fp8_config), 2)
    assert "tied" in block_gather_unfit(model[0], 2, tied=True)
    assert "param_dtype" in block_gather_unfit(model[0], 2, torch.float8_e5m2)
    rowwise = Fp8Linear(256, 256, config=Fp8Config.from_recipe("rowwise", backend="emulated"))
    assert "not a blockwise" in block_gather_unfit(rowwise, 2)
    plan = choose_plan(Fp8CommConfig(), False, model[0], torch.Size([256, 200]), 2)
    assert plan.direct and plan.block == 128 and plan.fp8_dtype == E4M3
    left_out = choose_plan(Fp8CommConfig(), False, model[4], torch.Size([100, 512]), 2)
    assert not left_out.direct and "straddle" in left_out.reason


@pytest.mark.parametrize("view", ["narrow", "transpose"])
def test_block_carrier_keeps_blocks_only_for_leading_row_views(view):
    from fp8boost.fp8.granular import quantize_blocks
    from fp8boost.fp8.prequantized import Fp8WeightTensor
    w = torch.randn(256, 200)
    q = quantize_blocks(w, E4M3, block=128)
    c = Fp8WeightTensor(q.data, q.inv_scale, torch.float32, block=128)
    if view == "narrow":  # what FSDP does to its padded all-gather output
        v = c.as_strided((200, 200), (200, 1), 0)
        assert isinstance(v, Fp8WeightTensor) and v.block == 128
        assert torch.equal(v.dequantize(), q.dequantize()[:200])
    else:  # a transpose would move bytes away from their scales: the dequantized value
        with pytest.warns(UserWarning, match="dequantized value"):
            v = c.t()
        assert type(v) is torch.Tensor and torch.equal(v, q.dequantize().t())
