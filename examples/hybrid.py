"""``--plugin hybrid`` for the training example: argument checks, the plugin, pipeline steps.

``HybridParallelPlugin`` lays ranks out as ``(dp, pp, tp)`` with tp innermost: the ``tp x pp``
ranks of one model replica must train on the same batch, so batches are drawn by the
data-parallel index (:func:`data_rank`), not the global rank.

With ``--pp N`` (N > 1) the model is split over N pipeline ranks and its own ``forward`` is
not usable: one training step is one ``booster.execute_pipeline`` call (forward and backward
of every micro-batch), then clip, ``optimizer.step()``. The step's batch on each replica is
``--batch-size x --grad-accum`` rows: ``--grad-accum`` batches (the ones a ``--pp 1`` run
accumulates over) concatenated, which the pipeline splits into ``--microbatches`` micro-batches
(the micro-batches are the gradient accumulation; ``booster.no_sync`` is not used).

Example:
    >>> import argparse
    >>> a = argparse.Namespace(plugin="hybrid", pp=2, pp_style="1f1b", batch_size=8,
    ...                        grad_accum=1, microbatches=None)
    >>> default_microbatches(a)
    8
    >>> data_rank(argparse.Namespace(plugin="hybrid", tp=2, pp=2), rank=5, world_size=8)
    1
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

import torch

from fp8boost.batch_checks import check_lm_batch

import faults
import presets

PP_STYLES = ("1f1b", "interleaved", "zbv")
PER_STAGE = 4  # default micro-batches per pipeline stage (default_microbatches)
# The pipeline split (fp8boost.parallel.pipeline) handles Llama/Mistral/Qwen2-structured LMs.
PP_FAMILIES = ("llama", "mistral", "qwen2")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The ``--plugin hybrid`` flags."""
    group.add_argument("--tp", type=int, default=1, help="--plugin hybrid: tensor-parallel size")
    group.add_argument("--sp", action="store_true",
                       help="--plugin hybrid: sequence parallelism (norms/dropout split over tp)")
    group.add_argument("--zero", type=int, default=1, choices=(0, 1, 2),
                       help="--plugin hybrid|moe: ZeRO stage over the data-parallel ranks (<= 1 "
                            "with --pp > 1; moe: over the ranks holding the same experts)")
    group.add_argument("--pp", type=int, default=1,
                       help="--plugin hybrid: pipeline-parallel size (training through "
                            "booster.execute_pipeline)")
    group.add_argument("--pp-style", default="1f1b", choices=PP_STYLES,
                       help="--pp > 1: pipeline schedule (interleaved and zbv hold two model "
                            "chunks per rank)")
    group.add_argument("--microbatches", type=int, default=None,
                       help="--pp > 1: micro-batches per step, dividing the replica's "
                            "--batch-size x --grad-accum rows (default: a multiple of --pp >= "
                            "--grad-accum that divides them, 4 per stage where the rows allow, "
                            "else as many as they allow)")


def num_chunks(args: argparse.Namespace) -> int:
    """Model chunks per pipeline rank: 1 for 1F1B, 2 for interleaved and zero-bubble V."""
    return 1 if args.pp_style == "1f1b" else 2


def default_microbatches(args: argparse.Namespace) -> Optional[int]:
    """``--microbatches`` when not given (pp > 1): a multiple of ``--pp`` that is at least
    ``--grad-accum`` (so a micro-batch holds at most ``--batch-size`` rows) and divides the
    step's ``--batch-size x --grad-accum`` rows. Of those, the smallest giving every stage
    :data:`PER_STAGE` micro-batches, else the largest; None when there is none (or pp == 1).

    Why: the 1F1B bubble is (pp - 1) / (m + pp - 1) of the step and FP8 does not shrink it. On
    2xH200 (7B-8L, pp2, BENCHMARKS.md 4e) 8 one-sequence micro-batches ran FP8 at 1.26x BF16;
    with 2 the bubble alone would be a third of the step.
    """
    if args.plugin != "hybrid" or args.pp <= 1 or args.batch_size < 1 or args.grad_accum < 1:
        return None
    rows = args.batch_size * args.grad_accum
    fits = [m for m in range(args.pp, rows + 1, args.pp) if m >= args.grad_accum and rows % m == 0]
    if not fits:
        return None
    enough = [m for m in fits if m >= PER_STAGE * args.pp]
    return min(enough) if enough else max(fits)


def data_rank(args: argparse.Namespace, rank: int, world_size: int) -> int:
    """The index batches are drawn with: the data-parallel index for ``--plugin hybrid`` (the
    ranks of one replica share their batches), else the rank."""
    if args.plugin != "hybrid":
        return rank
    return rank // (args.tp * args.pp)


def data_parallel_size(args: argparse.Namespace, world_size: int) -> int:
    """Model replicas (each reads its own batches)."""
    return world_size // (args.tp * args.pp) if args.plugin == "hybrid" else world_size


def describe(args: argparse.Namespace) -> str:
    """``hybrid(tp=2,pp=2,1f1b,microbatches=2)`` / ``moe(ep=2,zero=1)`` for the start-up
    line."""
    if args.plugin == "moe":
        return f"moe(ep={args.ep},zero={args.zero})"
    if args.plugin != "hybrid":
        return args.plugin
    pp = f",pp={args.pp},{args.pp_style},microbatches={args.microbatches}" if args.pp > 1 else ""
    return f"hybrid(tp={args.tp}{pp},zero={args.zero}{',sp' if args.sp else ''})"


def _num_layers(args: argparse.Namespace) -> Optional[int]:
    """Decoder layers of the model to train, read without building it (None: unknown)."""
    if args.model_path is None:
        return presets.PRESETS[args.preset]["num_hidden_layers"]
    config = Path(args.model_path) / "config.json"
    if not config.is_file():
        return None  # check_model_folder names the problem
    return json.loads(config.read_text()).get("num_hidden_layers")


def validate_hybrid_args(args: argparse.Namespace, world_size: int) -> None:
    """``--tp``/``--sp``/``--zero``/``--pp``/... belong to ``--plugin hybrid``; the mesh must
    fit the ranks, and a pipeline needs ZeRO <= 1, splittable layers and micro-batches that
    divide the batch. ValueError naming the fix, before any work or collective."""
    if args.plugin != "hybrid":
        given = [flag for flag, on in (("--tp", args.tp != 1), ("--sp", args.sp),
                                       ("--zero", args.zero != 1 and args.plugin != "moe"),
                                       ("--pp", args.pp != 1),
                                       ("--pp-style", args.pp_style != "1f1b"),
                                       ("--microbatches", args.microbatches is not None)) if on]
        if given:
            what = "is an option" if len(given) == 1 else "are options"
            raise ValueError(f"{', '.join(given)} {what} of --plugin hybrid; add --plugin hybrid "
                             f"(this run has --plugin {args.plugin})")
        return
    if args.tp < 1 or world_size % args.tp:
        raise ValueError(f"--tp {args.tp} must be >= 1 and divide the number of ranks "
                         f"({world_size}); launch with torchrun --nproc_per_node=<multiple of "
                         "--tp>")
    if args.sp and args.tp == 1:
        raise ValueError("--sp splits sequences over the tensor-parallel ranks: it needs --tp >= 2")
    if args.pp < 1:
        raise ValueError(f"--pp must be >= 1, got {args.pp}")
    if args.pp == 1:
        given = [flag for flag, on in (("--pp-style", args.pp_style != "1f1b"),
                                       ("--microbatches", args.microbatches is not None)) if on]
        if given:
            raise ValueError(f"{', '.join(given)} configure a pipeline: add --pp N (N >= 2)")
        return
    _validate_pipeline(args, world_size)


def _validate_pipeline(args: argparse.Namespace, world_size: int) -> None:
    if world_size % (args.tp * args.pp):
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} ranks per model "
                         f"replica must divide the number of ranks ({world_size}); launch with "
                         f"torchrun --nproc_per_node=<multiple of {args.tp * args.pp}>")
    if args.zero > 1:
        raise ValueError(f"--pp {args.pp} needs --zero 0 or 1 (got --zero {args.zero}): ZeRO-2 "
                         "reduce-scatters gradients in every backward, and a pipeline runs one "
                         "backward per micro-batch")
    if args.model is not None and args.model not in PP_FAMILIES:
        raise ValueError(f"--pp splits Llama/Mistral/Qwen2-structured models; --model "
                         f"{args.model} is not one: use --model {'|'.join(PP_FAMILIES)}")
    chunks = num_chunks(args)
    layers = _num_layers(args)
    if layers is not None and layers % (args.pp * chunks):
        what = f"--pp {args.pp}" + (f" x 2 chunks (--pp-style {args.pp_style})"
                                    if chunks > 1 else "")
        raise ValueError(f"the model's {layers} decoder layers do not split evenly over {what} "
                         f"= {args.pp * chunks} stages; choose --pp (and --pp-style) so that "
                         f"{args.pp * chunks} divides {layers}")
    rows = args.batch_size * args.grad_accum
    m = args.microbatches
    if m is None:
        raise ValueError(f"no micro-batch count divides the step's {rows} rows (--batch-size "
                         f"{args.batch_size} x --grad-accum {args.grad_accum}) in multiples of "
                         f"--pp {args.pp}: pass --microbatches M (M divides {rows}) or change "
                         "--batch-size")
    if m < 1 or rows % m:
        raise ValueError(f"--microbatches {m} must be >= 1 and divide the step's {rows} rows "
                         f"per replica (--batch-size {args.batch_size} x --grad-accum "
                         f"{args.grad_accum})")
    if args.pp_style == "1f1b" and m < args.pp:
        raise ValueError(f"--pp-style 1f1b needs --microbatches >= --pp ({args.pp}), got {m}: "
                         "every stage must have a micro-batch in flight")
    if args.pp_style == "interleaved" and m % max(1, m // args.pp):
        raise ValueError(f"--pp-style interleaved needs --microbatches divisible by "
                         f"max(1, {m} // --pp {args.pp}), got {m}: use a multiple of --pp")
    if args.sp and args.seq_len % args.tp:
        raise ValueError(f"--sp needs --seq-len ({args.seq_len}) divisible by --tp {args.tp}")


def make_plugin(args: argparse.Namespace, fp8_config):
    """``HybridParallelPlugin`` for ``--plugin hybrid`` (clipping stays with the example)."""
    # Imported here: only hybrid runs need the tensor/pipeline-parallel machinery.
    from fp8boost.plugins.hybrid_parallel_plugin import HybridParallelPlugin

    pipeline: dict[str, Any] = {}
    if args.pp > 1:
        pipeline = dict(pp_style=args.pp_style, num_model_chunks=num_chunks(args),
                        num_microbatches=args.microbatches)
    return HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero,
                                enable_sequence_parallelism=args.sp,
                                precision=args.precision, use_fp8=args.use_fp8,
                                fp8_communication=args.fp8_comm, fp8_config=fp8_config,
                                fp8_reduce_scatter=args.fp8_reduce_scatter,
                                **pipeline)


def step_batch(windows, args: argparse.Namespace, step: int, index: int,
               vocab_size: int) -> torch.Tensor:
    """The replica's ``[batch_size x grad_accum, seq_len]`` batch of ``step``: the batches a
    ``--pp 1`` run accumulates over, concatenated."""
    batch = torch.cat([windows.batch(step, micro, index, args.batch_size)
                       for micro in range(args.grad_accum)])
    check_lm_batch(batch, batch, vocab_size)  # host-side, before any kernel or collective
    return batch


def pipeline_train_step(run, args: argparse.Namespace, step: int, rank: int,
                        device: torch.device, clip) -> tuple[float, Optional[float]]:
    """One optimizer step through ``booster.execute_pipeline``; returns (loss, grad norm).

    The loss is the batch mean (the last stage's, broadcast to every rank of the pipeline).
    """
    batch = step_batch(run.train_windows, args, step, run.data_rank, run.vocab_size).to(device)
    out = run.booster.execute_pipeline(iter([{"input_ids": batch, "labels": batch}]), run.model,
                                       optimizer=run.optimizer)
    faults.maybe_crash(args.simulate_crash, step, rank)  # fault drill: dies mid-step
    grad_norm = clip(run.booster, run.model, run.optimizer, args)
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.lr_scheduler.step()
    return float(out["loss"]), grad_norm


@torch.no_grad()
def pipeline_evaluate(run, args: argparse.Namespace, device: torch.device) -> float:
    """This replica's mean validation loss over ``--eval-batches`` forward-only pipeline runs
    (batches of ``--batch-size x --grad-accum`` rows, so the micro-batches divide them)."""
    run.model.eval()
    total = 0.0
    for i in range(args.eval_batches):
        batch = run.val_windows.batch(step=i, micro_step=0, rank=run.data_rank,
                                      batch_size=args.batch_size * args.grad_accum)
        check_lm_batch(batch, batch, run.vocab_size)
        batch = batch.to(device)
        out = run.booster.execute_pipeline(iter([{"input_ids": batch, "labels": batch}]),
                                           run.model)
        total += float(out["loss"])
    run.model.train()
    return total / args.eval_batches
