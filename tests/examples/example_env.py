"""Where examples/ is, the short-run flags the example tests share, and importing the example's
modules the way the script imports them (examples/ on sys.path)."""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCRIPT = EXAMPLES / "train_llama.py"
SHORT = ["--seq-len", "16", "--batch-size", "2", "--lr", "3e-3", "--warmup-steps", "1",
         "--no-progress", "--eval-batches", "1"]
"""Tiny runs: short sequences, small batches, a one-batch evaluation."""


@contextlib.contextmanager
def example_modules(*names: str) -> Iterator[list]:
    """The example's modules ``names``, imported with examples/ on sys.path for the duration."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(EXAMPLES))
