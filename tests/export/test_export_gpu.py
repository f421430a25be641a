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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_block_export_loads_in_transformers_fp8(tmp_path, kind):
    from transformers import AutoModelForCausalLM
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
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.bfloat16,
                                               device_map="cuda")
    fp8 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.bfloat16,
                                               device_map="cuda")
    q = fp8.model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float8_e4m3fn, type(q)  # not dequantized: runs FP8 GEMMs
    assert tuple(q.weight_scale_inv.shape) == (2, 2)
    a, b = _loss_cuda(ref), _loss_cuda(fp8)
    print(f"{kind}: bf16 export {a:.4f}, fp8 block export via transformers FP8 {b:.4f} "
          f"({100 * (b / a - 1):+.3f}%)")
    assert abs(b / a - 1) < 0.01
