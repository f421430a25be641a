"""Checkpoints: sharded safetensors models (HF layout), re-shardable optimizer state, schedulers.

Model (a directory, written by data-parallel rank 0 only)::

    model.safetensors.index.json            {"metadata": {"total_size": N}, "weight_map": {...}}
    model-00001-of-00003.safetensors ...    (or a single model.safetensors with shard=False)
    config.json                             (when the model has an HF ``.config``)

``transformers``' ``from_pretrained`` loads it directly. Tensors sharing storage (tied weights)
are written once, as ``save_pretrained`` does; loading re-ties them through the model.

Optimizer (a directory; every rank that holds a shard writes its own file)::

    optimizer.index.json                    format, saved world size, param_groups, per-param
                                            shape/numel and which state keys are sharded
    optimizer-rank00000-of-00002.safetensors  "<param index>/<key>": rank r's piece of the
                                            flattened full-size state, elements
                                            [r*c, min((r+1)*c, numel)), c = ceil(numel/world)
    optimizer-replicated.safetensors        replicated tensors (e.g. Adam's "step")

Because a piece is a plain range of the flattened full tensor, a checkpoint saved by W ranks
loads into any other world size (each rank reads only the ranges it needs) and into a plain
unsharded optimizer; ``master_param`` pieces restore FP32 master weights exactly.

Atomicity: every save writes into a fresh temp directory next to the target, then renames it
into place (``os.replace``) once every rank has finished. A save that dies midway leaves the
previous checkpoint untouched (only a ``.<name>.tmp-*`` directory behind); one that fails (a
full disk: ``ENOSPC``) removes its temp directory and raises :class:`CheckpointSaveError` on
every rank, saying that the previous checkpoint is intact.

Checksums: before the swap, every file of the new directory is hashed (SHA-256, the files
spread over the ranks) and the digests and sizes go into the directory's own JSON index
(``model.safetensors.index.json``, ``optimizer.index.json``, the DCP/resumable markers) under
``"fp8boost_checksums"``; a directory without a JSON index (an unsharded ``model.safetensors``)
gets ``fp8boost_checksums.json``. Every load verifies them first (:func:`verify_checksums`,
collective: all ranks raise the same :class:`CheckpointCorruptError` naming the bad files,
before any rank reads a tensor). Cost: one extra read of the checkpoint at save and at load,
~1 GB/s per rank for SHA-256, divided over the ranks.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import uuid
from typing import Callable, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

MODEL_INDEX = "model.safetensors.index.json"
MODEL_SINGLE = "model.safetensors"
OPTIM_INDEX = "optimizer.index.json"
OPTIM_REPLICATED = "optimizer-replicated.safetensors"
OPTIM_FORMAT = "fp8boost-optimizer-v1"
CHECKSUM_KEY = "fp8boost_checksums"       # in a directory's JSON index
CHECKSUM_FILE = "fp8boost_checksums.json"  # for directories without a JSON index


class CheckpointSaveError(OSError, RuntimeError):
    """A save failed (on this or another rank); the previous checkpoint, if any, is intact."""


class CheckpointCorruptError(OSError, ValueError):
    """A checkpoint file is missing, truncated or altered since it was saved."""


# ------------------------------------------------------------------------------ coordination
def _active(group) -> bool:
    return group is not None and dist.is_initialized() and dist.get_world_size(group) > 1


def _rank(group) -> int:
    return dist.get_rank(group) if _active(group) else 0


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _barrier(group) -> None:
    if _active(group):
        dist.barrier(group=group)


def _broadcast_object(obj, group):
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group,
                               device=_comm_device(group))
    return box[0]


def _all_ok(ok: bool, group) -> bool:
    if not _active(group):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_comm_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _check_target(path: str, markers: tuple[str, ...]) -> Optional[str]:
    """Why ``path`` may not be (over)written, or None."""
    if os.path.isfile(path):
        return f"{path} is a file; checkpoints are directories: pass a directory path"
    if os.path.isdir(path) and os.listdir(path) and not any(
            os.path.exists(os.path.join(path, m)) for m in markers):
        return (f"refusing to replace {path}: it is a non-empty directory that is not a checkpoint "
                "of this kind; pass a new or an old checkpoint directory")
    return None


def atomic_save_dir(path: str, group, write: Callable[[str], None],
                    markers: tuple[str, ...]) -> None:
    """Run ``write(tmp_dir)`` on every rank of ``group``, then swap ``tmp_dir`` into ``path``.

    Rank 0 creates the temp dir and does the rename; a failure on any rank removes the temp dir,
    keeps the previous checkpoint and raises on every rank.
    """
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    tmp, err = None, None
    if _rank(group) == 0:
        err = _check_target(path, markers)
        if err is None:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    tmp, err = _broadcast_object((tmp, err), group)
    if err is not None:
        raise ValueError(err)
    failure: Optional[BaseException] = None
    try:
        write(tmp)
    except BaseException as e:  # noqa: BLE001 - every rank must learn about it before raising
        failure = e
    raise_if_failed(path, failure, group, tmp)
    try:  # digests of what is on disk now, before it becomes the checkpoint
        _add_checksums(tmp, group, markers)
    except BaseException as e:  # noqa: BLE001 - same agreement as a failed write
        failure = e
    raise_if_failed(path, failure, group, tmp)
    if _rank(group) == 0:
        _swap_in(tmp, path)
    _barrier(group)


class PeerSaveFailure(RuntimeError):
    """Raised on the healthy ranks of a save phase that failed on another rank."""


def run_agreed(fn: Callable[[], None], group) -> None:
    """Run one phase of a save on every rank, then agree (one all-reduce) that it worked.

    A rank that fails must not leave its peers waiting in the phase's next collective: after
    this returns, either every rank succeeded or every rank raises (the failing rank its own
    error, the others :class:`PeerSaveFailure`), to be reported by :func:`raise_if_failed`.
    """
    failure: Optional[BaseException] = None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the peers must hear of it first
        failure = e
    if not _all_ok(failure is None, group):
        raise failure if failure is not None else PeerSaveFailure("failed on another rank")


def raise_if_failed(path: str, failure: Optional[BaseException], group,
                    tmp: Optional[str] = None) -> None:
    """Collective: when a rank's part of a save failed, drop ``tmp`` and raise the same
    :class:`CheckpointSaveError` on every rank, naming the rank and cause and saying what is
    left at ``path``; otherwise return. Every rank must call it (one all-reduce)."""
    if _all_ok(failure is None, group):
        return
    mine = None if failure is None or isinstance(failure, PeerSaveFailure) else (
        f"{type(failure).__name__}: {failure}", getattr(failure, "errno", None))
    reports = [mine]
    if _active(group):
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, mine, group=group)
    if _rank(group) == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    bad = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    rank, (why, code) = bad[0] if bad else (0, ("unknown error", None))
    kept = (f"the previous checkpoint at {path} is intact" if os.path.exists(path) else
            f"nothing was written at {path}")
    hint = ("free disk space (or save elsewhere) and save again" if code in
            (errno.ENOSPC, errno.EDQUOT) else "fix the cause and save again")
    where = "rank " + ", ".join(str(r) for r, _ in bad) if _active(group) else "this process"
    message = (f"saving the checkpoint {path} failed on {where} ({why}); {kept} and the "
               f"partial files were removed: {hint}")
    err = CheckpointSaveError(message) if code is None else CheckpointSaveError(code, message)
    raise err from failure


# ------------------------------------------------------------------------------ checksums
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
    rank, world = _rank(group), (dist.get_world_size(group) if _active(group) else 1)
    mine = {f: _digest(os.path.join(directory, f)) for f in files[rank::world]}
    parts = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine, group=group)
    return {f: {"size": size, "sha256": digest}
            for part in parts for f, (size, digest) in sorted(part.items())}


def _add_checksums(tmp: str, group, markers: tuple[str, ...]) -> None:
    """Hash every file of ``tmp`` and record the digests in its index (rank 0 writes)."""
    names = _broadcast_object(_tree(tmp) if _rank(group) == 0 else None, group)
    index = _index_of(tmp, markers)
    sums = checksum_files(tmp, [f for f in names if f != index], group)
    if _rank(group) == 0:
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
    rank, world = _rank(group), (dist.get_world_size(group) if _active(group) else 1)
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


def _swap_in(tmp: str, path: str) -> None:
    if not os.path.exists(path):
        os.replace(tmp, path)
        return
    # rename(2) cannot replace a non-empty directory: move the old one aside first.
    old = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-{uuid.uuid4().hex[:8]}")
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _require(path: str, what: str, marker: str) -> None:
    if os.path.exists(os.path.join(path, marker)):
        return
    parent, name = os.path.split(os.path.abspath(path))
    leftovers = [d for d in os.listdir(parent) if d.startswith(f".{name}.old-")] \
        if os.path.isdir(parent) else []
    hint = (f"; a save was interrupted while swapping directories: the previous checkpoint is in "
            f"{os.path.join(parent, leftovers[0])}") if leftovers else ""
    raise FileNotFoundError(f"no {what} checkpoint at {path} (missing {marker}){hint}")


# ------------------------------------------------------------------------------------- model
def _dedup_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop keys whose tensor is an exact alias of an earlier key (tied weights)."""
    seen: set[tuple] = set()
    out = {}
    for k, t in sd.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = t
    return out


def _plan_shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for k, t in sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    return shards


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def write_model(model: nn.Module, directory: str, shard: bool, size_per_shard_mb: float,
                overrides: Optional[dict[int, torch.Tensor]] = None) -> None:
    """Write ``model``'s state into ``directory`` (HF layout; see module docstring).

    ``overrides`` maps ``id(param)`` to the tensor to write in its place.
    """
    sd = _dedup_state_dict(model.state_dict(keep_vars=True))
    if overrides:
        sd = {k: overrides.get(id(t), t) for k, t in sd.items()}
    if not shard:
        save_file({k: _cpu_copy(t) for k, t in sd.items()}, os.path.join(directory, MODEL_SINGLE),
                  metadata={"format": "pt"})
    else:
        plan = _plan_shards(sd, int(size_per_shard_mb * 1024 * 1024))
        weight_map, total = {}, 0
        for n, keys in enumerate(plan, 1):
            fname = f"model-{n:05d}-of-{len(plan):05d}.safetensors"
            tensors = {k: _cpu_copy(sd[k]) for k in keys}
            save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            weight_map.update({k: fname for k in keys})
        with open(os.path.join(directory, MODEL_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        gen.save_pretrained(directory)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))


def _open_checked(path: str, read: Callable):
    """``read(path)`` (``safe_open``/``load_file``) with a truncated or corrupt file named.

    safetensors' own error carries no path, so a user resuming from a half-written checkpoint
    could not tell which file is bad.
    """
    from safetensors import SafetensorError

    try:
        return read(path)
    except SafetensorError as exc:
        raise ValueError(f"checkpoint file {path} is unreadable ({exc}): it is truncated or "
                         "corrupt (a save killed midway, a full disk or a partial copy?); "
                         "resume from another checkpoint or copy the file again") from exc


def read_model(model: nn.Module, directory: str, strict: bool = True) -> None:
    """Load a directory written by ``write_model`` (or by HF ``save_pretrained``).

    Keys and shapes are checked against the model before any weight is copied, so a mismatch
    leaves the model untouched.
    """
    if os.path.exists(os.path.join(directory, MODEL_INDEX)):
        with open(os.path.join(directory, MODEL_INDEX)) as f:
            files = list(dict.fromkeys(json.load(f)["weight_map"].values()))
    else:
        _require(directory, "model", MODEL_SINGLE)
        files = [MODEL_SINGLE]
    own = model.state_dict()
    shapes: dict[str, tuple] = {}
    for fname in files:
        with _open_checked(os.path.join(directory, fname), lambda p: safe_open(p, "pt")) as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    unexpected = [k for k in shapes if k not in own]
    wrong = [f"{k}: {shapes[k]} vs {tuple(own[k].shape)}" for k in shapes
             if k in own and shapes[k] != tuple(own[k].shape)]
    # A key missing from the files is fine when the model ties it to a loaded tensor.
    tied = {_storage_key(own[k]) for k in shapes if k in own}
    missing = [k for k in own if k not in shapes and _storage_key(own[k]) not in tied]
    if wrong or (strict and (missing or unexpected)):
        raise RuntimeError(f"checkpoint {directory} does not match the model: shape mismatches "
                           f"{wrong[:5]}, missing keys {missing[:10]}, unexpected keys "
                           f"{unexpected[:10]} (strict=False allows missing/unexpected keys)")
    for fname in files:
        part = _open_checked(os.path.join(directory, fname), load_file)
        model.load_state_dict({k: v for k, v in part.items() if k in own}, strict=False)


# --------------------------------------------------------------------------------- optimizer
def _check_optimizer(optimizer) -> None:
    if not hasattr(optimizer, "checkpoint_state"):
        raise TypeError("save/load the optimizer returned by booster.boost(), not the raw torch "
                        f"optimizer (got {type(optimizer).__name__})")


def _jsonable(value):
    if torch.is_tensor(value):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def _shard_file(rank: int, world: int) -> str:
    return f"optimizer-rank{rank:05d}-of-{world:05d}.safetensors"


def write_optimizer(optimizer, directory: str, is_writer: bool) -> None:
    """Write this rank's part of the optimizer state (see module docstring)."""
    sharded, replicated, groups, extra = optimizer.checkpoint_state()
    world, rank = optimizer.shard_world_size, optimizer.shard_rank
    if not is_writer:
        return
    tensors = {f"{i}/{k}": _cpu_copy(v) for i, d in sharded.items() for k, v in d.items()
               if v.numel() > 0}
    save_file(tensors, os.path.join(directory, _shard_file(rank, world)))
    if rank != 0:
        return
    rep_tensors, params = {}, []
    for i, shard in enumerate(optimizer.checkpoint_layout()):
        values = {}
        for k, v in replicated.get(i, {}).items():
            if torch.is_tensor(v):
                rep_tensors[f"{i}/{k}"] = _cpu_copy(v)
            else:
                json.dumps(v)  # raises TypeError for state we cannot store
                values[k] = v
        params.append({"shape": list(shard.shape), "numel": shard.numel,
                       "sharded": sorted(sharded.get(i, {})),
                       "replicated_tensors": sorted(k for k, v in replicated.get(i, {}).items()
                                                    if torch.is_tensor(v)),
                       "replicated_values": values})
    save_file(rep_tensors, os.path.join(directory, OPTIM_REPLICATED))
    groups = [{k: _jsonable(v) for k, v in g.items()} for g in groups]
    index = {"format": OPTIM_FORMAT, "world_size": world, "param_groups": groups,
             "params": params, "extra": extra}
    with open(os.path.join(directory, OPTIM_INDEX), "w") as f:
        json.dump(index, f, indent=1)


def _restore_types(saved_groups: list[dict], current_groups: list[dict]) -> list[dict]:
    out = []
    for saved, cur in zip(saved_groups, current_groups):
        g = dict(saved)
        for k, v in cur.items():
            if k in g and k != "params":
                if isinstance(v, tuple):
                    g[k] = tuple(g[k])
                elif torch.is_tensor(v):
                    g[k] = torch.tensor(g[k], dtype=v.dtype, device=v.device)
        out.append(g)
    return out


def _agreed_read(fn: Callable[[], None], group, directory: str) -> None:
    """Run a read on every rank; if it fails on any, every rank raises that rank's error."""
    failure: Optional[BaseException] = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the peers must hear of it first
        failure = e
    if _all_ok(failure is None, group):
        return
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports = [mine]
    if _active(group):
        reports = [None] * dist.get_world_size(group)
        dist.all_gather_object(reports, mine, group=group)
    rank, why = next((r, m) for r, m in enumerate(reports) if m is not None)
    if failure is not None and isinstance(failure, (OSError, ValueError)):
        raise failure
    raise CheckpointCorruptError(f"loading {directory} failed on rank {rank}: {why}")


def read_optimizer(optimizer, directory: str, group=None) -> None:
    """Load optimizer state saved by any world size into this rank's layout.

    ``group``: the ranks loading together (a read error on one raises on all).
    """
    _require(directory, "optimizer", OPTIM_INDEX)
    with open(os.path.join(directory, OPTIM_INDEX)) as f:
        index = json.load(f)
    if index.get("format") != OPTIM_FORMAT:
        raise ValueError(f"{directory} has optimizer format {index.get('format')!r}, "
                         f"expected {OPTIM_FORMAT!r}")
    layout = optimizer.checkpoint_layout()
    metas = index["params"]
    if len(metas) != len(layout) or any(m["numel"] != s.numel for m, s in zip(metas, layout)):
        raise ValueError(f"optimizer checkpoint {directory} holds {len(metas)} parameters "
                         f"{[m['numel'] for m in metas][:8]}..., this optimizer has {len(layout)} "
                         f"{[s.numel for s in layout][:8]}...: same model and param groups needed")
    saved_world = index["world_size"]
    handles: dict[int, object] = {}

    def piece(i: int, key: str, start: int, end: int) -> torch.Tensor:
        numel = metas[i]["numel"]
        c = -(-numel // saved_world)
        parts = []
        for q in range(start // c, -(-end // c)) if end > start else []:
            qs, qe = q * c, min(q * c + c, numel)
            a, b = max(start, qs), min(end, qe)
            if a >= b:
                continue
            if q not in handles:
                handles[q] = _open_checked(os.path.join(directory, _shard_file(q, saved_world)),
                                           lambda p: safe_open(p, "pt"))
            parts.append(handles[q].get_slice(f"{i}/{key}")[a - qs:b - qs])
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    sharded, replicated = {}, {}

    def read() -> None:
        rep_file = _open_checked(os.path.join(directory, OPTIM_REPLICATED),
                                 lambda p: safe_open(p, "pt"))
        for i, (meta, s) in enumerate(zip(metas, layout)):
            sharded[i] = {k: piece(i, k, s.start, s.end) for k in meta["sharded"]}
            replicated[i] = dict(meta["replicated_values"])
            replicated[i].update({k: rep_file.get_tensor(f"{i}/{k}")
                                  for k in meta["replicated_tensors"]})

    # Ranks read different shards: a bad one (in a checkpoint without checksums) must stop
    # every rank here with its name, before load_checkpoint_state's collectives.
    _agreed_read(read, group, directory)
    groups = _restore_types(index["param_groups"], optimizer.param_groups)
    optimizer.load_checkpoint_state(sharded, replicated, groups, index.get("extra", {}))
