"""Throughput, FLOPs, memory, progress display, JSONL metrics and the loss-curve plot.

FLOPs follow the PaLM paper's accounting (Chowdhery et al. 2022, appendix B): a training step
costs ``6 * N`` FLOPs per token for the matmul parameters ``N`` (forward 2N, backward 4N) plus
``12 * n_layers * hidden * seq_len`` per token for the attention scores and the weighted sum
(QK^T and AV, forward and backward, counted without the causal-mask saving, like PaLM and
Megatron). ``N`` excludes the input embedding (a lookup, not a matmul) and includes ``lm_head``.

Example:
    >>> flops_per_token(n_matmul_params=1_000_000, n_layers=4, hidden=128, seq_len=128)
    6786432
"""
from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls: all but the input embedding (tied: counted once)."""
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    tied = out is not None and out.weight is embed
    return total if tied else total - embed.numel()


def flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int) -> int:
    """Training FLOPs per token: ``6 * N + 12 * n_layers * hidden * seq_len`` (PaLM)."""
    return 6 * n_matmul_params + 12 * n_layers * hidden * seq_len


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, peak RSS on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)


class Progress:
    """A tqdm bar when tqdm is installed, output is enabled and stderr is a terminal, else a
    printed line every ``print_every`` steps (a log file gets lines, not carriage returns).
    Only rank 0 should enable it."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True,
                 print_every: int = 10) -> None:
        self.enabled = enabled
        self.total = total
        self.print_every = max(1, print_every)
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                print("[train] tqdm is not installed: printing plain progress lines "
                      "(pip install tqdm for a progress bar)", flush=True)
            else:
                self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True,
                                desc="train", mininterval=0.5)

    def update(self, step: int, stats: dict[str, Any]) -> None:
        """Advance to ``step`` (1-based, steps done) and show ``stats``."""
        if not self.enabled:
            return
        text = {k: _short(v) for k, v in stats.items()}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(text, refresh=False)
        elif step % self.print_every == 0 or step == self.total:
            fields = " ".join(f"{k}={v}" for k, v in text.items())
            print(f"[train] step {step}/{self.total} {fields}", flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def drop_records_after(path: Path, step: int) -> int:
    """Rewrite ``path`` (atomically) without its records past ``step``; returns how many went.

    A run resumed from the checkpoint of ``step`` logs the later steps again: without this the
    file would hold two rows of each step the first attempt logged after its last checkpoint.
    """
    if not path.is_file():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    tmp.replace(path)
    return len(lines) - len(kept)


class MetricsWriter:
    """Appends one JSON object per line to ``path`` (rank 0 only), flushed every line so a
    crashed run keeps its metrics. Opened in append mode: a resumed run continues the file."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.file = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(jsonl_path: Path, png_path: Path, title: str = "") -> Optional[Path]:
    """Plot train (and validation) loss against step; returns the PNG path.

    Returns ``None``, with a warning, when matplotlib is not installed (the JSONL file still
    holds every number).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display on servers
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        warnings.warn("matplotlib is not installed: the loss-curve PNG is skipped "
                      f"(the metrics are in {jsonl_path}; pip install matplotlib)", stacklevel=2)
        return None
    records = read_jsonl(jsonl_path)
    # A resumed run drops the records past its checkpoint (drop_records_after); should a
    # step still appear twice (a file edited by hand), the later record wins.
    train = sorted({r["step"]: r["loss"] for r in records if r.get("kind") == "train"}.items())
    val = sorted({r["step"]: r["val_loss"] for r in records if r.get("kind") == "eval"}.items())
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no 2.5 ticks
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def check_tensorboard() -> None:
    """Raise a ValueError naming the fix when ``--tensorboard`` cannot work here."""
    try:
        import tensorboard  # noqa: F401 - torch.utils.tensorboard needs this package
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--tensorboard needs the tensorboard package ({exc}); pip install "
                         "tensorboard, or drop --tensorboard (metrics.jsonl and loss.png hold "
                         "the same numbers)") from exc


class TensorBoardWriter:
    """Scalars to ``<out-dir>/tensorboard`` (rank 0 only; a no-op when disabled)."""

    def __init__(self, log_dir: Path, enabled: bool = True) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if isinstance(value, (int, float)) and value is not None:
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class StepTimer:
    """Wall time of one optimizer step; on CUDA it synchronizes first so the GPU's queued
    work is counted in the step that issued it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        self._sync()
        self.start = time.perf_counter()

    def end(self) -> float:
        self._sync()
        return time.perf_counter() - self.start
