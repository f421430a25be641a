"""Model presets of the scale benchmarks (issue 15), beside examples/presets.py's Llama sizes.

Each preset is an HF config; ``bench/train.py --preset`` and ``bench/scale.py --preset`` accept
these names as well as examples/presets.py's (tiny, small, 125m, 1b, 7b, 7b-8l)::

    preset           arch    hidden layers heads kv  ffn    vocab   tied  params
    llama2-7b        Llama   4096   32     32    32  11008  32000   no    6.74B
    llama2-13b       Llama   5120   40     40    40  13824  32000   no    13.02B
    command-r-35b    Cohere  8192   40     64    64  22528  256000  yes   34.98B
    command-r-small  Cohere  512    4      8     8   1408   32000   yes   (smoke runs)

The Command-R shape is built as transformers' ``CohereForCausalLM`` (CohereConfig's defaults
otherwise: 64 kv heads, no q/k norm, logit_scale 0.0625, tied embeddings). Its decoder layer is
a parallel block (one LayerNorm feeding attention and MLP side by side) with Llama's module
names (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``), so fp8boost's built-in
tensor-parallel plan covers it: on 2 CPU ranks, tp2 and tp2 + sequence parallel give the
single-process loss to 1e-7 (checked by hand for issue 15; tests/bench/test_scale.py runs it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

_LLAMA = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "vocab_size")
SCALE_PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(arch="llama", **dict(zip(_LLAMA, (4096, 32, 32, 32, 11008, 32000)))),
    "llama2-13b": dict(arch="llama", **dict(zip(_LLAMA, (5120, 40, 40, 40, 13824, 32000)))),
    "command-r-35b": dict(arch="cohere", **dict(zip(_LLAMA, (8192, 40, 64, 64, 22528, 256000)))),
    "command-r-small": dict(arch="cohere", **dict(zip(_LLAMA, (512, 4, 8, 8, 1408, 32000)))),
}
SMALL_PRESETS = ("tiny", "small", "command-r-small")  # default sequence 256, not 4096


def default_vocab(preset: str) -> int:
    """The preset's own vocabulary (32000 for examples/presets.py's Llama sizes)."""
    return int(SCALE_PRESETS.get(preset, {}).get("vocab_size", 32000))


def build_config(preset: str, vocab_size: int, max_seq_len: int, **overrides: Any):
    """The HF config of a scale preset (``overrides``: any config field)."""
    spec = dict(SCALE_PRESETS[preset])
    arch = spec.pop("arch")
    spec.update(vocab_size=vocab_size, max_position_embeddings=max_seq_len, attention_dropout=0.0)
    spec.update(overrides)
    if arch == "cohere":
        from transformers import CohereConfig
        spec.setdefault("eos_token_id", min(255001, vocab_size - 1))  # inside a small vocab
        return CohereConfig(**spec)  # tie_word_embeddings=True, logit_scale 0.0625 (defaults)
    from transformers import LlamaConfig
    return LlamaConfig(tie_word_embeddings=False, **spec)


def build_model(preset: str, vocab_size: int, max_seq_len: int, device: torch.device,
                seed: int = 0, dtype: Optional[torch.dtype] = None,
                **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM of a scale preset, allocated on ``device``.

    ``dtype``: the parameter dtype to allocate in (default FP32, like examples/presets.py).
    BF16 halves the transient full-model copy each rank holds before its plugin shards it
    (35B: 70 instead of 140 GB, which one H200 does not have).
    """
    from transformers import AutoModelForCausalLM

    config = build_config(preset, vocab_size, max_seq_len, **overrides)
    torch.manual_seed(seed)
    with torch.device(device), _default_dtype(dtype or torch.float32):
        return AutoModelForCausalLM.from_config(config)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
