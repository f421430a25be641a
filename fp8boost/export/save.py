"""``Booster.save_model(..., fp8_export=...)``: an FP8 checkpoint from any plugin, atomically."""
from __future__ import annotations

import os
import shutil
from typing import Optional

import torch.distributed as dist
from torch import nn

from ..checkpoint_io import coordination as coord
from ..checkpoint_io.atomic import atomic_save_dir
from ..checkpoint_io.formats import MODEL_INDEX, MODEL_SINGLE
from . import writer
from .calibrate import observe
from .layouts import ExportSpec
from .quantize import find_targets

SCRATCH = ".full-precision"


def all_targets(module: nn.Module):
    """Every rank's quantization targets and ignored modules (pipeline stages hold different
    modules; collective when distributed)."""
    targets, ignored = find_targets(module)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (targets, ignored))
        seen_t, seen_i = {}, {}
        for t, i in parts:
            seen_t.update({x.key: x for x in t})
            seen_i.update(dict.fromkeys(i))
        targets, ignored = list(seen_t.values()), list(seen_i)
    return targets, ignored


def check_export(plugin, spec: ExportSpec) -> None:
    """Refuse what cannot work, before any collective."""
    if spec.calibrates and getattr(plugin, "pp_size", 1) > 1:
        raise ValueError("calibration_batches cannot run under pipeline parallelism (pp_size > 1)"
                         ": export with activation_scheme='dynamic' and kv_cache_scales=False, "
                         "or calibrate a pp_size=1 run")


def save_fp8_model(plugin, model: nn.Module, path: str, spec: ExportSpec, shard: bool,
                   size_mb: float, calibration_batches: Optional[list] = None) -> None:
    """Write ``model`` as an FP8 HF folder at ``path``; collective over the plugin's ranks.

    Args:
        plugin: the booster's plugin (its checkpoint IO gathers the full-precision tensors).
        model: the boosted model.
        path: target directory, replaced atomically (a failure keeps the previous one).
        spec: the validated layout (:func:`layouts.make_spec`).
        shard / size_mb: file splitting, as the full-precision export.
        calibration_batches: model inputs for static and KV-cache scales.

    Example:
        >>> booster.save_model(model, "out", fp8_export="block")  # doctest: +SKIP
    """
    check_export(plugin, spec)
    io = plugin.get_checkpoint_io()
    module = plugin.unwrap_model(model)
    targets, ignored = all_targets(module)
    stats = None
    if spec.calibrates:
        stats = observe(model, module, targets, calibration_batches,
                        inputs=spec.activation_scheme == "static", kv=spec.kv_cache_scales)

    def write(tmp: str) -> None:
        scratch = os.path.join(tmp, SCRATCH)
        io.save_model(model, scratch, shard, size_mb)
        if coord.rank(io.group) == 0:
            try:
                writer.convert(scratch, tmp, targets, ignored, spec, stats, shard)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

    atomic_save_dir(path, io.group, write, (MODEL_INDEX, MODEL_SINGLE))
