"""Training checkpoints for the example: model, optimizer, LR scheduler, step and RNG state.

Layout of one checkpoint (``<save_dir>/step_00000100/``)::

    model/              booster.save_model (sharded safetensors, HF index layout:
                        LlamaForCausalLM.from_pretrained can load it)
    optimizer/          booster.save_optimizer (sharded for ZeRO; loads into any world size)
    lr_scheduler.pt     booster.save_lr_scheduler
    rng/rank<r>.pt      torch CPU (+ CUDA) RNG state of each rank
    trainer_state.json  step, data position, tokens seen, world size, out_dir, seed, and the
                        SHA-256 of lr_scheduler.pt and rng/* (written last)

Every file is checksummed: ``model/`` and ``optimizer/`` in their own index (the library does
it), the rest in ``trainer_state.json``. Loading verifies them on every rank before reading,
so a truncated or altered file fails with an error naming it on all ranks alike.

A checkpoint is written into ``step_N.partial/`` and renamed to ``step_N/`` by rank 0 only
after every rank finished (a barrier), then ``<save_dir>/latest`` is replaced atomically. A run
killed mid-save therefore leaves the previous checkpoint and ``latest`` intact.

The data position is the step: batches are a pure function of ``(seed, rank, step,
micro_step)`` (see ``data.TokenWindows``). ``trainer_state.json`` records it with what defines
the stream (``data_position``); a resume that changes any of those is warned about.

``--resume auto`` takes the checkpoint ``latest`` names, then the older complete ones
(:func:`auto_candidates`; ``*.partial`` and hidden temp folders are skipped, as in the
library's ``latest_checkpoint``), falling back to the next one when a checkpoint fails
verification.

``--keep-last N`` (:func:`prune_checkpoints`, rank 0, after a save completed on every rank)
keeps the newest N complete checkpoints and deletes older ones, but never the checkpoint the
run resumed from, nor an incomplete ``*.partial`` folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fp8boost import checkpoint_io as cio
from fp8boost.checkpoint_io import complete_checkpoints as _complete
from fp8boost.checkpoint_io.checksums import recorded_checksums

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(booster, model, optimizer, lr_scheduler, save_dir: Path, step: int,
                    trainer_state: dict[str, Any], rank: int, device: torch.device) -> Path:
    """Save everything needed to resume at ``step``; returns the final checkpoint folder.

    Every rank must call this (the booster's save functions are collective for ZeRO).
    """
    final = save_dir / f"step_{step:08d}"
    partial = save_dir / f"step_{step:08d}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a save that died
        (partial / "rng").mkdir(parents=True, exist_ok=True)
    _barrier()
    try:
        # Collective calls: every rank enters each (ZeRO ranks write their own shards). A
        # failure (a full disk) raises the library's CheckpointSaveError on every rank alike.
        booster.save_model(model, str(partial / "model"), shard=True)
        booster.save_optimizer(optimizer, str(partial / "optimizer"))
        booster.save_lr_scheduler(lr_scheduler, str(partial / "lr_scheduler.pt"))
        failure = None
        try:
            torch.save(_rng_state(device), partial / "rng" / f"rank{rank}.pt")
        except OSError as exc:
            failure = exc
        cio.raise_if_failed(str(partial), failure, _group())  # all ranks alike, no hang
        # Collective too: the hashing is spread over the ranks.
        sums = cio.checksum_files(str(partial), _own_files(partial, rank), _group())
    except OSError as exc:  # raised on every rank alike (see raise_if_failed)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        previous = latest_complete(save_dir)
        kept = (f"the previous checkpoint {previous} is intact (--resume auto or --resume "
                f"{save_dir} continues from it)" if previous else "no earlier checkpoint exists")
        message = (f"saving the checkpoint of step {step} failed ({exc}); {kept}. Free disk "
                   "space or pass another --save-dir")
        code = getattr(exc, "errno", None)
        raise (cio.CheckpointSaveError(code, message) if code else
               cio.CheckpointSaveError(message)) from exc
    if rank == 0:
        state = dict(trainer_state, step=step)
        state[cio.CHECKSUM_KEY] = {"algorithm": "sha256", "files": sums}
        _write_atomic(partial / STATE_FILE, json.dumps(state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(save_dir / LATEST_FILE, final.name)
    _barrier()
    return final


def _group():
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _own_files(partial: Path, rank: int) -> list[str]:
    """The files beside ``model/`` and ``optimizer/`` (those carry their own checksums),
    listed identically on every rank."""
    del rank  # the listing must not depend on the rank: checksum_files splits it
    names = ["lr_scheduler.pt"] + sorted(f"rng/{p.name}" for p in (partial / "rng").iterdir())
    return names


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder from ``--resume``: the folder itself, or a save dir's ``latest``.

    Raises:
        ValueError: no complete checkpoint at ``path``.
    """
    folder = Path(path)
    if (folder / STATE_FILE).is_file():
        return folder
    latest = folder / LATEST_FILE
    if latest.is_file():
        target = folder / latest.read_text().strip()
        if (target / STATE_FILE).is_file():
            return target
    raise ValueError(f"--resume {str(path)!r} is not a complete checkpoint (no {STATE_FILE}) "
                     f"nor a save dir with a '{LATEST_FILE}' file; pass a step_* folder "
                     "written by --save-every")


def complete_checkpoints(save_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of ``save_dir`` (holding ``trainer_state.json``), newest first."""
    return _complete(save_dir, marker=STATE_FILE)


def auto_candidates(save_dir: str | os.PathLike) -> list[Path]:
    """What ``--resume auto`` tries, in order: the checkpoint ``<save_dir>/latest`` names (the
    last one this run completed), then the complete ones of earlier steps, newest first.

    A checkpoint numbered past ``latest`` is not this run's continuation (a run resumed from an
    older step leaves the later steps of its first attempt behind until it overwrites them), so
    it is never taken. With no ``latest`` file (or one naming an incomplete folder) every
    complete checkpoint is a candidate, newest first.
    """
    found = complete_checkpoints(save_dir)
    latest = Path(save_dir) / LATEST_FILE
    name = latest.read_text().strip() if latest.is_file() else ""
    target = Path(save_dir) / name
    if not name or target not in found:
        return found
    return found[found.index(target):]  # newest first: what follows is older


def latest_complete(save_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``--resume auto`` would take first (:func:`auto_candidates`), or None."""
    found = auto_candidates(save_dir)
    return found[0] if found else None


def prune_checkpoints(save_dir: str | os.PathLike, keep_last: int,
                      protect: str | os.PathLike | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints of ``save_dir``.

    Call it on rank 0 only, and only after a save completed (so the newest one is the one just
    written). ``keep_last`` 0 keeps everything. ``protect`` (the checkpoint this run resumed
    from) is never deleted, nor is anything :func:`complete_checkpoints` does not list
    (``*.partial`` folders of a save in progress or one that died, hidden temp folders).

    Each victim is first renamed to a hidden folder (atomic) and then removed: a run killed
    mid-delete leaves no half-deleted folder that ``--resume auto`` would take for complete.

    Returns:
        The checkpoint folders deleted, oldest last.
    """
    if keep_last <= 0:
        return []
    keep = Path(protect).resolve() if protect is not None else None
    removed = []
    for ckpt in auto_candidates(save_dir)[keep_last:]:  # never one numbered past latest
        if keep is not None and ckpt.resolve() == keep:
            continue
        doomed = ckpt.with_name(f".{ckpt.name}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)  # left by a run killed mid-delete
        os.replace(ckpt, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(ckpt)
    return removed


def check_file_sizes(ckpt: Path) -> None:
    """Every file the checkpoint's indexes record exists with its saved size: a truncated or
    missing file is found in milliseconds, before the model is built (the load still verifies
    each SHA-256).

    Raises:
        cio.CheckpointCorruptError: naming each such file and the fix.
    """
    problems = []
    for sub in (ckpt, ckpt / "model", ckpt / "optimizer"):
        for name, want in sorted(recorded_checksums(str(sub)).items()):
            path = sub / name
            size = path.stat().st_size if path.is_file() else None
            if size is None:
                problems.append(f"{path} is missing")
            elif size != want.get("size", size):
                problems.append(f"{path} has {size} bytes, {want['size']} were saved "
                                "(truncated)")
    if problems:
        raise cio.CheckpointCorruptError(
            f"checkpoint {ckpt} is incomplete: {'; '.join(problems)}; restore these files from "
            "a copy, or resume from an older checkpoint")


def warn_if_stream_changed(state: dict[str, Any], now: dict[str, Any]) -> None:
    """Say so when the resumed run's batches differ from those the saved run would have seen
    (a changed seed, data, sequence length, ... is allowed, but it is no continuation)."""
    saved = state.get("data_position") or {}
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k]]
    if changed:
        print(f"[train] note: the data stream differs from the saved run's ({', '.join(changed)}):"
              " training continues on other batches than an uninterrupted run would", flush=True)


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """The JSON trainer state of a checkpoint folder.

    Raises:
        cio.CheckpointCorruptError: the file is not JSON (truncated or altered), naming it.
    """
    path = ckpt / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise cio.CheckpointCorruptError(
            f"{path} is truncated or altered ({exc}); resume from an intact checkpoint "
            "(--resume auto skips to the next older one)") from None


def load_checkpoint(booster, model, optimizer, lr_scheduler, ckpt: Path, rank: int,
                    device: torch.device) -> dict[str, Any]:
    """Load model, optimizer, scheduler and this rank's RNG state; returns the trainer state.

    A rank with no RNG file (resuming into a larger world size) keeps its fresh seed and says so.
    """
    state = read_trainer_state(ckpt)
    cio.verify_checksums(str(ckpt), _group())  # lr_scheduler.pt and rng/* (collective)
    booster.load_model(model, str(ckpt / "model"))  # each load verifies its own files first
    booster.load_optimizer(optimizer, str(ckpt / "optimizer"))
    booster.load_lr_scheduler(lr_scheduler, str(ckpt / "lr_scheduler.pt"))
    rng_file = ckpt / "rng" / f"rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    else:
        print(f"[train] rank {rank}: checkpoint has no RNG state for this rank (saved with "
              f"world size {state.get('world_size')}); keeping the fresh seed", flush=True)
    return state

