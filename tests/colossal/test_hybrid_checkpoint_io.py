"""``HybridParallelCheckpointIO`` / ``MoECheckpointIO``: what the Colossal-AI hybrid and MoE
plugins' ``get_checkpoint_io()`` and ``booster.checkpoint_io`` return, with Colossal-AI's method
names and signatures over the plugin's own checkpoint IO.

One process (fp8boost's one-process gloo group, destroyed by the fixture), fp32 Adam with a
scheduler: a model file, a sharded model folder, the optimizer and the scheduler saved through
the Colossal-AI signatures load back bit for bit after another step; fp8boost's own
``Booster`` calls on the same object (``save_model(model, path, shard, size_mb)``,
``save_checkpoint``) keep working; the optimizer is saved in the plugin's re-shardable folder
even with ``shard=False`` (one file of rank 0's state would lose the other tp ranks' parts).
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed
from tests.plugins import helpers as H

# Colossal-AI v0.5.0's CheckpointIO signatures (colossalai/checkpoint_io/checkpoint_io_base.py)
SIGNATURES = {
    "save_model": ["model", "checkpoint", "shard", "gather_dtensor", "prefix", "size_per_shard",
                   "use_safetensors", "use_async"],
    "load_model": ["model", "checkpoint", "strict", "low_cpu_mem_mode", "num_threads"],
    "save_optimizer": ["optimizer", "checkpoint", "shard", "gather_dtensor", "prefix",
                       "size_per_shard", "use_async"],
    "load_optimizer": ["optimizer", "checkpoint", "prefix", "low_cpu_mem_mode", "num_threads"],
    "save_lr_scheduler": ["lr_scheduler", "checkpoint"],
    "load_lr_scheduler": ["lr_scheduler", "checkpoint"],
}


def _run(plugin):
    from fp8boost.colossal.booster import Booster

    booster = Booster(plugin=plugin)
    moe = type(plugin).__name__ == "MoeHybridParallelPlugin"
    if moe:
        from tests.plugins.test_moe_plugin import batch, tiny
        model = tiny("mixtral")
    else:
        model = H.make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)

    def step(s: int) -> None:
        if moe:
            loss = model(input_ids=batch(s), labels=batch(s)).loss
        else:
            x, y = H.global_batch(s)
            loss = F.mse_loss(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()

    return booster, model, opt, sched, step


def _snapshot(model, opt, sched):
    return ({k: v.clone() for k, v in model.unwrap().state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            sched.state_dict())


def _assert_restored(model, opt, sched, snap) -> None:
    weights, state, sched_state = snap
    now = model.unwrap().state_dict()
    assert now.keys() == weights.keys()
    assert all(torch.equal(now[k], weights[k]) for k in weights)
    got = opt.state_dict()["state"]
    assert got.keys() == state.keys()
    for i, s in state.items():
        assert all(torch.equal(got[i][k], v) for k, v in s.items()), i
    assert sched.state_dict() == sched_state


@pytest.mark.parametrize("moe", [False, True], ids=["hybrid", "moe"])
def test_get_checkpoint_io_is_colossal_class_and_round_trips(group, tmp_path, moe):
    from fp8boost.colossal.booster import plugin as plugins
    from fp8boost.colossal.checkpoint_io import (GeneralCheckpointIO, HybridParallelCheckpointIO,
                                                 MoECheckpointIO)
    from fp8boost.checkpoint_io import HybridCheckpointIO
    from fp8boost.checkpoint_io.moe import MoeCheckpointIO as NativeMoe

    plugin = (plugins.MoeHybridParallelPlugin(ep_size=1, zero_stage=1, precision="fp32") if moe
              else plugins.HybridParallelPlugin(tp_size=1, zero_stage=1, precision="fp32"))
    booster, model, opt, sched, step = _run(plugin)
    step(0)

    io = plugin.get_checkpoint_io()
    # Colossal-AI's hierarchy: MoECheckpointIO < HybridParallelCheckpointIO < GeneralCheckpointIO
    assert isinstance(io, HybridParallelCheckpointIO) and isinstance(io, GeneralCheckpointIO)
    assert isinstance(io, MoECheckpointIO) is moe
    assert isinstance(io.native, NativeMoe if moe else HybridCheckpointIO)
    assert type(booster.checkpoint_io) is type(io) and io.plugin is plugin
    for name, params in SIGNATURES.items():
        assert list(inspect.signature(getattr(io, name)).parameters) == params, name

    model_file, folder = str(tmp_path / "model.safetensors"), str(tmp_path / "sharded")
    optim_path, sched_path = str(tmp_path / "optim.bin"), str(tmp_path / "sched.pt")
    io.save_model(model, model_file)  # Colossal-AI's default shard=False: one file
    io.save_model(model, folder, shard=True, size_per_shard=1)
    io.save_optimizer(optimizer=opt, checkpoint=optim_path)
    io.save_lr_scheduler(sched, sched_path)
    for wait in (io._sync_d2h, io._sync_io, io.synchronize):  # saves are synchronous
        assert wait() is None
    assert os.path.isfile(model_file) and os.path.isfile(sched_path)
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert os.path.isdir(optim_path)  # the plugin's re-shardable format, shard or not
    snap = _snapshot(model, opt, sched)

    for source in (model_file, folder):
        step(1)  # move away, then back
        assert io.load_model(model, source) is model
        io.load_optimizer(opt, optim_path)
        io.load_lr_scheduler(sched, sched_path)
        _assert_restored(model, opt, sched, snap)

    # the same object is the plugin's checkpoint IO for fp8boost's Booster calls
    booster.save_model(model, str(tmp_path / "b.safetensors"))
    booster.save_checkpoint(str(tmp_path / "state"), model, opt, sched, extra={"step": 1})
    io.save_model(model, str(tmp_path / "native"), True, 1)  # fp8boost's (path, shard, size_mb)
    assert os.path.isfile(os.path.join(tmp_path, "native", "model.safetensors.index.json"))
    step(2)
    assert booster.load_checkpoint(str(tmp_path / "state"), model, opt, sched) == {"step": 1}
    _assert_restored(model, opt, sched, snap)
    booster.load_model(model, str(tmp_path / "b.safetensors"))
    with pytest.raises(TypeError, match="gather_dtensor must be True or False"):
        io.save_model(model, model_file, False, "yes")
    with pytest.raises(TypeError, match="shard must be True or False"):
        io.save_optimizer(opt, optim_path, "no")
    with pytest.raises(TypeError, match="low_cpu_mem_mode must be True or False"):
        io.load_optimizer(opt, optim_path, None, "no")


def _tp2_rank(rank: int, world: int, root: str) -> bool:
    """tp2 (2 ranks, each one half of every split weight and its Adam state): the Colossal-AI
    calls save each rank's part and load it back bit for bit."""
    from safetensors.torch import load_file

    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster.plugin import HybridParallelPlugin
    from fp8boost.colossal.checkpoint_io import HybridParallelCheckpointIO
    from tests.plugins.hybrid_cases import global_batch, tiny_model

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, zero_stage=1, precision="fp32"))
    full_shapes = {k: v.shape for k, v in tiny_model().state_dict().items()}
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)

    def step(s: int) -> None:
        ids = global_batch(s)
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()

    step(0)
    io = booster.checkpoint_io
    assert isinstance(io, HybridParallelCheckpointIO)
    model_file = os.path.join(root, "model.safetensors")
    io.save_model(model, model_file)
    io.save_optimizer(opt, os.path.join(root, "optim.bin"))  # shard=False, as Colossal-AI's
    io.save_lr_scheduler(sched, os.path.join(root, "sched.pt"))
    snap = _snapshot(model, opt, sched)
    assert any(snap[0][k].shape != full_shapes[k] for k in full_shapes)  # tp-split slices
    if rank == 0:  # the file holds the gathered weights
        assert {k: v.shape for k, v in load_file(model_file).items()} == full_shapes
    step(1)
    io.load_model(model, model_file)
    io.load_optimizer(opt, os.path.join(root, "optim.bin"))
    io.load_lr_scheduler(sched, os.path.join(root, "sched.pt"))
    _assert_restored(model, opt, sched, snap)
    return True


def test_tp2_saves_and_restores_every_ranks_part(tmp_path):
    assert run_distributed(_tp2_rank, 2, str(tmp_path)) == [True, True]


def test_checkpoint_io_for_picks_the_class_by_plugin():
    from fp8boost import plugins
    from fp8boost.colossal.booster import plugin as colossal_plugins
    from fp8boost.colossal.checkpoint_io import (GeneralCheckpointIO, HybridParallelCheckpointIO,
                                                 MoECheckpointIO, checkpoint_io_for)
    from fp8boost.checkpoint_io import HybridCheckpointIO

    # fp8boost's own plugin classes (no Colossal-AI get_checkpoint_io) get the same classes
    assert type(checkpoint_io_for(plugins.HybridParallelPlugin(tp_size=1))) \
        is HybridParallelCheckpointIO
    assert type(checkpoint_io_for(plugins.MoeHybridParallelPlugin(ep_size=1))) is MoECheckpointIO
    assert not isinstance(plugins.HybridParallelPlugin(tp_size=1).get_checkpoint_io(),
                          GeneralCheckpointIO)  # fp8boost's plugin keeps its own interface
    for plugin in (plugins.LowLevelZeroPlugin(), colossal_plugins.LowLevelZeroPlugin(),
                   colossal_plugins.TorchDDPPlugin()):
        io = checkpoint_io_for(plugin)
        assert type(io) is GeneralCheckpointIO and io.plugin is plugin
    # built by hand over a Colossal-AI-facing plugin: the native IO is the one it wraps
    io = HybridParallelCheckpointIO(colossal_plugins.HybridParallelPlugin(tp_size=1))
    assert type(io.native) is HybridCheckpointIO


def test_long_module_paths():
    from fp8boost.colossal import checkpoint_io
    from fp8boost.colossal.checkpoint_io.hybrid_parallel_checkpoint_io import \
        HybridParallelCheckpointIO
    from fp8boost.colossal.checkpoint_io.moe_checkpoint import MoECheckpointIO

    assert checkpoint_io.HybridParallelCheckpointIO is HybridParallelCheckpointIO
    assert checkpoint_io.MoECheckpointIO is MoECheckpointIO
    assert issubclass(MoECheckpointIO, HybridParallelCheckpointIO)
    # colossalai/checkpoint_io/__init__.py's names (CheckpointIndexFile, an internal, aside)
    for name in ("CheckpointIO", "GeneralCheckpointIO", "HybridParallelCheckpointIO",
                 "MoECheckpointIO"):
        assert name in checkpoint_io.__all__
