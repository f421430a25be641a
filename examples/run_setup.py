"""Everything the training example (``train_llama.py``) builds before its first step: the
corpus, the model, optimizer, schedule and booster, the checkpoint it resumes from, and the
output folder. :func:`setup` returns them as one :class:`Run`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

import checkpointing
import data as data_lib
import hybrid
import metrics as metrics_lib
import moe
import run_checks
from booster_setup import make_booster
from cli import UsageError, save_dir_of
from model_setup import build_model, cosine_with_warmup, make_optimizer, prepare_model

SHARDED_PLUGINS = ("gemini", "fsdp")  # FSDP2: a --model-path model is loaded shard by shard


@dataclasses.dataclass
class Run:
    """Everything ``train`` works with, built by :func:`setup`."""

    booster: Any
    model: Any
    optimizer: Any
    lr_scheduler: Any
    train_windows: data_lib.TokenWindows
    val_windows: Optional[data_lib.TokenWindows]
    resume_state: Optional[dict]
    n_params: int
    flops_per_token: int
    vocab_size: int = 0  # the model's: every token id must be below it
    data_rank: int = 0  # batches are drawn by it (hybrid: the replica, see hybrid.data_rank)
    fp8_coverage: Optional[dict] = None  # moe.fp8_coverage of the boosted model
    val_note: Optional[str] = None  # why there is no validation split (run_checks)


def load_corpus(args: argparse.Namespace, seq_len: int) -> tuple[
        Any, data_lib.TokenWindows, Optional[data_lib.TokenWindows]]:
    """(tokenizer, train windows, validation windows or None)."""
    tok_path = args.tokenizer
    if tok_path is None and args.model_path and data_lib.has_tokenizer_files(args.model_path):
        tok_path = args.model_path
    tokenizer = data_lib.load_tokenizer(tok_path)
    path = args.data if args.data is not None else data_lib.default_data_path()
    tokens = tokenizer.encode_file(path)
    data_lib.check_length(tokens.numel(), seq_len, path)  # every rank alike: no collective yet
    train, val = data_lib.split_train_val(tokens, args.val_fraction, seq_len)
    train_windows = data_lib.TokenWindows(train, seq_len, seed=args.seed)
    # Validation uses a different seed stream so it never mirrors the training draws.
    val_windows = data_lib.TokenWindows(val, seq_len, seed=args.seed + 1) if val is not None \
        else None
    return tokenizer, train_windows, val_windows


def setup(args: argparse.Namespace, rank: int, device: torch.device) -> Run:
    """Data, model, optimizer, scheduler and booster, boosted and (when resuming) restored."""
    tokenizer, train_windows, val_windows = load_corpus(args, args.seq_len)
    max_pos = max(args.seq_len, 2048)
    # Sharded plugins build a pretrained model on the meta device: boost allocates only each
    # rank's shards and load_model reads only each rank's part of the checkpoint.
    lazy = args.model_path is not None and args.plugin in SHARDED_PLUGINS
    model = build_model(args, tokenizer.vocab_size, max_pos,
                        torch.device("meta") if lazy else device)
    prepare_model(model, args)
    vocab_size = model.config.vocab_size
    # Once per corpus (same on every rank, before any collective): later batches are slices.
    source = args.data if args.data is not None else "the shipped sample"
    data_lib.check_token_range(train_windows.tokens, vocab_size, source)
    if val_windows is not None:
        data_lib.check_token_range(val_windows.tokens, vocab_size, source)
    # Count before boosting: plugins may wrap the model or flatten its parameters.
    n_params = sum(p.numel() for p in model.parameters())
    fpt = metrics_lib.flops_per_token(metrics_lib.matmul_params(model)
                                      - moe.inactive_expert_params(model),
                                      model.config.num_hidden_layers, model.config.hidden_size,
                                      args.seq_len)
    torch.manual_seed(args.seed + rank)  # per-rank stream for anything stochastic later
    optimizer = make_optimizer(model, args)
    lr_scheduler = cosine_with_warmup(optimizer, args.warmup_steps, args.steps,
                                      args.min_lr_ratio)
    booster = make_booster(args, device)
    model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer,
                                                         lr_scheduler=lr_scheduler)
    resume_state = restore(args, booster, model, optimizer, lr_scheduler, rank, device)
    if lazy and resume_state is None:  # a fresh start (--resume auto may find nothing)
        booster.load_model(model, args.model_path)
    index = hybrid.data_rank(args, rank, int(os.environ.get("WORLD_SIZE", "1")))
    val_note = None if val_windows is not None else \
        run_checks.validation_note(args, len(train_windows))  # no split: it is all training
    return Run(booster, model, optimizer, lr_scheduler, train_windows, val_windows,
               resume_state, n_params, fpt, vocab_size, index, moe.fp8_coverage(model),
               val_note)


def resume_candidates(args: argparse.Namespace) -> list[Path]:
    """Checkpoints to try, in order: ``--resume DIR`` alone, or for ``--resume auto`` the one
    the save dir's ``latest`` names, then older complete ones (none: a fresh start)."""
    if args.resume is None:
        return []
    if args.resume != "auto":
        return [checkpointing.resolve_checkpoint(args.resume)]
    return checkpointing.auto_candidates(
        save_dir_of(args, Path(args.out_dir) if args.out_dir else None))


def restore(args: argparse.Namespace, booster: Any, model: Any, optimizer: Any,
            lr_scheduler: Any, rank: int, device: torch.device) -> Optional[dict]:
    """Load the checkpoint to resume from; returns its trainer state (None: fresh start).

    With ``--resume auto`` a checkpoint that fails verification (a truncated or altered file:
    the error is the same on every rank) is skipped for the next older one, with a message.
    """
    from fp8boost.checkpoint_io import CheckpointCorruptError

    candidates = resume_candidates(args)
    for i, ckpt in enumerate(candidates):
        try:
            state = checkpointing.load_checkpoint(booster, model, optimizer, lr_scheduler,
                                                  ckpt, rank, device)
        except CheckpointCorruptError as exc:
            if args.resume != "auto" or i + 1 == len(candidates):
                fix = ("--resume auto falls back to the newest intact one" if args.resume
                       != "auto" else "no older one is left: start afresh in a new --out-dir")
                raise UsageError(f"--resume {args.resume}: {exc} ({fix})") from exc
            if rank == 0:
                print(f"[train] {exc}\n[train] --resume auto: trying the older checkpoint "
                      f"{candidates[i + 1]}", flush=True)
            continue
        if rank == 0:
            print(f"[train] resumed from {ckpt} (step {state['step']})", flush=True)
            checkpointing.warn_if_stream_changed(state, data_position(args))
        state["resumed_from"] = str(ckpt)  # --keep-last never deletes it
        return state
    return None


def data_position(args: argparse.Namespace) -> dict[str, Any]:
    """What defines the batch stream besides the step (batches are a function of these)."""
    return dict(seed=args.seed, data=args.data, seq_len=args.seq_len,
                batch_size=args.batch_size, grad_accum=args.grad_accum,
                val_fraction=args.val_fraction, tokenizer=args.tokenizer)


def finished_already(args: argparse.Namespace, rank: int) -> bool:
    """``--resume auto`` after the run completed (its newest checkpoint is at ``--steps``):
    a restart has nothing left to do."""
    if args.resume != "auto":
        return False
    found = resume_candidates(args)
    if not found or checkpointing.read_trainer_state(found[0])["step"] < args.steps:
        return False
    if rank == 0:
        print(f"[train] --resume auto: {found[0]} is at step {args.steps} = --steps; the run "
              "is complete, nothing to do (raise --steps to train further)", flush=True)
    return True


def make_out_dir(args: argparse.Namespace, resume_state: Optional[dict], rank: int,
                 world_size: int) -> Path:
    """``--out-dir``, else the resumed run's, else ``runs/<timestamp>`` (agreed by all ranks)."""
    if args.out_dir is not None:
        return Path(args.out_dir)
    if resume_state is not None and resume_state.get("out_dir"):
        return Path(resume_state["out_dir"])
    stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
    if world_size > 1:
        dist.broadcast_object_list(stamp, src=0)  # ranks must not disagree by a second
    return Path("runs") / stamp[0]
