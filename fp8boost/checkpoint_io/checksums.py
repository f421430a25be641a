"""SHA-256 checksums of every file of a checkpoint directory, recorded at save, verified at load.

Before the swap (``atomic.atomic_save_dir``), every file of the new directory is hashed (the
files spread over the ranks) and the digests and sizes go into the directory's own JSON index
(``model.safetensors.index.json``, ``optimizer.index.json``, the DCP/resumable markers) under
``CHECKSUM_KEY``; a directory without a JSON index (an unsharded ``model.safetensors``) gets
``CHECKSUM_FILE``. Every load verifies them first (:func:`verify_checksums`, collective: all
ranks raise the same :class:`CheckpointCorruptError` naming the bad files, before any rank reads
a tensor). Cost: one extra read of the checkpoint at save and at load, ~1 GB/s per rank for
SHA-256, divided over the ranks.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

from . import coordination as coord
from .errors import CheckpointCorruptError
from .formats import CHECKSUM_FILE, CHECKSUM_KEY


def _digest(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return os.path.getsize(path), h.hexdigest()


def _tree(root: str) -> list[str]:
    """Every file below ``root``, as sorted relative paths."""
    out = []
    for base, _dirs, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), root) for f in files]
    return sorted(out)


def _index_of(directory: str, markers: tuple[str, ...]) -> str:
    """The JSON index that holds ``directory``'s checksums (``CHECKSUM_FILE`` if it has none)."""
    for m in markers:
        if m.endswith(".json") and os.path.isfile(os.path.join(directory, m)):
            return m
    return CHECKSUM_FILE


def checksum_files(directory: str, files: list[str], group=None) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}`` of ``files`` under ``directory``, the hashing
    spread over ``group``'s ranks (collective when the group has several ranks)."""
    rank, world = coord.rank(group), coord.world_size(group)
    mine = {f: _digest(os.path.join(directory, f)) for f in files[rank::world]}
    parts = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    return {f: {"size": size, "sha256": digest}
            for part in parts for f, (size, digest) in sorted(part.items())}


def add_checksums(tmp: str, group, markers: tuple[str, ...]) -> None:
    """Hash every file of ``tmp`` and record the digests in its index (rank 0 writes);
    collective over ``group``."""
    names = coord.broadcast_object(_tree(tmp) if coord.rank(group) == 0 else None, group)
    index = _index_of(tmp, markers)
    sums = checksum_files(tmp, [f for f in names if f != index], group)
    if coord.rank(group) == 0:
        write_checksums(os.path.join(tmp, index), sums)


def write_checksums(index_path: str, sums: dict[str, dict]) -> None:
    """Put ``sums`` into the JSON file ``index_path`` (created when missing), atomically."""
    data = {}
    if os.path.exists(index_path):
        with open(index_path) as f:
            data = json.load(f)
    data[CHECKSUM_KEY] = {"algorithm": "sha256", "files": sums}
    tmp = f"{index_path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, index_path)


def recorded_checksums(directory: str) -> dict[str, dict]:
    """The checksums recorded in ``directory``'s JSON files (its index or ``CHECKSUM_FILE``);
    empty for checkpoints written without them (older fp8boost, ``save_pretrained``)."""
    sums: dict[str, dict] = {}
    if not os.path.isdir(directory):
        return sums
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue  # a broken index is reported by the load that needs it
        if isinstance(data, dict) and isinstance(data.get(CHECKSUM_KEY), dict):
            sums.update(data[CHECKSUM_KEY].get("files", {}))
    return sums


def verify_checksums(directory: str, group=None) -> int:
    """Check every file recorded in ``directory``'s checksums; returns how many were checked.

    Collective over ``group`` (the files are spread over its ranks, and every rank learns every
    verdict), so all ranks raise the same error before any of them reads a tensor.

    Raises:
        CheckpointCorruptError: a file is missing, has another size or another SHA-256 than
            when it was saved; the message names each such file and what to do.
    """
    sums = recorded_checksums(directory)
    if not sums:
        return 0
    files = sorted(sums)
    rank, world = coord.rank(group), coord.world_size(group)
    problems = {}
    for f in files[rank::world]:
        want, path = sums[f], os.path.join(directory, f)
        if not os.path.isfile(path):
            problems[f] = "is missing (deleted or never copied)"
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems[f] = (f"is unreadable: {size} bytes, {want['size']} were saved (truncated "
                           "or corrupt)")
        elif _digest(path)[1] != want["sha256"]:
            problems[f] = ("is unreadable: its SHA-256 differs from the one saved (corrupt: "
                           "altered bytes)")
    parts = [problems]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, problems, group=group)
    bad = {f: why for part in parts for f, why in part.items()}
    if bad:
        lines = "; ".join(f"{os.path.join(directory, f)} {why}" for f, why in sorted(bad.items()))
        raise CheckpointCorruptError(
            f"checkpoint {directory} failed verification: {lines}. Restore these files from a "
            "copy, or load an older checkpoint")
    return len(files)
