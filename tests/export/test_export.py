"""FP8 exports (issue 28): format, bit-exact bytes, shared scales, loaders, quality, atomicity."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from fp8boost.booster import Booster
from fp8boost.export import load_dequantized
from fp8boost.export.loader import read_fp8_state
from fp8boost.fp8.granular.quantize import quantize_blocks, quantize_rows
from fp8boost.fp8.scaling import E4M3, cast_to_fp8, scale_from_amax
from tests.export import helpers as H

LAYOUTS = ("per_tensor", "block", "compressed_tensors")
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def models():
    return {k: H.trained(k) for k in ("llama", "qwen2", "gpt2")}


def _boosted(raw):
    booster = Booster(mixed_precision="bf16", device="cpu")
    model, *_ = booster.boost(raw)
    return booster, model


def _export(models, kind, tmp_path, layout, **kw):
    import copy
    booster, model = _boosted(copy.deepcopy(models[kind]))
    path = str(tmp_path / f"{kind}_{layout}_{kw.get('weight_strategy', '')}")
    booster.save_model(model, path, fp8_export=layout, **kw)
    return path, model.unwrap()


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["quantization_config"]


def test_format_per_tensor(models, tmp_path):
    path, _ = _export(models, "llama", tmp_path, "per_tensor")
    assert _config(path) == {"quant_method": "fp8", "activation_scheme": "dynamic",
                             "ignored_layers": ["lm_head"]}
    sd = read_fp8_state(path)
    q = "model.layers.0.self_attn.q_proj."
    assert sd[q + "weight"].dtype == FP8 and sd[q + "weight"].shape == (128, 128)
    assert sd[q + "weight_scale"].dtype == torch.float32 and sd[q + "weight_scale"].shape == ()
    for k in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
              "model.layers.0.input_layernorm.weight"):
        assert sd[k].dtype == torch.bfloat16, k
    assert not [k for k in sd if k.endswith(("input_scale", "k_scale"))]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert set(json.load(f)["weight_map"]) == set(sd)


def test_format_block(models, tmp_path):
    path, _ = _export(models, "llama", tmp_path, "block")
    assert _config(path) == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128], "ignored_layers": ["lm_head"]}
    sd = read_fp8_state(path)
    up, down = "model.layers.0.mlp.up_proj.", "model.layers.0.mlp.down_proj."
    assert sd[up + "weight"].shape == (384, 128) and sd[up + "weight_scale_inv"].shape == (3, 1)
    assert sd[down + "weight_scale_inv"].shape == (1, 3)
    assert sd[up + "weight_scale_inv"].dtype == torch.float32


@pytest.mark.parametrize("strategy,shape", [("tensor", (1,)), ("channel", (384, 1)),
                                            ("block", (3, 1))])
def test_format_compressed_tensors(models, tmp_path, strategy, shape):
    from compressed_tensors.quantization import QuantizationConfig
    path, _ = _export(models, "llama", tmp_path, "compressed_tensors", weight_strategy=strategy)
    cfg = _config(path)
    parsed = QuantizationConfig.model_validate(cfg)  # its own schema
    assert parsed.format == "float-quantized" and parsed.ignore == ["lm_head"]
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == strategy
    sd = read_fp8_state(path)
    up = "model.layers.0.mlp.up_proj."
    assert sd[up + "weight"].dtype == FP8 and tuple(sd[up + "weight_scale"].shape) == shape


def _training_cast(w, strategy, group_amax=None):
    if strategy == "tensor":
        s = scale_from_amax(w.abs().amax().float() if group_amax is None else group_amax, E4M3)
        return cast_to_fp8(w, s, E4M3), s.reciprocal()
    r = quantize_rows(w, E4M3) if strategy == "channel" else quantize_blocks(w, E4M3, block=128)
    return r.data, r.inv_scale


@pytest.mark.parametrize("layout,strategy", [("per_tensor", "tensor"), ("block", "block"),
                                             ("compressed_tensors", "channel")])
def test_bytes_are_the_training_cast(models, tmp_path, layout, strategy):
    kw = {"weight_strategy": strategy} if layout == "compressed_tensors" else {}
    path, module = _export(models, "llama", tmp_path, layout, **kw)
    sd, params = read_fp8_state(path), dict(module.named_parameters())
    attn = "model.layers.1.self_attn."
    group = max(params[attn + p + ".weight"].detach().abs().amax().float()
                for p in ("q_proj", "k_proj", "v_proj"))
    for name in ("q_proj", "o_proj"):
        key = attn + name + ".weight"
        shared = group if strategy == "tensor" and name == "q_proj" else None
        q, s = _training_cast(params[key].detach(), strategy, shared)
        assert torch.equal(sd[key].view(torch.uint8), q.view(torch.uint8)), key
        scale = sd[key[:-len("weight")] + ("weight_scale_inv" if layout == "block" else
                                            "weight_scale")]
        assert torch.equal(scale.reshape(s.shape), s), key


def test_shared_qkv_and_gate_up_scales(models, tmp_path):
    path, _ = _export(models, "qwen2", tmp_path, "per_tensor")
    sd = read_fp8_state(path)
    for i in range(2):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [sd[a + p + ".weight_scale"] for p in ("q_proj", "k_proj", "v_proj")]
        assert qkv[0] == qkv[1] == qkv[2]
        assert sd[m + "gate_proj.weight_scale"] == sd[m + "up_proj.weight_scale"]
        assert sd[a + "o_proj.weight_scale"] != qkv[0]  # not one scale for everything
        assert sd[a + "q_proj.bias"].dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_quality_within_one_percent(models, tmp_path, kind):
    import copy
    from transformers import AutoModelForCausalLM
    booster, model = _boosted(copy.deepcopy(models[kind]))
    booster.save_model(model, str(tmp_path / "bf16"))
    ref = H.held_back_loss(AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"),
                                                                dtype=torch.float32))
    for layout in LAYOUTS:
        path = str(tmp_path / layout)
        booster.save_model(model, path, fp8_export=layout)
        loss = H.held_back_loss(load_dequantized(path))
        print(f"{kind} {layout}: bf16 export {ref:.4f}, fp8 dequantized {loss:.4f} "
              f"({100 * (loss / ref - 1):+.3f}%)")
        assert abs(loss / ref - 1) < 0.01, (kind, layout, loss, ref)


def test_gpt2_conv1d_layout(models, tmp_path):
    path, module = _export(models, "gpt2", tmp_path, "block")
    sd = read_fp8_state(path)
    w = module.transformer.h[0].mlp.c_fc.weight  # Conv1D: [in=128, out=512]
    assert sd["transformer.h.0.mlp.c_fc.weight"].shape == w.shape == (128, 512)
    assert sd["transformer.h.0.mlp.c_fc.weight_scale_inv"].shape == (4, 1)  # [out/128, in/128]
    q = quantize_blocks(w.detach().t(), E4M3, block=128)
    assert torch.equal(sd["transformer.h.0.mlp.c_fc.weight"].t().view(torch.uint8),
                       q.data.view(torch.uint8))


def test_compressed_tensors_own_loader(models, tmp_path):
    """transformers' compressed-tensors integration (``dequantize``) reads the same weights."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    path, _ = _export(models, "llama", tmp_path, "compressed_tensors", weight_strategy="channel")
    theirs = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(run_compressed=False),
        dtype=torch.float32)
    ours = load_dequantized(path).state_dict()
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, ours[k]), k


def test_block_through_transformers_fp8_on_cpu(models, tmp_path):
    """transformers' FineGrainedFP8 loader dequantizes to BF16 on a machine without a GPU."""
    from transformers import AutoModelForCausalLM
    path, _ = _export(models, "llama", tmp_path, "block")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ours = load_dequantized(path).state_dict()
    for k, v in theirs.state_dict().items():
        assert torch.equal(v, ours[k].to(v.dtype)), k


def test_static_and_kv_scales(models, tmp_path):
    cal = [{"input_ids": ids} for ids in H.batches(H.split()[0], 2)]
    path, module = _export(models, "llama", tmp_path, "per_tensor", activation_scheme="static",
                           kv_cache_scales=True, calibration_batches=cal)
    assert _config(path)["activation_scheme"] == "static"
    sd = read_fp8_state(path)
    seen = {}
    hook = module.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda m, a, o: seen.update(x=max(seen.get("x", 0), float(a[0].abs().amax())),
                                    k=max(seen.get("k", 0), float(o.abs().amax()))))
    with torch.no_grad():
        for b in cal:
            module(**b)
    hook.remove()
    a = "model.layers.0.self_attn."
    assert sd[a + "k_proj.input_scale"].shape == () and sd[a + "k_scale"].shape == ()
    assert float(sd[a + "k_proj.input_scale"]) == pytest.approx(seen["x"] / 448, rel=1e-6)
    assert float(sd[a + "k_scale"]) == pytest.approx(seen["k"] / 448, rel=1e-6)
    assert sd[a + "q_proj.input_scale"] == sd[a + "k_proj.input_scale"]
    assert "lm_head.input_scale" not in sd


@pytest.mark.parametrize("kw,match", [
    ({"fp8_export": "int8"}, "fp8_export must be one of"),
    ({"fp8_export": "block", "activation_scheme": "static"}, "needs per-tensor"),
    ({"fp8_export": "per_tensor", "activation_scheme": "static"}, "calibration_batches"),
    ({"fp8_export": "block", "weight_strategy": "channel"}, "not available"),
    ({"fp8_export": "per_tensor", "kv_cache_scales": 1}, "must be a bool")])
def test_bad_arguments(kw, match, tmp_path):
    booster, model = _boosted(H.make("llama", hidden=64, inter=64))
    with pytest.raises((ValueError, TypeError), match=match):
        booster.save_model(model, str(tmp_path / "x"), **kw)
    assert not os.path.exists(tmp_path / "x")


def test_failed_export_keeps_previous(tmp_path, monkeypatch):
    from fp8boost.export import writer
    booster, model = _boosted(H.make("llama", hidden=64, inter=64))
    path = str(tmp_path / "ckpt")
    booster.save_model(model, path, fp8_export="per_tensor")
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}

    def broken(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(writer, "convert", broken)
    with pytest.raises(Exception, match="No space left"):
        booster.save_model(model, path, fp8_export="block")
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
    assert [d for d in os.listdir(tmp_path) if d != "ckpt"] == []
    with safe_open(os.path.join(path, "model-00001-of-00001.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.up_proj.weight_scale" in f.keys()


def test_one_file_and_small_shards(tmp_path):
    booster, model = _boosted(H.make("llama", hidden=64, inter=64))
    one = str(tmp_path / "one")
    booster.save_model(model, one, shard=False, fp8_export="block")
    assert sorted(f for f in os.listdir(one) if f.endswith(".safetensors")) == \
        ["model.safetensors"]
    many = str(tmp_path / "many")
    booster.save_model(model, many, fp8_export="block", size_per_shard_mb=0.02)
    with open(os.path.join(many, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) >= 3
    assert index["weight_map"].keys() == read_fp8_state(one).keys()
    a, b = read_fp8_state(one), read_fp8_state(many)
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)
