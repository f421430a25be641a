"""Llama size presets and model construction for the examples and benchmarks.

A preset fixes the architecture (width, depth, heads, FFN size); the vocabulary size comes
from the tokenizer (256 for the byte-level tokenizer), so the same preset works with any
tokenizer. Shapes follow well-known models where one exists:

==========  ======  ======  =====  =====  ======  ==================================
preset      hidden  layers  heads  kv     ffn     shape of
==========  ======  ======  =====  =====  ======  ==================================
tiny        128     4       4      4      352     (CPU smoke test; trains in ~1 min)
small       512     8       8      8      1376    (~25M non-embedding params)
125m        768     12      12     12     2048    GPT-2 small / OPT-125m width
1b          2048    22      32     4      5632    TinyLlama-1.1B
7b          4096    32      32     32     11008   Llama-2-7B
7b-8l       4096    8       32     32     11008   Llama-2-7B shapes, 8 layers (benchmarks)
mistral-8l  4096    8       32     8      14336   Mistral-7B shapes, 8 layers (--model
                                                  mixtral: Mixtral-8x7B; benchmarks)
==========  ======  ======  =====  =====  ======  ==================================

Every hidden and FFN size is a multiple of 16, so all decoder linear layers are eligible for
FP8 (Hopper FP8 GEMMs need dims divisible by 16).

Example:
    >>> from presets import build_llama_config
    >>> cfg = build_llama_config("tiny", vocab_size=256)
    >>> cfg.hidden_size, cfg.num_hidden_layers
    (128, 4)
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, intermediate_size=352),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=1376),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, intermediate_size=2048),
    "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, intermediate_size=5632),
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, intermediate_size=11008),
    "7b-8l": dict(hidden_size=4096, num_hidden_layers=8, num_attention_heads=32,
                  num_key_value_heads=32, intermediate_size=11008),
    "mistral-8l": dict(hidden_size=4096, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336),
}

# Training defaults per preset (any of them can be overridden on the command line). The tiny
# ones are sized so the loss visibly falls (byte-level loss from ln(256) = 5.5 to ~2.2 nats in
# 300 steps); the large ones are usual values for models of that size. On CPU (no GPU, or
# --device cpu) the tiny preset trains CPU_STEPS instead, so the README's main command ends in
# about a minute on 2 CPU cores (0.3 s a step there, emulated FP8: issue 39).
TRAIN_DEFAULTS: dict[str, dict[str, float | int]] = {
    "tiny": dict(seq_len=128, batch_size=8, lr=3e-3, steps=300),
    "small": dict(seq_len=256, batch_size=8, lr=1e-3, steps=1000),
    "125m": dict(seq_len=512, batch_size=8, lr=6e-4, steps=2000),
    "1b": dict(seq_len=2048, batch_size=4, lr=3e-4, steps=2000),
    "7b": dict(seq_len=4096, batch_size=1, lr=1.5e-4, steps=1000),
    "7b-8l": dict(seq_len=4096, batch_size=2, lr=1.5e-4, steps=1000),
    "mistral-8l": dict(seq_len=4096, batch_size=2, lr=1.5e-4, steps=1000),
}
CPU_STEPS: dict[str, int] = {"tiny": 150}


def build_llama_config(preset: str, vocab_size: int, max_seq_len: int = 2048, **overrides: Any):
    """A ``LlamaConfig`` for a size preset.

    Args:
        preset: one of :data:`PRESETS`.
        vocab_size: tokenizer vocabulary size (256 for the byte-level tokenizer).
        max_seq_len: ``max_position_embeddings`` (RoPE tables are sized from it).
        **overrides: any other ``LlamaConfig`` field (e.g. ``num_hidden_layers=2``).

    Raises:
        ValueError: unknown preset or a non-positive size.
    """
    from transformers import LlamaConfig  # deferred: importing transformers takes seconds

    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {list(PRESETS)} "
                         "or pass --model-path to a local pretrained folder")
    if vocab_size < 2 or max_seq_len < 1:
        raise ValueError(f"vocab_size must be >= 2 and max_seq_len >= 1, got {vocab_size}, "
                         f"{max_seq_len}")
    kwargs: dict[str, Any] = dict(PRESETS[preset])
    kwargs.update(vocab_size=vocab_size, max_position_embeddings=max_seq_len,
                  tie_word_embeddings=False, attention_dropout=0.0)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def check_model_path(path: str | os.PathLike) -> Path:
    """Validate a local pretrained folder (``config.json`` + safetensors weights).

    Raises:
        ValueError: the folder, its ``config.json`` or its weights are missing.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"--model-path {str(path)!r} is not a directory; pass a local folder "
                         "with config.json and *.safetensors (downloads are not supported)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model-path {str(path)!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model-path {str(path)!r} has no *.safetensors weights; save the model "
                         "with save_pretrained(..., safe_serialization=True)")
    config = json.loads((folder / "config.json").read_text())
    model_type = config.get("model_type")
    if model_type not in (None, "llama"):
        raise ValueError(f"--model-path holds a {model_type!r} model; this example trains "
                         "LlamaForCausalLM only")
    return folder


def _check_vocab(model: torch.nn.Module, vocab_size: int) -> None:
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"the pretrained model's vocabulary ({model.config.vocab_size}) is "
                         f"smaller than the tokenizer's ({vocab_size}); pass --tokenizer "
                         "pointing at the model's own tokenizer folder")


def build_model(preset: Optional[str], vocab_size: int, max_seq_len: int,
                model_path: Optional[str] = None, dtype: torch.dtype = torch.float32,
                device: Optional[torch.device] = None, seed: int = 0,
                **overrides: Any) -> torch.nn.Module:
    """Build ``LlamaForCausalLM`` from a preset (random init) or a local pretrained folder.

    Args:
        preset: size preset name (ignored when ``model_path`` is given).
        vocab_size: vocabulary size for a preset model; a pretrained model must cover it.
        max_seq_len: longest sequence the model will see.
        model_path: local folder with ``config.json`` + safetensors; no downloads.
        dtype: parameter dtype to build in (the plugin decides the training dtypes).
        device: where to allocate the parameters (building a 7B model on the GPU directly
            avoids a slow CPU init and a host-to-device copy).
        seed: init seed, so every rank builds identical weights.
        **overrides: extra ``LlamaConfig`` fields for a preset.

    Example:
        >>> model = build_model("tiny", vocab_size=256, max_seq_len=128)
        >>> type(model).__name__
        'LlamaForCausalLM'
    """
    from transformers import LlamaForCausalLM

    if model_path is not None:
        folder = check_model_path(model_path)
        if device is not None and torch.device(device).type == "meta":
            # Weights come later, shard by shard (booster.load_model after boost): build the
            # structure only, no host copy of the checkpoint.
            from transformers import LlamaConfig
            config = LlamaConfig.from_pretrained(str(folder), local_files_only=True)
            with torch.device("meta"):
                model = LlamaForCausalLM(config).to(dtype)
            _check_vocab(model, vocab_size)
            return model
        model = LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                 dtype=dtype)
        _check_vocab(model, vocab_size)
        return model.to(device) if device is not None else model
    config = build_llama_config(preset, vocab_size, max_seq_len, **overrides)
    torch.manual_seed(seed)
    with torch.device(device if device is not None else "cpu"):
        model = LlamaForCausalLM(config)
    return model.to(dtype)
