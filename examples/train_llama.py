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
reads only its shards of the checkpoint (no full copy per rank).

This file is the entry point only; the work lives beside it: flags and their checks in
``cli.py``, the training loop in ``training.py``, what is built before the first step in
``run_setup.py`` (model building in ``model_setup.py``, the Booster in ``booster_setup.py``),
ranks and devices in ``ranks.py``, run records in ``run_log.py``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Iterator, Optional

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path and (_HERE.parent / "fp8boost").is_dir():
    sys.path.insert(0, str(_HERE.parent))  # run from a checkout without installing fp8boost

import torch.distributed as dist  # noqa: E402

# The example's functions live in the modules beside this file. Their names are re-exported
# here so that code written against ``train_llama`` (tests, users' scripts, fault_driver.py)
# keeps importing them from where it always did.
from booster_setup import make_booster, make_plugin  # noqa: E402,F401
from cli import (DESCRIPTION, PEER_ERROR_GRACE_S, PLUGINS, PRECISIONS,  # noqa: E402,F401
                 PRETRAINED_DEFAULTS, PROG, UsageError, check_resume, parse_args,
                 report_usage_error, save_dir_of, validate_args)
from interrupts import exit_status, sigterm_as_interrupt, signal_name  # noqa: E402
from model_setup import (MODEL_FAMILIES, build_model, check_model_folder,  # noqa: E402,F401
                         cosine_with_warmup, decoder_blocks, family_config, make_optimizer,
                         prepare_model)
from ranks import rank_and_device, reduce_mean_max, start_process_group  # noqa: E402,F401
from run_log import RunLogger, announce, finish, summarize, write_run_config  # noqa: E402,F401
from run_setup import (SHARDED_PLUGINS, Run, data_position, finished_already,  # noqa: E402,F401
                       load_corpus, make_out_dir, resume_candidates, restore, setup)
from training import (RANK0_WARNINGS, Interrupted, clip_gradients,  # noqa: E402,F401
                      evaluate, run_steps, save_and_prune, train, train_step)


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """Within: a warning prints as one line (file:line: category: message), without the
    source line Python adds below it, which in the run's log read as a stray line of code
    (issue 39 item 6)."""
    default = warnings.formatwarning

    def one_line(message, category, filename, lineno, line=None):  # noqa: ANN001
        return default(message, category, filename, lineno, line="")  # "": no source line

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = default


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: ``python examples/train_llama.py [options]``.

    Returns 0, 2 after a bad flag (printed as one line, no traceback: the traceback would
    only show where the check lives), or 128 + the signal after Ctrl-C (130) or SIGTERM (143,
    what torchrun forwards to every rank when it is stopped, and what schedulers send): one
    line; during training every rank finishes its step and the partial run's summary.json
    and loss.png are written first (``interrupts.py``). Any other error propagates with its
    traceback.
    """
    args = parse_args(argv)  # argparse's errors: one line and SystemExit(2) already
    ok = False
    try:
        with sigterm_as_interrupt(), one_line_warnings():
            train(args)
        ok = True
    except UsageError as exc:
        report_usage_error(str(exc))
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: one line, no traceback
        if not isinstance(exc, Interrupted) and int(os.environ.get("RANK", "0")) == 0:
            print(f"[train] interrupted ({signal_name(getattr(exc, 'signum', None))}) outside "
                  "the training steps (while starting or closing the run): no partial summary "
                  "was written", flush=True)
        return exit_status(exc)
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
