"""Losses: the lm_head and its cross-entropy fused, without the ``[tokens, vocab]`` logits.

``linear_cross_entropy.py`` is the autograd function (any device, eager and ``torch.compile``;
vocabulary-parallel through a process-group hook, as ``fp8/`` knows distribution only through
its amax group); ``causal_lm.py`` decides which HF causal LMs take it and installs it, once, at
``boost``. This layer sits between ``fp8/`` (it reads the conversion's record,
``fp8.record``) and ``parallel/`` (``tp`` uses it): it imports nothing from ``parallel/`` or above.
"""
from .causal_lm import (FusedLmLossConfig, FusedLossForward, HeadRecipe, head_recipe,
                        install_fused_lm_loss, resolve_fused_lm_loss)
from .linear_cross_entropy import (CHUNK_ELEMENTS, VocabParallel, auto_chunk_size,
                                   chunked_linear_cross_entropy)

__all__ = ["chunked_linear_cross_entropy", "auto_chunk_size", "CHUNK_ELEMENTS", "VocabParallel",
           "FusedLmLossConfig", "resolve_fused_lm_loss", "install_fused_lm_loss",
           "FusedLossForward", "HeadRecipe", "head_recipe"]
