"""Fault handling of every plugin on 2 gloo ranks (issue 14), in ONE spawned group.

For each of ddp, zero2, gemini, fsdp and hybrid (tp 2), on a tiny Llama:

* non-finite guard: Inf injected into rank 1's batch (its embedding output) at step 2: no
  rank's weights, masters or optimizer state change that step, rank 0 warns once naming the
  step and the bad rank, and the next step trains again; two bad steps in a row then stop
  training with ``NonFiniteError`` on every rank;
* verified checkpoints: a truncated and a bit-flipped file of a resumable checkpoint and of an
  HF export fail the load on EVERY rank with ``CheckpointCorruptError`` naming the file (no
  gloo peer error on the rank that did not read it);
* a full disk (ENOSPC, simulated in ``open`` and safetensors' writer) during a save raises
  ``CheckpointSaveError`` on every rank saying the previous checkpoint is intact, and that
  checkpoint still loads, bit-exact.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.plugins import hybrid_cases as HC

PLUGINS = ("ddp", "zero2", "gemini", "fsdp", "hybrid")


def _plugin(name: str):
    from fp8boost.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
    if name == "ddp":
        return TorchDDPPlugin(precision="bf16")
    if name == "zero2":
        return LowLevelZeroPlugin(stage=2, precision="bf16")
    if name == "gemini":
        return GeminiPlugin(precision="bf16")
    if name == "fsdp":
        return TorchFSDPPlugin(precision="fp32")
    from fp8boost.plugins.hybrid_parallel_plugin import HybridParallelPlugin
    return HybridParallelPlugin(tp_size=2, zero_stage=1, precision="bf16")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _snapshot(model, opt) -> list[torch.Tensor]:
    """This rank's weights, FP32 masters and optimizer state (what a bad step must not touch)."""
    out = [_local(p).detach().float().clone() for p in model.unwrap().parameters()]
    out += [m.detach().clone() for m in getattr(opt, "masters", [])]
    out += [_local(v).detach().clone() for st in opt.state.values() for v in st.values()
            if torch.is_tensor(v)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _step(booster, model, opt, step: int, rank: int, dp_rank: int, dp: int, poison: list):
    batch = HC.global_batch(step)
    b = batch.shape[0] // dp
    ids = batch[dp_rank * b:(dp_rank + 1) * b]
    poison[0] = rank == 1 and step in poison[1]
    loss = model(input_ids=ids, labels=ids).loss
    booster.backward(loss, opt)
    opt.step()
    opt.zero_grad()


@contextlib.contextmanager
def _disk_full(root: str, budget: int):
    """Writes below ``root`` fail with ENOSPC once ``budget`` bytes were written (this rank)."""
    from fp8boost.checkpoint_io import tensor_files as cio

    left = [budget]
    real_open, real_io_open, real_save_file = open, io.open, cio.save_file

    class Full:
        def __init__(self, f, path):
            self._f, self._path = f, path

        def write(self, data):
            n = memoryview(data).nbytes
            if n > left[0]:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)", self._path)
            left[0] -= n
            return self._f.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

        def __getattr__(self, name):
            return getattr(self._f, name)

    def limited(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        path = os.fspath(file) if not isinstance(file, int) else ""
        if any(c in mode for c in "wax+") and str(path).startswith(root):
            return Full(f, path)
        return f

    def save_file(tensors, filename, metadata=None):
        from safetensors.torch import save
        with limited(filename, "wb") as f:
            f.write(save(tensors, metadata=metadata))

    import builtins
    builtins.open, io.open, cio.save_file = limited, limited, save_file
    try:
        yield
    finally:
        builtins.open, io.open, cio.save_file = real_open, real_io_open, real_save_file


def _corrupt_and_load(rank: int, directory: str, load, label: str) -> None:
    """Truncate, then bit-flip a file of ``directory``: ``load()`` must fail on every rank
    naming it; each file is restored afterwards."""
    from fp8boost.checkpoint_io import CheckpointCorruptError
    from fp8boost.checkpoint_io import checksums as cio

    sums = cio.recorded_checksums(directory)
    assert sums, f"{label}: no checksums recorded in {directory}"
    by_size = sorted(sums, key=lambda f: (-sums[f]["size"], f))
    for victim, how in ((by_size[0], "truncate"), (by_size[-1], "flip")):
        path = os.path.join(directory, victim)
        if rank == 0:
            shutil.copyfile(path, path + ".bak")
            if how == "truncate":
                os.truncate(path, sums[victim]["size"] // 2)
            else:
                with open(path, "r+b") as f:
                    byte = f.read(1)
                    f.seek(0)
                    f.write(bytes([byte[0] ^ 0x10]))
        dist.barrier()
        expect = "truncated" if how == "truncate" else "corrupt"
        with pytest.raises(CheckpointCorruptError,
                           match=re.escape(path) + f".*{expect}") as info:
            load()
        assert "load an older checkpoint" in str(info.value), label
        dist.barrier()
        if rank == 0:
            os.replace(path + ".bak", path)
        dist.barrier()


def _unverified_shard_error(booster, opt, rank: int, path: str) -> None:
    """Issue 13: a truncated ZeRO shard that only rank 1 reads gave rank 0 a gloo peer error.
    Without checksums (older checkpoints) every rank must still get the error naming it."""
    import json

    from fp8boost.checkpoint_io import formats as cio

    booster.save_optimizer(opt, path)
    shard = os.path.join(path, "optimizer-rank00001-of-00002.safetensors")
    if rank == 0:
        index = os.path.join(path, cio.OPTIM_INDEX)
        data = json.load(open(index))
        del data[cio.CHECKSUM_KEY]
        json.dump(data, open(index, "w"))
        os.truncate(shard, os.path.getsize(shard) - 100)
    dist.barrier()
    with pytest.raises((OSError, ValueError), match=re.escape(shard) + ".*truncated or corrupt"):
        booster.load_optimizer(opt, path)


def _faults(rank: int, world: int, root: str) -> dict:
    from fp8boost.booster import Booster
    from fp8boost.parallel.nonfinite import NonFiniteError, NonFiniteGuard, NonFiniteStepWarning
    from fp8boost.checkpoint_io import CheckpointSaveError

    from fp8boost import _state

    # Issue 13: a library warning whose condition is the same on every rank prints once per
    # job (rank 0), not once per rank; every rank still records the key.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _state.warn_once("faults-test-once", "fp8boost: same on every rank")
        _state.warn_once("faults-test-once", "fp8boost: same on every rank")
        _state.warn_once("faults-test-all", "fp8boost: rank-specific", all_ranks=True)
    texts = [str(w.message) for w in caught]
    assert texts == (["fp8boost: same on every rank"] if rank == 0 else []) + \
        ["fp8boost: rank-specific"], texts

    report = {}
    for name in PLUGINS:
        plugin = _plugin(name)
        booster = Booster(plugin=plugin, nonfinite_guard=NonFiniteGuard(max_consecutive=2))
        model = HC.tiny_model()
        raw = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, *_ = booster.boost(model, raw)
        dp = 1 if name == "hybrid" else world
        dp_rank = 0 if name == "hybrid" else rank
        poison = [False, {2, 5, 6}]  # rank 1's batch goes bad at these steps

        def hook(_mod, _inp, out):
            return out + float("inf") if poison[0] else out

        model.unwrap().get_input_embeddings().register_forward_hook(hook)
        # -------------------------------------------------------------- non-finite guard
        before = _snapshot(model, opt)
        _step(booster, model, opt, 1, rank, dp_rank, dp, poison)
        after_1 = _snapshot(model, opt)
        assert not _same(before, after_1), f"{name}: step 1 did not train"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(booster, model, opt, 2, rank, dp_rank, dp, poison)
        assert _same(after_1, _snapshot(model, opt)), f"{name}: the bad step changed weights"
        mine = [str(w.message) for w in caught if issubclass(w.category, NonFiniteStepWarning)]
        if rank == 0:
            # hybrid: tp ranks share activations, so rank 0's loss goes bad too.
            who = "rank 0" if name == "hybrid" else "rank 1"
            assert len(mine) == 1 and f"loss on {who} at optimizer step 2" in mine[0], \
                (name, mine)
        else:
            assert not mine, (name, mine)  # one warning per job, not per rank
        _step(booster, model, opt, 3, rank, dp_rank, dp, poison)
        trained = _snapshot(model, opt)
        assert not _same(after_1, trained), f"{name}: training did not continue after a skip"
        assert all(torch.isfinite(t).all() for t in trained), name
        # ----------------------------------------------------- checkpoints: verification
        state, export = os.path.join(root, name, "state"), os.path.join(root, name, "export")
        booster.save_checkpoint(state, model, opt, extra={"step": 3})
        booster.save_model(model, export, size_per_shard_mb=0.05)
        _corrupt_and_load(rank, state, lambda: booster.load_checkpoint(state, model, opt),
                          name)
        _corrupt_and_load(rank, export, lambda: booster.load_model(model, export), name)
        # ------------------------------------------------------- ENOSPC during a save
        _step(booster, model, opt, 4, rank, dp_rank, dp, poison)
        with _disk_full(root, budget=4096):
            with pytest.raises(CheckpointSaveError,
                               match=f"previous checkpoint at {re.escape(state)} is intact"):
                booster.save_checkpoint(state, model, opt, extra={"step": 4})
        assert not [d for d in os.listdir(os.path.dirname(state)) if ".tmp-" in d]
        assert booster.load_checkpoint(state, model, opt) == {"step": 3}
        assert _same(trained, _snapshot(model, opt)), f"{name}: previous checkpoint changed"
        if name == "zero2":  # an older checkpoint without checksums: rank 1's shard truncated
            _unverified_shard_error(booster, opt, rank, os.path.join(root, name, "optim"))
        # ------------------------------------------- K consecutive bad steps stop training
        _step(booster, model, opt, 5, rank, dp_rank, dp, poison)  # bad 1 of 2: skipped
        with pytest.raises(NonFiniteError, match=r"2 optimizer steps in a row \(5-6\)"):
            _step(booster, model, opt, 6, rank, dp_rank, dp, poison)
        assert _same(trained, _snapshot(model, opt)), name
        report[name] = "ok"
    return report


def test_guard_checksums_and_full_disk_every_plugin(tmp_path):
    results = run_distributed(_faults, 2, str(tmp_path), timeout=600)
    assert results[0] == {name: "ok" for name in PLUGINS}
