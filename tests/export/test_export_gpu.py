"""GPU: the block FP8 export loads through transformers' own FP8 support (FP8Linear, Triton
block GEMMs) on CUDA, and its held-back loss is within 1% of the BF16 export's (issue 28).

Run on the device machine: ``pytest -q tests/export/test_export_gpu.py -s``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from tests.export import helpers as H

pytestmark = pytest.mark.gpu


@torch.no_grad()
def _loss_cuda(model) -> float:
    model.eval()
    losses = [model(input_ids=ids.cuda(), labels=ids.cuda()).loss.float()
              for ids in H.batches(H.split()[1], 6, seed=1)]
    return float(torch.stack(losses).mean())


def _exports(tmp_path, kind):
    from fp8boost.booster import Booster
    raw = H.make(kind, hidden=256, inter=512)  # every dim a multiple of 128 (block kernels)
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-3)
    for ids in H.batches(H.split()[0], 30):
        raw(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    booster = Booster(mixed_precision="bf16", device="cpu")
    model, *_ = booster.boost(copy.deepcopy(raw))
    booster.save_model(model, str(tmp_path / "bf16"))
    booster.save_model(model, str(tmp_path / "fp8"), fp8_export="block")
    return str(tmp_path / "bf16"), str(tmp_path / "fp8")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_block_export_loads_in_transformers_fp8(tmp_path, kind):
    """FP8Linear modules with our FP8 weights on CUDA, their FP8 GEMMs within 1% of BF16.

    transformers takes its FP8 GEMMs (DeepGEMM, Triton finegrained-fp8) from the ``kernels``
    hub; where they cannot be fetched the forward is skipped, and the dequantized load below
    still checks the loss on the GPU.
    """
    from transformers import AutoModelForCausalLM
    bf16, fp8_path = _exports(tmp_path, kind)
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, device_map="cuda")
    fp8 = AutoModelForCausalLM.from_pretrained(fp8_path, dtype=torch.bfloat16, device_map="cuda")
    q = fp8.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float8_e4m3fn, type(q)  # not dequantized: runs FP8 GEMMs
    assert tuple(q.weight_scale_inv.shape) == (2, 2)
    a = _loss_cuda(ref)
    try:
        b = _loss_cuda(fp8)
    except ImportError as exc:  # the hub kernels are not installed / reachable
        pytest.skip(f"transformers' FP8 GEMM kernels unavailable here: {exc}")
    print(f"{kind}: bf16 export {a:.4f}, fp8 block export via transformers FP8 {b:.4f} "
          f"({100 * (b / a - 1):+.3f}%)")
    assert abs(b / a - 1) < 0.01


def test_block_export_dequantized_by_transformers_on_cuda(tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    bf16, fp8_path = _exports(tmp_path, "llama")
    ref = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16, device_map="cuda")
    deq = AutoModelForCausalLM.from_pretrained(
        fp8_path, dtype=torch.bfloat16, device_map="cuda",
        quantization_config=FineGrainedFP8Config(dequantize=True))
    a, b = _loss_cuda(ref), _loss_cuda(deq)
    print(f"llama: bf16 export {a:.4f}, fp8 block export dequantized by transformers {b:.4f}")
    assert abs(b / a - 1) < 0.01
