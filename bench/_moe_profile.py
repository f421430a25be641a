"""Where an MoE training step's GPU milliseconds go (bench/moe_step.py ``--profile-steps``).

Each GPU kernel is attributed through the torch op that launched it and that op's parents
(torch.profiler with CPU and CUDA activity):

* ``expert_fprop`` / ``expert_dgrad`` / ``expert_wgrad``: the grouped GEMMs of the experts,
  FP8 (``fp8boost::moe_scaled_mm``, ``_wgrad``) or BF16 (``aten::_grouped_mm``: forward is
  fprop; in backward, two 2-D operands make the wgrad, a 3-D one the dgrad);
* ``fp8_cast``: fp8boost's Triton cast kernels, ATen's ``scatter_reduce`` (the group amax of
  the torch-op casts), and inductor kernels whose fused ops include an amax or a clamp (the casts a compiled graph generates; approximate: a fused kernel may carry
  other work of its graph);
* ``permutation``: routing and token permutation (sort, index, gather/scatter, repeat,
  histogram kernels, and inductor kernels named after them);
* ``dense_gemm`` (attention projections, router, lm_head), ``attention``, ``optimizer``, and
  ``rest`` (norms, activations, loss, copies).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import torch

_CAST = re.compile(r"^_(cast|amax|row_amax|cast_rows|quantize_rows|rows|transpose|dequant|group_|"
                   r"seg_)\w*kernel|^triton_\w*(amax|clamp)")
_PERM = re.compile(r"sort|index|gather|scatter|repeat_interleave|histc|bincount|cumsum")
_PERM_OPS = ("aten::sort", "aten::argsort", "aten::index", "aten::index_copy",
             "aten::index_select", "aten::gather", "aten::scatter", "aten::repeat_interleave",
             "aten::histc", "aten::bincount", "aten::cumsum", "aten::index_put_",
             "aten::index_add_", "aten::scatter_add_")
_GEMM = re.compile(r"nvjet|gemm|cutlass|splitk|xmma")
_ATTN = re.compile(r"flash|fmha|attention|sdpa|compute_dot_do_o")
_OPT = re.compile(r"adam|fusedoptimizer|lpnorm|multi_tensor")


def _chain(ev) -> list:
    out = []
    while ev is not None:
        out.append(ev)
        ev = ev.cpu_parent
    return out


def classify(kernel: str, chain: list) -> str:
    """The category of one kernel, from its name and the ops that launched it."""
    names = [e.name for e in chain]
    backward = any("backward" in n.lower() for n in names)
    low = kernel.lower()
    if "fp8boost::moe_scaled_mm_wgrad" in names:
        return "expert_wgrad"
    if "fp8boost::moe_scaled_mm" in names:
        return "expert_dgrad" if backward else "expert_fprop"
    for e in chain:
        if e.name == "aten::_grouped_mm":
            if not backward:
                return "expert_fprop"
            dims = [len(s) for s in (e.input_shapes or [])[:2]]
            return "expert_wgrad" if dims == [2, 2] else "expert_dgrad"
    # The torch-op casts' per-(expert, column) amax is the only scatter_reduce of a step; the
    # fused casts run as fp8boost::moe_cast_* ops (their buffer fills included).
    if (_CAST.search(low) or any(n.startswith(("aten::scatter_reduce", "fp8boost::moe_cast"))
                                 for n in names)):
        return "fp8_cast"
    if _ATTN.search(low):
        return "attention"
    if _OPT.search(low):
        return "optimizer"
    if _GEMM.search(low):
        return "dense_gemm"
    if any(n in _PERM_OPS for n in names) or (low.startswith("triton_") and _PERM.search(low)):
        return "permutation"
    return "rest"


def step_breakdown(step: Callable[[], Any], steps: int, top: int = 20) -> dict[str, Any]:
    """Run ``steps`` steps under the profiler: kernel ms per step by category, top kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        for k in getattr(ev, "kernels", ()):
            cat = classify(k.name, _chain(ev))
            ms = k.duration / 1e3
            by_cat[cat] += ms / steps
            rec = per_kernel[(k.name[:120], cat)]
            rec[0] += ms / steps
            rec[1] += 1 / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(steps=steps, total_ms_per_step=round(sum(by_cat.values()), 3),
                by_category_ms={k: round(v, 3) for k, v in sorted(by_cat.items(),
                                                                   key=lambda kv: -kv[1])},
                top_kernels=[dict(name=n, category=c, ms_per_step=round(ms, 3), calls=round(k, 1))
                             for (n, c), (ms, k) in ranked])
