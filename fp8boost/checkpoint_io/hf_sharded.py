"""HF-layout safetensors for models whose parameters are DTensors (any mesh, any placements).

* ``write_gathered``: every rank walks the state dict in the same order and calls
  ``full_tensor()`` on one tensor at a time; rank 0 streams each gathered tensor straight into
  its file (the safetensors header is computed up front from global shapes and dtypes), so no
  rank ever holds more than one full tensor, whatever the shard size, ``shard=False`` included.
  The layout (file names, index, ``config.json``) is that of ``model_io.write_model``.
* ``read_sharded``: each rank reads only the slice of every tensor that its local shard holds
  (``safe_open(...).get_slice(name)[slices]``); plain tensors are read whole.

Nothing here imports ``torch.distributed.tensor`` at import time.
"""
from __future__ import annotations

import ctypes
import json
import os
import struct
from types import MappingProxyType
from typing import Iterator, Mapping, Optional

import safetensors
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fp8boost.parallel.fsdp.full_state_dict import local_of

from .atomic import require
from .formats import MODEL_INDEX, MODEL_SINGLE
from .model_io import check_keys, dedup_state_dict, plan_shards, storage_key

_ST_DTYPES = MappingProxyType({
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"})


# ------------------------------------------------------------------------- DTensor helpers
def is_dtensor(t: torch.Tensor) -> bool:
    # Duck-typed: importing torch.distributed.tensor costs seconds, and plain models never need it.
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


def gatherable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a DTensor with a plain local tensor on its mesh's device.

    Collectives cannot see through weight subclasses, and an offloaded (CPU) shard of a CUDA
    mesh must move to the device before NCCL gathers it. Shares storage when nothing moves.
    """
    local = local_of(t)
    if local is t._local_tensor and local.device.type == t.device_mesh.device_type:
        return t
    local = local.to(t.device_mesh.device_type)
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def local_slices(t: torch.Tensor) -> Optional[tuple[slice, ...]]:
    """This rank's shard of DTensor ``t`` as one box of the full tensor, or None when the
    placements do not make a box (strided shards of FSDP x TP, partial sums)."""
    if any(type(p) not in (Shard, Replicate) for p in t.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def unique_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)`` with tied tensors kept once (first key wins).

    DTensor parameters are deduplicated by identity (FSDP2 gives tied parameters one object;
    their local shards say nothing about the global tensor); plain tensors by storage, as
    ``model_io.dedup_state_dict`` does.
    """
    sd = module.state_dict(keep_vars=True)
    plain = dedup_state_dict({k: t for k, t in sd.items() if not is_dtensor(t)})
    seen: set[int] = set()
    kept = {}
    for k, t in sd.items():
        if is_dtensor(t) and id(t) not in seen:
            seen.add(id(t))
            kept[k] = t
        elif k in plain:
            kept[k] = t
    return kept


# ------------------------------------------------------------------------------ writing
class _StreamedFile:
    """A safetensors file written one tensor at a time in a fixed order."""

    def __init__(self, path: str, entries: list[tuple[str, torch.Tensor]]) -> None:
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, t in entries:
            if t.dtype not in _ST_DTYPES:
                raise TypeError(f"cannot write {key}: dtype {t.dtype} has no safetensors code")
            nbytes = t.numel() * t.element_size()
            header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # tensor data starts 8-byte aligned, as safetensors does
        self.path = path
        self.expected = [(k, t.dtype, tuple(t.shape)) for k, t in entries]
        self.fh = open(path, "wb")
        self.fh.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, key: str, t: torch.Tensor) -> None:
        want = self.expected.pop(0) if self.expected else None
        if want != (key, t.dtype, tuple(t.shape)):
            raise RuntimeError(f"{self.path}: got {key} {t.dtype} {tuple(t.shape)}, the header "
                               f"announced {want}")
        cpu = t.detach().to("cpu").contiguous()
        n = cpu.numel() * cpu.element_size()
        if n:  # safetensors stores little-endian, as every platform torch runs on
            self.fh.write((ctypes.c_char * n).from_address(cpu.data_ptr()))

    def close(self) -> None:
        self.fh.close()
        if self.expected:
            raise RuntimeError(f"{self.path} is incomplete: {len(self.expected)} tensors missing")


class Sink:
    """Rank 0's files. A write that fails (disk full, ...) is remembered, not raised: the other
    ranks are still gathering, and rank 0 must keep joining those collectives until the end
    (then ``atomic_save_dir`` drops the partial directory on every rank)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.file: Optional[_StreamedFile] = None
        self.failure: Optional[BaseException] = None

    def _guard(self, fn, *args) -> None:
        if self.failure is None:
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - raised after the last gather
                self.failure = exc

    def open(self, name: str, entries: list[tuple[str, torch.Tensor]]) -> None:
        def make() -> None:
            self.file = _StreamedFile(os.path.join(self.directory, name), entries)
        self._guard(make)

    def write(self, key: str, t: torch.Tensor) -> None:
        if self.file is not None:
            self._guard(self.file.write, key, t)

    def close(self) -> None:
        if self.file is not None:
            file, self.file = self.file, None
            self._guard(file.close)


def plan_files(sd: dict[str, torch.Tensor], shard: bool, size_mb: float) -> list[list[str]]:
    """Keys per file: state-dict order cut at ``size_mb`` (as ``model_io.plan_shards``); inside
    a file, wider dtypes first so that every tensor stays aligned to its element size."""
    plan = plan_shards(sd, int(size_mb * 1024 * 1024)) if shard else [list(sd)]
    return [sorted(keys, key=lambda k: -sd[k].element_size()) for keys in plan]


def file_names(plan: list[list[str]], shard: bool) -> list[str]:
    """The HF file names of ``plan``'s files (``model.safetensors`` when not sharded)."""
    if not shard:
        return [MODEL_SINGLE]
    return [f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]


def _gathered(sd: dict[str, torch.Tensor], keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors in ``keys`` order; collective (every rank gathers every DTensor)."""
    with torch.no_grad():
        for k in keys:
            t = sd[k]
            yield k, (gatherable(t).full_tensor() if is_dtensor(t) else t)


def write_gathered(module: nn.Module, directory: str, shard: bool, size_mb: float,
                   writer: bool) -> None:
    """Write ``module``'s state into ``directory`` in HF layout; collective over its meshes.

    Args:
        module: the unwrapped model (parameters DTensors or plain tensors).
        directory: existing directory to write into (rank 0 writes, the others only gather).
        shard: several ``model-0000i-of-0000n.safetensors`` + index, else one file.
        size_mb: file size limit in MiB (a larger single tensor gets a file of its own).
        writer: True on the one rank that writes.
    """
    sd = unique_state(module)
    plan = plan_files(sd, shard, size_mb)
    names = file_names(plan, shard)
    sink = Sink(directory) if writer else None
    for name, keys in zip(names, plan):
        if sink is not None:
            sink.open(name, [(k, sd[k]) for k in keys])
        for k, full in _gathered(sd, keys):
            if sink is not None:
                sink.write(k, full)
            del full  # free the gathered copy before the next collective
        if sink is not None:
            sink.close()
    finish(sink, module, directory, names, plan, sd, shard)


# ------------------------------------------------------------------------------ reading
class Reader:
    """Opened safetensors files of one checkpoint; errors name the file."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.handles: dict[str, object] = {}

    def file(self, fname: str):
        if fname not in self.handles:
            with self.errors(fname):
                self.handles[fname] = safetensors.safe_open(
                    os.path.join(self.directory, fname), "pt")
        return self.handles[fname]

    def errors(self, fname: str):
        return _NamedErrors(os.path.join(self.directory, fname))

    def close(self) -> None:
        self.handles.clear()  # safe_open handles unmap when dropped


class CheckpointFileError(OSError):
    """A checkpoint file could not be read (missing, truncated or corrupt)."""


class _NamedErrors:
    """Re-raise a read failure (``SafetensorError``, ``OSError``, ...) naming the file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, (OSError, ValueError, KeyError, safetensors.SafetensorError)) \
                and not isinstance(exc, CheckpointFileError):
            raise CheckpointFileError(f"cannot read checkpoint file {self.path}: {exc} (missing, "
                                      "truncated or corrupt: restore it or load another "
                                      "checkpoint)") from exc
        return False


def finish(sink: Optional["Sink"], module: nn.Module, directory: str, names: list[str],
           plan: list[list[str]], tensors: dict[str, torch.Tensor], shard: bool) -> None:
    """After a save's file loop: the writer (``sink`` not None) re-raises what a file write
    failed with, else writes :func:`write_index_and_config`; other ranks do nothing."""
    if sink is None:
        return
    if sink.failure is not None:
        raise sink.failure
    write_index_and_config(module, directory, names, plan, tensors, shard)


def write_index_and_config(module: nn.Module, directory: str, names: list[str],
                           plan: list[list[str]], tensors: dict[str, torch.Tensor],
                           shard: bool) -> None:
    """The HF index of a sharded export (``tensors``: every saved key, full size; only numel
    and dtype are read, so meta tensors do), and the config files ``from_pretrained`` needs."""
    if shard:
        weight_map = {k: n for n, keys in zip(names, plan) for k in keys}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(directory, MODEL_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    for attr in ("config", "generation_config"):  # what from_pretrained needs beside weights
        cfg = getattr(module, attr, None)
        if cfg is not None and hasattr(cfg, "save_pretrained"):
            cfg.save_pretrained(directory)


def checkpoint_files(directory: str) -> list[str]:
    """Safetensors files of an HF folder: the index's files, else ``model.safetensors``."""
    index = os.path.join(directory, MODEL_INDEX)
    if os.path.exists(index):
        with _NamedErrors(index):
            with open(index) as f:
                return list(dict.fromkeys(json.load(f)["weight_map"].values()))
    require(directory, "model", MODEL_SINGLE)
    return [MODEL_SINGLE]


def _identity(t: torch.Tensor):
    # DTensor parameters: one object per tied group (FSDP2); plain tensors: their storage.
    return id(t) if is_dtensor(t) else storage_key(t)


def _check_keys(own: dict[str, torch.Tensor], shapes: dict[str, tuple], directory: str,
                strict: bool) -> None:
    meta = [k for k, t in own.items() if t.is_meta]
    if meta:
        raise RuntimeError(f"cannot load {directory} into tensors on the meta device "
                           f"{meta[:5]}: materialise the model first (to_empty)")
    check_keys(own, shapes, directory, strict, identity=_identity)


def _read_local(handle, key: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Read what ``t``'s local storage needs of ``key``: (data, True when it is the whole
    tensor and this rank's piece must still be cut out of it)."""
    if not is_dtensor(t):
        return handle.get_tensor(key), False
    box = local_slices(t)
    if box is None:  # no single box (strided shard, partial): read it whole
        return handle.get_tensor(key), True
    if not box:  # 0-d
        return handle.get_tensor(key), False
    if any(b.stop == b.start for b in box):  # an empty shard (uneven split): nothing to read
        return torch.empty([b.stop - b.start for b in box]), False
    return handle.get_slice(key)[box], False


def _cut(full: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for DTensor ``t``, cut locally (src_data_rank=None: every
    rank holds ``full``, so nothing is communicated)."""
    full = full.to(t.device_mesh.device_type)
    return distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()


def read_sharded(module: nn.Module, directory: str, strict: bool = True,
                 dtypes: Optional[Mapping[str, torch.dtype]] = None) -> None:
    """Fill ``module``'s parameters and persistent buffers from an HF folder, in place.

    Keys and shapes are checked against the model before anything is copied. Each DTensor
    receives only its local shard, read as a slice. Not collective. ``dtypes`` (``{key:
    dtype}``): each tensor read for such a key is cast to that dtype before it is copied in
    (the rounding ``from_pretrained(torch_dtype=...)`` applies, whatever the model's dtype now).
    """
    files = checkpoint_files(directory)
    own = module.state_dict(keep_vars=True)
    reader = Reader(directory)
    try:
        where: dict[str, str] = {}
        shapes: dict[str, tuple] = {}
        for fname in files:
            f = reader.file(fname)
            with reader.errors(fname):
                for k in f.keys():
                    where[k] = fname
                    shapes[k] = tuple(f.get_slice(k).get_shape())
        _check_keys(own, shapes, directory, strict)
        with torch.no_grad():
            for key, t in own.items():
                if key not in where:
                    continue
                with reader.errors(where[key]):
                    part, whole = _read_local(reader.file(where[key]), key, t)
                if whole:
                    part = _cut(part, t)
                if dtypes is not None and key in dtypes:
                    part = part.to(dtypes[key])
                dst = local_of(t)
                if tuple(part.shape) != tuple(dst.shape):
                    raise RuntimeError(f"{key}: read a {tuple(part.shape)} piece for a local shard "
                                       f"of shape {tuple(dst.shape)} "
                                       f"({getattr(t, 'placements', 'not a DTensor')})")
                dst.copy_(part)
    finally:
        reader.close()
