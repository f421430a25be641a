"""Command line of the training example (``train_llama.py``): its flags, the defaults a preset
fills, the checks that reject a bad combination before any work, and how a usage error is
printed (one line, once per job, exit status 2).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Optional

from fp8boost.fp8.config import NAMED_RECIPES, Fp8Config, option_value

import checkpointing
import data as data_lib
import faults
import hybrid
import metrics as metrics_lib
import moe
import presets
import run_checks
from model_setup import MODEL_FAMILIES, check_model_folder

PLUGINS = ("none", "ddp", "zero1", "zero2", "gemini", "fsdp", "hybrid", "moe")
PRECISIONS = ("bf16", "fp16", "fp32")
PRETRAINED_DEFAULTS = dict(seq_len=512, batch_size=4, lr=1e-4, steps=1000)
PROG = "train_llama.py"
# The first line of train_llama.py's docstring: --help shows it as the description.
DESCRIPTION = ("Train a causal LM (Llama by default) with fp8boost: one flag turns a BF16 run "
               "into FP8.")
# Under torchrun a rank other than 0 waits this long before printing an argument error: rank 0
# fails alike and prints at once, and torchrun ends the other ranks when it exits, so the job
# shows the message once. A rank still alive after this has an error of its own: it prints it.
PEER_ERROR_GRACE_S = 10.0


class UsageError(ValueError):
    """A bad command line (a flag's value or a combination): one line, exit status 2."""


def report_usage_error(message: str) -> None:
    """Print ``<prog>: error: <cause>; <fix>`` to stderr, once for the whole job.

    Plain python and torchrun's rank 0 print at once. Any other rank first waits
    ``PEER_ERROR_GRACE_S`` (torchrun ends it when rank 0, failing alike, exits) and prints,
    naming its rank, only if it is still running: then the error was its own.
    """
    rank = int(os.environ.get("RANK", "0"))
    prefix = f"{PROG}: error: "
    if rank != 0:
        time.sleep(PEER_ERROR_GRACE_S)
        prefix = f"{PROG}: rank {rank}: error: "
    print(prefix + message, file=sys.stderr, flush=True)


class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line naming the fix (no 25-line usage block), printed
    once per job (:func:`report_usage_error`), exit status 2 as argparse's."""

    def error(self, message: str) -> NoReturn:
        report_usage_error(f"{message}; see {self.prog} --help for every option")
        sys.exit(2)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default once, as ``(default: X)`` after its help, except where the help
    already says what the default is, where the default is None (computed later: the help says
    how) and for on/off switches (off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action.default, bool) or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


# Plugins whose gradient reduce-scatter can run in FP8 (fp8_reduce_scatter=True).
RS_PLUGINS = ("zero1", "zero2", "gemini", "fsdp", "hybrid")


def _from_preset(key: str) -> str:
    """Help for a default the preset fills: each preset's value and the --model-path one."""
    values = ", ".join(f"{name} {d[key]:g}" + (f" ({presets.CPU_STEPS[name]} on CPU)"
                                                if key == "steps" and name in presets.CPU_STEPS
                                                else "")
                       for name, d in presets.TRAIN_DEFAULTS.items())
    return (f"(default: from --preset: {values}; {PRETRAINED_DEFAULTS[key]:g} with "
            "--model-path)")


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The "model and data" group."""
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="tiny", choices=list(presets.PRESETS),
                   help="model size (hidden, layers, heads, FFN) for --model")
    g.add_argument("--model", default=None, choices=MODEL_FAMILIES,
                   help="HF model family built at --preset size with random weights "
                        "(default: llama)")
    g.add_argument("--model-path", default=None,
                   help="local pretrained causal-LM folder of any transformers type "
                        "(config.json + *.safetensors), instead of --model")
    g.add_argument("--tokenizer", default=None, help="local HF tokenizer folder (default: the "
                   "model folder's tokenizer if it has one, else byte-level, vocab 256)")
    g.add_argument("--data", default=None, help="UTF-8 text file (default: shipped sample)")
    g.add_argument("--val-fraction", type=float, default=0.05,
                   help="last fraction of the text held out for validation")
    g.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per training sequence {_from_preset('seq_len')}")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the weight init and of the batch order")


def _add_parallel_arguments(p: argparse.ArgumentParser) -> None:
    """The "parallelism and precision" group, with hybrid.py's and moe.py's flags."""
    g = p.add_argument_group("parallelism and precision")
    g.add_argument("--plugin", default="none", choices=PLUGINS,
                   help="none: one process, Booster(mixed_precision=...); ddp: TorchDDPPlugin; "
                        "zero1/zero2: LowLevelZeroPlugin; gemini: ZeRO-3 on FSDP2; fsdp: "
                        "TorchFSDPPlugin; hybrid: HybridParallelPlugin (--tp, --sp, --pp); "
                        "moe: MoeHybridParallelPlugin (--ep, --zero)")
    g.add_argument("--precision", default="bf16", choices=PRECISIONS,
                   help="training dtype; bf16 and fp16 keep FP32 master weights (fp16 adds "
                        "loss scaling); --use-fp8 adds FP8 GEMMs on top of bf16")
    g.add_argument("--use-fp8", action="store_true", help="run linear-layer GEMMs in FP8")
    g.add_argument("--fp8-comm", action="store_true", help="FP8 gradient/parameter communication")
    g.add_argument("--fp8-reduce-scatter", action="store_true",
                   help="with --fp8-comm, reduce-scatter gradients in FP8 too (zero1/zero2/"
                        "gemini/fsdp/hybrid; off by default: slower on NVLink, for slow links)")
    g.add_argument("--fp8-recipe", default="tensorwise", choices=tuple(NAMED_RECIPES),
                   help="FP8 scaling recipe (Fp8Config.from_recipe) for --use-fp8: per tensor "
                        "(tensorwise*, delayed), per row (rowwise, rowwise_with_gw_hp: BF16 "
                        "weight gradient) or DeepSeek-V3 blocks (blockwise, blockwise_pow2)")
    g.add_argument("--fp8-option", action="append", default=[], metavar="FIELD=VALUE",
                   help="override one Fp8Config field of --fp8-recipe, e.g. fp8_format=hybrid "
                        "or power_of_2_scale=false (repeatable; needs --use-fp8)")
    g.add_argument("--fp8-head", default="none", choices=("none", "rowwise", "blockwise"),
                   help="the lm_head's logits and input-gradient GEMMs in FP8 inside the fused "
                        "loss (FusedLmLossConfig(fp8_recipe=...)); independent of --use-fp8")
    g.add_argument("--fp8-min-numel", type=int, default=None,
                   help="linear layers with fewer weight elements stay BF16 (default: the library's "
                        "4096*4096 on GPU, where smaller layers measured slower in FP8; 0 on CPU)")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda:LOCAL_RANK when a GPU is visible, else cpu")
    hybrid.add_arguments(g)  # --tp --sp --zero --pp --pp-style --microbatches
    moe.add_arguments(g)  # --ep
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder block (its first steps pay the compile)")
    g.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for --compile (aot_eager: fast to compile)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder block in backward: less memory, ~1/3 more "
                        "compute")


def _add_optimisation_arguments(p: argparse.ArgumentParser) -> None:
    """The "optimisation" group."""
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps in total {_from_preset('steps')}")
    g.add_argument("--batch-size", type=int, default=None,
                   help="micro-batch size per rank (hybrid: per model replica) "
                        f"{_from_preset('batch_size')}")
    g.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (--pp > 1: joined into one step batch "
                        "that the pipeline splits into --microbatches)")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (cosine schedule) {_from_preset('lr')}")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear lr warm-up steps (default: 5%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--max-norm", type=float, default=1.0, help="grad-norm clip; 0 disables")


def _add_logging_arguments(p: argparse.ArgumentParser) -> None:
    """The "logging and checkpoints" group."""
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--out-dir", default=None,
                   help="folder of metrics.jsonl, summary.json and checkpoints, one run per "
                        "folder: one that holds a run needs --resume (default: "
                        "runs/<timestamp>)")
    g.add_argument("--eval-every", type=int, default=None,
                   help="validation interval (default: --steps/10, or only at the end below "
                   "100 steps); 0: at the end only")
    g.add_argument("--eval-batches", type=int, default=8,
                   help="validation batches per evaluation")
    g.add_argument("--log-every", type=int, default=20, help="plain-print interval (no tqdm)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar / lines")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint interval; 0: never")
    g.add_argument("--save-dir", default=None, help="checkpoint folder (default: <out-dir>/checkpoints)")
    g.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="keep the newest N complete checkpoints: after each save has "
                        "completed, older ones are deleted (by rank 0), never the one this run "
                        "resumed from nor an unfinished *.partial; 0 keeps every checkpoint, "
                        "2 or more leave --resume auto one to fall back to")
    g.add_argument("--resume", default=None,
                   help="checkpoint folder, a save dir (its latest), or 'auto': the checkpoint "
                        "that the 'latest' file of --save-dir (default <out-dir>/checkpoints) "
                        "names, or an older one if it is damaged, else a fresh start; for "
                        "torchrun --max-restarts")
    g.add_argument("--tensorboard", action="store_true",
                   help="also log to TensorBoard (<out-dir>/tensorboard; needs tensorboard)")


def _add_fault_arguments(p: argparse.ArgumentParser) -> None:
    """The "faults" group: the non-finite guard and the crash drill."""
    g = p.add_argument_group("faults")
    g.add_argument("--no-nonfinite-guard", action="store_true",
                   help="do not skip optimizer steps with a NaN/Inf loss or gradient (the "
                        "example then stops at the first non-finite loss, after the step)")
    g.add_argument("--max-bad-steps", type=int, default=3,
                   help="non-finite steps in a row that stop training (each one is skipped)")
    g.add_argument("--simulate-crash", default=None, metavar="STEP[:RANK[:ATTEMPT]]",
                   help="fault drill: RANK (default: the last) exits mid-step (after backward) "
                        "at STEP, only in torchrun attempt ATTEMPT (default 0, i.e. "
                        "TORCHELASTIC_RESTART_COUNT=0)")


def build_parser() -> argparse.ArgumentParser:
    """The example's parser; the groups are added in the order ``--help`` lists them."""
    p = _ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=_HelpFormatter)
    _add_model_arguments(p)
    _add_parallel_arguments(p)
    _add_optimisation_arguments(p)
    _add_logging_arguments(p)
    _add_fault_arguments(p)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options; ``None`` defaults are filled from the preset.

    A bad flag prints one line and exits with status 2 (``SystemExit``), see
    :class:`_ArgumentParser`.
    """
    p = build_parser()
    args = p.parse_args(argv)
    if args.model is not None and args.model_path is not None:
        p.error("pass --model (a family built from --preset) or --model-path, not both")
    if args.model is None and args.model_path is None:
        args.model = "llama"
    defaults = PRETRAINED_DEFAULTS if args.model_path else presets.TRAIN_DEFAULTS[args.preset]
    if args.steps is None and not args.model_path and args.preset in presets.CPU_STEPS:
        import torch  # here, not at the top: --help stays fast

        # A run on CPU (no GPU, or --device cpu) gets the quick default.
        if args.device == "cpu" or not torch.cuda.is_available():
            args.steps = presets.CPU_STEPS[args.preset]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    if args.eval_every is None:  # ten validation points on the curve; short runs: at the end
        args.eval_every = args.steps // 10 if args.steps >= 100 else 0
    if args.microbatches is None:  # --pp > 1 (None when no count fits: validate_args says so)
        args.microbatches = hybrid.default_microbatches(args)
    return args


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Reject bad options with a ValueError naming the fix, before any work or collective.

    The checks run in a fixed order (numbers, then the plugin, then files and the fault
    flags), so a command line with several mistakes always reports the same one first.
    """
    _check_numbers(args)
    _check_plugin(args, world_size)
    _check_files_and_faults(args, world_size)


def _check_numbers(args: argparse.Namespace) -> None:
    """Counts, intervals and rates in their ranges."""
    positive = {"--steps": args.steps, "--batch-size": args.batch_size,
                "--grad-accum": args.grad_accum, "--eval-batches": args.eval_batches,
                "--log-every": args.log_every}
    for flag, value in positive.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}; pass {flag} 1 or more")
    nonneg = {"--warmup-steps": args.warmup_steps, "--max-norm": args.max_norm,
              "--save-every": args.save_every, "--eval-every": args.eval_every,
              "--weight-decay": args.weight_decay}
    for flag, value in nonneg.items():
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}; pass {flag} 0 or more")
    if args.keep_last < 0:
        raise ValueError(f"--keep-last must be >= 0, got {args.keep_last}; 0 keeps every "
                         "checkpoint, N the newest N")
    if args.keep_last and not args.save_every:
        raise ValueError(f"--keep-last {args.keep_last} keeps checkpoints, but none is saved; "
                         "add --save-every N")
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {args.seq_len}; pass --seq-len 2 or "
                         "more")
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}; pass a positive --lr, e.g. 3e-4")
    if not 0.0 <= args.val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {args.val_fraction}; pass the "
                         "fraction of the text held out for validation, e.g. 0.05 (0: none)")
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}; pass a "
                         "fraction of the peak lr")


def _check_plugin(args: argparse.Namespace, world_size: int) -> None:
    """``--plugin`` fits the world size and the precision flags (hybrid/moe: their own checks)."""
    if args.plugin == "none" and world_size > 1:
        raise ValueError(f"--plugin none trains in one process but WORLD_SIZE={world_size}; "
                         "use --plugin ddp, zero1, zero2, gemini, fsdp or hybrid under torchrun")
    if args.plugin == "none" and args.fp8_comm:
        raise ValueError("--fp8-comm needs a distributed plugin: add --plugin "
                         "ddp|zero1|zero2|gemini|fsdp|hybrid")
    if args.fp8_head != "none" and args.plugin in ("hybrid", "moe"):
        raise ValueError(f"--fp8-head is wired for --plugin none/ddp/zero1/zero2/gemini/fsdp in "
                         f"this example, not {args.plugin}: pass fused_lm_loss="
                         "FusedLmLossConfig(fp8_recipe=...) to the plugin in your own script")
    if args.fp8_reduce_scatter and not args.fp8_comm:
        raise ValueError("--fp8-reduce-scatter needs --fp8-comm (it puts the gradients of FP8 "
                         "communication in FP8 too); add --fp8-comm")
    if args.fp8_reduce_scatter and args.plugin not in RS_PLUGINS:
        raise ValueError(f"--fp8-reduce-scatter applies to --plugin {'|'.join(RS_PLUGINS)} "
                         f"(this run has --plugin {args.plugin}); drop it")
    if args.fp8_option:
        fp8_options(args)  # a bad FIELD=VALUE is refused here, before any work
    hybrid.validate_hybrid_args(args, world_size)
    moe.validate_moe_args(args, world_size)
    if args.plugin == "none" and args.use_fp8 and args.precision != "bf16":
        raise ValueError("--plugin none --use-fp8 trains BF16 with FP8 GEMMs "
                         "(Booster(mixed_precision='fp8')); use --precision bf16 or a plugin")


def fp8_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--fp8-option FIELD=VALUE`` pairs as ``Fp8Config.from_recipe`` overrides.

    Values are read by ``fp8boost.fp8.config.option_value`` (bool, int, else text); the field
    names are checked here and the values by ``Fp8Config`` itself (its ``ValueError`` names the
    fix).
    """
    if args.fp8_option and not args.use_fp8:
        raise ValueError("--fp8-option sets a field of the FP8 recipe; add --use-fp8")
    fields = set(Fp8Config.__dataclass_fields__)
    out: dict[str, Any] = {}
    for item in args.fp8_option:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"--fp8-option {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"Fp8Config's fields ({', '.join(sorted(fields))})")
        out[name] = option_value(text)
    if out:
        Fp8Config.from_recipe(args.fp8_recipe, **out)  # the config's own checks, before any work
    return out


def _check_files_and_faults(args: argparse.Namespace, world_size: int) -> None:
    """Data, model and checkpoint folders exist and fit; the fault flags parse."""
    if args.data is not None and not Path(args.data).is_file():
        raise ValueError(f"--data {args.data!r} is not a file; pass a UTF-8 text file, or "
                         "leave --data out for the shipped sample")
    if args.data is not None and args.tokenizer is None and not args.model_path:
        # Byte-level tokenizer: one token per byte, so the size is known before any work.
        data_lib.check_length(Path(args.data).stat().st_size, args.seq_len, args.data)
    if args.max_bad_steps < 1:
        raise ValueError(f"--max-bad-steps must be >= 1, got {args.max_bad_steps}; pass 1 or "
                         "more (--no-nonfinite-guard turns the guard off)")
    if args.simulate_crash is not None:
        faults.parse_crash(args.simulate_crash, world_size)
    if args.tensorboard:
        metrics_lib.check_tensorboard()
    if args.model_path is not None:
        check_model_folder(args.model_path)
    run_checks.check_inputs(args, save_dir_of(args, Path(args.out_dir) if args.out_dir
                                              else None))
    if args.resume is not None:
        check_resume(args)


def save_dir_of(args: argparse.Namespace, out_dir: Optional[Path]) -> Optional[Path]:
    """Where checkpoints go: ``--save-dir``, else ``<out-dir>/checkpoints``."""
    if args.save_dir:
        return Path(args.save_dir)
    return out_dir / "checkpoints" if out_dir is not None else None


def check_resume(args: argparse.Namespace) -> None:
    """The checkpoint must be complete (every file of its saved size), before ``--steps``
    and of the same model.

    ``--resume auto`` needs a fixed folder (``--out-dir`` or ``--save-dir``: a restarted job
    must find what the dead one saved); with no checkpoint there yet it starts afresh, and a
    run whose ``latest`` checkpoint is at ``--steps`` is already finished (nothing to check).
    """
    if args.resume == "auto":
        folder = save_dir_of(args, Path(args.out_dir) if args.out_dir else None)
        if folder is None:
            raise ValueError("--resume auto looks for checkpoints in --save-dir (default "
                             "<out-dir>/checkpoints): pass --out-dir or --save-dir, the same in "
                             "every launch")
        found = checkpointing.auto_candidates(folder)
        if not found:
            return
        state = checkpointing.read_trainer_state(found[0])
        if state["step"] >= args.steps:
            return  # finished: train() says so and exits
    else:
        ckpt = checkpointing.resolve_checkpoint(args.resume)
        state = checkpointing.read_trainer_state(ckpt)
        checkpointing.check_file_sizes(ckpt)  # a truncated file: before the model is built
    if state["step"] >= args.steps:
        raise ValueError(f"the checkpoint is at step {state['step']}, not before --steps "
                         f"{args.steps}; raise --steps to train further")
    for key in ("preset", "model", "model_path", "tokenizer"):
        if key in state and state[key] != getattr(args, key):
            raise ValueError(f"the checkpoint was trained with --{key.replace('_', '-')} "
                             f"{state[key]}, this run has {getattr(args, key)}; pass the same")
