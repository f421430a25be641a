"""Train a causal LM (Llama by default) with fp8boost: one flag turns a BF16 run into FP8.

Runs as plain python (one process, CPU or one GPU) or under torchrun (gloo on CPU, NCCL on
GPU). The default is a Llama of the ``tiny`` preset on the shipped text sample, which trains
on a 2-core CPU in about a minute::

    python examples/train_llama.py                                   # tiny, BF16, no plugin
    python examples/train_llama.py --use-fp8                         # same, FP8 GEMMs
    python examples/train_llama.py --use-fp8 --model gpt2            # mistral, qwen2, gpt2
    python examples/train_llama.py --use-fp8 --compile --activation-checkpointing
    python examples/train_llama.py --use-fp8 --model-path DIR        # any local HF causal LM
    torchrun --nproc_per_node=2 examples/train_llama.py --plugin zero2 --use-fp8 --fp8-comm
    # tensor x pipeline parallel (4 ranks, one replica): steps through booster.execute_pipeline
    torchrun --nproc_per_node=4 examples/train_llama.py --plugin hybrid --tp 2 --pp 2 \
        --use-fp8 --fp8-comm
    # mixture of experts (mixtral, qwen3_moe): experts split over --ep ranks, FP8 dispatch
    torchrun --nproc_per_node=2 examples/train_llama.py --model mixtral --plugin moe --ep 2 \
        --use-fp8 --fp8-comm
    torchrun --nproc_per_node=8 examples/train_llama.py --preset 7b-8l --plugin zero2 \\
        --use-fp8 --data ../shared/data/shakespeare.txt --save-every 200 --save-dir ckpt
    # continue from ckpt/latest (any world size; same preset, batches are a function of step)
    torchrun --nproc_per_node=8 examples/train_llama.py --preset 7b-8l --plugin zero2 \\
        --use-fp8 --data ../shared/data/shakespeare.txt --resume ckpt --steps 2000
    # survive a crashed rank: torchrun restarts the job, which resumes from its newest
    # complete checkpoint (bit-exact on CPU/gloo)
    torchrun --nproc_per_node=2 --max-restarts 3 examples/train_llama.py --plugin zero2 \\
        --out-dir runs/a --save-every 50 --keep-last 3 --resume auto

Writes ``<out-dir>/metrics.jsonl`` (one record per step, plus eval records), ``summary.json``,
``run_config.json`` and ``loss.png`` (when matplotlib is installed). ``--plugin none`` uses
``Booster(mixed_precision=...)``; ``ddp`` / ``zero1`` / ``zero2`` / ``gemini`` / ``fsdp`` use
``TorchDDPPlugin`` / ``LowLevelZeroPlugin(stage=1|2)`` / ``GeminiPlugin`` (ZeRO-3 on FSDP2) /
``TorchFSDPPlugin``; ``hybrid`` uses ``HybridParallelPlugin`` (``--tp``, ``--sp``,
``--zero``, and pipeline parallelism with ``--pp``, ``--pp-style``, ``--microbatches``: see
``hybrid.py``); ``moe`` uses ``MoeHybridParallelPlugin`` (``--ep``, ``--zero``; MoE families
and their presets: ``moe.py``). ``--compile`` compiles each decoder block in place;
``--activation-checkpointing`` recomputes each block in backward; both work with every plugin.
With ``gemini`` or ``fsdp``, ``--model-path`` builds the model on the meta device and each rank
reads only its shards of the checkpoint (no full copy per rank). Model building is in
``model_setup.py``, run records in ``run_log.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path and (_HERE.parent / "fp8boost").is_dir():
    sys.path.insert(0, str(_HERE.parent))  # run from a checkout without installing fp8boost

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fp8boost.batch_checks import check_lm_batch  # noqa: E402
from fp8boost.fp8.config import NAMED_RECIPES  # noqa: E402

import checkpointing  # noqa: E402
import data as data_lib  # noqa: E402
import faults  # noqa: E402
import hybrid  # noqa: E402
import metrics as metrics_lib  # noqa: E402
import moe  # noqa: E402
import presets  # noqa: E402
# Model building and run logging live beside this file; their names are re-exported here.
from model_setup import (MODEL_FAMILIES, build_model, check_model_folder,  # noqa: E402,F401
                         cosine_with_warmup, decoder_blocks, family_config, make_optimizer,
                         prepare_model)
from run_log import RunLogger, announce, finish, summarize, write_run_config  # noqa: E402,F401

PLUGINS = ("none", "ddp", "zero1", "zero2", "gemini", "fsdp", "hybrid", "moe")
# Warnings every rank would print identically: rank 0 alone says them.
RANK0_WARNINGS = (r"fp8boost: FP8 tensor cores unavailable", r"fp8boost: no linear layer",
                  r"fp8boost: use_fp8=True but no linear layer")
SHARDED_PLUGINS = ("gemini", "fsdp")  # FSDP2: a --model-path model is loaded shard by shard
PRECISIONS = ("bf16", "fp16", "fp32")
PRETRAINED_DEFAULTS = dict(seq_len=512, batch_size=4, lr=1e-4, steps=1000)
PROG = "train_llama.py"
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


def _from_preset(key: str) -> str:
    """Help for a default the preset fills: each preset's value and the --model-path one."""
    values = ", ".join(f"{name} {d[key]:g}" for name, d in presets.TRAIN_DEFAULTS.items())
    return (f"(default: from --preset: {values}; {PRETRAINED_DEFAULTS[key]:g} with "
            "--model-path)")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Command-line options; ``None`` defaults are filled from the preset.

    A bad flag prints one line and exits with status 2 (``SystemExit``), see
    :class:`_ArgumentParser`.
    """
    p = _ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                        formatter_class=_HelpFormatter)
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
    g.add_argument("--fp8-recipe", default="tensorwise", choices=tuple(NAMED_RECIPES),
                   help="FP8 scaling recipe (Fp8Config.from_recipe) for --use-fp8: per tensor "
                        "(tensorwise*, delayed), per row (rowwise, rowwise_with_gw_hp: BF16 "
                        "weight gradient) or DeepSeek-V3 blocks (blockwise, blockwise_pow2)")
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
    g = p.add_argument_group("logging and checkpoints")
    g.add_argument("--out-dir", default=None,
                   help="folder of metrics.jsonl, summary.json and checkpoints (default: "
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
                        "resumed from nor an unfinished *.partial; 0 keeps every checkpoint")
    g.add_argument("--resume", default=None,
                   help="checkpoint folder, a save dir (its latest), or 'auto': the newest "
                        "complete checkpoint in --save-dir (default <out-dir>/checkpoints) if "
                        "any, else a fresh start; for torchrun --max-restarts")
    g.add_argument("--tensorboard", action="store_true",
                   help="also log to TensorBoard (<out-dir>/tensorboard; needs tensorboard)")
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
    args = p.parse_args(argv)
    if args.model is not None and args.model_path is not None:
        p.error("pass --model (a family built from --preset) or --model-path, not both")
    if args.model is None and args.model_path is None:
        args.model = "llama"
    defaults = PRETRAINED_DEFAULTS if args.model_path else presets.TRAIN_DEFAULTS[args.preset]
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
    """Reject bad options with a ValueError naming the fix, before any work or collective."""
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
    if not 0.0 <= args.min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}; pass a "
                         "fraction of the peak lr")
    if args.plugin == "none" and world_size > 1:
        raise ValueError(f"--plugin none trains in one process but WORLD_SIZE={world_size}; "
                         "use --plugin ddp, zero1, zero2, gemini, fsdp or hybrid under torchrun")
    if args.plugin == "none" and args.fp8_comm:
        raise ValueError("--fp8-comm needs a distributed plugin: add --plugin "
                         "ddp|zero1|zero2|gemini|fsdp|hybrid")
    hybrid.validate_hybrid_args(args, world_size)
    moe.validate_moe_args(args, world_size)
    if args.plugin == "none" and args.use_fp8 and args.precision != "bf16":
        raise ValueError("--plugin none --use-fp8 trains BF16 with FP8 GEMMs "
                         "(Booster(mixed_precision='fp8')); use --precision bf16 or a plugin")
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
    if args.resume is not None:
        check_resume(args)


def save_dir_of(args: argparse.Namespace, out_dir: Optional[Path]) -> Optional[Path]:
    """Where checkpoints go: ``--save-dir``, else ``<out-dir>/checkpoints``."""
    if args.save_dir:
        return Path(args.save_dir)
    return out_dir / "checkpoints" if out_dir is not None else None


def check_resume(args: argparse.Namespace) -> None:
    """The checkpoint must be complete, before ``--steps`` and of the same model.

    ``--resume auto`` needs a fixed folder (``--out-dir`` or ``--save-dir``: a restarted job
    must find what the dead one saved); with no checkpoint there yet it starts afresh, and a
    run whose newest checkpoint is at ``--steps`` is already finished (nothing to check).
    """
    if args.resume == "auto":
        folder = save_dir_of(args, Path(args.out_dir) if args.out_dir else None)
        if folder is None:
            raise ValueError("--resume auto looks for checkpoints in --save-dir (default "
                             "<out-dir>/checkpoints): pass --out-dir or --save-dir, the same in "
                             "every launch")
        found = checkpointing.complete_checkpoints(folder)
        if not found:
            return
        state = checkpointing.read_trainer_state(found[0])
        if state["step"] >= args.steps:
            return  # finished: train() says so and exits
    else:
        state = checkpointing.read_trainer_state(checkpointing.resolve_checkpoint(args.resume))
    if state["step"] >= args.steps:
        raise ValueError(f"the checkpoint is at step {state['step']}, not before --steps "
                         f"{args.steps}; raise --steps to train further")
    for key in ("preset", "model", "model_path", "tokenizer"):
        if key in state and state[key] != getattr(args, key):
            raise ValueError(f"the checkpoint was trained with --{key.replace('_', '-')} "
                             f"{state[key]}, this run has {getattr(args, key)}; pass the same")


def rank_and_device(device_arg: str) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment (0, 1 as plain python); the
    GPU is ``cuda:LOCAL_RANK`` when CUDA is used."""
    if device_arg == "cuda" and not torch.cuda.is_available():
        # Checked before set_device, which fails with an AttributeError on a CPU-only torch.
        raise ValueError("--device cuda but no CUDA device is visible (torch "
                         f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                         "use --device cpu or auto")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return int(os.environ.get("RANK", "0")), world_size, device


def start_process_group(world_size: int, device: torch.device) -> None:
    """Join torchrun's process group (NCCL on GPU, gloo on CPU) with a timeout, so a crashed
    peer ends the job instead of hanging it. The library's ``init_distributed`` also re-forms
    the group after a ``torchrun --max-restarts`` restart (a store prefix per attempt)."""
    from fp8boost.plugins import init_distributed

    init_distributed("nccl" if device.type == "cuda" else "gloo", timeout_s=600.0,
                     device=device if device.type == "cuda" else None)


def make_booster(args: argparse.Namespace, device: torch.device):
    """The Booster for ``--plugin`` / ``--precision`` / ``--use-fp8`` / ``--fp8-comm``.

    Clipping is left to :func:`clip_gradients` (``booster.clip_grad_norm_``), which also
    reports the norm, so no plugin gets a ``max_norm`` of its own.
    """
    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision
    from fp8boost.fp8 import Fp8Config

    fp8_config = None
    if args.use_fp8:
        min_numel = args.fp8_min_numel
        if min_numel is None and device.type != "cuda":
            # No FP8 tensor cores here: FP8 is emulated for its numerics only, so there is no
            # speed to lose on small layers. Convert them all so the demo really runs FP8.
            min_numel = 0
        extra = {} if min_numel is None else dict(min_numel=min_numel)
        fp8_config = Fp8Config.from_recipe(args.fp8_recipe, **extra)
    from fp8boost.parallel.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard(max_consecutive=args.max_bad_steps,
                           enabled=not args.no_nonfinite_guard)
    if args.plugin == "none":
        mp = MixedPrecision("fp8", fp8_config) if args.use_fp8 else args.precision
        return Booster(mixed_precision=mp, device=device, nonfinite_guard=guard)
    return Booster(plugin=make_plugin(args, fp8_config), device=device, nonfinite_guard=guard)


def make_plugin(args: argparse.Namespace, fp8_config):
    """The fp8boost plugin for ``--plugin`` (not ``none``)."""
    from fp8boost.plugins import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if args.plugin == "hybrid":
        return hybrid.make_plugin(args, fp8_config)
    if args.plugin == "moe":
        return moe.make_plugin(args, fp8_config)
    if args.plugin == "gemini":
        plugin = GeminiPlugin(precision=args.precision, use_fp8=args.use_fp8,
                              fp8_communication=args.fp8_comm, fp8_config=fp8_config,
                              enable_gradient_accumulation=args.grad_accum > 1)
    elif args.plugin == "fsdp":
        plugin = TorchFSDPPlugin(precision=args.precision, use_fp8=args.use_fp8,
                                 fp8_communication=args.fp8_comm, fp8_config=fp8_config)
    elif args.plugin == "ddp":
        plugin = TorchDDPPlugin(use_fp8=args.use_fp8, fp8_communication=args.fp8_comm,
                                precision=args.precision, fp8_config=fp8_config)
    else:
        plugin = LowLevelZeroPlugin(stage=1 if args.plugin == "zero1" else 2,
                                    precision=args.precision, use_fp8=args.use_fp8,
                                    fp8_communication=args.fp8_comm, fp8_config=fp8_config)
    return plugin


def clip_gradients(booster, model, optimizer, args: argparse.Namespace) -> Optional[float]:
    """Clip the global grad norm to ``--max-norm`` (over all shards for ZeRO); returns the
    norm before clipping (inf when FP16 gradients overflowed and the step will be skipped)."""
    if args.max_norm <= 0:
        return None
    return float(booster.clip_grad_norm_(model, optimizer, args.max_norm))


def load_corpus(args: argparse.Namespace, seq_len: int):
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


def reduce_mean_max(values: list[float], maxima: list[float], world_size: int,
                    device: torch.device) -> tuple[list[float], list[float]]:
    """Mean of ``values`` and max of ``maxima`` over ranks, in one small collective."""
    if world_size == 1:
        return values, maxima
    comm_device = device if device.type == "cuda" else torch.device("cpu")
    t = torch.tensor(values + maxima, dtype=torch.float64, device=comm_device)
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t)
    stacked = torch.stack(gathered)
    n = len(values)
    return stacked[:, :n].mean(0).tolist(), stacked[:, n:].max(0).values.tolist()


@torch.no_grad()
def evaluate(run: "Run", args, world_size: int, device: torch.device) -> float:
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


def train_step(run: "Run", args: argparse.Namespace, step: int, rank: int,
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
    return Run(booster, model, optimizer, lr_scheduler, train_windows, val_windows,
               resume_state, n_params, fpt, vocab_size, index, moe.fp8_coverage(model))


def resume_candidates(args: argparse.Namespace) -> list[Path]:
    """Checkpoints to try, in order: ``--resume DIR`` alone, or for ``--resume auto`` every
    complete checkpoint of the save dir, newest first (none: a fresh start)."""
    if args.resume is None:
        return []
    if args.resume != "auto":
        return [checkpointing.resolve_checkpoint(args.resume)]
    return checkpointing.complete_checkpoints(
        save_dir_of(args, Path(args.out_dir) if args.out_dir else None))


def restore(args: argparse.Namespace, booster, model, optimizer, lr_scheduler, rank: int,
            device: torch.device) -> Optional[dict]:
    """Load the checkpoint to resume from; returns its trainer state (None: fresh start).

    With ``--resume auto`` a checkpoint that fails verification (a truncated or altered file:
    the error is the same on every rank) is skipped for the next older one, with a message.
    """
    from fp8boost.plugins.checkpoint_io import CheckpointCorruptError

    candidates = resume_candidates(args)
    for i, ckpt in enumerate(candidates):
        try:
            state = checkpointing.load_checkpoint(booster, model, optimizer, lr_scheduler,
                                                  ckpt, rank, device)
        except CheckpointCorruptError as exc:
            if args.resume != "auto" or i + 1 == len(candidates):
                raise
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


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole training; returns the summary (rank 0's view; empty on other ranks).

    Raises:
        UsageError: a bad flag (from :func:`validate_args` or the device check), before any
            work or collective; ``main`` prints it as one line.
    """
    try:
        rank, world_size, device = rank_and_device(args.device)
        validate_args(args, world_size)
    except (ValueError, TypeError) as exc:  # the flag checks' own errors, nothing later
        raise UsageError(str(exc)) from exc
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
        out_dir.mkdir(parents=True, exist_ok=True)
        write_run_config(out_dir, args, world_size, device, run)
        print(f"[train] {run.n_params / 1e6:.2f}M params, model={args.model or args.model_path} "
              f"compile={args.compile} activation_checkpointing={args.activation_checkpointing} "
              f"plugin={hybrid.describe(args)} "
              f"precision={args.precision} fp8={args.use_fp8} fp8_comm={args.fp8_comm} "
              f"world_size={world_size} device={device} start_step={start_step} "
              f"out_dir={out_dir}", flush=True)
        if args.use_fp8:
            print(f"[train] {moe.describe_coverage(run.fp8_coverage)}", flush=True)
    logger = RunLogger(out_dir, args, start_step, rank == 0, run.flops_per_token, world_size)
    guard = getattr(run.optimizer, "nonfinite_guard", None)
    if guard is not None:
        guard.step = start_step  # its warnings name the training step
    timer = metrics_lib.StepTimer(device)
    run.model.train()
    val_loss = None
    for step in range(start_step + 1, args.steps + 1):
        lr = run.optimizer.param_groups[0]["lr"]  # the lr this step uses
        timer.begin()
        loss, grad_norm = train_step(run, args, step, rank, device)
        seconds = timer.end()
        (loss,), (seconds, mem) = reduce_mean_max(
            [loss], [seconds, metrics_lib.peak_memory_gib(device)], world_size, device)
        skipped = guard is not None and step in guard.skipped[-1:]
        if not math.isfinite(loss) and not skipped:  # guard off: the step was applied
            raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or use "
                                     "--precision bf16")
        logger.step(step, loss, grad_norm, lr, seconds, mem, skipped)
        if run.val_windows is not None and args.eval_every and step % args.eval_every == 0:
            val_loss = evaluate(run, args, world_size, device)
            logger.eval(step, val_loss)
        if args.save_every and (step % args.save_every == 0 or step == args.steps):
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
    if run.val_windows is not None and (not args.eval_every or args.steps % args.eval_every):
        val_loss = evaluate(run, args, world_size, device)
        logger.eval(args.steps, val_loss)
    logger.close()
    return finish(logger, val_loss, out_dir, args, start_step) if rank == 0 else {}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: ``python examples/train_llama.py [options]``.

    Returns 0, or 2 after a bad flag (printed as one line, no traceback: the traceback would
    only show where the check lives). Any other error propagates with its traceback.
    """
    args = parse_args(argv)  # argparse's errors: one line and SystemExit(2) already
    ok = False
    try:
        train(args)
        ok = True
    except UsageError as exc:
        report_usage_error(str(exc))
        return 2
    finally:
        if dist.is_initialized():
            if ok:
                # Every rank reaches the end before teardown: destroying a gloo group while a
                # peer is still finishing aborted that peer's transport thread ("terminate called
                # without an active exception", seen once in six 2-rank runs).
                dist.barrier()
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
