"""Pipeline building blocks in one process: layouts, the hand split, FP8 stage boundaries.

The boundary tests are exact: what a stage receives must be bit-identical to "quantize, then
dequantize" of what the other stage sent, computed here from first principles (amax ->
power-of-two scale -> saturating cast -> multiply by the inverse scale).
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch

from fp8boost.fp8.scaling import fp8_max, scale_from_amax
from fp8boost.parallel.comm.config import Fp8CommConfig
from fp8boost.parallel.pipeline import (BoundaryPlan, build_stage_modules, decode_fp8,
                                        encode_fp8, make_layout, strip_to_rank)
from fp8boost.parallel.pipeline.boundary import container_numel
from tests.plugins.pipeline_cases import tiny_model

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _qdq(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    amax = x.detach().abs().max().float()
    scale = scale_from_amax(amax, dt, 0, True)
    m = fp8_max(dt)
    q = (x.float() * scale).clamp(-m, m).to(dt)
    return (q.float() * scale.reciprocal()).to(x.dtype)


def test_layouts() -> None:
    lay = make_layout(8, 4, num_chunks=2, style="interleaved")
    assert [lay.stages_of(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.last_rank == 3 and lay.layers[5] == (5,)
    v = make_layout(8, 4, num_chunks=2, style="zbv")
    assert [v.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert v.last_rank == 0
    assert make_layout(6, 2, num_layers_per_stage=[2, 4]).layers == ((0, 1), (2, 3, 4, 5))
    with pytest.raises(ValueError, match="do not split evenly"):
        make_layout(6, 4)
    with pytest.raises(ValueError, match="sums to"):
        make_layout(6, 2, num_layers_per_stage=[2, 3])


def test_microbatch_count() -> None:
    from fp8boost.parallel.pipeline import microbatch_count

    assert microbatch_count(8, 4, None) == 4 and microbatch_count(8, None, 2) == 4
    with pytest.raises(ValueError, match="num_microbatches=3"):
        microbatch_count(8, 3, None)
    with pytest.raises(ValueError, match="microbatch_size=3"):
        microbatch_count(8, None, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_boundary_is_quantize_dequantize(dtype) -> None:
    torch.manual_seed(0)
    cfg = Fp8CommConfig(min_payload_numel=0)
    x = (torch.randn(3, 5, 24) * torch.logspace(-3, 2, 24)).to(dtype)
    for dt in (E4M3, E5M2):
        c = encode_fp8(x, dt, cfg)
        assert c.dtype == torch.float32 and c.shape == (container_numel(x.numel()),)
        assert c._base is None  # torch's schedules detach stage outputs in place
        assert torch.equal(decode_fp8(c, x.shape, dtype, dt, cfg), _qdq(x, dt))
    # Through autograd, as the stages run it: forward e4m3, backward e5m2.
    plan = BoundaryPlan(enabled=True, cfg=cfg)
    x.requires_grad_(True)
    wire = plan.encode(x, 0)
    received = wire.detach().requires_grad_(True)  # what torch's recv buffer holds
    h = plan.decode(received, 0, tuple(x.shape), dtype)
    assert torch.equal(h, _qdq(x.detach(), E4M3))
    g = (torch.randn(x.shape) * 1e-3).to(dtype)
    h.backward(g)
    wire.backward(received.grad)  # the gradient message travels back to the sender
    assert torch.equal(x.grad, _qdq(g, E5M2))
    assert plan.report["stage 0->1"].startswith("FP8")


def test_boundary_fallbacks_are_reported_and_logged(caplog) -> None:
    x = torch.randn(2, 4, 8)
    plan = BoundaryPlan(enabled=True, cfg=Fp8CommConfig(min_payload_numel=1000),
                        same_rank={1: True})
    with caplog.at_level(logging.INFO, logger="fp8boost.parallel.pipeline"):
        assert plan.encode(x, 0) is x  # 64 elements < min_payload_numel
        assert plan.encode(x, 1) is x  # both stages on one rank
    assert "min_payload_numel" in plan.report["stage 0->1"]
    assert "one rank" in plan.report["stage 1->2"]
    assert "stays in the training dtype" in caplog.text
    off = BoundaryPlan(enabled=False, cfg=Fp8CommConfig(min_payload_numel=0))
    assert off.wire_meta(0, (2, 4, 8), torch.bfloat16) == ((2, 4, 8), torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
# No FutureWarning: transformers 5.24 deprecated the past_key_values keyword the stages passed,
# and warned on every rank of every pipeline run (issue 39 item 6).
@pytest.mark.filterwarnings("error::FutureWarning")
def test_hand_split_stages_chain_to_the_full_model(arch) -> None:
    model = tiny_model(4, arch, tie=True)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    layout = make_layout(4, 2, num_chunks=2, style="zbv")  # rank 0: stages 0, 3; rank 1: 1, 2
    plan = BoundaryPlan(enabled=False, cfg=Fp8CommConfig())
    parts, mods = [], {}
    for rank in (0, 1):
        m = copy.deepcopy(model)
        weight_ids = {id(p) for p in m.parameters()}
        strip_to_rank(m, layout, rank)
        assert {id(p) for p in m.parameters()} <= weight_ids  # kept Parameters are the same objects
        parts.append(m)
        mods.update({s.index: s for s in build_stage_modules(m, layout, rank, plan,
                                                             torch.float32)})
    names0 = {n for n, _ in parts[0].named_parameters()}
    assert "model.embed_tokens.weight" in names0 and "model.layers.3.mlp.up_proj.weight" in names0
    assert not any(".layers.1." in n for n in names0) and parts[1].lm_head is None
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        h = ids
        for s in range(4):
            h = mods[s](h, position_ids=pos)
    assert torch.equal(h, want)
