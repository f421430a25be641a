"""A local Hugging Face tokenizer folder with a large vocabulary, trained offline on a text file.

The convergence runs use a byte-level vocabulary of 256, which cannot show what a real LM head
sees: at Llama 3's 128256 words, most of a token's ~128k softmax probabilities sit near 1/V of
the largest, the values an FP8 logit gradient must keep (``fp8boost/loss/fp8_head.py``). This
trains a byte-level BPE on the corpus (as many merges as it supports: ~20-40k words on 5 MB of
Shakespeare) and, with ``--vocab``, pads the vocabulary with never-seen tokens up to that size,
so the model's head and softmax have the real width (the unused rows learn to stay improbable,
as rare words do). Seconds on a CPU; the folder travels with the data (``carry=[".data"]``).

    python bench/make_tokenizer.py --data .data/shakespeare.txt --vocab 128256 \\
        --out .data/tok128k
    python examples/train_llama.py --data .data/shakespeare.txt --tokenizer .data/tok128k ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional


def build(data: Path, vocab: int, out: Path, bpe_vocab: int = 50000) -> dict:
    """Train the BPE, pad to ``vocab`` entries, save the folder; returns what it made."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(bpe_vocab, vocab), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(data)], trainer)
    learned = tok.get_vocab_size()
    if learned > vocab:
        raise ValueError(f"the BPE learned {learned} tokens, more than --vocab {vocab}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    # Padding tokens that never occur in text: special, so no input string maps to them.
    fast.add_special_tokens({"additional_special_tokens": [
        f"<|unused_{i}|>" for i in range(vocab - learned)]})
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    info = {"data": str(data), "learned": learned, "vocab": len(fast),
            "tokens_in_data": len(fast(data.read_text(encoding="utf-8", errors="replace"),
                                       add_special_tokens=False)["input_ids"])}
    (out / "MADE_BY.json").write_text(json.dumps(info, indent=1))
    return info


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="the text to train the BPE on")
    p.add_argument("--vocab", type=int, default=128256, help="final vocabulary size")
    p.add_argument("--bpe-vocab", type=int, default=50000, help="at most this many learned")
    p.add_argument("--out", type=Path, required=True, help="the tokenizer folder to write")
    args = p.parse_args(argv)
    if args.vocab < 512:
        raise SystemExit("--vocab must be >= 512 (the byte alphabet and some merges)")
    print(json.dumps(build(args.data, args.vocab, args.out, args.bpe_vocab)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
