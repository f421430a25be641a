"""Colossal-AI's runtime names on fp8boost (issue 25, item 3): the Booster's checkpoint
keyword arguments, one-file ``save_model(shard=False)``, ``prepare_dataloader`` with
``distributed_sampler_cls``, and ``plugin.stage_manager`` (2 gloo ranks, pp_size=2)."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.utils.data import DistributedSampler

from fp8boost.booster import Booster
from fp8boost.plugins import HybridParallelPlugin, TorchDDPPlugin
from tests.dist_utils import run_distributed
from tests.plugins import helpers as H


def _boosted(seed=0):
    booster = Booster(mixed_precision="bf16", device="cpu")
    m = H.make_mlp(seed)
    m, o, *_ = booster.boost(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
    return booster, m, o


def _same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.unwrap().parameters(),
                                                 b.unwrap().parameters()))


def test_colossal_keyword_names_bind_and_round_trip(tmp_path, caplog):
    b1, m1, o1 = _boosted(0)
    H.train(b1, m1, o1, 0, 1, 2)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(H.make_mlp().parameters(), lr=1), 1)
    sched.optimizer.step()
    sched.step()
    with caplog.at_level(logging.INFO, logger="fp8boost.booster"):
        b1.save_model(m1, checkpoint=str(tmp_path / "m"), shard=True, gather_dtensor=True,
                      prefix=None, size_per_shard=1024, use_safetensors=False, use_async=False)
        b1.save_optimizer(o1, checkpoint=str(tmp_path / "o"), shard=True, gather_dtensor=True,
                          prefix=None, size_per_shard=1024, use_async=False)
        b1.save_lr_scheduler(sched, checkpoint=str(tmp_path / "s.pt"))
    assert "use_safetensors" in caplog.text  # said once, still safetensors
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / "m"))
    b2, m2, o2 = _boosted(1)
    sched2 = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(H.make_mlp().parameters(), lr=1), 1)
    b2.load_model(m2, checkpoint=str(tmp_path / "m"), strict=True, low_cpu_mem_mode=True,
                  num_threads=1)
    b2.load_optimizer(o2, checkpoint=str(tmp_path / "o"), low_cpu_mem_mode=True, num_threads=1)
    b2.load_lr_scheduler(sched2, checkpoint=str(tmp_path / "s.pt"))
    assert _same_weights(m1, m2)
    assert all(torch.equal(a, b) for a, b in zip(o1.masters, o2.masters))
    assert sched2.state_dict() == sched.state_dict()
    # fp8boost's own names and positional use still work
    b2.save_model(m2, path=str(tmp_path / "p"), size_per_shard_mb=1)
    b2.load_model(m2, str(tmp_path / "p"))
    b2.save_optimizer(o2, str(tmp_path / "o2"), shard=False)  # the same per-rank directory
    b2.load_optimizer(o2, path=str(tmp_path / "o2"))
    with pytest.raises(TypeError, match="both checkpoint= and path="):
        b2.load_model(m2, checkpoint=str(tmp_path / "p"), path=str(tmp_path / "p"))
    with pytest.raises(TypeError, match="gather_dtensor must be True or False"):
        b2.save_model(m2, str(tmp_path / "q"), True, 512)  # the old 4th positional argument
    with pytest.raises(TypeError, match="different values"):
        b2.save_model(m2, str(tmp_path / "q"), size_per_shard=1, size_per_shard_mb=2)


def test_unsharded_save_is_one_file_and_round_trips(tmp_path):
    b1, m1, o1 = _boosted(0)
    H.train(b1, m1, o1, 0, 1, 2)
    for name in ("model.safetensors", "model.pt", "weights.bin"):
        target = tmp_path / "ckpt" / name
        b1.save_model(m1, str(target), shard=False)
        assert target.is_file()
        assert not [f for f in os.listdir(tmp_path / "ckpt") if f.startswith(".")]  # no temp left
        b1.save_model(m1, target, shard=False)  # overwrites the file
        b2, m2, _ = _boosted(1)
        b2.load_model(m2, str(target))
        assert _same_weights(m1, m2)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["model.pt", "model.safetensors",
                                                     "weights.bin"]
    # a torch.save state dict (Colossal-AI's use_safetensors=False file) loads too
    torch.save(m1.unwrap().state_dict(), tmp_path / "colossal.pt")
    b3, m3, _ = _boosted(2)
    b3.load_model(m3, str(tmp_path / "colossal.pt"))
    assert _same_weights(m1, m3)
    torch.save({"step": torch.tensor(1), "nested": {"a": 1}}, tmp_path / "notsd.pt")
    with pytest.raises(ValueError, match="not a model state dict"):
        b3.load_model(m3, str(tmp_path / "notsd.pt"))
    bad = tmp_path / "ckpt" / "weights.bin"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated: the error names the user's file
    with pytest.raises(Exception, match=str(bad)) as info:
        b1.load_model(m1, str(bad))
    assert "fp8boost-load" not in str(info.value)
    other = H.make_mlp(0)
    other[0] = torch.nn.Linear(32, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        Booster(device="cpu").load_model(other, str(tmp_path / "ckpt" / "model.pt"))
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))  # a plain state dict file
    assert set(sd) == set(m1.unwrap().state_dict())
    # a directory path keeps fp8boost's unsharded layout (a folder holding model.safetensors)
    b1.save_model(m1, str(tmp_path / "dir"), shard=False)
    assert "model.safetensors" in os.listdir(tmp_path / "dir")
    (tmp_path / "adir.pt").mkdir()
    b1.save_model(m1, str(tmp_path / "adir.pt"), shard=False)  # an existing directory stays one
    assert "model.safetensors" in os.listdir(tmp_path / "adir.pt")


def test_prepare_dataloader_colossal_signature():
    class Stateful(DistributedSampler):
        pass

    plugin = TorchDDPPlugin()
    loader = plugin.prepare_dataloader(list(range(10)), 2, shuffle=True, seed=7, drop_last=True,
                                       pin_memory=False, num_workers=0,
                                       distributed_sampler_cls=Stateful)
    assert type(loader.sampler) is Stateful
    s = loader.sampler
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (1, 0, True, 7, True)
    assert sorted(int(v) for b in loader for v in b) == list(range(10))
    plain = plugin.prepare_dataloader(list(range(10)), 2, shuffle=True, seed=7, pin_memory=False,
                                      num_workers=0)
    assert type(plain.sampler) is DistributedSampler and plain.sampler.seed == 7
    assert [b.tolist() for b in plain] == [b.tolist() for b in loader]
    with pytest.raises(TypeError, match="DistributedSampler subclass"):
        plugin.prepare_dataloader(list(range(10)), 2, distributed_sampler_cls=object)


def test_stage_manager_none_at_pp1():
    assert HybridParallelPlugin(tp_size=1, pp_size=1).stage_manager is None


def _stage_manager(rank, world, tmp):
    from tests.plugins.pipeline_cases import tiny_model
    plugin = HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp32")
    before = plugin.stage_manager  # readable before boost, as in Colossal-AI
    model = tiny_model(2)
    booster = Booster(plugin=plugin, device="cpu")
    wrapped, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    sm = plugin.stage_manager
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), wrapped,
                                   optimizer=opt, return_outputs=True)
    # one-file unsharded save through the pipeline's checkpoint IO, and back
    target = os.path.join(tmp, "pp_model.safetensors")
    booster.save_model(wrapped, target, shard=False)
    fresh = tiny_model(2, seed=3)
    b2 = Booster(plugin=HybridParallelPlugin(pp_size=2, num_microbatches=2, precision="fp32"),
                 device="cpu")
    w2, *_ = b2.boost(fresh)
    b2.load_model(w2, target)
    mine = plugin.unwrap_model(wrapped).state_dict()
    got = b2.plugin.unwrap_model(w2).state_dict()
    assert mine.keys() == got.keys() and all(torch.equal(mine[k], got[k]) for k in mine)
    return dict(same=sm is before, file=sorted(os.listdir(tmp)), stage=sm.stage, num_stages=sm.num_stages,
                first=sm.is_first_stage(), last=sm.is_last_stage(),
                pp_rank=plugin.pp_state.rank, has_outputs=out["outputs"] is not None,
                prev=sm.prev_rank, next=sm.next_rank)


def test_stage_manager_two_ranks(tmp_path):
    res = run_distributed(_stage_manager, 2, str(tmp_path), timeout=60)
    for r, got in enumerate(res):
        assert got["file"] == ["pp_model.safetensors"]
        assert got["same"] and got["stage"] == r == got["pp_rank"] and got["num_stages"] == 2
        assert got["first"] == (r == 0) and got["last"] == (r == 1)
        assert got["has_outputs"] == got["last"]
        assert got["prev"] == got["next"] == 1 - r
