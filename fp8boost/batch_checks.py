"""Host-side checks of a language-model batch, before it reaches a kernel or a collective.

A token id outside ``[0, vocab)`` makes the embedding lookup fail with a CUDA device-side
assert (which poisons the CUDA context) or, on several ranks, leaves the healthy ranks waiting
in a collective for the one that crashed; labels of another shape fail deep inside the loss.
:func:`check_lm_batch` turns both into a ``ValueError`` that names the problem, on the host.

Cost: one ``aminmax`` pass over the ids (and labels) and a shape comparison. On a CPU batch
(before ``.to(device)``), that is a few microseconds for 8 x 4096 tokens and no device work;
on a device tensor it costs one small kernel and one host sync, so check batches before
moving them.

Example:
    >>> import torch
    >>> check_lm_batch(torch.tensor([[1, 2, 3]]), vocab_size=4)
    >>> check_lm_batch(torch.tensor([[1, 7]]), vocab_size=4)
    Traceback (most recent call last):
    ...
    ValueError: input_ids hold token id 7, outside the model's vocabulary [0, 4): the data was tokenized with another tokenizer (or the model's vocab_size is too small); re-tokenize the data with the model's tokenizer or resize the model's embeddings
"""
from __future__ import annotations

from typing import Optional

import torch


def check_lm_batch(input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                   vocab_size: Optional[int] = None, ignore_index: int = -100) -> None:
    """Raise a ``ValueError`` for ids outside ``[0, vocab_size)`` or labels of another shape.

    Args:
        input_ids: integer token ids, any shape (usually ``[batch, seq]``).
        labels: targets of the same shape (``ignore_index`` entries are allowed), or None.
        vocab_size: the model's vocabulary size (``model.config.vocab_size``); None skips the
            range check.
        ignore_index: label value the loss ignores (HF: -100).

    Raises:
        ValueError: a floating-point or empty batch, an id out of range, or a shape mismatch.
    """
    if not torch.is_tensor(input_ids) or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError("input_ids must be an integer tensor of token ids, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): the data source "
                         "produced no tokens for this batch")
    if labels is not None and tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels have shape {tuple(labels.shape)} but input_ids "
                         f"{tuple(input_ids.shape)}: give every token its label (HF causal LMs "
                         "shift labels themselves; pass labels=input_ids)")
    if vocab_size is None:
        return
    for name, t, allowed in (("input_ids", input_ids, None), ("labels", labels, ignore_index)):
        if t is None:
            continue
        values = t if allowed is None else t[t != allowed]
        if values.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(values))
        bad = low if low < 0 else high if high >= vocab_size else None
        if bad is not None:
            raise ValueError(
                f"{name} hold token id {bad}, outside the model's vocabulary [0, {vocab_size}): "
                "the data was tokenized with another tokenizer (or the model's vocab_size is too "
                "small); re-tokenize the data with the model's tokenizer or resize the model's "
                "embeddings")
