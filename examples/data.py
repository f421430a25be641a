"""Text data for the training example: tokenizers and random contiguous windows.

The default corpus is ``fp8boost/data/sample.txt`` (Shakespeare's *Hamlet*, ~170 KB, from the
public-domain Gutenberg "standard" edition, no license header), so the example runs with no
download. Any UTF-8 text file works (``--data``), e.g. the team's 5 MB
``../shared/data/shakespeare.txt``.

Batches are a pure function of ``(seed, rank, step, micro_step)``: each draws ``batch_size``
random start offsets from a generator seeded with those numbers. Resuming at step ``s``
therefore continues with exactly the batches an uninterrupted run would have seen, and the
"data position" in a checkpoint is just the step.

Example:
    >>> from data import ByteTokenizer, TokenWindows
    >>> tok = ByteTokenizer()
    >>> ids = tok.encode_file(default_data_path())
    >>> windows = TokenWindows(ids, seq_len=64, seed=0)
    >>> windows.batch(step=0, micro_step=0, rank=0, batch_size=4).shape
    torch.Size([4, 64])
"""
from __future__ import annotations

import importlib.resources
from pathlib import Path
from typing import Optional, Protocol

import torch

_MIX = 1_000_003  # a prime: mixes (seed, rank, step, micro) into one 63-bit generator seed


class Tokenizer(Protocol):
    """What the example needs from a tokenizer."""

    vocab_size: int

    def encode_file(self, path: str | Path) -> torch.Tensor: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download, nothing unknown.

    Example:
        >>> ByteTokenizer().decode(ByteTokenizer().encode("hi"))
        'hi'
    """

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_file(self, path: str | Path) -> torch.Tensor:
        raw = Path(path).read_bytes()
        # frombuffer needs a writable buffer to avoid a warning; bytearray copies once.
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer folder (``tokenizer.json`` etc.); never downloads."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"--tokenizer {str(path)!r} is not a directory; pass a local "
                             "tokenizer folder or leave it out for the byte-level tokenizer")
        self.tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.vocab_size = len(self.tok)

    def encode_file(self, path: str | Path) -> torch.Tensor:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def has_tokenizer_files(folder: str | Path) -> bool:
    """True when ``folder`` holds a Hugging Face tokenizer."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any((Path(folder) / n).is_file() for n in names)


def load_tokenizer(path: Optional[str]) -> Tokenizer:
    """The tokenizer at ``path`` (a local HF folder), or the byte-level one when ``None``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def default_data_path() -> Path:
    """The text sample shipped inside the ``fp8boost`` package (the checkout's copy when this
    file runs from a checkout, else the installed package's)."""
    checkout = Path(__file__).resolve().parents[1] / "fp8boost" / "data" / "sample.txt"
    if checkout.is_file():
        return checkout
    return Path(str(importlib.resources.files("fp8boost") / "data" / "sample.txt"))


def check_length(n_tokens: int, seq_len: int, source: str | Path) -> None:
    """Reject a corpus too short for one window: it needs ``seq_len + 1`` tokens.

    Raises:
        ValueError: naming the file, its length and the length required.
    """
    if n_tokens <= seq_len:
        what = "is empty" if n_tokens == 0 else f"has {n_tokens} tokens"
        raise ValueError(f"the data {str(source)!r} {what}; training needs at least "
                         f"{seq_len + 1} tokens (--seq-len {seq_len} + 1) in one text: use a "
                         "longer --data file or a smaller --seq-len")


def check_token_range(tokens: torch.Tensor, vocab_size: int, source: str | Path) -> None:
    """Every id of the corpus must lie in ``[0, vocab_size)`` (checked once, at load).

    Raises:
        ValueError: naming the largest bad id and the fix.
    """
    if tokens.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(tokens.long() if tokens.dtype == torch.uint8
                                                else tokens))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"the data {str(source)!r} holds token id {bad}, outside the model's "
                         f"vocabulary [0, {vocab_size}): pass the model's own --tokenizer, or a "
                         "model whose vocabulary covers this tokenizer")


class TokenWindows:
    """Random contiguous windows of ``seq_len`` tokens from one long token stream.

    Args:
        tokens: 1-D integer tensor (the whole corpus, tokenized).
        seq_len: tokens per sample. The model shifts labels itself (HF causal-LM loss), so a
            window of ``seq_len`` tokens gives ``seq_len - 1`` predictions.
        seed: base seed shared by all ranks; ranks differ through ``rank``.

    Raises:
        ValueError: the stream is not 1-D or is not longer than ``seq_len``.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        check_length(tokens.numel(), seq_len, "text")
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self) -> int:
        return self.tokens.numel()

    def batch(self, step: int, micro_step: int, rank: int, batch_size: int) -> torch.Tensor:
        """The ``[batch_size, seq_len]`` int64 batch for this (step, micro step, rank)."""
        seed = ((self.seed * _MIX + rank) * _MIX + step) * _MIX + micro_step
        gen = torch.Generator().manual_seed(seed % (2 ** 63))
        starts = torch.randint(0, self.tokens.numel() - self.seq_len + 1, (batch_size,),
                               generator=gen)
        offsets = starts[:, None] + torch.arange(self.seq_len)[None, :]
        return self.tokens[offsets].long()


def split_train_val(tokens: torch.Tensor, val_fraction: float,
                    min_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Split the last ``val_fraction`` of the stream off for validation.

    Returns ``(train, None)`` when the validation part would be shorter than ``min_len + 1``
    tokens (too short to hold one window): a tiny file then trains on everything.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    n_val = int(tokens.numel() * val_fraction)
    if n_val <= min_len:
        return tokens, None
    return tokens[:-n_val], tokens[-n_val:]
