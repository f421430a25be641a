"""bench/scale.py's configs: their names, their layout on a world size, and the pipeline setup.

A config is a baseline (``rep.BASELINES``) or ``zero2_<v>``, ``gemini_<v>``, ``tpN[sp]_<v>``,
``ppN_<v>`` with ``<v>`` in :data:`VARIANTS` (``zero2_<v>_ovl``: ``overlap_allgather``).
"""
from __future__ import annotations

import re
from typing import Any

import torch

import _scale_report as rep  # bench/_scale_report.py
import train  # bench/train.py

VARIANTS = ("bf16", "fp8", "fp8_comm")
CONFIG_RE = re.compile(
    r"^(?:(zero2|gemini)|tp(\d+)(sp)?|pp(\d+))_(bf16|fp8|fp8_comm)(_ovl)?$")
BASELINES = list(rep.BASELINES)
MATRIX_7B = BASELINES + [f"{f}_{v}" for f in ("zero2", "gemini", "tp2", "pp2") for v in VARIANTS]
MATRIX_35B = ["tp8sp_bf16", "tp8sp_fp8", "tp4sp_bf16", "tp4sp_fp8"]


def layout_of(name: str, world_size: int) -> dict[str, Any]:
    """A config's plugin, variant and (tp, pp, dp, sp) on ``world_size`` ranks.

    Raises:
        ValueError: unknown name, or tp x pp does not divide the world size.

    Example:
        >>> layout_of("tp2_fp8", 8)["dp"], layout_of("pp2_bf16", 2)["dp"]
        (4, 1)
    """
    if name in BASELINES:
        return dict(config=name, plugin=name.split("_")[0], variant="bf16", tp=1, pp=1,
                    dp=world_size, sp=False)
    m = CONFIG_RE.match(name)
    if m is None:
        raise ValueError(f"unknown config {name!r}: use {BASELINES}, zero2_<v>, gemini_<v>, "
                         f"tpN_<v>, tpNsp_<v> or ppN_<v> with <v> in {VARIANTS}")
    plain, tp, sp, pp, variant, ovl = m.groups()
    if ovl and plain != "zero2":
        raise ValueError(f"{name}: _ovl (overlap_allgather) is a ZeRO option: zero2_<v>_ovl")
    tp, pp = int(tp or 1), int(pp or 1)
    if tp < 1 or (m.group(4) and pp < 2) or (sp and tp < 2):
        raise ValueError(f"{name}: tp must be >= 1, pp >= 2, and sequence parallelism needs "
                         "tp >= 2")
    if world_size % (tp * pp):
        raise ValueError(f"{name} needs tp x pp = {tp * pp} to divide the world size {world_size}")
    plugin = plain or ("pipeline" if pp > 1 else "hybrid")
    return dict(config=name, plugin=plugin, variant=variant, tp=tp, pp=pp,
                dp=world_size // (tp * pp), sp=bool(sp))


def pp_chunks(args) -> int:
    """Model chunks per pipeline rank: ``--pp-chunks``, else 1 for 1f1b and 2 otherwise."""
    return args.pp_chunks or (1 if args.pp_style == "1f1b" else 2)


def setup_pipeline(model, lay: dict[str, Any], args, device, replica_batch: int):
    """HybridParallelPlugin(pp_size, num_microbatches, zero_stage=1); a step via
    ``booster.execute_pipeline``. Raises NotImplementedError where pp is not implemented."""
    from fp8boost.booster import Booster
    from fp8boost.plugins import HybridParallelPlugin

    fp8_cfg = train.fp8_config_of(args) if lay["variant"] != "bf16" else None
    plugin = HybridParallelPlugin(
        tp_size=lay["tp"], pp_size=lay["pp"], zero_stage=1, precision="bf16",
        num_microbatches=args.microbatches or replica_batch, pp_style=args.pp_style,
        num_model_chunks=pp_chunks(args),
        use_fp8=lay["variant"] != "bf16", fp8_communication=lay["variant"] == "fp8_comm",
        reduce_bucket_size_in_m=args.bucket_m, fp8_config=fp8_cfg,
        fused_lm_loss=train.fused_lm_loss_setting(args.fused_lm_loss))
    if args.compile:
        train.compile_layers(model)
    booster = Booster(plugin=plugin, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    model, optimizer, *_ = booster.boost(model, optimizer)
    report = getattr(plugin, "fp8_report", None)
    if report is not None:
        args._fp8_layers = dict(converted=len(report.converted), kept=len(report.skipped))
    return booster, model, optimizer
