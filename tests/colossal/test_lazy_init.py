"""LazyInitContext: meta-device construction, materialization (standalone and at boost, one
process, every plugin), load_model filling a lazily built model, bad uses, and
``from_pretrained`` inside the context (weights read at materialization, bit-equal to eager).

The in-process boosts start fp8boost's one-process gloo group; the fixture destroys it so no
later test finds a group it did not start.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fp8boost.colossal.lazy import LazyInitContext


def _config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


def _llama(lazy: bool, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if not lazy:
        return AutoModelForCausalLM.from_config(_config(**kw))
    with LazyInitContext():
        return AutoModelForCausalLM.from_config(_config(**kw))


def test_context_builds_on_meta_and_materialize_follows_eager_init():
    lazy = _llama(lazy=True)
    tensors = list(lazy.parameters()) + list(lazy.buffers())
    assert tensors and all(t.is_meta for t in tensors)  # nothing allocated inside the context
    assert not nn.Linear(2, 2).weight.is_meta  # the context is gone after the block
    eager = _llama(lazy=False)
    assert LazyInitContext.materialize(lazy) is lazy
    got, want = lazy.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert got[name].shape == ref.shape and got[name].device.type == "cpu", name
        if ref.dim() == 1:  # rotary inv_freq tables and RMSNorm weights: exactly eager's
            assert torch.equal(got[name], ref), name
        else:  # HF _init_weights: normal(0, initializer_range=0.02), as eager
            assert abs(got[name].std().item() - 0.02) < 0.003, name
            assert abs(got[name].mean().item()) < 0.003, name
    inv = lazy.model.rotary_emb.original_inv_freq
    assert torch.equal(inv, eager.model.rotary_emb.original_inv_freq)
    # Deterministic under the same seed at materialization (so ranks seeded alike agree).
    again = _llama(lazy=True)
    torch.manual_seed(0)
    LazyInitContext.materialize(again)
    torch.manual_seed(0)
    LazyInitContext.materialize(lazy := _llama(lazy=True))
    assert all(torch.equal(a, b) for a, b in zip(lazy.state_dict().values(),
                                                 again.state_dict().values()))


def test_materialize_keeps_ties_and_default_device_and_refuses_bad_models():
    tied = LazyInitContext.materialize(_llama(lazy=True, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    with LazyInitContext(default_device="cpu") as ctx:
        layer = nn.Linear(3, 3)
        with pytest.raises(RuntimeError, match="already entered"):
            ctx.__enter__()
    assert LazyInitContext.materialize(layer, verbose=True).weight.device.type == "cpu"
    with pytest.raises(TypeError, match="nn.Module"):
        LazyInitContext.materialize(torch.zeros(2))
    with LazyInitContext():
        mixed = nn.Sequential(nn.Linear(2, 2))
    mixed.append(nn.Linear(2, 2))  # real, beside meta
    with pytest.raises(ValueError, match="build the whole model on the meta device"):
        LazyInitContext.materialize(mixed)


def test_boost_refuses_a_half_meta_model_before_any_group():
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin

    with LazyInitContext():
        mixed = nn.Sequential(nn.Linear(2, 2))
    mixed.append(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="real while others are on the meta device"):
        Booster(plugin=LowLevelZeroPlugin(precision="fp32")).boost(mixed)
    assert not dist.is_initialized()


PLUGINS = {
    "LowLevelZeroPlugin": dict(stage=2, precision="fp32"),
    "TorchDDPPlugin": {},
    "HybridParallelPlugin": dict(tp_size=1, pp_size=1, precision="fp32"),
    "GeminiPlugin": dict(precision="fp32"),
    "TorchFSDPPlugin": {},
}


@pytest.mark.parametrize("plugin_name", list(PLUGINS))
def test_boost_materializes_trains_and_load_model_fills(group, tmp_path, plugin_name):
    """Colossal-AI's script order: lazy build -> optimizer on it -> boost -> a step ->
    booster.load_model(model, hf_folder): the outputs equal an eager model loaded from it."""
    from transformers import AutoModelForCausalLM

    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster import plugin as plugins
    from fp8boost.colossal.nn.optimizer import HybridAdam

    _llama(lazy=False, seed=1).save_pretrained(tmp_path)
    model = _llama(lazy=True)
    optimizer = HybridAdam(model.parameters(), lr=1e-2)
    booster = Booster(plugin=getattr(plugins, plugin_name)(**PLUGINS[plugin_name]))
    model, optimizer, *_ = booster.boost(model, optimizer)
    assert not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    ids = torch.randint(0, 64, (2, 8))
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[1] < losses[0], losses  # the optimizer steps the materialized parameters
    booster.load_model(model, str(tmp_path))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, want in reference.state_dict().items():  # every weight bit-exactly the file's
        got = model.unwrap().state_dict()[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert torch.equal(got, want), name
    with torch.no_grad():
        got = model(input_ids=ids).logits
        want = reference(input_ids=ids).logits
    if got.dtype == torch.float32:
        assert torch.equal(got, want), (got - want).abs().max()
    else:  # TorchFSDPPlugin computes in bf16 by default
        assert torch.allclose(got.float(), want, atol=2e-2), (got.float() - want).abs().max()


# ------------------------------------------------------- from_pretrained inside the context
def _saved(tmp_path, seed: int = 1, **kw) -> str:
    _llama(lazy=False, seed=seed, **kw).save_pretrained(tmp_path)
    return str(tmp_path)


def test_from_pretrained_in_context_builds_on_meta_and_materialize_loads(tmp_path):
    """Colossal-LLaMA's ``with LazyInitContext(): AutoModelForCausalLM.from_pretrained(...)``:
    nothing is read inside the context, the method is restored on exit (also on an exception),
    and ``materialize`` fills the model bit-exactly as eager ``from_pretrained`` (ties kept)."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    path = _saved(tmp_path, tie_word_embeddings=True)
    original = PreTrainedModel.__dict__["from_pretrained"]
    with LazyInitContext():
        assert PreTrainedModel.__dict__["from_pretrained"] is not original
        lazy = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    assert PreTrainedModel.__dict__["from_pretrained"] is original
    assert all(t.is_meta for t in [*lazy.parameters(), *lazy.buffers()])
    assert not lazy.training  # eval mode, as from_pretrained leaves it
    with pytest.raises(ZeroDivisionError):
        with LazyInitContext():
            1 / 0
    assert PreTrainedModel.__dict__["from_pretrained"] is original
    with LazyInitContext(), pytest.raises(ValueError, match="device_map"):
        AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    assert PreTrainedModel.__dict__["from_pretrained"] is original
    eager = AutoModelForCausalLM.from_pretrained(path)
    assert LazyInitContext.materialize(lazy) is lazy
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    got, want = lazy.state_dict(), eager.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(lazy(input_ids=ids).logits, eager(input_ids=ids).logits)


PRETRAINED_PLUGINS = {
    "LowLevelZeroPlugin": dict(stage=2),
    "TorchDDPPlugin": {},
    "HybridParallelPlugin": dict(tp_size=1, pp_size=1),
    "GeminiPlugin": {},
}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("plugin_name", list(PRETRAINED_PLUGINS))
def test_boost_loads_lazy_from_pretrained(group, tmp_path, plugin_name, dtype):
    """Lazy ``from_pretrained`` -> optimizer -> boost: every parameter equals eager
    ``from_pretrained``'s (its upcast where the plugin keeps FP32), bit for bit, and the
    logits equal those of the eager model boosted alike (of the plain eager model in fp32)."""
    from transformers import AutoModelForCausalLM

    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.booster import plugin as plugins
    from fp8boost.colossal.nn.optimizer import HybridAdam

    path = _saved(tmp_path)
    kw = {} if dtype is None else dict(torch_dtype=dtype)
    options = dict(PRETRAINED_PLUGINS[plugin_name])
    if plugin_name != "TorchDDPPlugin":
        options["precision"] = "fp32" if dtype is None else "bf16"

    def boosted(lazy: bool):
        if lazy:
            with LazyInitContext(default_device="cpu"):
                model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kw)
            assert all(p.is_meta for p in model.parameters())
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kw)
        model.train()
        optimizer = HybridAdam(model.parameters(), lr=1e-2)
        booster = Booster(plugin=getattr(plugins, plugin_name)(**options))
        return booster.boost(model, optimizer)[0]

    model = boosted(lazy=True)
    eager = AutoModelForCausalLM.from_pretrained(path, **kw)
    state = model.unwrap().state_dict()
    for name, want in eager.state_dict().items():
        got = state[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert got.dtype in (want.dtype, torch.float32), (name, got.dtype)
        assert torch.equal(got, want.to(got.dtype)), name  # exactly representable: bit-equal
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        if dtype is None:
            want = eager(input_ids=ids).logits
        else:  # bf16 compute: the eager model through the same plugin
            want = boosted(lazy=False)(input_ids=ids).logits
    assert torch.equal(got, want), (got.float() - want.float()).abs().max()
