"""The Booster of the training example (``train_llama.py``): ``--plugin``, ``--precision``,
``--use-fp8`` / ``--fp8-recipe`` and ``--fp8-comm`` turned into an fp8boost plugin (or plain
mixed precision) with the non-finite guard of ``--max-bad-steps``.
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

import hybrid
import moe
from cli import fp8_options


def make_booster(args: argparse.Namespace, device: torch.device) -> Any:
    """The Booster for ``--plugin`` / ``--precision`` / ``--use-fp8`` / ``--fp8-comm``.

    Clipping is left to ``training.clip_gradients`` (``booster.clip_grad_norm_``), which also
    reports the norm, so no plugin gets a ``max_norm`` of its own.
    """
    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision
    from fp8boost.fp8 import Fp8Config
    from fp8boost.loss import FusedLmLossConfig

    fp8_config = None
    if args.use_fp8:
        min_numel = args.fp8_min_numel
        if min_numel is None and device.type != "cuda":
            # No FP8 tensor cores here: FP8 is emulated for its numerics only, so there is no
            # speed to lose on small layers. Convert them all so the demo really runs FP8.
            min_numel = 0
        extra = {} if min_numel is None else dict(min_numel=min_numel)
        extra.update(fp8_options(args))
        fp8_config = Fp8Config.from_recipe(args.fp8_recipe, **extra)
    from fp8boost.parallel.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard(max_consecutive=args.max_bad_steps,
                           enabled=not args.no_nonfinite_guard)
    head = {} if args.fp8_head == "none" else {
        "fused_lm_loss": FusedLmLossConfig(fp8_recipe=args.fp8_head)}
    if args.plugin == "none":
        mp = MixedPrecision("fp8" if args.use_fp8 else args.precision, fp8_config, **head)
        return Booster(mixed_precision=mp, device=device, nonfinite_guard=guard)
    # --fp8-head with hybrid/moe is refused by cli.validate_args, before any work
    return Booster(plugin=make_plugin(args, fp8_config, **head), device=device,
                   nonfinite_guard=guard)


def make_plugin(args: argparse.Namespace, fp8_config: Any, **options: Any) -> Any:
    """The fp8boost plugin for ``--plugin`` (not ``none``); ``options``: more plugin keywords
    (``fused_lm_loss``) for the ddp/zero/gemini/fsdp plugins."""
    from fp8boost.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if args.plugin == "hybrid":
        return hybrid.make_plugin(args, fp8_config)
    if args.plugin == "moe":
        return moe.make_plugin(args, fp8_config)
    if args.plugin == "gemini":
        plugin = GeminiPlugin(precision=args.precision, use_fp8=args.use_fp8,
                              fp8_communication=args.fp8_comm, fp8_config=fp8_config,
                              fp8_reduce_scatter=args.fp8_reduce_scatter,
                              enable_gradient_accumulation=args.grad_accum > 1, **options)
    elif args.plugin == "fsdp":
        plugin = TorchFSDPPlugin(precision=args.precision, use_fp8=args.use_fp8,
                                 fp8_communication=args.fp8_comm, fp8_config=fp8_config,
                                 fp8_reduce_scatter=args.fp8_reduce_scatter, **options)
    elif args.plugin == "ddp":
        plugin = TorchDDPPlugin(use_fp8=args.use_fp8, fp8_communication=args.fp8_comm,
                                precision=args.precision, fp8_config=fp8_config, **options)
    else:
        plugin = LowLevelZeroPlugin(stage=1 if args.plugin == "zero1" else 2,
                                    precision=args.precision, use_fp8=args.use_fp8,
                                    fp8_communication=args.fp8_comm, fp8_config=fp8_config,
                                    fp8_reduce_scatter=args.fp8_reduce_scatter, **options)
    return plugin
