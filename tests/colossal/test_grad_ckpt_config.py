"""Issue 25 item 2: ``gradient_checkpoint_config`` is a real mapping: with HF checkpointing on,
only the first k decoder layers of each stage keep recomputing (Colossal-AI's rule)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fp8boost.colossal.shardformer import (GradientCheckpointConfig,
                                           PipelineGradientCheckpointConfig)
from fp8boost.parallel.pipeline import make_layout
from fp8boost.plugins.grad_ckpt import apply_checkpointing, plan_checkpointing
from tests.dist_utils import run_distributed


class Block(nn.Module):
    def __init__(self, on: bool = True) -> None:
        super().__init__()
        self.gradient_checkpointing = on


def test_config_semantics_and_validation():
    cfg = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[3, 1, 0, 2])
    assert cfg.get_num_ckpt_layers(1, 2, 4, model_chunk_id=1, num_model_chunks=2) == 2
    assert PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5) \
        .get_num_ckpt_layers(0, 2, 5) == 2
    assert GradientCheckpointConfig(0.25).get_num_ckpt_layers(8) == 2
    with pytest.raises(ValueError, match="0% to 100%"):
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.5)
    with pytest.raises(ValueError, match="list of ints >= 0"):
        PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, -1])
    with pytest.raises(ValueError, match="entries"):
        cfg.get_num_ckpt_layers(0, 2, 4)  # 4 entries, 2 stages x 1 chunk
    with pytest.raises(ValueError, match="holds 2"):
        cfg.get_num_ckpt_layers(0, 4, 2)
    with pytest.raises(Exception):
        cfg.gradient_checkpointing_ratio = 0.1  # frozen


def test_plan_per_pipeline_stage_first_layers():
    layers = [Block() for _ in range(8)]
    layout = make_layout(8, 2)  # stages [0..3], [4..7]
    flags = plan_checkpointing(layers, PipelineGradientCheckpointConfig(
        num_ckpt_layers_per_stage=[3, 1]), layout)
    assert flags == [True, True, True, False, True, False, False, False]
    flags = plan_checkpointing(layers, PipelineGradientCheckpointConfig(
        gradient_checkpointing_ratio=0.5), layout)
    assert flags == [True, True, False, False, True, True, False, False]
    apply_checkpointing(layers, flags)
    assert [b.gradient_checkpointing for b in layers] == flags
    with pytest.raises(ValueError, match="num_stages=4"):
        plan_checkpointing(layers, PipelineGradientCheckpointConfig(
            gradient_checkpointing_ratio=0.5, num_stages=4), layout)
    # checkpointing off everywhere: nothing to select (INFO), flags untouched
    assert plan_checkpointing([Block(False)] * 3, GradientCheckpointConfig(1.0)) is None


def _train(model, plugin_kwargs, steps=2):
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin
    from tests.plugins.hybrid_cases import VOCAB

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=HybridParallelPlugin(precision="bf16", **plugin_kwargs),
                      device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    flags = [layer.gradient_checkpointing for layer in model.unwrap().model.layers]
    losses = []
    for s in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(s))
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return flags, losses


def _check(rank: int, world: int) -> dict:
    from tests.plugins.hybrid_cases import tiny_model

    base = tiny_model("llama", layers=4)
    ckpt = copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
    flags, got = _train(ckpt, dict(gradient_checkpoint_config=cfg))
    _, ref = _train(copy.deepcopy(base), {})
    return dict(flags=flags, got=got, ref=ref)


def test_boost_sets_flags_per_layer_and_training_is_unchanged():
    res = run_distributed(_check, 1)[0]
    assert res["flags"] == [True, True, False, False]
    assert res["got"] == res["ref"]  # recomputation changes nothing
    assert not dist.is_initialized()
