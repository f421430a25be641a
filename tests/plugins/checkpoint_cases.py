"""Checkpoint scenarios run inside the spawned ranks of test_plugins_distributed.py.

* save -> load on the same world size is bit-exact (weights, FP32 masters, optimizer state,
  lr scheduler) and the resumed run is bit-identical to the uninterrupted one;
* a checkpoint saved by 2 ranks resumes on 4 ranks (other plugins too) and in one process;
  the loaded state is bit-exact, and the continued training matches within the parity
  tolerances of test_plugins_distributed.py (only the order of gradient sums changes);
* a save that fails midway (on one rank) keeps the previous checkpoint loadable.
"""
from __future__ import annotations

import glob
import os

import pytest
import torch

from tests.plugins import helpers as H

# name -> (plugin, precision, fp8_communication) of the 2-rank run that writes it
CASES = {"zero2_bf16": ("zero2", "bf16", False), "zero1_fp32": ("zero1", "fp32", False),
         "ddp_fp32": ("ddp", "fp32", False), "zero2_fp8_comm": ("zero2", "fp8", True)}
# 2 -> 4 ranks: which plugin resumes each checkpoint
RESUME_4 = {"zero2_bf16": "zero2", "zero1_fp32": "zero2", "ddp_fp32": "zero1",
            "zero2_fp8_comm": "zero1"}
SHARD_MB = 0.01  # ~10 KB: the 29 KB MLP is written as several shards


def _boost(booster, seed=0):
    model = H.make_mlp(seed)
    raw = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(raw, step_size=2, gamma=0.5)
    model, opt, _, _, sched = booster.boost(model, raw, lr_scheduler=sched)
    return model, opt, sched


def _steps(booster, model, opt, sched, rank, world, n, start):
    losses = []
    for s in range(start, start + n):
        losses += H.train(booster, model, opt, rank, world, 1, start=s)
        sched.step()
    return losses


def _paths(root, case):
    d = os.path.join(root, case)
    return os.path.join(d, "model"), os.path.join(d, "optim"), os.path.join(d, "sched.pt")


def _save(booster, model, opt, sched, root, case):
    m, o, s = _paths(root, case)
    booster.save_model(model, m, size_per_shard_mb=SHARD_MB)
    booster.save_optimizer(opt, o)
    booster.save_lr_scheduler(sched, s)


def _load(booster, model, opt, sched, root, case):
    m, o, s = _paths(root, case)
    booster.load_model(model, m)  # model first: load_optimizer then restores exact masters
    booster.load_optimizer(opt, o)
    booster.load_lr_scheduler(sched, s)


def _plugin(name, prec, comm):
    from tests.plugins.test_plugins_distributed import _plugin as make
    return make(name, prec, comm)


def _tol(prec, comm):
    from tests.plugins.test_plugins_distributed import TOL
    return TOL["comm" if comm else prec]


def _saved_weights(path):
    from safetensors.torch import load_file
    out = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        out.update(load_file(f))
    return out


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def two_rank_checkpoints(rank, world, root):
    from fp8boost.booster import Booster
    for case, (name, prec, comm) in CASES.items():
        booster = Booster(plugin=_plugin(name, prec, comm))
        model, opt, sched = _boost(booster)
        _steps(booster, model, opt, sched, rank, world, 3, 0)
        _save(booster, model, opt, sched, root, case)
        at = H.true_weights(model, opt)
        saved = _saved_weights(_paths(root, case)[0])
        for (k, p), w in zip(model.unwrap().named_parameters(), at):  # masters, not FP8 copies
            assert torch.equal(saved[k], w.to(p.dtype)), (case, k)
        cont = _steps(booster, model, opt, sched, rank, world, 2, 3)
        final = H.true_weights(model, opt)
        if rank == 0:
            torch.save({"at": at, "losses": cont, "weights": final},
                       os.path.join(root, case, "expected.pt"))
        # Resume on the same world size, into a model initialised differently: bit-exact.
        booster2 = Booster(plugin=_plugin(name, prec, comm))
        model2, opt2, sched2 = _boost(booster2, seed=1)
        _load(booster2, model2, opt2, sched2, root, case)
        assert _equal(H.true_weights(model2, opt2), at), case
        assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] * 2
        resumed = _steps(booster2, model2, opt2, sched2, rank, world, 2, 3)
        assert resumed == cont and _equal(H.true_weights(model2, opt2), final), case
        assert _equal(model2.unwrap().parameters(), model.unwrap().parameters())
    if rank == 0:
        files = sorted(os.listdir(_paths(root, "zero2_bf16")[0]))
        assert "model.safetensors.index.json" in files and len(files) >= 3, files
    _failed_save_keeps_previous(rank, world, root)


def _failed_save_keeps_previous(rank, world, root):
    """A save that raises midway (rank 1's optimizer shard; rank 0's 2nd model shard)."""
    from fp8boost.booster import Booster
    from fp8boost.checkpoint_io import tensor_files as cio
    booster = Booster(plugin=_plugin("zero2", "bf16", False))
    model, opt, sched = _boost(booster, seed=2)  # different weights than the saved checkpoint
    _steps(booster, model, opt, sched, rank, world, 1, 0)
    m_path, o_path, _ = _paths(root, "zero2_bf16")
    real = cio.save_file
    calls = []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if (rank == 1 and "optimizer" in filename) or (rank == 0 and len(calls) == 2):
            raise OSError("injected failure: disk full")
        return real(tensors, filename, metadata=metadata)

    cio.save_file = failing
    try:
        with pytest.raises((OSError, RuntimeError)):
            booster.save_model(model, m_path, size_per_shard_mb=SHARD_MB)
        calls.clear()
        with pytest.raises((OSError, RuntimeError)):
            booster.save_optimizer(opt, o_path)
    finally:
        cio.save_file = real
    parent = os.path.dirname(m_path)
    assert not glob.glob(os.path.join(parent, ".*tmp-*")), os.listdir(parent)
    expected = torch.load(os.path.join(root, "zero2_bf16", "expected.pt"))
    booster2 = Booster(plugin=_plugin("zero2", "bf16", False))
    model2, opt2, sched2 = _boost(booster2, seed=3)
    _load(booster2, model2, opt2, sched2, root, "zero2_bf16")
    assert _equal(H.true_weights(model2, opt2), expected["at"])


def _check_resume(got_losses, got_weights, expected, tol, what):
    tl, tw = tol
    dl = H.max_rel(got_losses, expected["losses"])
    dw = H.rel_update_error(got_weights, expected["weights"], expected["at"])
    assert dl <= tl and dw <= tw, f"{what}: loss {dl:.2e} (tol {tl}), weights {dw:.2e} (tol {tw})"


def resume_in_other_world(rank, world, root):
    """Checkpoints of 2 ranks resume on ``world`` ranks (with another plugin, too)."""
    from fp8boost.booster import Booster
    for case, (_, prec, comm) in CASES.items():
        expected = torch.load(os.path.join(root, case, "expected.pt"))
        booster = Booster(plugin=_plugin(RESUME_4[case], prec, comm))
        model, opt, sched = _boost(booster, seed=1)
        _load(booster, model, opt, sched, root, case)
        assert _equal(H.true_weights(model, opt), expected["at"]), case
        losses = _steps(booster, model, opt, sched, rank, world, 2, 3)
        _check_resume(losses, H.true_weights(model, opt), expected, _tol(prec, comm),
                      f"{case} -> {world} ranks")


def resume_in_single_process(root):
    """The 2-rank checkpoints resume in one process without a plugin."""
    from fp8boost.booster import Booster, MixedPrecision
    from tests.plugins.test_plugins_distributed import _fp8_configs
    for case, (_, prec, _comm) in CASES.items():
        expected = torch.load(os.path.join(root, case, "expected.pt"))
        fp8_config = _fp8_configs()[0] if prec == "fp8" else None
        booster = Booster(mixed_precision=MixedPrecision(prec, fp8_config), device="cpu")
        model, opt, sched = _boost(booster, seed=1)
        _load(booster, model, opt, sched, root, case)
        assert _equal(H.true_weights(model, opt), expected["at"]), case
        losses = _steps(booster, model, opt, sched, 0, 1, 2, 3)
        _check_resume(losses, H.true_weights(model, opt), expected, _tol(prec, False),
                      f"{case} -> 1 process")
