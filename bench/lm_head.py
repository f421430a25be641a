"""The lm_head + loss alone, forward + backward: HF's path against the fused one (issue 35).

Cells, one shape (default: Llama-3-8B's head at 8192 tokens: hidden 4096, vocabulary 128256, BF16):
  hf             F.cross_entropy(F.linear(h, W).float(), y): what HF's ForCausalLMLoss runs
  fused_opbyop   chunked_linear_cross_entropy with its chunk math op by op (the FP32 logits copy)
  fused          the same with fp8boost.loss.chunk_ops compiled (the library default on CUDA)
  fused_fp8_rowwise / fused_fp8_blockwise   + FusedLmLossConfig(fp8_recipe=...)

Per cell: median ms of ``--reps`` timed calls after a warm-up, and the peak memory above the
inputs. Usage::

    python bench/lm_head.py --output bench/results/lm_head_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp8boost.loss import chunk_ops, chunked_linear_cross_entropy  # noqa: E402

CELLS = ("hf", "fused_opbyop", "fused", "fused_fp8_rowwise", "fused_fp8_blockwise")


def cell_fn(name: str, h, w, y) -> Callable[[], torch.Tensor]:
    if name == "hf":
        return lambda: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)
    recipe = {"fused_fp8_rowwise": "rowwise", "fused_fp8_blockwise": "blockwise"}.get(name)
    return lambda: chunked_linear_cross_entropy(h, w, y, fp8_recipe=recipe)


def measure(fn: Callable[[], torch.Tensor], h, w, reps: int) -> dict:
    def step():
        h.grad = w.grad = None
        loss = fn()
        loss.backward()
        return loss

    loss = step()  # warm-up: compiles, tunes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": sorted(times)[reps // 2], "ms_all": times, "loss": loss.item(),
            "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--cells", default=",".join(CELLS))
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/lm_head.py needs a CUDA GPU")
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16()
    h.requires_grad_(), w.requires_grad_()
    y = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    cells = {}
    for name in args.cells.split(","):
        # fused_opbyop: the chunk math as plain ops (what ran before chunk_ops was compiled)
        chunk_ops_wanted = chunk_ops._wants_compile
        if name == "fused_opbyop":
            chunk_ops._wants_compile = lambda z: False
        try:
            cells[name] = measure(cell_fn(name, h, w, y), h, w, args.reps)
        finally:
            chunk_ops._wants_compile = chunk_ops_wanted
        c = cells[name]
        print(f"[lm_head] {name:22s} {c['ms']:8.2f} ms  peak +{c['peak_extra_gib']:.2f} GiB  "
              f"loss {c['loss']:.5f}", flush=True)
    base = cells.get("hf", {}).get("ms")
    for c in cells.values():
        c["vs_hf"] = base / c["ms"] if base else None
    report = {"device": torch.cuda.get_device_name(), "date": date.today().isoformat(),
              "torch": torch.__version__, "shape": vars(args), "command": " ".join(sys.argv),
              "cells": cells}
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
