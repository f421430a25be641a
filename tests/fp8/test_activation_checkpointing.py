"""FP8 layers under activation checkpointing (recomputation), one process.

The oracle: the same model trained without checkpointing. Recomputation must not change a single
bit, whatever form it takes (HF's switch, ``torch.utils.checkpoint`` reentrant or not, torch's
selective activation checkpointing, compiled blocks), with the weight-cast cache on and with
gradient accumulation (the cache's second-forward path). Regression: HF's
``gradient_checkpointing_enable()`` with the default Fp8Config raised ``CheckpointError:
Recomputed values ... have different metadata`` in backward (the forward saved the BF16 weight
for dgrad's re-cast, the recomputation found a cached cast and saved its FP8 transpose).
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from fp8boost.fp8 import Fp8Config, Fp8Linear, convert_to_fp8
from fp8boost.fp8.recompute import recomputing

from tests.plugins.hybrid_cases import VOCAB, tiny_model

SEQ = 16


def _batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * step + micro)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    ids[0, 0] = 7  # one id repeated: its embedding row is an activation outlier below
    return ids


def _fp8_model(recipe: str = "tensorwise"):
    model = tiny_model("llama", layers=2).to(torch.bfloat16)
    with torch.no_grad():  # an outlier column, so scales are not all alike
        model.model.embed_tokens.weight[7].mul_(50.0)
    report = convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0, recipe=recipe))
    assert len(report.converted) == 14  # 7 linears per block, lm_head stays BF16
    return model


def _train(model, steps: int = 2, micro: int = 2, ckpt=None,
           device: str = "cpu") -> tuple[list, list]:
    """AdamW steps with ``micro`` accumulated micro-batches; ``ckpt(layer, hidden, **kw)``
    replaces each decoder layer's call when given. Returns the losses and final weights."""
    if ckpt is not None:
        for layer in model.model.layers:
            layer.forward = functools.partial(ckpt, layer.__class__.forward.__get__(layer))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        for m in range(micro):
            ids = _batch(s, m).to(device)
            loss = model(input_ids=ids, labels=ids).loss / micro
            loss.backward()
            losses.append(loss.detach().float())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses).cpu(), [p.detach().clone() for p in model.parameters()]


def _same(a, b) -> None:
    la, wa = a
    lb, wb = b
    assert torch.equal(la, lb), (la, lb)
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))


def _hf_switch(model, reentrant: bool):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def _torch_ckpt(reentrant: bool):
    def call(fwd, *args, **kwargs):
        return checkpoint(functools.partial(fwd, **kwargs), *args, use_reentrant=reentrant)
    return call


def _sac(fwd, *args, **kwargs):
    """Selective activation checkpointing: keep matmul outputs, recompute everything else."""
    def policy(ctx, op, *a, **k):
        return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default,
                                                    torch.ops.aten.addmm.default) \
            else CheckpointPolicy.PREFER_RECOMPUTE
    return checkpoint(functools.partial(fwd, **kwargs), *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_checkpointed_training_is_bit_identical(recipe):
    base = _fp8_model(recipe)
    ref = _train(copy.deepcopy(base))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning on these paths
        _same(_train(_hf_switch(copy.deepcopy(base), reentrant=False)), ref)
        _same(_train(copy.deepcopy(base), ckpt=_torch_ckpt(False)), ref)
        _same(_train(copy.deepcopy(base), ckpt=_sac), ref)
        if recipe == "tensorwise":
            _same(_train(_hf_switch(copy.deepcopy(base), reentrant=True)), ref)
            _same(_train(copy.deepcopy(base), ckpt=_torch_ckpt(True)), ref)


def test_delayed_scaling_reentrant_warns_instead_of_guessing():
    """A reentrant checkpoint runs the forward under no_grad: delayed scaling has no scale to
    replay, says so, and still trains (with the current scale)."""
    from fp8boost import _state
    _state.reset()
    model = _fp8_model("delayed")
    with pytest.warns(UserWarning, match="recorded no scale"):
        losses, _ = _train(model, steps=1, ckpt=_torch_ckpt(True))
    assert torch.isfinite(losses).all()


def test_recomputed_casts_equal_the_forward_casts():
    """Spy on every cast: each recomputed input/weight cast repeats a forward cast bit for bit,
    and recomputation pins no weight cast in the cache (memory is what checkpointing buys)."""
    model = _fp8_model()
    _hf_switch(model, reentrant=False)
    fwd, rec = [], []
    originals = {}
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            def spy(role, x, dtype, with_transpose, replay_scale=None, _orig=mod.casts.quantize,
                    _mod=mod):
                q = _orig(role, x, dtype, with_transpose, replay_scale)
                if role != "grad":
                    (rec if recomputing() else fwd).append((id(_mod), role, q.data.clone(),
                                                            q.inv_scale.clone()))
                return q
            originals[mod] = mod.casts.quantize
            mod.casts.quantize = spy
    ids = _batch(0, 0)
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(rec) == len(fwd) > 0
    key = lambda c: (c[0], c[1])  # noqa: E731
    fwd_by = {key(c): c for c in fwd}
    for c in rec:
        f = fwd_by[key(c)]
        assert torch.equal(c[2].view(torch.uint8), f[2].view(torch.uint8))
        assert torch.equal(c[3], f[3])
    assert all(m.operands.cache is None or m.operands.cache[1] is None for m in originals)


def test_compiled_blocks_with_checkpointing_match_uncheckpointed():
    """Each block compiled (as the library compiles them) under HF's switch."""
    torch._dynamo.reset()
    base = _fp8_model()

    def compiled(model):
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        return model

    ref = _train(compiled(copy.deepcopy(base)), steps=1)
    got = _train(compiled(_hf_switch(copy.deepcopy(base), reentrant=False)), steps=1)
    _same(got, ref)


def _cuda_model(layers: int = 2):
    """A Llama with 256-wide layers on the GPU, every linear FP8 through the default (Triton)
    backend."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers,
                                   vocab_size=VOCAB, max_position_embeddings=64, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[7].mul_(50.0)
    report = convert_to_fp8(model, Fp8Config(min_numel=0))
    assert len(report.converted) == 7 * layers
    return model



@pytest.mark.gpu
def test_gpu_checkpointing_bit_identical_eager_and_compiled():
    """The Triton casts and GEMMs: HF's switch and selective AC change no bit, eager and with
    every block compiled by inductor (fp8boost.compile.compile_blocks)."""
    from fp8boost.compile import compile_blocks

    base = _cuda_model()
    ref = _train(copy.deepcopy(base), device="cuda")
    _same(_train(_hf_switch(copy.deepcopy(base), reentrant=False), device="cuda"), ref)
    _same(_train(copy.deepcopy(base), ckpt=_sac, device="cuda"), ref)
    torch._dynamo.reset()
    plain, ckpt = copy.deepcopy(base), _hf_switch(copy.deepcopy(base), reentrant=False)
    compile_blocks(plain)
    compile_blocks(ckpt)
    _same(_train(ckpt, device="cuda"), _train(plain, device="cuda"))
