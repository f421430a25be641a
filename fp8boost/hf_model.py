"""What fp8boost needs to know about a (HuggingFace-style) model: its repeated blocks, and how
to keep training from building a KV cache.

Training never needs a KV cache: HF causal LMs build one whenever ``config.use_cache`` is true,
also in a training forward, which costs memory and, under ``torch.compile``, makes each decoder
block guard on its own cache layer (``past_key_values.layers[i]``), so every block past dynamo's
recompile limit (8) silently runs eager.
"""
from __future__ import annotations

import logging

from torch import nn

from fp8boost import _state

logger = logging.getLogger("fp8boost")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of the first ``nn.ModuleList`` (HF decoders:
    ``model.model.layers``, GPT-2: ``transformer.h``); empty when the model has none.

    Example:
        >>> import torch
        >>> from fp8boost.hf_model import find_blocks
        >>> len(find_blocks(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))))
        1
    """
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            return list(mod)
    return []


def disable_kv_cache(model: nn.Module) -> int:
    """Set ``use_cache = False`` on every HF config inside ``model`` (training builds no cache).

    ``generate()`` still works afterwards (pass ``use_cache=True`` to it for fast decoding).
    Returns how many configs were switched off (logged once at DEBUG: the cache is off in training anyway).

    Example:
        >>> import transformers
        >>> from fp8boost.hf_model import disable_kv_cache
        >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> disable_kv_cache(model), model.config.use_cache
        (1, False)
    """
    seen: set[int] = set()
    switched = 0
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        for c in (cfg, getattr(cfg, "text_config", None)):
            if c is None or id(c) in seen or not hasattr(c, "use_cache"):
                continue
            seen.add(id(c))
            if c.use_cache:
                c.use_cache = False
                switched += 1
    if switched:
        _state.log_once(logger, ("kv-cache-off", type(model).__name__),
                        f"fp8boost: training {type(model).__name__} with use_cache=False (no KV "
                        "cache is built in training; pass use_cache=True to generate())",
                        level=logging.DEBUG)  # routine: was a WARNING on every run (issue 39)
    return switched
