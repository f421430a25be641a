"""Tiny trained HF models and held-back text for the FP8 export tests."""
from __future__ import annotations

import os

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 64


def text_bytes() -> torch.Tensor:
    with open(os.path.join(REPO, "fp8boost", "data", "sample.txt"), "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)


def split() -> tuple[torch.Tensor, torch.Tensor]:
    """(training bytes, held-back bytes): the last 15% is never trained on."""
    data = text_bytes()
    cut = int(len(data) * 0.85)
    return data[:cut], data[cut:]


def batches(data: torch.Tensor, n: int, size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - SEQ - 1, (n, size), generator=g)
    return [torch.stack([data[s:s + SEQ] for s in row]) for row in starts]


def make(kind: str, hidden: int = 128, inter: int = 384):
    """A tiny untrained model: ``llama``, ``qwen2`` or ``gpt2`` (byte vocabulary)."""
    import transformers as T
    torch.manual_seed(0)
    if kind == "llama":
        cfg = T.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False)
        return T.LlamaForCausalLM(cfg)
    if kind == "qwen2":
        cfg = T.Qwen2Config(vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=False)
        return T.Qwen2ForCausalLM(cfg)
    cfg = T.GPT2Config(vocab_size=256, n_embd=hidden, n_layer=2, n_head=4, n_positions=SEQ,
                       bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(cfg)


def trained(kind: str, steps: int = 15):
    """``make(kind)`` after ``steps`` AdamW steps on the training bytes (FP32)."""
    model = make(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for ids in batches(split()[0], steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@torch.no_grad()
def held_back_loss(model, n: int = 6) -> float:
    model.eval()
    losses = [model(input_ids=ids, labels=ids).loss.float() for ids in batches(split()[1], n,
                                                                                 seed=1)]
    return float(torch.stack(losses).mean())
