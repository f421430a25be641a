"""What the bench tests share: bench/ scripts import each other as top-level modules."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def on_bench_path():
    """``bench/`` first on ``sys.path`` while the block runs (its scripts import each other
    by bare name, e.g. ``from _common import bench``), removed afterwards."""
    sys.path.insert(0, str(BENCH))
    try:
        yield
    finally:
        sys.path.remove(str(BENCH))
