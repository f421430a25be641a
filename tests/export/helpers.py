"""Tiny trained HF models and held-back text for the FP8 export tests."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import pytest

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


# transformers' FP8 GEMM kernel offline ---------------------------------------------------------
# transformers 5.x (5.17 and 5.23 alike) runs FP8Linear through the Triton kernel it downloads
# with the `kernels` package: finegrained_fp8._load_finegrained_fp8_kernel() first requires
# is_kernels_available(), then hub_kernels.lazy_load_kernel("finegrained-fp8") returns the module
# cached in hub_kernels._KERNEL_MODULE_MAPPING or calls get_kernel(
# "kernels-community/finegrained-fp8", version=4), and takes matmul_2d / matmul_batched /
# matmul_grouped from it. The GPU machine has no internet and no `kernels`, so
# bench/hub_kernel_offline.sh copies that kernel's source into .hubkernels/ (gitignored, carried
# there with carry=[".hubkernels"]) and the helpers below put it where the download would go.

FINEGRAINED_FP8_DIR = os.path.join(REPO, ".hubkernels", "finegrained_fp8")
_HUB_NAME = "finegrained-fp8"  # the key of transformers' _HUB_KERNEL_MAPPING
_MODULE_NAME = "finegrained_fp8"


def offline_kernel_source() -> dict | None:
    """Provenance of the local copy (SOURCE.json from bench/hub_kernel_offline.sh), or None."""
    path = os.path.join(FINEGRAINED_FP8_DIR, "SOURCE.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def import_offline_kernel() -> ModuleType:
    """Import .hubkernels/finegrained_fp8 as a package, once per process.

    Once: importing it registers its triton_op's in torch.library, and a second registration of
    the same op names raises. Its modules import each other relatively (``from ._ops import``),
    as in the hub build, hence a package spec with its own search location.
    """
    init = os.path.join(FINEGRAINED_FP8_DIR, "__init__.py")
    loaded = sys.modules.get(_MODULE_NAME)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "")) == init:
        return loaded
    spec = importlib.util.spec_from_file_location(
        _MODULE_NAME, init, submodule_search_locations=[FINEGRAINED_FP8_DIR])
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_MODULE_NAME]
        raise
    return module


def register_offline_kernel(monkeypatch: "pytest.MonkeyPatch") -> ModuleType:
    """Make transformers load the local copy as if ``get_kernel`` had downloaded it.

    Only two things change, both undone by ``monkeypatch``: the module goes into
    ``hub_kernels._KERNEL_MODULE_MAPPING`` (where lazy_load_kernel caches a downloaded kernel and
    looks first), and, where the `kernels` package is absent, finegrained_fp8's own
    ``is_kernels_available`` gate says yes (it guards the download we replace; DeepGEMM's gate in
    integrations/deepgemm.py is left alone, so fp8_linear still takes the Triton path there).
    """
    from transformers.integrations import finegrained_fp8 as fg
    from transformers.integrations import hub_kernels

    module = import_offline_kernel()
    monkeypatch.setitem(hub_kernels._KERNEL_MODULE_MAPPING, _HUB_NAME, module)
    if not fg.is_kernels_available():
        monkeypatch.setattr(fg, "is_kernels_available", lambda *args, **kwargs: True)
    # A kernel resolved earlier in this process (from the hub) would be served from this cache.
    monkeypatch.setattr(fg, "_FINEGRAINED_FP8", None)
    return module


def transformers_fp8_kernel(monkeypatch: "pytest.MonkeyPatch") -> tuple[object | None, str]:
    """(the kernel bundle transformers' FP8Linear will use, where it came from), or (None, why).

    The local copy wins when present (the GPU machine has no hub); otherwise transformers' own
    loader is asked, which downloads from the hub where `kernels` and the internet are there.
    """
    from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

    source = offline_kernel_source()
    if source is not None:
        register_offline_kernel(monkeypatch)
        where = (f"offline copy of {source['repo']}/{source['path']} @ {source['commit'][:12]} "
                 f"(build version {source['build_version']}; hub unreachable)")
    else:
        where = "hub (kernels-community/finegrained-fp8 via the kernels package)"
    try:
        return load_finegrained_fp8_kernel(), where
    except ImportError as exc:
        return None, (f"transformers' FP8 GEMM kernel unavailable (no hub download and no "
                      f".hubkernels/ from bench/hub_kernel_offline.sh): {exc}")
