"""Checkpoint IO of ``MoeHybridParallelPlugin``: HF models with every expert, and optimizer
state per expert-parallel rank in the re-shardable optimizer format.

Model files (``save_model`` / ``load_model``): the HF layout with all E experts of each layer
(all-gathered over the ep group one Parameter at a time); they load at any ep size.

Optimizer directory (``save_optimizer``; also ``optimizer/`` inside ``save_checkpoint``)::

    moe_optimizer.index.json          format, ep_size, moe-dp size, world size, zero stage,
                                      the sub-directories, SHA-256 of every file below
    ep00000-of-00002/                 ep rank 0's optimizer: the re-shardable format
        optimizer.index.json          (``formats``) written by the moe-dp group of ep rank 0
        optimizer-rank00000-of-00001.safetensors ...
    ep00001-of-00002/ ...

Each ep rank holds different experts, so each ep rank's moe-dp group writes its own
sub-directory with the shared ``write_optimizer`` (ZeRO shards of the moe-dp group, its
master weights, Adam moments, loss scaler); the replicated non-expert state is in every
sub-directory (ep copies on disk: the price of reusing the format unchanged). Loading reads
the sub-directory of this rank's ep rank with ``read_optimizer``, which re-shards it to any
moe-dp size (so another dp size and another ZeRO stage load); another ep size is refused with
a ``ValueError`` before any collective: a sub-directory's parameter ranges are of its own
``E/ep`` experts, which the format cannot re-split. The whole directory is written atomically
(``atomic_save_dir``): a failed save leaves the previous checkpoint at the path intact.
"""
from __future__ import annotations

import json
import os

import torch.distributed as dist
from torch import nn

from fp8boost.plugins.moe_dispatch import EpExperts, whole_experts

from . import coordination as coord
from .atomic import atomic_save_dir, require
from .base import GeneralCheckpointIO
from .checksums import verify_checksums
from .formats import OPTIM_INDEX
from .model_io import read_model
from .optimizer_io import check_optimizer, read_optimizer, write_optimizer

MOE_OPTIM_INDEX = "moe_optimizer.index.json"
MOE_OPTIM_FORMAT = "fp8boost-moe-optimizer-v1"


def ep_subdir(ep_rank: int, ep_size: int) -> str:
    """The sub-directory holding ep rank ``ep_rank``'s optimizer state."""
    return f"ep{ep_rank:05d}-of-{ep_size:05d}"


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

    def load_model(self, model: nn.Module, path: str, strict: bool = True) -> None:
        verify_checksums(os.fspath(path), self.group)
        experts = [m for m in self.plugin.unwrap_model(model).modules()
                   if isinstance(m, EpExperts)]
        with whole_experts(experts):
            read_model(self.plugin.unwrap_model(model), os.fspath(path), strict)
        self.plugin.after_load_model(model)

    # ------------------------------------------------------------------ optimizer
    def _topology(self) -> dict:
        """This run's layout, as the index records it."""
        plugin = self.plugin
        return {"ep_size": plugin.ep_size, "dp_size": dist.get_world_size(plugin.moe_dp_group),
                "world_size": dist.get_world_size(), "zero_stage": plugin.zero_stage}

    def save_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        atomic_save_dir(path, self.group, lambda tmp: self._write_optimizer_into(optimizer, tmp),
                        (MOE_OPTIM_INDEX,))

    def _write_optimizer_into(self, optimizer, directory: str) -> None:
        check_optimizer(optimizer)
        plugin = self.plugin
        ep_rank = dist.get_rank(plugin.ep_group)
        sub = os.path.join(directory, ep_subdir(ep_rank, plugin.ep_size))
        # One writer group per ep rank: its moe-dp ranks holding a ZeRO shard, else the first.
        is_writer = (optimizer.shard_world_size > 1
                     or dist.get_rank(plugin.moe_dp_group) == 0)

        def prepare() -> None:
            if is_writer:
                os.makedirs(sub, exist_ok=True)
            if coord.rank(self.group) == 0:
                os.makedirs(directory, exist_ok=True)
                meta = {"format": MOE_OPTIM_FORMAT, **self._topology(),
                        "subdirs": [ep_subdir(e, plugin.ep_size) for e in range(plugin.ep_size)]}
                with open(os.path.join(directory, MOE_OPTIM_INDEX), "w") as f:
                    json.dump(meta, f, indent=1)

        # Agreed, not a bare barrier: a rank that cannot create its directory must not leave
        # the others waiting; write_optimizer itself communicates nothing.
        coord.run_agreed(prepare, self.group)
        write_optimizer(optimizer, sub, is_writer)

    def load_optimizer(self, optimizer, path: str) -> None:
        check_optimizer(optimizer)
        path = os.fspath(path)
        sub = self._check_saved_topology(path)  # every rank raises alike, before any collective
        verify_checksums(path, self.group)
        read_optimizer(optimizer, sub, self.group)

    def _check_saved_topology(self, path: str) -> str:
        """The sub-directory this rank reads, after checking the saved ep size (no collective).

        Raises:
            FileNotFoundError: no MoE optimizer checkpoint at ``path``.
            ValueError: another plugin's optimizer directory, or another ep size.
        """
        if not os.path.exists(os.path.join(path, MOE_OPTIM_INDEX)) and os.path.exists(
                os.path.join(path, OPTIM_INDEX)):
            raise ValueError(f"{path} is an optimizer checkpoint of another plugin (no "
                             f"{MOE_OPTIM_INDEX}; its state is not split by expert): "
                             "MoeHybridParallelPlugin loads optimizer checkpoints it saved; "
                             "load the model (booster.load_model) and start a fresh optimizer")
        require(path, "MoE optimizer", MOE_OPTIM_INDEX)
        with open(os.path.join(path, MOE_OPTIM_INDEX)) as f:
            meta = json.load(f)
        if meta.get("format") != MOE_OPTIM_FORMAT:
            raise ValueError(f"{path} has MoE optimizer format {meta.get('format')!r}, expected "
                             f"{MOE_OPTIM_FORMAT!r}")
        now = self._topology()
        if meta["ep_size"] != now["ep_size"]:
            def show(t: dict) -> str:
                return (f"ep_size={t['ep_size']} x dp={t['dp_size']} (world {t['world_size']}, "
                        f"zero_stage={t['zero_stage']})")
            raise ValueError(
                f"optimizer checkpoint {path} was saved at {show(meta)}; this run is "
                f"{show(now)}. Expert optimizer state is stored per ep rank and loads only at "
                f"the same ep_size (any dp size or ZeRO stage): resume with "
                f"ep_size={meta['ep_size']}, or load the model alone (booster.load_model reads "
                "any ep size) and start a fresh optimizer")
        return os.path.join(path, ep_subdir(dist.get_rank(self.plugin.ep_group), now["ep_size"]))
