"""What a Llama decoder layer keeps for backward: BF16 vs FP8, eager vs compiled (issue 11, item 5).

Peak training memory is weights + optimizer state + what autograd saves between forward and
backward. This script counts the last part exactly, per decoder layer, on CPU (no GPU needed:
the saved tensors are a property of the autograd graph, not of the device):

* eager: every tensor handed to autograd's saved-tensor hooks during one layer's forward,
  parameters excluded, each storage counted once (three layers saving one shared FP8 copy
  count it once);
* compiled: the forward/backward split that AOTAutograd's min-cut partitioner (the one
  inductor uses) makes for the compiled layer: every saved value of the backward graph, minus
  parameters, measured from its fake tensor.

Modes: ``bf16``; ``fp8`` (the defaults: shared input casts, W^T re-cast in backward,
inductor-fusable casts under compile); ``fp8_before`` (the behaviour before those three
options: every projection casts its own input, the transposed FP8 weight is kept for
backward, the Triton cast is an opaque op under compile); one-option ablations
``fp8_noshare``, ``fp8_keep_wt`` and ``fp8_kernel_casts``. FP8 rows use the emulated backend
on CPU, except the kernel-cast rows, which go through the Triton backend's custom ops (their
CPU reference implementations). The layer's own input (the residual stream) is counted, as both
eager BF16 and FP8 save it for RMSNorm's backward.

    python bench/saved_activations.py                  # -> bench/results/saved_activations_<date>.json
    python bench/saved_activations.py --hidden 1024 --ffn 2752 --tokens 2048

The default shape keeps Llama-7B's FFN/hidden ratio (11008/4096) at a CPU-friendly width.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# FP8 modes: Fp8Config fields (emulated backend, every linear converted).
MODES: dict[str, dict[str, Any]] = {
    "fp8_before": dict(share_input_casts=False, recompute_weight_cast=False,
                       compiled_casts="kernel"),  # the behaviour before these options
    "fp8_noshare": dict(share_input_casts=False),
    "fp8_keep_wt": dict(recompute_weight_cast=False),
    "fp8": {},  # the defaults
    "fp8_kernel_casts": dict(compiled_casts="kernel"),
}
EAGER_MODES = ("bf16", "fp8_before", "fp8_noshare", "fp8_keep_wt", "fp8")
COMPILED_MODES = ("bf16", "fp8_before", "fp8_kernel_casts", "fp8")


def build_layer(args, mode: str, compiled: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from fp8boost.fp8 import Fp8Config, convert_to_fp8

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      num_hidden_layers=1, vocab_size=256, max_position_embeddings=args.tokens)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16)
    if mode != "bf16":
        fp8 = Fp8Config(backend="emulated", min_numel=0, **MODES[mode])
        report = convert_to_fp8(layer, fp8)
        assert len(report.converted) == 7, report
        if compiled and MODES[mode].get("compiled_casts") == "kernel":
            from fp8boost.fp8.kernels.backend import TritonBackend
            for mod in layer.modules():
                if hasattr(mod, "use_backend"):
                    mod.use_backend(TritonBackend(), torch.device("cpu"))
    layer.rotary = LlamaRotaryEmbedding(cfg)
    return layer


def layer_inputs(args, layer):
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(args.tokens)[None]
    cos, sin = layer.rotary(x, pos)
    return x, (cos, sin)


def run_layer(layer, x, pe):
    out = layer(x, position_embeddings=pe, attention_mask=None, position_ids=None)
    return out[0] if isinstance(out, tuple) else out


def eager_saved(args, mode: str) -> dict[str, Any]:
    layer = build_layer(args, mode)
    x, pe = layer_inputs(args, layer)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (t.untyped_storage().nbytes(), str(t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run_layer(layer, x, pe)
    y.float().sum().backward()  # the graph runs: the counted tensors were the ones it needed
    return _summary(list(seen.values()))


def compiled_saved(args, mode: str) -> dict[str, Any]:
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    layer = build_layer(args, mode, compiled=True)
    x, pe = layer_inputs(args, layer)
    param_keys = {(tuple(p.shape), p.dtype) for p in layer.parameters()}
    saved: list[tuple[int, str]] = []

    def bw_compiler(gm, _inputs):
        for node in gm.graph.nodes:
            if node.op != "placeholder" or node.name.startswith("tangents"):
                continue
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor) or (tuple(val.shape), val.dtype) in param_keys:
                continue
            saved.append((val.numel() * val.element_size(), str(val.dtype)))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=lambda gm, _i: make_boxed_func(gm.forward),
                           bw_compiler=bw_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(lambda x, pe: run_layer(layer, x, pe), backend=backend,
                             fullgraph=True)
    compiled(x, pe).float().sum().backward()
    return _summary(saved)


def _summary(items: list[tuple[int, str]]) -> dict[str, Any]:
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in items:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
    return dict(bytes=sum(by_dtype.values()), tensors=len(items), bytes_by_dtype=by_dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    rows = {}
    for mode in EAGER_MODES:
        rows[f"eager/{mode}"] = eager_saved(args, mode)
    for mode in COMPILED_MODES:
        rows[f"compiled/{mode}"] = compiled_saved(args, mode)
    unit = args.tokens * args.hidden  # bytes are reported per token*hidden element too
    for name, r in rows.items():
        r["bytes_per_token_hidden"] = r["bytes"] / unit
        base = rows["eager/bf16" if name.startswith("eager") else "compiled/bf16"]["bytes"]
        r["vs_bf16_same_mode"] = r["bytes"] / base
    import transformers
    import platform
    report = dict(benchmark="saved_activations_per_decoder_layer",
                  device=f"cpu ({platform.machine()}; saved bytes do not depend on the device)",
                  torch=torch.__version__,
                  transformers=transformers.__version__,
                  date=datetime.datetime.now().isoformat(timespec="seconds"),
                  command="python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:]),
                  shape=dict(hidden=args.hidden, ffn=args.ffn, heads=args.heads,
                             tokens=args.tokens), rows=rows)
    out = Path(args.output) if args.output else Path(os.environ.get("OUT") or ROOT / "bench" /
                                                          "results") / \
        f"saved_activations_{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}\n| mode | saved MiB | bytes per token x hidden | x BF16 (same mode) |"
          f" by dtype |\n|---|---|---|---|---|")
    for name, r in rows.items():
        dt = ", ".join(f"{k.replace('torch.', '')} {v / 2**20:.1f}"
                       for k, v in sorted(r["bytes_by_dtype"].items()))
        print(f"| {name} | {r['bytes'] / 2**20:.1f} | {r['bytes_per_token_hidden']:.2f} | "
              f"{r['vs_bf16_same_mode']:.2f} | {dt} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
