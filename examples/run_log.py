"""Run records of the training example (``train_llama.py``): ``run_config.json``, per-step
metrics (``metrics.jsonl``, progress display, TensorBoard), ``summary.json`` and the closing
line with the loss plot. Rank 0 writes; the other ranks' loggers are disabled.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

import checkpointing
import hybrid
import metrics as metrics_lib


def write_run_config(out_dir: Path, args: argparse.Namespace, world_size: int,
                     device: torch.device, run: Any) -> None:
    """``run_config.json``: every option plus the environment, so a run can be reproduced."""
    import transformers

    info = dict(vars(args), world_size=world_size, device=str(device),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda"
                else platform.processor() or platform.machine(),
                torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), command=" ".join(sys.argv),
                n_params=run.n_params, flops_per_token=run.flops_per_token,
                fp8_coverage=getattr(run, "fp8_coverage", None),
                date=datetime.datetime.now().isoformat(timespec="seconds"))
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    (out_dir / "run_config.json").write_text(json.dumps(info, indent=2, default=str))


class RunLogger:
    """Per-step metrics: JSONL records and the progress display (rank 0 only)."""

    def __init__(self, out_dir: Path, args: argparse.Namespace, start_step: int, enabled: bool,
                 flops_per_token: int, world_size: int) -> None:
        if enabled:  # a resumed run logs the steps after its checkpoint again
            metrics_lib.drop_records_after(out_dir / "metrics.jsonl", start_step)
        self.writer = metrics_lib.MetricsWriter(out_dir / "metrics.jsonl", enabled=enabled)
        self.tensorboard = metrics_lib.TensorBoardWriter(
            out_dir / "tensorboard", enabled=enabled and args.tensorboard)
        self.progress = metrics_lib.Progress(args.steps, initial=start_step,
                                             enabled=enabled and not args.no_progress,
                                             print_every=args.log_every)
        # Tokens per optimizer step over every replica (hybrid: tp x pp ranks share a batch).
        self.tokens_per_step = (args.batch_size * args.grad_accum * args.seq_len *
                                hybrid.data_parallel_size(args, world_size))
        self.flops_per_token = flops_per_token
        self.world_size = world_size
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.last_step = start_step  # the last step logged
        self.t0 = time.perf_counter()

    def step(self, step: int, loss: float, grad_norm: Optional[float], lr: float,
             seconds: float, mem_gib: float, skipped: bool = False) -> None:
        self.step_times.append(seconds)
        self.last_step = step
        if skipped:  # a non-finite step the guard skipped: logged, kept out of the summary
            self.writer.write(dict(kind="train", step=step, loss=None, skipped=True, lr=lr))
            self.progress.write(f"[train] step {step}: non-finite loss/gradient, step skipped")
            return
        self.losses.append(loss)
        tok_s = self.tokens_per_step / seconds
        tflops = self.flops_per_token * tok_s / self.world_size / 1e12
        record = dict(kind="train", step=step, loss=loss, lr=lr, grad_norm=grad_norm,
                      tokens=step * self.tokens_per_step, step_time_s=seconds,
                      tokens_per_s=tok_s, tflops_per_device=tflops, peak_mem_gib=mem_gib,
                      elapsed_s=time.perf_counter() - self.t0)
        self.writer.write(record)
        self.tensorboard.scalars(step, {"train/loss": loss, "train/lr": lr,
                                        "train/grad_norm": grad_norm, "perf/tokens_per_s": tok_s,
                                        "perf/peak_mem_gib": mem_gib})
        recent = self.step_times[-10:]
        smooth_tok_s = self.tokens_per_step * len(recent) / sum(recent)
        self.progress.update(step, {
            "loss": loss, "tok/s": round(smooth_tok_s),
            "TFLOP/s": smooth_tok_s * self.flops_per_token / self.world_size / 1e12,
            "mem": f"{mem_gib:.2f}G"})

    def eval(self, step: int, val_loss: float) -> None:
        self.writer.write(dict(kind="eval", step=step, val_loss=val_loss))
        self.tensorboard.scalars(step, {"eval/loss": val_loss})
        self.progress.write(f"[train] step {step}: validation loss {val_loss:.4f}")

    def close(self) -> None:
        self.progress.close()
        self.writer.close()
        self.tensorboard.close()


def announce(logger: RunLogger, message: str) -> None:
    """Print a line now, through the progress bar when there is one (so it stays intact)."""
    bar = getattr(logger.progress, "bar", None)
    if bar is not None:
        bar.write(message)
    else:
        print(message, flush=True)


def summarize(logger: RunLogger, val_loss: Optional[float], out_dir: Path,
              args: argparse.Namespace, start_step: int,
              interrupted: bool = False) -> dict[str, Any]:
    """``summary.json``: first/last losses (means of up to 10 steps each, never overlapping),
    median speed, peak memory; an interrupted run ends at its last logged step."""
    times = logger.step_times[1:] or logger.step_times  # step 1 pays one-off warm-up costs
    median = statistics.median(times) if times else float("nan")
    tok_s = logger.tokens_per_step / median if times else float("nan")
    # A run of <= 20 steps gets shorter windows: overlapping ones printed "loss a -> a".
    window = max(1, min(10, len(logger.losses) // 2))
    summary = dict(
        steps_run=len(logger.losses), start_step=start_step,
        end_step=logger.last_step if interrupted else args.steps, interrupted=interrupted,
        loss_window=window,
        first_loss=statistics.fmean(logger.losses[:window]) if logger.losses else None,
        last_loss=statistics.fmean(logger.losses[-window:]) if logger.losses else None,
        val_loss=val_loss, median_step_time_s=median, tokens_per_s=tok_s,
        tokens_per_s_per_device=tok_s / logger.world_size,
        tflops_per_device=tok_s * logger.flops_per_token / logger.world_size / 1e12,
        wall_time_s=time.perf_counter() - logger.t0)
    if getattr(args, "compile", False):  # the proof that --compile compiled (dynamo's counters)
        from torch._dynamo.utils import counters

        summary["compile"] = dict(graphs=int(counters["stats"].get("unique_graphs", 0)),
                                  graph_breaks=sum(counters["graph_break"].values()))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _plot(out_dir: Path, args: argparse.Namespace) -> Optional[Path]:
    """``loss.png`` from ``metrics.jsonl`` (None without matplotlib)."""
    model = args.model or Path(args.model_path).name
    size = f" {args.preset}" if args.model_path is None else ""
    layout = "one process" if args.plugin == "none" else hybrid.describe(args)
    numerics = f"{args.precision} + FP8 GEMMs" if args.use_fp8 else args.precision
    title = f"{model}{size}, {layout}, {numerics}"  # "llama tiny, one process, bf16 + FP8 GEMMs"
    return metrics_lib.plot_loss_curve(out_dir / "metrics.jsonl", out_dir / "loss.png", title)


def finish(logger: RunLogger, val_loss: Optional[float], out_dir: Path,
           args: argparse.Namespace, start_step: int) -> dict[str, Any]:
    """Rank 0: summary.json, the loss plot and a closing line."""
    summary = summarize(logger, val_loss, out_dir, args, start_step)
    png = _plot(out_dir, args)
    val = f"{val_loss:.3f}" if val_loss is not None else "n/a"
    if summary["steps_run"] < 2:
        losses = f"loss {summary['last_loss']:.3f} ({summary['steps_run']} step)"
    else:
        window = summary["loss_window"]
        losses = (f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} (mean of "
                  f"first/last {window} step{'s' if window > 1 else ''})")
    print(f"[train] done: {losses}, validation {val}, "
          f"{summary['tokens_per_s']:.0f} tokens/s, metrics in {out_dir}"
          + (f", plot {png}" if png else ""), flush=True)
    return summary


def finish_interrupted(logger: RunLogger, out_dir: Path, args: argparse.Namespace,
                       start_step: int, save_dir: Path, cause: str = "Ctrl-C") -> dict[str, Any]:
    """Rank 0 after Ctrl-C or SIGTERM (``cause`` names it): the partial run's summary.json and
    loss plot, and one line saying where they are and how the run continues."""
    summary = summarize(logger, None, out_dir, args, start_step, interrupted=True)
    png = _plot(out_dir, args)
    ckpt = checkpointing.latest_complete(save_dir)
    # --resume auto needs a fixed folder to look in; a runs/<time> folder is named instead.
    how = "--resume auto" if args.out_dir or args.save_dir else f"--resume {save_dir}"
    then = (f"{how} continues from {ckpt.name}" if ckpt is not None else
            "no checkpoint was saved (--save-every N makes a run resumable)")
    print(f"[train] interrupted ({cause}) after step {logger.last_step} of {args.steps}: "
          f"summary.json{', loss.png' if png else ''} and metrics.jsonl of the partial run "
          f"are in {out_dir}; {then}", flush=True)
    return summary
