"""Checks of the training example's inputs that read the disk: the run folder (one run per
``--out-dir``), the tokenizer folder, the data's encoding and the schedule. ``cli.validate_args``
calls :func:`check_inputs` before the model is built; each failure is one ``ValueError`` that
names the cause and the fix (``main`` prints it as one line).

:func:`start_notes` are the lines rank 0 prints when a run starts with a setting that works but
is probably not what the user meant (``--keep-last 1``, no validation split, a very long step).
"""
from __future__ import annotations

import argparse
import codecs
import json
from pathlib import Path
from typing import Any, Optional

import checkpointing
import data as data_lib

RUN_FILES = ("metrics.jsonl", "run_config.json", "summary.json")
"""What a run writes into its ``--out-dir``: a folder holding one of them holds a run."""
UTF8_CHECK_BYTES = 4 << 20
"""The head of a ``--data`` file checked for UTF-8 (a binary file fails in its first bytes)."""
LONG_STEP_FLOP = 1e12
"""On a CPU, a step costing more than this (~10 s at ~100 GFLOP/s) gets a note."""


def check_inputs(args: argparse.Namespace, save_dir: Optional[Path]) -> None:
    """Every check of this module, in the order the messages should come."""
    check_run_dir(args, save_dir)
    if args.tokenizer is not None:
        check_tokenizer(args.tokenizer)
    if args.data is not None:
        check_utf8(args.data)
    check_schedule(args)
    if args.model_path is not None:
        check_positions(args.model_path, args.seq_len)


def _check_folder_path(flag: str, path: Path) -> None:
    """``path`` is a folder or can become one (no file in its place or above it)."""
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                where = "is a file" if part == path else f"lies under the file {str(part)!r}"
                raise ValueError(f"{flag} {str(path)!r} {where}, not a folder; pass a folder "
                                 "path (it is created when missing)")
            return


def check_run_dir(args: argparse.Namespace, save_dir: Optional[Path]) -> None:
    """One run per folder: without ``--resume``, an ``--out-dir`` (or ``--save-dir``) that holds
    a run already is refused, since a second run would append to its metrics and mix its
    checkpoints with the first run's (``--resume auto`` would then pick either)."""
    out_dir = Path(args.out_dir) if args.out_dir is not None else None
    if out_dir is not None:
        _check_folder_path("--out-dir", out_dir)
    if args.save_dir is not None:
        _check_folder_path("--save-dir", Path(args.save_dir))
    if args.resume is not None:
        return
    files = [name for name in RUN_FILES if out_dir is not None and (out_dir / name).exists()]
    ckpts = checkpointing.complete_checkpoints(save_dir) if save_dir is not None else []
    if not files and not ckpts:
        return
    held = files + ([f"checkpoints up to {ckpts[0].name}"] if ckpts else [])
    flag, folder = (("--out-dir", out_dir) if files or args.save_dir is None
                    else ("--save-dir", save_dir))
    raise ValueError(f"{flag} {str(folder)!r} already holds a run ({', '.join(held)}); pass "
                     f"--resume auto to continue it, or a new {flag} for a new run")


def check_tokenizer(path: str) -> None:
    """``--tokenizer`` is a local Hugging Face tokenizer folder."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"--tokenizer {path!r} {what}; pass a local Hugging Face tokenizer "
                         "folder, or leave --tokenizer out for the byte-level tokenizer")
    if not data_lib.has_tokenizer_files(folder):
        raise ValueError(f"--tokenizer {path!r} holds no tokenizer.json, tokenizer_config.json "
                         "or tokenizer.model; pass the folder a tokenizer was saved to "
                         "(save_pretrained), or leave --tokenizer out for the byte-level one")


def check_utf8(path: str) -> None:
    """The head of a ``--data`` file decodes as UTF-8 (a binary file fails in its first bytes;
    a character cut at the end of the head is not an error)."""
    with open(path, "rb") as f:
        head = f.read(UTF8_CHECK_BYTES)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as exc:
        raise ValueError(f"--data {path!r} is not UTF-8 text (byte 0x{head[exc.start]:02x} at "
                         f"offset {exc.start} is invalid); pass a UTF-8 text file (convert one "
                         "with iconv -t UTF-8), or leave --data out for the shipped sample") \
            from None


def check_schedule(args: argparse.Namespace) -> None:
    """The learning-rate warm-up ends within the run."""
    if args.warmup_steps > args.steps:
        raise ValueError(f"--warmup-steps {args.warmup_steps} is more than --steps "
                         f"{args.steps}: the learning rate would never reach its peak; pass "
                         f"--warmup-steps {max(1, args.steps // 20)} or less (the default is "
                         "5% of --steps)")


def check_positions(model_path: str, seq_len: int) -> None:
    """``--seq-len`` fits the pretrained model's positions (``max_position_embeddings``)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    limit = config.get("max_position_embeddings", config.get("n_positions"))
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the {limit} positions the model "
                         f"in --model-path was built for; pass --seq-len {limit} or less")


def validation_note(args: argparse.Namespace, n_tokens: int) -> Optional[str]:
    """Why a run has no validation split (None when it has one or none was asked for)."""
    n_val = int(n_tokens * args.val_fraction)
    if args.val_fraction == 0 or n_val > args.seq_len:
        return None
    return (f"no validation (shown as n/a): the held-out --val-fraction {args.val_fraction:g} "
            f"of the data is {n_val} tokens, shorter than one window of --seq-len "
            f"{args.seq_len} + 1; lower --seq-len or raise --val-fraction")


def start_notes(args: argparse.Namespace, run: Any, device: Any,
                tokens_per_step: int) -> list[str]:
    """``[train] note:`` lines for settings that work but are probably not what was meant."""
    notes = []
    if args.keep_last == 1:
        notes.append("--keep-last 1 leaves no older checkpoint to fall back to when the newest "
                     "one is damaged (--resume auto needs one); pass --keep-last 2 or more")
    if getattr(run, "val_note", None):
        notes.append(run.val_note)
    step_flop = run.flops_per_token * tokens_per_step
    if getattr(device, "type", "cpu") == "cpu" and step_flop > LONG_STEP_FLOP:
        notes.append(f"one step costs {step_flop / 1e12:.1f} TFLOP (--seq-len {args.seq_len} "
                     f"x --batch-size {args.batch_size} x --grad-accum {args.grad_accum}; "
                     "attention grows with the square of --seq-len): expect tens of seconds "
                     "or more per step on a CPU; lower --seq-len or --batch-size for a quick run")
    return [f"[train] note: {n}" for n in notes]
