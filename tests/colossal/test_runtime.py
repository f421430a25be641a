"""DistCoordinator, get_dist_logger and launch_from_torch in one process (no torchrun).

launch_from_torch forms fp8boost's one-process gloo group here; the fixture destroys it so
no later test finds a group it did not start.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.distributed as dist

import fp8boost.colossal as colossalai
from fp8boost.colossal.cluster import DistCoordinator
from fp8boost.colossal.logging import get_dist_logger


def test_coordinator_needs_the_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="launch_from_torch"):
        DistCoordinator()


def test_launch_from_torch_forms_group_seeds_and_coordinator_answers(group, capsys):
    colossalai.launch_from_torch(seed=42, config={})  # old config argument: ignored
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert dist.get_backend() == "gloo"  # Colossal-AI's default "nccl" without CUDA
    a = (torch.rand(3), random.random())
    colossalai.launch_from_torch(seed=42)  # the group exists: seeds again only
    assert torch.equal(a[0], torch.rand(3)) and a[1] == random.random()

    c = DistCoordinator()
    assert (c.rank, c.world_size, c.local_rank) == (0, 1, 0)
    assert c.is_master() and c.is_node_master() and c.is_last_process()
    c.print_on_master("from master")
    c.print_on_node_master("from node master")
    c.block_all()
    order = []
    with c.priority_execution():
        order.append("ran")
    assert order == ["ran"]

    @c.on_master_only()
    def answer():
        return 42

    assert answer() == 42
    out = capsys.readouterr().out
    assert "from master" in out and "from node master" in out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_launch_takes_explicit_rendezvous_and_old_positional_config(group, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    colossalai.launch(rank=0, world_size=1, host="127.0.0.1", port=port, seed=7,
                      verbose=False)
    assert dist.get_world_size() == 1 and dist.get_rank() == 0
    first = torch.rand(2)
    colossalai.launch_from_torch({"old": "config"}, seed=7)  # Colossal-AI < 0.4: config first
    assert torch.equal(first, torch.rand(2))
    assert "config argument of older Colossal-AI versions is ignored" in capsys.readouterr().err


def test_launch_without_local_rank_spreads_ranks_over_gpus(monkeypatch):
    """launch(rank, ...) from processes no launcher started (no LOCAL_RANK): rank % the GPU
    count, as Colossal-AI picks; every rank landed on GPU 0 before (issue 37)."""
    from fp8boost.colossal.initialize import default_local_rank

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [default_local_rank(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert default_local_rank(5, local_rank=2) == 2  # given: kept
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_local_rank(1) == 3  # a launcher's LOCAL_RANK wins
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_local_rank(3) == 0  # CPU: no GPU to pick


def test_accelerator_choice():
    from fp8boost.colossal.accelerator import (CpuAccelerator, get_accelerator,
                                               set_accelerator)

    assert get_accelerator() is get_accelerator()
    set_accelerator(CpuAccelerator())
    acc = get_accelerator()
    assert acc.get_current_device() == torch.device("cpu") and acc.device_count() == 1
    assert acc.max_memory_allocated() == 0
    acc.synchronize(); acc.empty_cache(); acc.manual_seed(1)
    with pytest.raises(ValueError, match="unknown accelerator"):
        set_accelerator("tpu")
    with pytest.raises(TypeError):
        set_accelerator(3)


def test_dist_logger_filters_by_rank(group, capsys):
    logger = get_dist_logger()
    assert logger is get_dist_logger("colossalai")
    seen = _Records()
    logger.logger.addHandler(seen)
    try:
        logger.info("everyone")          # ranks=None: every rank
        logger.info("rank zero", ranks=[0])
        logger.warning("not me", ranks=[1])
        logger.error("bad", ranks=[0])
        assert [r.getMessage() for r in seen.records] == ["everyone", "rank zero", "bad"]
        assert seen.records[0].filename == "test_runtime.py"  # the caller, not the logger
        assert "INFO colossalai: rank zero" in capsys.readouterr().err
        with pytest.raises(ValueError):
            logger.set_level("LOUD")
    finally:
        logger.logger.removeHandler(seen)


def test_dist_logger_writes_rank_files(tmp_path):
    logger = get_dist_logger("colossal-test-file")
    logger.log_to_file(tmp_path, suffix="x")
    logger.info("to the file")
    for h in logger.logger.handlers:
        h.flush()
    assert "to the file" in (tmp_path / "rank_0_x.log").read_text()
    for h in list(logger.logger.handlers):
        if isinstance(h, logging.FileHandler):
            logger.logger.removeHandler(h)
            h.close()


@pytest.mark.parametrize("plugin_name", ["TorchDDPPlugin", "LowLevelZeroPlugin", "GeminiPlugin",
                                         "TorchFSDPPlugin"])
def test_plugins_take_hybrid_adam_as_a_torch_optimizer(group, plugin_name):
    """One process: each plugin boosts HybridAdam (DTensor parameters under Gemini/FSDP
    take the foreach path) and the loss of a fixed batch falls over 3 steps."""
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster import plugin as plugins
    from fp8boost.colossal.nn.optimizer import HybridAdam

    colossalai.launch_from_torch(seed=0, verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    booster = Booster(plugin=getattr(plugins, plugin_name)())
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-2))
    x = torch.randn(8, 16)
    losses = []
    for _ in range(3):
        loss = model(x).float().square().mean()
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
