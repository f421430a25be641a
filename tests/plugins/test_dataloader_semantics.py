"""Issue 23 item 2: every data-parallel size, 1 included, gets distributed-sampler semantics,
and the ranks of one model replica are caught when fed different batches.

Before the fix a single replica (tp-only / pp-only) kept the user's plain ``RandomSampler``:
``seed`` was ignored, ``loader.sampler.set_epoch`` raised ``AttributeError`` and the two tp
ranks of ``HybridParallelPlugin(tp_size=2)`` read different batches without anything noticing.

One 4-rank gloo spawn (~11 s of imports) covers tp 2 x dp 2 (the loaders; the guard at the
first forward and, with ``FP8BOOST_DEBUG_TP_INPUTS=1``, at every forward) and the README's
tp 2 x pp 2 (the guard in ``execute_pipeline``); the rest runs in-process.
"""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, TensorDataset,
                              WeightedRandomSampler)

from fp8boost.parallel.tp.input_guard import DEBUG_ENV, debug_every_step, input_checksum
from fp8boost.plugins.plugin_base import shard_dataloader
from tests.dist_utils import run_distributed


def _order(loader: DataLoader) -> list[int]:
    return [int(v) for batch in loader for v in (batch[0] if isinstance(batch, list) else batch)]


# ------------------------------------------------------------------ one replica, in-process
def test_one_replica_gets_a_seeded_distributed_sampler():
    data = list(range(20))
    loader = shard_dataloader(DataLoader(data, batch_size=4, shuffle=True, drop_last=True),
                              1, 0, seed=7)
    assert isinstance(loader.sampler, DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank, loader.sampler.seed) == (1, 0, 7)
    assert loader.drop_last and loader.batch_size == 4
    ref = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
    assert _order(loader) == list(ref)  # seeded: the same order in every process
    assert sorted(_order(loader)) == data
    loader.sampler.set_epoch(1)
    ref.set_epoch(1)
    assert _order(loader) == list(ref) != list(DistributedSampler(data, 1, 0, seed=7))

    ordered = shard_dataloader(DataLoader(data, batch_size=3), 1, 0)  # no shuffle: same order
    assert isinstance(ordered.sampler, DistributedSampler) and not ordered.sampler.shuffle
    assert _order(ordered) == data and len(ordered) == 7


def test_one_replica_keeps_loaders_with_their_own_sampler():
    data = TensorDataset(torch.arange(8))
    own = DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    weighted = WeightedRandomSampler([1.0] * 8, num_samples=8)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    loaders = [DataLoader(data, batch_size=2, sampler=own),
               DataLoader(data, batch_size=2, sampler=weighted),
               DataLoader(data, batch_sampler=[[0, 1], [2, 3]]),
               DataLoader(Stream(), batch_size=2)]
    for loader in loaders:
        assert shard_dataloader(loader, 1, 0) is loader
    assert shard_dataloader(loaders[0], 4, 2) is loaders[0]  # a user's DistributedSampler stays


def test_replacing_a_users_sampler_over_replicas_says_so():
    """Over several replicas a custom sampler cannot be kept: replaced, never silently."""
    from fp8boost import _state

    _state.reset()
    data = TensorDataset(torch.arange(8))
    weighted = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 8, 8))
    with pytest.warns(UserWarning, match="WeightedRandomSampler is replaced by a "
                                         "DistributedSampler over 2"):
        loader = shard_dataloader(weighted, 2, 1)
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.rank == 1


def test_booster_without_plugin_shards_like_one_replica():
    from fp8boost.booster import Booster

    booster = Booster(device="cpu")
    model = torch.nn.Linear(2, 2)
    data = TensorDataset(torch.arange(12))
    *_, loader, _ = booster.boost(model, dataloader=DataLoader(data, batch_size=4, shuffle=True))
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.num_replicas == 1
    first = _order(loader)
    loader.sampler.set_epoch(3)
    assert sorted(first) == sorted(_order(loader)) == list(range(12)) and first != _order(loader)
    prepared = booster.plugin.prepare_dataloader(data, batch_size=4, shuffle=True, seed=5)
    assert _order(prepared) == list(DistributedSampler(data, 1, 0, shuffle=True, seed=5))


def test_debug_switch_and_checksum():
    assert debug_every_step({}) is False
    assert debug_every_step({DEBUG_ENV: "0"}) is False
    assert debug_every_step({DEBUG_ENV: "1"}) is True
    with pytest.raises(ValueError, match=DEBUG_ENV):
        debug_every_step({DEBUG_ENV: "yes"})

    ids = torch.arange(12).view(3, 4)
    same = input_checksum((ids,), {"labels": ids.clone()})
    assert torch.equal(same, input_checksum((ids.clone(),), {"labels": ids}))
    others = [input_checksum((ids.flip(0),), {"labels": ids}),  # rows reordered
              input_checksum((ids.view(4, 3),), {"labels": ids}),  # other shape
              input_checksum((ids,), {"labels": ids + 1}),
              input_checksum((ids,), {})]
    assert all(not torch.equal(same, o) for o in others)
    # Float inputs are not compared (documented): they leave the checksum unchanged.
    assert torch.equal(same, input_checksum((ids, torch.randn(3)), {"labels": ids}))


# ------------------------------------------------------------------------- 4 gloo ranks
def _boost(tp: int, pp: int):
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin
    from tests.plugins.hybrid_cases import tiny_model

    kw = dict(pp_size=pp, num_microbatches=2) if pp > 1 else {}
    plugin = HybridParallelPlugin(tp_size=tp, precision="fp32", **kw)
    booster = Booster(plugin=plugin, device="cpu")
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(64))
    model, opt, _, loader, _ = booster.boost(
        model, opt, dataloader=DataLoader(data, batch_size=4, shuffle=True))
    return booster, plugin, model, opt, loader


def _orders(loader: DataLoader) -> list[list[int]]:
    """The loader's order at epochs 0 and 1 (``set_epoch``: AttributeError on a RandomSampler)."""
    out = []
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        out.append(_order(loader))
    return out


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))


def _replica_ranks(rank: int, world: int) -> dict:
    out: dict = {}
    # tp 2 x pp 2 (the README's pipeline): one replica of 4 ranks, whose loader used to be the
    # user's RandomSampler (no set_epoch, a different order on every rank).
    pipe = _boost(tp=2, pp=2)
    assert pipe[1].dp_size == 1
    out["pp_orders"] = _orders(pipe[4])

    # tp 2 x dp 2: ranks {0, 1} and {2, 3} are the two replicas.
    booster, plugin, model, opt, boosted = _boost(tp=2, pp=1)
    assert (plugin.dp_size, plugin.dp_rank) == (2, rank // 2)
    prepared = plugin.prepare_dataloader(list(range(64)), batch_size=4, shuffle=True, seed=3)
    out["tp_orders"] = [_orders(prepared), _orders(boosted)]
    prepared.sampler.set_epoch(0)
    assert _order(prepared) == list(DistributedSampler(range(64), 2, rank // 2, seed=3))

    with pytest.raises(ValueError, match="fed different batches") as err:
        model(input_ids=_ids(rank), labels=_ids(rank))  # each rank its own batch
    out["tp_message"] = str(err.value)
    per_replica = _ids(plugin.dp_rank)  # replicas differ, their tp ranks agree: no error
    booster.backward(model(input_ids=per_replica, labels=per_replica).loss, opt)
    opt.step()
    model(input_ids=_ids(rank), labels=_ids(rank))  # checked once, not at every forward

    os.environ[DEBUG_ENV] = "1"  # read at boost: this model compares at every forward
    try:
        _, plugin, model, _, _ = _boost(tp=2, pp=1)
    finally:
        del os.environ[DEBUG_ENV]
    model(input_ids=per_replica, labels=per_replica)
    with pytest.raises(ValueError, match=f"at this step.*{DEBUG_ENV}=1"):
        model(input_ids=_ids(rank), labels=_ids(rank))

    # The pipeline: stage 0 embeds the ids, stage 1 scores the labels, each from its own copy
    # of the batch.
    booster, plugin, model, opt, _ = pipe
    stage_batch = _ids(rank // 2)  # tp ranks agree, the two stages do not
    with pytest.raises(ValueError, match="fed different batches") as err:
        booster.execute_pipeline(iter([{"input_ids": stage_batch, "labels": stage_batch}]),
                                 model, optimizer=opt)
    out["pp_message"] = str(err.value)
    same = _ids(7)
    out["pp_loss"] = booster.execute_pipeline(iter([{"input_ids": same, "labels": same}]), model,
                                              optimizer=opt)["loss"].item()
    return out


def test_replica_ranks_read_the_same_batches_and_mismatch_is_caught_4_ranks():
    results = run_distributed(_replica_ranks, 4)
    for loader in (0, 1):  # prepare_dataloader, boost(dataloader=...)
        orders = [r["tp_orders"][loader] for r in results]
        assert orders[0] == orders[1] and orders[2] == orders[3], loader  # a replica's tp ranks
        for epoch in (0, 1):
            assert sorted(orders[0][epoch] + orders[2][epoch]) == list(range(64))  # dp shards
        assert orders[0][0] != orders[0][1]  # set_epoch reshuffles
    pp_orders = [r["pp_orders"] for r in results]
    assert all(o == pp_orders[0] for o in pp_orders) and pp_orders[0][0] != pp_orders[0][1]
    assert sorted(pp_orders[0][0]) == list(range(64))

    tp_msg = results[0]["tp_message"]
    assert results[1]["tp_message"] == tp_msg  # both ranks of the replica raised alike
    for part in ("ranks [0]", "ranks [1]", "plugin.prepare_dataloader",
                 "booster.boost(dataloader=...)", f"{DEBUG_ENV}=1"):
        assert part in tp_msg, (part, tp_msg)
    other = results[2]["tp_message"]  # the other replica compared its own pair, not across dp
    assert "ranks [2]" in other and "ranks [3]" in other and "ranks [0]" not in other, other
    pp_msg = results[0]["pp_message"]
    assert all(r["pp_message"] == pp_msg for r in results)
    assert "ranks [0, 1]" in pp_msg and "ranks [2, 3]" in pp_msg, pp_msg
    assert len({r["pp_loss"] for r in results}) == 1
