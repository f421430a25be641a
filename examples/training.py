"""The training loop of the example (``train_llama.py``): one optimizer step, evaluation,
periodic checkpoints, and :func:`train`, which runs a whole training from parsed flags.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import signal
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from fp8boost.batch_checks import check_lm_batch

import checkpointing
import faults
import hybrid
import interrupts
import metrics as metrics_lib
import moe
import run_checks
from cli import UsageError, validate_args
from ranks import rank_and_device, reduce_mean_max, start_process_group
from run_log import (RunLogger, announce, finish, finish_interrupted,
                     write_run_config)
from run_setup import Run, data_position, finished_already, make_out_dir, setup

# Warnings every rank would print identically: rank 0 alone says them.
RANK0_WARNINGS = (r"fp8boost: FP8 tensor cores unavailable", r"fp8boost: no linear layer",
                  r"fp8boost: use_fp8=True but no linear layer")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during training, after the partial run's records were written and
    announced.

    Attributes:
        signum: the signal that stopped the run (``main`` exits with ``128 + signum``).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(interrupts.signal_name(signum))
        self.signum = signum


def clip_gradients(booster: Any, model: Any, optimizer: Any,
                   args: argparse.Namespace) -> Optional[float]:
    """Clip the global grad norm to ``--max-norm`` (over all shards for ZeRO); returns the
    norm before clipping (inf when FP16 gradients overflowed and the step will be skipped)."""
    if args.max_norm <= 0:
        return None
    return float(booster.clip_grad_norm_(model, optimizer, args.max_norm))


@torch.no_grad()
def evaluate(run: Run, args: argparse.Namespace, world_size: int,
             device: torch.device) -> float:
    """Mean validation loss over ``--eval-batches`` fixed batches per replica, across ranks."""
    if args.pp > 1:
        local = hybrid.pipeline_evaluate(run, args, device)
    else:
        model, total = run.model, 0.0
        model.eval()
        for i in range(args.eval_batches):
            batch = run.val_windows.batch(step=i, micro_step=0, rank=run.data_rank,
                                          batch_size=args.batch_size)
            check_lm_batch(batch, batch, run.vocab_size)  # host-side, ~us: before kernels
            batch = batch.to(device)
            total += float(model(input_ids=batch, labels=batch).loss)
        model.train()
        local = total / args.eval_batches
    (mean,), _ = reduce_mean_max([local], [], world_size, device)
    return mean


def train_step(run: Run, args: argparse.Namespace, step: int, rank: int,
               device: torch.device) -> tuple[float, Optional[float]]:
    """One optimizer step over ``--grad-accum`` micro-batches; returns (local loss, grad norm).

    Gradients of all but the last micro-batch stay local (``booster.no_sync``): communicating
    them once per step is what makes accumulation cheap.
    """
    if args.pp > 1:  # one execute_pipeline call: its micro-batches are the accumulation
        return hybrid.pipeline_train_step(run, args, step, rank, device, clip_gradients)
    booster, model, optimizer = run.booster, run.model, run.optimizer
    loss_sum = 0.0
    for micro in range(args.grad_accum):
        batch = run.train_windows.batch(step, micro, run.data_rank, args.batch_size)
        # Host-side, before any kernel or collective (a few us per batch; see batch_checks).
        check_lm_batch(batch, batch, run.vocab_size)
        batch = batch.to(device)
        last = micro == args.grad_accum - 1
        sync = contextlib.nullcontext() if last else booster.no_sync(model, optimizer)
        with sync:
            loss = model(input_ids=batch, labels=batch).loss / args.grad_accum
            booster.backward(loss, optimizer)
        loss_sum += float(loss.detach())
    faults.maybe_crash(args.simulate_crash, step, rank)  # fault drill: dies mid-step
    grad_norm = clip_gradients(booster, model, optimizer, args)
    optimizer.step()
    optimizer.zero_grad()
    run.lr_scheduler.step()
    return loss_sum, grad_norm


def save_and_prune(run: Run, args: argparse.Namespace, logger: RunLogger, step: int,
                   out_dir: Path, save_dir: Path, rank: int, world_size: int,
                   device: torch.device) -> None:
    """Save the checkpoint of ``step`` (every rank), then rank 0 announces it and applies
    ``--keep-last``."""
    state = dict(world_size=world_size, out_dir=str(out_dir), seed=args.seed,
                 tokens=step * logger.tokens_per_step, preset=args.preset,
                 model=args.model, model_path=args.model_path,
                 tokenizer=args.tokenizer)
    state["data_position"] = dict(data_position(args), next_step=step + 1)
    saved = checkpointing.save_checkpoint(run.booster, run.model, run.optimizer,
                                          run.lr_scheduler, save_dir, step, state,
                                          rank, device)
    if rank == 0:  # printed even with --no-progress: a user must know it exists
        announce(logger, f"[train] step {step}: saved checkpoint {saved} "
                         f"(resume with --resume {save_dir})")
        # After the save completed on every rank (save_checkpoint's last barrier).
        resumed = run.resume_state.get("resumed_from") if run.resume_state else None
        removed = checkpointing.prune_checkpoints(save_dir, args.keep_last, resumed)
        if removed:
            announce(logger, f"[train] --keep-last {args.keep_last}: deleted "
                             f"{', '.join(p.name for p in removed)}")


def run_steps(run: Run, args: argparse.Namespace, logger: RunLogger, start_step: int,
              out_dir: Path, save_dir: Path, rank: int, world_size: int,
              device: torch.device) -> Optional[float]:
    """Steps ``start_step + 1 .. --steps`` with their logs, evaluations and checkpoints;
    returns the last validation loss (None when none was taken).

    Raises:
        interrupts.SignalInterrupt: on every rank, once a step in which any rank received
            Ctrl-C or SIGTERM is logged (a second signal raises at once, mid-step).
    """
    guard = getattr(run.optimizer, "nonfinite_guard", None)
    if guard is not None:
        guard.step = start_step  # its warnings name the training step
    timer = metrics_lib.StepTimer(device)
    run.model.train()
    val_loss = None
    # Ctrl-C / SIGTERM stop the run at the end of a step; ranks get a watchdog (interrupts.py).
    grace = interrupts.STOP_GRACE_S if world_size > 1 else None
    with interrupts.deferred_stop(grace, rank) as stop:
        for step in range(start_step + 1, args.steps + 1):
            lr = run.optimizer.param_groups[0]["lr"]  # the lr this step uses
            timer.begin()
            loss, grad_norm = train_step(run, args, step, rank, device)
            seconds = timer.end()
            # The stop request rides on the step's own collective: every rank learns that any
            # rank got the signal, after the same step.
            (loss,), (seconds, mem, signum) = reduce_mean_max(
                [loss], [seconds, metrics_lib.peak_memory_gib(device), stop.signum or 0],
                world_size, device)
            skipped = guard is not None and step in guard.skipped[-1:]
            if not math.isfinite(loss) and not skipped:  # guard off: the step was applied
                raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or use "
                                         "--precision bf16")
            logger.step(step, loss, grad_norm, lr, seconds, mem, skipped)
            if signum:  # no evaluation or save: torchrun kills ranks 30 s after its signal
                raise interrupts.SignalInterrupt(int(signum))
            if run.val_windows is not None and args.eval_every and step % args.eval_every == 0:
                val_loss = evaluate(run, args, world_size, device)
                logger.eval(step, val_loss)
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                save_and_prune(run, args, logger, step, out_dir, save_dir, rank, world_size,
                               device)
    return val_loss


def _checked_placement(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """(rank, world size, device) once the flags passed every check; a failed check is a
    :class:`UsageError`. Only the checks' own errors are converted: anything later keeps its
    type and traceback."""
    try:
        rank, world_size, device = rank_and_device(args.device)
        validate_args(args, world_size)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    return rank, world_size, device


def _start_records(args: argparse.Namespace, run: Run, out_dir: Path, start_step: int,
                   world_size: int, device: torch.device) -> None:
    """Rank 0: the output folder, ``run_config.json`` and the opening ``[train]`` lines."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_config(out_dir, args, world_size, device, run)
    print(f"[train] {run.n_params / 1e6:.2f}M params, model={args.model or args.model_path} "
          f"compile={args.compile} activation_checkpointing={args.activation_checkpointing} "
          f"plugin={hybrid.describe(args)} "
          f"precision={args.precision} fp8={args.use_fp8} fp8_comm={args.fp8_comm} "
          f"world_size={world_size} device={device} start_step={start_step} "
          f"out_dir={out_dir}", flush=True)
    if args.use_fp8:
        print(f"[train] {moe.describe_coverage(run.fp8_coverage, args.pp)}", flush=True)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole training; returns the summary (rank 0's view; empty on other ranks).

    Raises:
        UsageError: a bad flag (from :func:`cli.validate_args` or the device check), before
            any work or collective; ``main`` prints it as one line.
    """
    rank, world_size, device = _checked_placement(args)
    if rank != 0:
        for message in RANK0_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
    if finished_already(args, rank):
        return {}
    if world_size > 1:  # plain python: the plugins start a one-process group themselves
        start_process_group(world_size, device)
    run = setup(args, rank, device)
    start_step = run.resume_state["step"] if run.resume_state else 0
    out_dir = make_out_dir(args, run.resume_state, rank, world_size)
    save_dir = Path(args.save_dir) if args.save_dir else out_dir / "checkpoints"
    if rank == 0:
        _start_records(args, run, out_dir, start_step, world_size, device)
    logger = RunLogger(out_dir, args, start_step, rank == 0, run.flops_per_token, world_size)
    if rank == 0:
        for note in run_checks.start_notes(args, run, device, logger.tokens_per_step):
            announce(logger, note)
    try:
        val_loss = run_steps(run, args, logger, start_step, out_dir, save_dir, rank,
                             world_size, device)
        if run.val_windows is not None and (not args.eval_every
                                            or args.steps % args.eval_every):
            val_loss = evaluate(run, args, world_size, device)
            logger.eval(args.steps, val_loss)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (interrupts.py), or a second one
        signum = getattr(exc, "signum", signal.SIGINT)
        logger.close()
        if rank == 0:
            finish_interrupted(logger, out_dir, args, start_step, save_dir,
                               interrupts.signal_name(signum))
        raise Interrupted(signum) from None
    logger.close()
    return finish(logger, val_loss, out_dir, args, start_step) if rank == 0 else {}
