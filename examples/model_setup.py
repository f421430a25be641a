"""Model, optimizer and schedule of the training example (``train_llama.py``).

``--model FAMILY`` builds an HF causal LM of the ``--preset`` size with random weights;
``--model-path DIR`` loads any local pretrained causal LM. :func:`prepare_model` applies
``--activation-checkpointing`` and ``--compile`` before the plugin boosts the model.

Example:
    >>> import math
    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = cosine_with_warmup(opt, warmup=2, total=10, min_ratio=0.1)
    >>> opt.param_groups[0]["lr"]
    0.5
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import moe
import presets

# --model: HF families built from a size preset (random init); --model-path takes any causal LM.
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "gpt2") + moe.MOE_FAMILIES


def check_model_folder(path: str) -> Path:
    """A local pretrained folder: ``config.json`` of a transformers causal LM + safetensors.

    Raises:
        ValueError: the folder, its config or weights are missing, or its type is no causal LM.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"--model-path {path!r} is not a directory; pass a local folder "
                         "with config.json and *.safetensors (downloads are not supported)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model-path {path!r} has no config.json")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model-path {path!r} has no *.safetensors weights; save the model "
                         "with save_pretrained(..., safe_serialization=True)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"--model-path holds a {model_type!r} model, which transformers' "
                         "AutoModelForCausalLM does not build; pass a causal language model")
    return folder


def family_config(family: str, preset: str, vocab_size: int, max_pos: int):
    """The HF config of ``--model FAMILY`` at the ``--preset`` size (random init)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    size = {**presets.PRESETS[preset], **moe.moe_fields(family, preset)}  # MoE: + experts
    defaults = CONFIG_MAPPING[family]()
    # Family defaults (e.g. GPT-2's token id 50256) can point past a small tokenizer's vocabulary.
    ids = {key: None for key in ("bos_token_id", "eos_token_id", "pad_token_id")
           if isinstance(getattr(defaults, key, None), int) and getattr(defaults, key) >= vocab_size}
    if family == "gpt2":  # GPT-2 names its sizes differently and has learned positions
        config = AutoConfig.for_model(
            "gpt2", n_embd=size["hidden_size"], n_layer=size["num_hidden_layers"],
            n_head=size["num_attention_heads"], n_inner=size["intermediate_size"],
            n_positions=max_pos, vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **ids)
    else:
        config = AutoConfig.for_model(family, **size, vocab_size=vocab_size,
                                      max_position_embeddings=max_pos,
                                      tie_word_embeddings=False, attention_dropout=0.0, **ids)
    return config


def build_model(args: argparse.Namespace, vocab_size: int, max_pos: int,
                device: torch.device) -> torch.nn.Module:
    """``--model`` at ``--preset`` size, or ``--model-path`` (structure only on meta)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model == "llama":  # the presets' own builder: same weights as before --model
        return presets.build_model(args.preset, vocab_size, max_pos, device=device,
                                   seed=args.seed)
    if args.model is not None:
        torch.manual_seed(args.seed)  # every rank builds identical weights
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                family_config(args.model, args.preset, vocab_size, max_pos))
    folder = str(check_model_folder(args.model_path))
    if device.type == "meta":  # weights come later, shard by shard (booster.load_model)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(folder, local_files_only=True))
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                     dtype=torch.float32).to(device)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"the pretrained model's vocabulary ({model.config.vocab_size}) is "
                         f"smaller than the tokenizer's ({vocab_size}); pass --tokenizer "
                         "pointing at the model's own tokenizer folder")
    return model


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (HF: ``model.layers``, GPT-2: ``transformer.h``)."""
    from fp8boost.hf_model import find_blocks

    return find_blocks(model)


def prepare_model(model: torch.nn.Module, args: argparse.Namespace) -> int:
    """``--activation-checkpointing`` and ``--compile``, before boost; returns blocks compiled.

    ``fp8boost.compile.compile_blocks`` compiles each block in place (parameter names and the
    module tree stay, so plugins, FP8 conversion and checkpoints see the same model) and lazily:
    the FP8 layers the plugin swaps in during ``boost`` are what gets traced at the first step.
    It also turns the KV cache off and makes a block that would fall back to eager raise.
    """
    if args.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(model).__name__} does not support activation "
                             "checkpointing in transformers; drop --activation-checkpointing")
        # Non-reentrant: works with FSDP2, DDP and torch.compile.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the name in newer transformers
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not args.compile:
        return 0
    from fp8boost.compile import compile_blocks

    try:
        return compile_blocks(model, backend=args.compile_backend)
    except ValueError as e:
        raise ValueError(f"--compile: {e}") from None


def cosine_with_warmup(optimizer: torch.optim.Optimizer, warmup: int, total: int,
                       min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to the peak lr over ``warmup`` steps, then cosine decay to
    ``min_ratio * peak`` at step ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms and biases (1-D parameters), as usual for LLMs."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
