"""``HybridCheckpointIO``: checkpoints of ``HybridParallelPlugin`` (tensor parallel x ZeRO).

Under tensor parallelism every split parameter is a plain tensor holding this rank's shard
(``plugin.tp_state.shard_dims`` says along which dim); the ZeRO optimizer further splits the
FP32 masters and optimizer state of each local shard into flat chunks over the ``dp`` group.

* ``save_model``: HF-layout safetensors (``from_pretrained`` loads them). Exact weights first
  (``plugin.exact_weights``: FP32 masters where the working copy is FP8-rounded), then ONE
  parameter at a time is gathered over tp onto global rank 0 (``dist.gather``) and streamed
  to disk. Only the tp group of data-parallel replica 0 communicates; tied weights are
  written once (first key, as ``save_pretrained`` does).
* ``load_model``: each rank reads only its tp slice of every tensor (safetensors
  ``get_slice``), one file at a time; then ZeRO masters follow (``plugin.after_load_model``).
* ``save_checkpoint`` / ``load_checkpoint``: ``torch.distributed.checkpoint`` (DCP) with one
  DTensor per tensor on the plugin's ``("dp", "pp", "tp")`` mesh, placements ``Shard(d)``
  over tp and ``Replicate()`` elsewhere. Model tensors are keyed ``model/<name>``, optimizer
  state ``optim/<param name>/<key>`` (by name, never by index); non-tensor state,
  ``param_groups`` (parameter names) and the loss scaler go to ``hybrid_state.json``. DCP
  writes each replicated chunk once and reshards on load, so a checkpoint loads into any
  (tp, dp, zero_stage) that splits the same model.

Pipeline parallelism (pp_size > 1, ``hybrid_pp.py``): each stage holds different parameters
under their HF names (a tied embedding keeps ``model.embed_tokens.weight`` on the last stage),
so every format above keys them as in an unsplit run and loads into any other (pp, tp, dp)
split; ``save_model`` brings each tensor to rank 0 from its stage, one at a time.

Memory cost of ``save_checkpoint``/``load_checkpoint``: every rank materialises its
tp-local shard of the FP32 masters and of every optimizer state tensor (e.g. 3 x 4 bytes x
params / tp for AdamW), gathering the ZeRO chunks over dp one parameter at a time: the
resident size of ZeRO stage 0, i.e. ``dp`` times what stages 1/2 hold. ``load_model`` holds
one safetensors file's local slices at a time; ``save_model`` one full parameter on rank 0
(plus, with FP8 all-gather, ``exact_weights``' tp-local FP32 masters on every rank).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import atomic, coordination as coord, hf_sharded as hf
from .base import STATE_MARKER, CheckpointIO
from .checksums import verify_checksums
from .formats import (HYBRID_OPTIM_MARKER as OPTIM_MARKER, MODEL_INDEX, MODEL_SINGLE,
                      OPTIMIZER_MARKERS)
from .hybrid_pp import all_keys, local_param_groups, merge_optimizer_index, write_hf_gathered_pp
from .hybrid_tp import TpLayout
from .model_io import dedup_state_dict, storage_key
from .optimizer_io import check_optimizer, jsonable, restore_types

STATE_DIR = "dcp"
STATE_INDEX = "hybrid_state.json"


# ------------------------------------------------------------------------------ checks
def _check_boosted(plugin, module: nn.Module) -> None:
    """Raise (before any collective) when ``module`` was not split by this plugin."""
    if plugin.tp_size > 1 and plugin.tp_state is None:
        raise ValueError("this HybridParallelPlugin has not split a model yet: boost the model "
                         "with booster.boost(model, optimizer) before saving or loading it")
    dims = plugin.tp_state.shard_dims if plugin.tp_state is not None else {}
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    stray = [n for n in dims if n not in names]
    if stray:
        raise ValueError(f"the model does not hold the tensor-parallel parameters {stray[:3]} "
                         "this plugin split: pass the model returned by this plugin's boost()")


def _check_target(path: str, markers: tuple[str, ...]) -> None:
    """Every rank checks the target itself, so a bad path fails before any collective."""
    err = atomic.check_target(os.path.abspath(os.fspath(path)), markers)
    if err is not None:
        raise ValueError(err)


def _check_size(size_per_shard_mb) -> None:
    if isinstance(size_per_shard_mb, bool) or not isinstance(size_per_shard_mb, (int, float)) \
            or size_per_shard_mb <= 0:
        raise ValueError(f"size_per_shard_mb must be > 0 (MiB per file), got {size_per_shard_mb!r}")


# ------------------------------------------------------------------------------ export
def write_hf_gathered(plugin, model: nn.Module, directory: str, shard: bool,
                      size_mb: float) -> None:
    """Write the full model in HF layout into ``directory``; collective over the world.

    Global rank 0 writes; the other ranks of its tp group send their shards one parameter at
    a time; the other data-parallel replicas only join ``exact_weights``. With pp_size > 1
    each stage's tensors come to rank 0 from their owner (``hybrid_pp.py``).
    """
    if plugin.pp_size > 1:
        return write_hf_gathered_pp(plugin, model, directory, shard, size_mb)
    module = plugin.unwrap_model(model)
    overrides = plugin.exact_weights(model)  # collective over dp: before the per-rank paths
    tp = TpLayout.of(plugin)
    sd = dedup_state_dict(module.state_dict(keep_vars=True))
    # Meta stand-ins with the full shapes: file planning and headers need no data.
    shapes = {k: torch.empty(tp.full_shape(k, t), dtype=t.dtype, device="meta")
              for k, t in sd.items()}
    plan = hf.plan_files(shapes, shard, size_mb)
    names = hf.file_names(plan, shard)
    writer = coord.rank(plugin.checkpoint_group) == 0
    # rank 0's tp group (Ulysses sp ranks hold the same weights: sp rank 0's group sends)
    sends = tp.size > 1 and plugin.dp_rank == 0 and plugin.topology().rank("sp") == 0
    sink = hf.Sink(directory) if writer else None
    with torch.no_grad():
        for fname, keys in zip(names, plan):
            if sink is not None:
                sink.open(fname, [(k, shapes[k]) for k in keys])
            for k in keys:
                t = overrides.get(id(sd[k]), sd[k]).detach()
                if sends and k in tp.shard_dims:
                    t = tp.gather(k, t, dst=0)
                if sink is not None:
                    sink.write(k, t)
                del t  # free the gathered copy before the next gather
            if sink is not None:
                sink.close()
    hf.finish(sink, module, directory, names, plan, shapes, shard)


# ------------------------------------------------------------------------------ reading
def _check_hf_keys(own: dict, shapes: dict, tp: TpLayout, directory: str, strict: bool,
                   known: Optional[set] = None) -> None:
    """Compare the files' full shapes with the model's (local shape x tp along the split).

    ``known``: every rank's keys (pipeline stages hold different ones), or None.
    """
    unexpected = [k for k in shapes if k not in own and (known is None or k not in known)]
    wrong = [f"{k}: {shapes[k]} vs {tp.full_shape(k, own[k])}" for k in shapes
             if k in own and shapes[k] != tp.full_shape(k, own[k])]
    loaded = {storage_key(own[k]) for k in shapes if k in own}
    missing = [k for k in own if k not in shapes and storage_key(own[k]) not in loaded]
    if wrong or (strict and (missing or unexpected)):
        raise ValueError(f"checkpoint {directory} does not match the model: shape mismatches "
                         f"{wrong[:5]}, missing keys {missing[:10]}, unexpected keys "
                         f"{unexpected[:10]}; load a checkpoint of this model (strict=False "
                         "allows missing/unexpected keys)")


def read_hf_sliced(plugin, model: nn.Module, directory: str, strict: bool = True) -> None:
    """Fill ``model`` from an HF folder, each rank reading only its tp slices.

    Not collective, except with pp_size > 1 (one ``all_gather_object`` of the key names).
    """
    module = plugin.unwrap_model(model)
    known = None
    if plugin.pp_size > 1:
        known = all_keys(plugin, module, dedup=False)
    tp = TpLayout.of(plugin)
    files = hf.checkpoint_files(directory)
    own = module.state_dict(keep_vars=True)
    reader = hf.Reader(directory)
    try:
        keys_of: dict[str, list[str]] = {}
        shapes: dict[str, tuple] = {}
        for fname in files:
            f = reader.file(fname)
            with reader.errors(fname):
                keys_of[fname] = list(f.keys())
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in keys_of[fname]})
        _check_hf_keys(own, shapes, tp, directory, strict, known)
        for fname in files:  # one file's local slices at a time
            f, part = reader.file(fname), {}
            with reader.errors(fname):
                for k in keys_of[fname]:
                    if k in own and k in tp.shard_dims:
                        part[k] = f.get_slice(k)[tp.box(k, shapes[k])]
                    elif k in own:
                        part[k] = f.get_tensor(k)
            # load_state_dict (not copy_): Fp8Linear drops its cached weight casts.
            module.load_state_dict(part, strict=False)
            del part
    finally:
        reader.close()


# ----------------------------------------------------------------------- resumable (DCP)
class _Placer:
    """Wraps tp-local tensors as DTensors on the plugin's mesh (``Shard(d)`` over tp)."""

    def __init__(self, plugin) -> None:
        self.tp = TpLayout.of(plugin)
        self.size = self.tp.size
        self.mesh = plugin.topology().mesh if self.size > 1 else None

    def wrap(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the DTensor of the full tensor; replicated tensors stay plain (DCP
        writes one copy of a plain tensor and every rank reads it whole)."""
        dim = self.tp.shard_dims.get(name)
        if dim is None:
            return local

        placements = [Shard(dim) if n == "tp" else Replicate() for n in self.mesh.mesh_dim_names]
        shape = torch.Size(self.tp.full_shape(name, local))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local.contiguous(), self.mesh, placements, run_check=False,
                                  shape=shape, stride=stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hf.is_dtensor(t) else t


def _param_names(module: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (the first name of a tied parameter)."""
    return {id(p): n for n, p in module.named_parameters()}


def _gather_dp(piece: torch.Tensor, shard, optimizer) -> torch.Tensor:
    """The tp-local tensor (``shard.shape``) from every dp rank's flat ZeRO chunk."""
    if optimizer.shard_world_size == 1:
        return piece.detach().reshape(shard.shape).clone()
    # On the parameter's device: NCCL cannot gather CPU-offloaded chunks.
    device = optimizer.params[shard.index].device
    buf = torch.zeros(shard.chunk, dtype=piece.dtype, device=device)
    buf[: shard.length].copy_(piece.reshape(-1))
    parts = [torch.empty_like(buf) for _ in range(optimizer.shard_world_size)]
    dist.all_gather(parts, buf, group=optimizer.dp_group)
    return torch.cat(parts)[: shard.numel].view(shard.shape)


def _optimizer_state(optimizer, names: dict[int, str], placer: _Placer) -> tuple[dict, dict]:
    """(DCP tensors ``optim/<name>/<key>``, JSON index) of a ZeroOptimizer; collective over dp."""
    sharded, replicated, groups, extra = optimizer.checkpoint_state()
    tensors, params = {}, {}
    for i, (p, s) in enumerate(zip(optimizer.params, optimizer.checkpoint_layout())):
        name = names[id(p)]
        meta = {"sharded": {}, "replicated_tensors": {}, "replicated_values": {}}
        for key, piece in sorted(sharded.get(i, {}).items()):
            tensors[f"optim/{name}/{key}"] = placer.wrap(name, _gather_dp(piece, s, optimizer))
            meta["sharded"][key] = str(piece.dtype).removeprefix("torch.")
        for key, value in replicated.get(i, {}).items():
            if torch.is_tensor(value):
                tensors[f"optim/{name}/{key}"] = value.detach().clone()
                meta["replicated_tensors"][key] = [str(value.dtype).removeprefix("torch."),
                                                   list(value.shape)]
            else:
                json.dumps(value)  # TypeError for state we cannot store
                meta["replicated_values"][key] = value
        params[name] = meta
    by_index = [names[id(p)] for p in optimizer.params]
    groups = [{**{k: jsonable(v) for k, v in g.items() if k != "params"},
               "params": [by_index[j] for j in g["params"]]} for g in groups]
    return tensors, {"params": params, "param_groups": groups, "extra": extra}


def _model_state(module: nn.Module, placer: _Placer) -> dict[str, torch.Tensor]:
    sd = dedup_state_dict(module.state_dict(keep_vars=True))
    return {f"model/{k}": placer.wrap(k, t.detach()) for k, t in sd.items()}


def _templates(module: nn.Module, optimizer, index: dict, placer: _Placer) -> dict:
    """Zero tensors in this run's layout for every key DCP should fill."""
    state = {k: placer.wrap(k[len("model/"):], torch.zeros_like(_local(t)))
             for k, t in _model_state(module, placer).items()}
    if optimizer is None:
        return state
    names = _param_names(module)
    saved = index.get("optim", {}).get("params", {})
    for p, s in zip(optimizer.params, optimizer.checkpoint_layout()):
        meta = saved.get(names[id(p)], {})
        for key, dtype in meta.get("sharded", {}).items():
            local = torch.zeros(s.shape, dtype=getattr(torch, dtype), device=p.device)
            state[f"optim/{names[id(p)]}/{key}"] = placer.wrap(names[id(p)], local)
        for key, (dtype, shape) in meta.get("replicated_tensors", {}).items():
            state[f"optim/{names[id(p)]}/{key}"] = torch.zeros(shape, dtype=getattr(torch, dtype))
    return state


def _check_against_metadata(state: dict, directory: str, known: Optional[set] = None) -> None:
    """Every key we load exists with the same global shape (read locally: no collective).

    ``known``: every rank's ``model/`` keys (pipeline stages hold different ones), or None.
    """
    if not os.path.exists(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"no DCP checkpoint at {directory} (missing .metadata): the "
                                "save did not finish; resume from another checkpoint")
    md = FileSystemReader(directory).read_metadata().state_dict_metadata
    missing = [k for k in state if k not in md]
    wrong = [f"{k}: saved {tuple(md[k].size)} vs {tuple(state[k].shape)}" for k in state
             if k in md and hasattr(md[k], "size") and tuple(md[k].size) != tuple(state[k].shape)]
    extra = [k for k in md if k.startswith("model/") and k not in (known or state)]
    if missing or wrong or extra:
        raise ValueError(f"checkpoint {directory} does not match this model/optimizer: missing "
                         f"{missing[:5]}, shape mismatches {wrong[:5]}, unexpected {extra[:5]}; "
                         "resume with the model (and optimizer param groups) that saved it")


def _load_optimizer_state(optimizer, module: nn.Module, state: dict, index: dict) -> None:
    """Cut this rank's ZeRO chunks out of the loaded tp-local tensors and hand them over."""
    names = _param_names(module)
    saved = index["params"]
    position = {names[id(p)]: i for i, p in enumerate(optimizer.params)}
    sharded, replicated = {}, {}
    for i, (p, s) in enumerate(zip(optimizer.params, optimizer.checkpoint_layout())):
        name, meta = names[id(p)], saved.get(names[id(p)], {})
        sharded[i] = {k: _local(state[f"optim/{name}/{k}"]).reshape(-1)[s.start:s.end]
                      for k in meta.get("sharded", {})}
        replicated[i] = dict(meta.get("replicated_values", {}))
        replicated[i].update({k: state[f"optim/{name}/{k}"]
                              for k in meta.get("replicated_tensors", {})})
    groups = []
    for g in index["param_groups"]:
        unknown = [n for n in g["params"] if n not in position]
        if unknown:
            raise ValueError(f"the checkpoint's optimizer holds parameters {unknown[:3]} that "
                             "this optimizer does not: build it on the same model parameters")
        groups.append({**g, "params": [position[n] for n in g["params"]]})
    groups = restore_types(groups, optimizer.param_groups)
    optimizer.load_checkpoint_state(sharded, replicated, groups, index.get("extra", {}))


class HybridCheckpointIO(CheckpointIO):
    """Checkpoint IO of ``HybridParallelPlugin``: HF exports and re-shardable DCP state.

    Every method is collective over the world (``plugin.checkpoint_group``); argument and
    path errors are raised on every rank before any collective. See the module docstring
    for the formats and their memory cost.

    Example:
        >>> booster = Booster(plugin=HybridParallelPlugin(tp_size=2, zero_stage=1))  # doctest: +SKIP
        >>> model, opt, *_ = booster.boost(model, opt)                             # doctest: +SKIP
        >>> booster.save_model(model, "export")     # from_pretrained loads it      # doctest: +SKIP
        >>> booster.save_checkpoint("ckpt", model, opt, extra={"step": 100})       # doctest: +SKIP
        >>> booster.load_checkpoint("ckpt", model, opt)  # any tp x dp x stage      # doctest: +SKIP
    """

    state_format = "fp8boost-hybrid-dcp-v1"

    # ---------------------------------------------------------------- HF-layout export
    def save_model(self, model: nn.Module, path: str, shard: bool = True,
                   size_per_shard_mb: float = 1024) -> None:
        """HF folder, gathered over tp one parameter at a time onto global rank 0."""
        _check_size(size_per_shard_mb)
        _check_boosted(self.plugin, self.plugin.unwrap_model(model))
        _check_target(path, (MODEL_INDEX, MODEL_SINGLE))
        atomic.atomic_save_dir(path, self.group,
                               lambda tmp: self._write_model_into(model, tmp, shard,
                                                                  size_per_shard_mb),
                               (MODEL_INDEX, MODEL_SINGLE))

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        if coord.rank(self.group) == 0:
            os.makedirs(directory, exist_ok=True)
        write_hf_gathered(self.plugin, model, directory, shard, size_mb)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        """Load an HF folder (ours or ``save_pretrained``'s); each rank reads its tp slices."""
        _check_boosted(self.plugin, self.plugin.unwrap_model(model))
        verify_checksums(os.fspath(path), self.group)  # every rank raises alike
        read_hf_sliced(self.plugin, model, os.fspath(path), strict)
        self.plugin.after_load_model(model)

    # ------------------------------------------------------------------------ optimizer
    def save_optimizer(self, optimizer, path: str) -> None:
        """Optimizer state alone (DCP, keyed by parameter name: loads into any tp x dp x stage).

        The names come from the model this plugin boosted together with ``optimizer``.
        """
        module = self._module_of(optimizer)
        check_optimizer(optimizer)
        _check_target(path, OPTIMIZER_MARKERS)

        def write(tmp: str) -> None:
            self._write_state(tmp, module, optimizer, None, with_model=False)
            if coord.rank(self.group) == 0:
                with open(os.path.join(tmp, OPTIM_MARKER), "w") as f:
                    json.dump({"format": self.state_format}, f)

        atomic.atomic_save_dir(path, self.group, write, OPTIMIZER_MARKERS)

    def load_optimizer(self, optimizer, path: str) -> None:
        """Load a ``save_optimizer`` directory (written at any tp x dp x stage)."""
        module = self._module_of(optimizer)
        check_optimizer(optimizer)
        atomic.require(os.fspath(path), "hybrid optimizer", OPTIM_MARKER)
        verify_checksums(os.fspath(path), self.group)  # every rank raises alike
        self._read_state(os.fspath(path), module, optimizer, with_model=False)

    def _module_of(self, optimizer):
        module = self.plugin.boosted_module
        if module is None or self.plugin.boosted_optimizer is not optimizer:
            raise ValueError("save_optimizer/load_optimizer need the optimizer returned by this "
                             "plugin's boost() (its parameter names come from the model boosted "
                             "with it); or use booster.save_checkpoint(path, model, optimizer)")
        return module

    # ---------------------------------------------------------------- resumable state
    def save_checkpoint(self, path: str, model: nn.Module, optimizer=None, lr_scheduler=None,
                        extra: Optional[dict] = None) -> None:
        """Model + optimizer (+ scheduler, ``extra``) as DCP; see the module docstring."""
        _check_boosted(self.plugin, self.plugin.unwrap_model(model))
        if optimizer is not None:
            check_optimizer(optimizer)
        _check_target(path, (STATE_MARKER,))
        super().save_checkpoint(path, model, optimizer, lr_scheduler, extra)

    def load_checkpoint(self, path: str, model: nn.Module, optimizer=None,
                        lr_scheduler=None) -> dict:
        """Restore a ``save_checkpoint`` directory written at any (tp, dp, zero_stage)."""
        _check_boosted(self.plugin, self.plugin.unwrap_model(model))
        if optimizer is not None:
            check_optimizer(optimizer)
        return super().load_checkpoint(path, model, optimizer, lr_scheduler)

    def _write_state(self, tmp: str, model, optimizer, lr_scheduler,
                     with_model: bool = True) -> None:
        module = self.plugin.unwrap_model(model)
        placer = _Placer(self.plugin)
        state = _model_state(module, placer) if with_model else {}
        index: dict = {"tp": placer.size, "dp": self.plugin.dp_size}
        if optimizer is not None:
            tensors, index["optim"] = _optimizer_state(optimizer, _param_names(module), placer)
            if self.plugin.pp_size > 1:  # rank 0 writes the index: every stage's names
                index["optim"] = merge_optimizer_index(self.plugin, index["optim"])
            state.update(tensors)
            index["zero_stage"] = optimizer.stage
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(tmp, STATE_DIR)),
                 process_group=self.group)
        if coord.rank(self.group) == 0:
            with open(os.path.join(tmp, STATE_INDEX), "w") as f:
                json.dump(index, f, indent=1)

    def _read_state(self, path: str, model, optimizer, with_model: bool = True) -> None:
        with open(os.path.join(path, STATE_INDEX)) as f:
            index = json.load(f)
        if optimizer is not None and "optim" not in index:
            raise ValueError(f"{path} holds no optimizer state (saved with optimizer=None): "
                             "load it with optimizer=None")
        module = self.plugin.unwrap_model(model)
        placer = _Placer(self.plugin)
        state = _templates(module, optimizer, index, placer)
        if not with_model:
            state = {k: v for k, v in state.items() if not k.startswith("model/")}
        known = None
        if self.plugin.pp_size > 1 and with_model:  # stages hold different keys
            known = {f"model/{k}" for k in all_keys(self.plugin, module)}
        _check_against_metadata(state, os.path.join(path, STATE_DIR), known)  # before DCP
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.path.join(path, STATE_DIR)),
                 process_group=self.group)
        model_part = {k[len("model/"):]: _local(t) for k, t in state.items()
                      if k.startswith("model/")}
        if with_model:
            module.load_state_dict(model_part, strict=False)  # tied keys were saved once
            self.plugin.after_load_model(model)  # masters of parameters without saved state
        if optimizer is not None:
            optim = index["optim"]
            if self.plugin.pp_size > 1:  # each stage loads its own parameters' groups
                optim = {**optim, "param_groups": local_param_groups(
                    self.plugin, optim["param_groups"], set(_param_names(module).values()))}
            _load_optimizer_state(optimizer, module, state, optim)
