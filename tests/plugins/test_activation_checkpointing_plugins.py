"""Every plugin with ``use_fp8=True`` (default Fp8Config, weight-cast cache on) and HF's
``gradient_checkpointing_enable()`` on gloo: training runs, and its losses equal those of the same
plugin without checkpointing bit for bit (recomputation changes nothing).

Regression: zero2, gemini and hybrid tp2×pp2 failed in backward with ``CheckpointError:
Recomputed values ... have different metadata than during the forward pass``.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins.hybrid_cases import VOCAB, tiny_model

SEQ, BATCH = 16, 4


def _ids(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _plugin(name: str):
    from fp8boost.fp8 import Fp8Config
    from fp8boost.plugins import (GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin,
                                  TorchDDPPlugin, TorchFSDPPlugin)

    cfg = Fp8Config(backend="emulated", min_numel=0)
    common = dict(use_fp8=True, fp8_config=cfg)
    return {
        "ddp": lambda: TorchDDPPlugin(precision="bf16", **common),
        "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="bf16", **common),
        "gemini": lambda: GeminiPlugin(precision="bf16", **common),
        "fsdp": lambda: TorchFSDPPlugin(precision="bf16", **common),
        "hybrid_tp2": lambda: HybridParallelPlugin(tp_size=2, precision="bf16", **common),
        "hybrid_pp2": lambda: HybridParallelPlugin(pp_size=2, precision="bf16",
                                                   num_microbatches=2, **common),
        "hybrid_tp2_pp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=2, precision="bf16",
                                                       num_microbatches=2, **common),
    }[name]()


def _losses(name: str, base, checkpointing: bool, steps: int = 2) -> list[float]:
    from fp8boost.booster import Booster

    model = copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = _plugin(name)
    booster = Booster(plugin=plugin, device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for s in range(steps):
        ids = _ids(s).chunk(plugin.dp_size)[plugin.dp_rank]
        if plugin.pp_size > 1:
            out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model,
                                           optimizer=opt)
            loss = out["loss"]
        else:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _check(rank: int, world: int, names: list[str]) -> dict:
    base = tiny_model("llama", layers=2)
    out = {}
    for name in names:
        ref = _losses(name, base, checkpointing=False)
        got = _losses(name, base, checkpointing=True)
        assert got == ref, (name, got, ref)
        out[name] = got
    return out


def test_fp8_activation_checkpointing_every_plugin_two_ranks():
    res = run_distributed(_check, 2, ["ddp", "zero2", "gemini", "fsdp", "hybrid_tp2",
                                      "hybrid_pp2"])
    assert set(res[0]) == {"ddp", "zero2", "gemini", "fsdp", "hybrid_tp2", "hybrid_pp2"}


def test_fp8_activation_checkpointing_hybrid_tp2_pp2_four_ranks():
    res = run_distributed(_check, 4, ["hybrid_tp2_pp2"])
    assert "hybrid_tp2_pp2" in res[0]
