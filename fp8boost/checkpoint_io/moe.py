"""Checkpoint IO of ``MoeHybridParallelPlugin``: HF models with every expert, and optimizer
state per expert-parallel rank in the re-shardable optimizer format.

Model files (``save_model`` / ``load_model``): the HF layout with all E experts of each layer
(all-gathered over the ep group one Parameter at a time; with ``tp_size > 1`` all at once,
then the tp shards are gathered as ``HybridParallelPlugin``'s export does); they load at any
ep and tp size. Optimizer state saved at one tp size and loaded at another is refused
(``ValueError``). With ``pp_size > 1`` the model files are gathered over pp too (each stage's
tensors sent to rank 0 by their owner, ``hybrid_pp``) and load at any pp, ep and tp size;
optimizer state is kept per stage (one sub-directory per stage, ep and tp rank): it loads at
the saved pp size (re-split over ep, dp and ZeRO stage as without pp), another pp size is
refused (``ValueError``).

Optimizer directory (``save_optimizer``; also ``optimizer/`` inside ``save_checkpoint``)::

    moe_optimizer.index.json          format, ep_size, moe-dp size, world size, zero stage,
                                      tp and pp sizes, the sub-directories, SHA-256 of
                                      every file below
    ep00000-of-00002/                 ep rank 0's optimizer: the re-shardable format
        optimizer.index.json          (``formats``) written by the moe-dp group of ep rank 0
        optimizer-rank00000-of-00001.safetensors ...
    ep00001-of-00002/ ...

(with ``tp_size > 1`` each name ends ``-tp<rank>-of-<tp size>``, with ``pp_size > 1`` then
``-pp<stage>-of-<pp size>``: :func:`ep_subdir`)

Each ep rank holds different experts, so each ep rank's moe-dp group writes its own
sub-directory with the shared ``write_optimizer`` (ZeRO shards of the moe-dp group, its
master weights, Adam moments, loss scaler); the replicated non-expert state is in every
sub-directory (ep copies on disk: the price of reusing the format unchanged). Loading at the
saved ep size reads the sub-directory of this rank's ep rank with ``read_optimizer``, which
re-shards it to any moe-dp size (so another dp size and another ZeRO stage load). At another
ep size each rank reads, per parameter, only the ranges it now holds: a non-expert state from
the first sub-directory, an expert state from the sub-directories of the saved ep ranks that
held its experts (the flattened ``[E, ...]`` expert tensor is the saved ep ranks' flattened
``[E/ep, ...]`` tensors one after the other, so a range of it maps onto their ranges). An
optimizer directory of another plugin (DDP, ZeRO: every expert whole, as one ep rank) loads
the same way. The
whole directory is written atomically (``atomic_save_dir``): a failed save leaves the previous
checkpoint at the path intact.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fp8boost.parallel.ep import EpExperts, gathered_experts, whole_experts

from . import coordination as coord
from .atomic import atomic_save_dir
from .base import GeneralCheckpointIO
from .checksums import verify_checksums
from .coordination import agreed_read
from .formats import MOE_OPTIM_INDEX, OPTIM_INDEX, OPTIMIZER_MARKERS
from .hybrid import read_hf_sliced, write_hf_gathered
from .model_io import read_model
from .optimizer_io import (ShardPieces, check_optimizer, open_replicated, read_index,
                           read_optimizer, replicated_state, restore_types, write_optimizer)

MOE_OPTIM_FORMAT = "fp8boost-moe-optimizer-v1"


def ep_subdir(ep_rank: int, ep_size: int, tp_rank: int = 0, tp_size: int = 1,
              pp_rank: int = 0, pp_size: int = 1) -> str:
    """The sub-directory holding ep rank ``ep_rank``'s optimizer state (and, with
    ``tp_size > 1``, tp rank ``tp_rank``'s: its tp shards of the non-expert parameters; with
    ``pp_size > 1``, pipeline stage ``pp_rank``'s: the parameters of its layers).

    Example:
        >>> ep_subdir(1, 2), ep_subdir(0, 2, pp_rank=1, pp_size=2)
        ('ep00001-of-00002', 'ep00000-of-00002-pp00001-of-00002')
    """
    tp = f"-tp{tp_rank:05d}-of-{tp_size:05d}" if tp_size > 1 else ""
    pp = f"-pp{pp_rank:05d}-of-{pp_size:05d}" if pp_size > 1 else ""
    return f"ep{ep_rank:05d}-of-{ep_size:05d}{tp}{pp}"


class MoeCheckpointIO(GeneralCheckpointIO):
    """``GeneralCheckpointIO`` whose model files hold every expert and whose optimizer
    directories hold one re-shardable optimizer sub-directory per ep rank (module docstring).

    ``save_model``: rank 0 writes, the expert Parameters replaced by their all-gathered whole
    (``MoeHybridParallelPlugin.exact_weights``). ``load_model``: each rank's expert
    Parameters are grown to all E experts, the whole file is read with the usual key and
    shape checks, then each rank keeps its own experts again: a checkpoint saved at one ep
    size (or by ``save_pretrained``) loads at any other.
    """

    state_format = "fp8boost-moe-v1"  # resumable directories: the optimizer part differs

    def _experts(self, model: nn.Module) -> list[EpExperts]:
        return [m for m in self.plugin.unwrap_model(model).modules() if isinstance(m, EpExperts)]

    def _write_model_into(self, model, directory: str, shard: bool, size_mb: float) -> None:
        """With ``tp_size > 1`` or ``pp_size > 1``: every rank holds its experts whole for the
        export (gathered over ep), then ``HybridParallelPlugin``'s export gathers the tp
        shards and the stages onto rank 0."""
        if self.plugin.tp_size == 1 and self.plugin.pp_size == 1:
            return super()._write_model_into(model, directory, shard, size_mb)
        if coord.rank(self.group) == 0:
            os.makedirs(directory, exist_ok=True)
        with gathered_experts(self._experts(model)):
            write_hf_gathered(self.plugin, model, directory, shard, size_mb)

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        verify_checksums(os.fspath(path), self.group)
        with whole_experts(self._experts(model)):
            if self.plugin.tp_size > 1 or self.plugin.pp_size > 1:
                # each rank reads its tp slices of its stages' keys (experts whole)
                read_hf_sliced(self.plugin, model, os.fspath(path), strict)
            else:
                read_model(self.plugin.unwrap_model(model), os.fspath(path), strict)
        self.plugin.after_load_model(model)

    # ------------------------------------------------------------------ optimizer
    def _topology(self) -> dict:
        """This run's layout, as the index records it."""
        plugin = self.plugin
        return {"ep_size": plugin.ep_size, "dp_size": dist.get_world_size(plugin.moe_dp_group),
                "world_size": dist.get_world_size(), "zero_stage": plugin.zero_stage,
                "tp_size": plugin.tp_size, "pp_size": plugin.pp_size}

    def _pp_rank(self) -> int:
        """This rank's pipeline rank (0 without pp)."""
        sm = self.plugin.stage_manager
        return sm.stage if sm is not None else 0

    def _subdir(self, ep_rank: int, ep_size: int) -> str:
        """``ep_subdir`` for this rank's tp rank (tp ranks hold different non-expert shards)
        and pipeline rank (stages hold different layers)."""
        st = self.plugin.tp_state
        return ep_subdir(ep_rank, ep_size, st.rank if st is not None else 0,
                         self.plugin.tp_size, self._pp_rank(), self.plugin.pp_size)

    def save_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                        OPTIMIZER_MARKERS)

    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        check_optimizer(optimizer)
        plugin = self.plugin
        ep_rank = dist.get_rank(plugin.ep_group)
        sub = os.path.join(directory, self._subdir(ep_rank, plugin.ep_size))
        # One writer group per (ep, tp) rank: its moe-dp ranks holding a ZeRO shard, else the
        # first.
        is_writer = (optimizer.shard_world_size > 1
                     or dist.get_rank(plugin.moe_dp_group) == 0)

        def prepare() -> None:
            if is_writer:
                os.makedirs(sub, exist_ok=True)
            if coord.rank(self.group) == 0:
                os.makedirs(directory, exist_ok=True)
                meta = {"format": MOE_OPTIM_FORMAT, **self._topology(),
                        "subdirs": [ep_subdir(e, plugin.ep_size, t, plugin.tp_size, s,
                                              plugin.pp_size)
                                    for e in range(plugin.ep_size)
                                    for t in range(plugin.tp_size)
                                    for s in range(plugin.pp_size)]}
                with open(os.path.join(directory, MOE_OPTIM_INDEX), "w") as f:
                    json.dump(meta, f, indent=1)

        # Agreed, not a bare barrier: a rank that cannot create its directory must not leave
        # the others waiting; write_optimizer itself communicates nothing.
        coord.run_agreed(prepare, self.group)
        write_optimizer(optimizer, sub, is_writer)

    def load_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        path = os.fspath(path)
        saved_ep = self._saved_ep_size(path)  # every rank raises alike, before any collective
        verify_checksums(path, self.group)
        if saved_ep is None:  # another plugin's (DDP, ZeRO): every expert whole, as at ep 1
            self._read_resplit(optimizer, [path], path)
        elif saved_ep == self.plugin.ep_size:
            ep_rank = dist.get_rank(self.plugin.ep_group)
            read_optimizer(optimizer, os.path.join(path, self._subdir(ep_rank, saved_ep)),
                           self.group)
        else:
            self._read_resplit(optimizer, [os.path.join(path, self._subdir(e, saved_ep))
                                           for e in range(saved_ep)], path)

    def _saved_ep_size(self, path: str) -> Optional[int]:
        """The ep size ``path`` was saved at; None for another plugin's optimizer directory
        (file reads only, no collective).

        Raises:
            FileNotFoundError: no optimizer checkpoint at ``path``.
            ValueError: an unknown MoE optimizer format.
        """
        if not os.path.exists(os.path.join(path, MOE_OPTIM_INDEX)) and os.path.exists(
                os.path.join(path, OPTIM_INDEX)):
            # another plugin's: whole tensors, every layer in one place, as at tp 1 and pp 1
            self._check_saved_axes(path, 1, 1)
            return None
        meta = read_index(path, "MoE optimizer", MOE_OPTIM_INDEX, MOE_OPTIM_FORMAT)
        self._check_saved_axes(path, meta.get("tp_size", 1), meta.get("pp_size", 1))
        return meta["ep_size"]

    def _check_saved_axes(self, path: str, saved_tp: int, saved_pp: int) -> None:
        """Optimizer state re-splits over ep, dp and ZeRO stage, not over tp or pp (kept per
        tp rank and per pipeline stage); no collective.

        Raises:
            ValueError: ``path`` was saved at another tp or pp size than this run's.
        """
        for axis, saved, now in (("tp", saved_tp, self.plugin.tp_size),
                                 ("pp", saved_pp, self.plugin.pp_size)):
            if saved != now:
                raise ValueError(
                    f"optimizer checkpoint {path} was saved at {axis}_size={saved}, this run "
                    f"has {axis}_size={now}: MoeHybridParallelPlugin's optimizer state "
                    f"re-splits over ep_size, dp size and zero_stage but not over {axis}; "
                    f"resume with {axis}_size={saved} (booster.load_model loads the model at "
                    f"any {axis} size)")

    def _read_resplit(self, optimizer, subs: list[str], path: str) -> None:
        """Load optimizer directories ``subs`` saved by ep ranks ``0..len(subs)-1`` of another
        ep size: each rank reads the ranges of its own shards, an expert state's from the
        saved ep ranks holding them (``path``: the checkpoint, for messages)."""
        saved_ep = len(subs)
        indexes = [read_index(d) for d in subs]
        metas, layout = indexes[0]["params"], optimizer.checkpoint_layout()
        expert = [self.plugin.is_expert_param(p) for p in optimizer.params]
        ep, ep_rank = self.plugin.ep_size, dist.get_rank(self.plugin.ep_group)
        want = [s.numel * ep // saved_ep if x else s.numel for s, x in zip(layout, expert)]
        if len(metas) != len(layout) or any(m["numel"] != w for m, w in zip(metas, want)):
            raise ValueError(f"optimizer checkpoint {path} (saved at ep_size={saved_ep}) holds "
                             f"{len(metas)} parameters {[m['numel'] for m in metas][:8]}...; "
                             f"this optimizer (ep_size={ep}) would have saved {len(want)} "
                             f"{want[:8]}... there: same model and param groups needed")
        readers = [ShardPieces(d, index) for d, index in zip(subs, indexes)]

        def expert_range(i: int, key: str, start: int, end: int) -> torch.Tensor:
            # This rank's local experts start at element ep_rank * (local numel) of the whole
            # flattened [E, ...] tensor; saved ep rank e held [e * n, (e + 1) * n) of it.
            n, lo = metas[i]["numel"], ep_rank * layout[i].numel
            first, last = lo + start, lo + end
            parts = []
            for e in range(saved_ep):
                a, b = max(first, e * n), min(last, (e + 1) * n)
                if a < b:
                    parts.append(readers[e].get(i, key, a - e * n, b - e * n))
            return torch.cat(parts) if parts else torch.zeros(0)

        sharded, replicated = {}, {}

        def read() -> None:
            rep_file = open_replicated(subs[0])
            for i, (meta, s) in enumerate(zip(metas, layout)):
                get = expert_range if expert[i] else readers[0].get
                sharded[i] = {k: get(i, k, s.start, s.end) for k in meta["sharded"]}
                replicated[i] = replicated_state(meta, i, rep_file)

        agreed_read(read, self.group, path)  # a bad file stops every rank, with its name
        groups = restore_types(indexes[0]["param_groups"], optimizer.param_groups)
        optimizer.load_checkpoint_state(sharded, replicated, groups, indexes[0].get("extra", {}))
