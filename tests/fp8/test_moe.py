"""FP8 experts of transformers MoE models (``fp8boost.fp8.moe``), on CPU with the emulated backend.

Tolerances. The grouped path is checked two ways. Against a per-expert loop of the same
quantize/dequantize math (granular ``quantize_rows`` + FP32 matmul) it must agree to FP32
summation order (rtol 1e-5): routing, scales and the three GEMMs are then exactly the recipe.
Against the HF module in FP32 it differs by FP8 rounding: e4m3 keeps 3 mantissa bits (up to
6% per element, ~3.6% RMS); two quantized operands per GEMM and two GEMMs in a row give a
measured relative (Frobenius) error of 0.03-0.08 on random data with outliers; we allow 0.12.
"""
import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

from fp8boost.fp8 import Fp8Config, convert_from_fp8, convert_to_fp8
from fp8boost.fp8.granular.quantize import quantize_rows
from fp8boost.fp8.moe import (Fp8Experts, GroupedOptions, find_expert_spec, fp8_experts,
                              grouped_linear, route)
from fp8boost.fp8.moe.gemm import emulated_mm, emulated_mm_wgrad, resolve_backend

transformers = pytest.importorskip("transformers")

EMU = Fp8Config(backend="emulated", min_numel=0)
HF_TOL = 0.12
COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def family_config(name: str, **extra):
    t = transformers
    if name == "mixtral":
        return t.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                               num_experts_per_tok=2, **extra)
    if name == "qwen2_moe":
        return t.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32,
                                shared_expert_intermediate_size=64, num_experts=4,
                                num_experts_per_tok=2, **extra)
    if name == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=32,
                                num_experts=4, num_experts_per_tok=2, head_dim=16, **extra)
    if name == "deepseek_v3":
        return t.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64,
                                  moe_intermediate_size=32, n_routed_experts=4,
                                  num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                  q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                                  v_head_dim=16, **extra)
    assert name == "olmoe"
    return t.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         **extra)


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe")
EXPERT_LAYERS = {"deepseek_v3": 1}  # first_k_dense_replace=1: layer 0 is a dense MLP


def tiny(name: str, **extra):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(family_config(name, **extra))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def qd(t):
    return quantize_rows(t).dequantize()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_converts_its_experts_keeping_names_and_parameters(family):
    model = tiny(family)
    before = {n: (p, tuple(p.shape)) for n, p in model.named_parameters()}
    specs = {n: find_expert_spec(m) for n, m in model.named_modules()}
    found = sorted(n for n, s in specs.items() if s is not None)
    n_layers = EXPERT_LAYERS.get(family, 2)
    assert len(found) == n_layers and all(n.endswith("mlp.experts") for n in found), found
    report = convert_to_fp8(model, EMU)
    assert sorted(report.experts) == found
    assert f"and {n_layers} expert module(s)" in str(report)
    assert all(isinstance(model.get_submodule(n), Fp8Experts) for n in found)
    # Shared experts / dense MLPs are linears; the routers are not nn.Linear in transformers 5.
    assert any(".mlp." in n for n in report.converted) or family in ("mixtral", "qwen3_moe",
                                                                    "olmoe")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p for n, (p, _) in before.items())  # the same Parameter objects
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(after[n].grad is not None for n in after if n.endswith("experts.gate_up_proj"))
    assert convert_from_fp8(model) >= n_layers
    assert not fp8_experts(model)
    assert all(dict(model.named_parameters())[n] is p for n, (p, _) in before.items())


def grouped_loop_reference(x, w, idx):
    """Per-expert loop of the same math: y, and the three GEMMs' operands via autograd-free
    formulas (dx, dW) for an upstream gradient of ones scaled per row."""
    rows = [torch.where(idx.reshape(-1) == e)[0] for e in range(w.shape[0])]
    xs = x.repeat_interleave(idx.shape[1], 0)
    y = torch.zeros(xs.shape[0], w.shape[1])
    dy = torch.linspace(-1, 2, xs.shape[0]).unsqueeze(1) * torch.randn(
        1, w.shape[1], generator=torch.Generator().manual_seed(3))
    dx, dw = torch.zeros_like(xs), torch.zeros_like(w)
    for e, r in enumerate(rows):
        if len(r) == 0:
            continue
        y[r] = qd(xs[r]) @ qd(w[e]).T
        dx[r] = qd(dy[r]) @ qd(w[e].T).T
        dw[e] = qd(dy[r].T.contiguous()) @ qd(xs[r].T.contiguous()).T
    return y, dy, dx, dw


@pytest.mark.parametrize("assign", ["random", "one_expert", "empty"])
def test_grouped_linear_is_exactly_the_rowwise_recipe_per_expert(assign):
    g = torch.Generator().manual_seed(0)
    t, k, e = (0, 2, 3) if assign == "empty" else (24, 2, 3)
    x = torch.randn(t, 32, generator=g)
    if t:
        x[5, 3] = 80.0  # an outlier: its row's scale only
    w = torch.randn(e, 48, 32, generator=g)
    idx = (torch.randint(0, e, (t, k), generator=g) if assign == "random"
           else torch.full((t, k), 1))
    r = route(idx, e)
    xr = x.repeat_interleave(k, 0).requires_grad_()
    wp = w.clone().requires_grad_()
    rows = torch.zeros(r.rows, 32).index_copy(0, r.pos, xr)
    y = grouped_linear(rows, wp, r, GroupedOptions())
    y_ref, dy, dx_ref, dw_ref = grouped_loop_reference(x, w, idx)
    y[r.pos].backward(dy)
    torch.testing.assert_close(y[r.pos], y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xr.grad, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wp.grad, dw_ref, rtol=1e-5, atol=1e-5)
    assert (y[r.group == e] == 0).all()  # rows of no expert
    if assign == "one_expert":
        assert (wp.grad[0] == 0).all() and (wp.grad[2] == 0).all()


def test_batched_emulation_equals_grouped_mm_emulation():
    # The emulated path off CPU (one bmm over padded experts) against CPU's torch._grouped_mm.
    g = torch.Generator().manual_seed(1)
    r = route(torch.randint(0, 4, (30, 2), generator=g), 4)
    e4 = torch.float8_e4m3fn
    a, b = torch.randn(r.rows, 32, generator=g).to(e4), torch.randn(4, 16, 32, generator=g).to(e4)
    ai, bi = torch.rand(r.rows, generator=g), torch.rand(4, 16, generator=g)
    valid = (r.group < 4).unsqueeze(1)
    args = (a, ai, b, bi, r.offsets, r.group, r.local)
    torch.testing.assert_close(torch.where(valid, emulated_mm(*args, grouped=True), 0),
                               torch.where(valid, emulated_mm(*args, grouped=False), 0))
    wa = torch.randn(16, r.rows, generator=g).to(e4)
    wb = torch.randn(32, r.rows, generator=g).to(e4)
    wai, wbi = torch.rand(4, 16, generator=g), torch.rand(4, 32, generator=g)
    wargs = (wa, wai, wb, wbi, r.offsets, r.group, r.local)
    torch.testing.assert_close(emulated_mm_wgrad(*wargs, grouped=True),
                               emulated_mm_wgrad(*wargs, grouped=False))


def hf_and_fp8_experts(family: str, dtype=torch.float32):
    model = tiny(family)
    hf = next(m for m in model.modules() if find_expert_spec(m) is not None)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    hf = hf.to(dtype)
    ref = copy.deepcopy(hf)
    return ref, Fp8Experts(hf, find_expert_spec(hf), EMU)


@pytest.mark.parametrize("family,route_to", [("mixtral", "random"), ("qwen3_moe", "random"),
                                             ("deepseek_v3", "one_expert")])
def test_fp8_experts_match_the_hf_module_forward_and_backward(family, route_to):
    ref, fp8 = hf_and_fp8_experts(family)
    g = torch.Generator().manual_seed(2)
    t = 40
    x = torch.randn(t, 64, generator=g)
    x[3, 5] = 30.0  # outlier
    idx = (torch.randint(0, 4, (t, 2), generator=g) if route_to == "random"
           else torch.tensor([[2, 3]]).expand(t, 2))  # experts 0 and 1 get no token
    w = torch.rand(t, 2, generator=g)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y1 = ref(x1, idx, w)
    y2 = fp8(x2, idx, w)
    dy = torch.randn(y1.shape, generator=g)
    y1.backward(dy)
    y2.backward(dy)
    assert rel(y2, y1) < HF_TOL
    assert rel(x2.grad, x1.grad) < HF_TOL
    for name in ("gate_up_proj", "down_proj"):
        got, want = getattr(fp8, name).grad, getattr(ref, name).grad
        assert rel(got, want) < HF_TOL, name
        if route_to == "one_expert":
            assert (got[:2] == 0).all()


def test_bf16_experts_and_sentinel_ids():
    ref, fp8 = hf_and_fp8_experts("qwen3_moe", torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(16, 64, generator=g).bfloat16()
    idx = torch.randint(0, 4, (16, 2), generator=g)
    w = torch.rand(16, 2, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y_ref = ref(x, idx, w)
    y = fp8(x, idx, w)
    assert y.dtype == torch.bfloat16 and rel(y, y_ref) < HF_TOL
    # An expert id of E (HF's expert-parallel sentinel) contributes nothing, as in HF's loop:
    # the same as routing each token to its first choice alone.
    idx2 = idx.clone()
    idx2[:, 1] = 4
    torch.testing.assert_close(fp8(x, idx2, w), fp8(x, idx[:, :1], w[:, :1]))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_tiny_moe_trains_with_use_fp8_and_keeps_its_aux_loss(family):
    from fp8boost.booster import Booster
    from fp8boost.booster.mixed_precision import MixedPrecision
    model = tiny(family, output_router_logits=True, router_aux_loss_coef=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    booster = Booster(mixed_precision=MixedPrecision("fp8", EMU), device="cpu")
    model, opt, *_ = booster.boost(model, opt)
    assert len(fp8_experts(model)) == 2
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(6):
        out = model(input_ids=ids, labels=ids)
        assert out.aux_loss is not None and torch.isfinite(out.aux_loss)
        # The model's own total: LM loss + coef * its load-balancing loss.
        lm = nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(),
                                         ids[:, 1:].flatten())
        assert abs(out.loss.item() - (lm.item() + 0.01 * out.aux_loss.item())) < 0.02
        booster.backward(out.loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.3, losses


def test_save_pretrained_round_trip_keeps_hf_names_and_shapes(tmp_path):
    model = tiny("qwen3_moe")
    convert_to_fp8(model, EMU)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj.add_(1.0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_state = loaded.state_dict()
    assert loaded_state.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(loaded_state[k], v), k
    assert type(loaded.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"


def test_unsupported_layouts_are_reported_not_silently_kept():
    class Transposed(nn.Module):  # gpt-oss style: [E, H, 2I] / [E, I, H]
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 64))
            self.down_proj = nn.Parameter(torch.randn(4, 32, 64))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Transposed()
            self.proj = nn.Linear(64, 64)

    block = Block()
    report = convert_to_fp8(block, EMU)
    assert "transposed or ungated" in report.skipped["experts"]
    assert report.experts == [] and report.converted == ["proj"]


def test_bad_inputs_raise_with_the_fix():
    _, fp8 = hf_and_fp8_experts("mixtral")
    with pytest.raises(ValueError, match="top_k_index"):
        fp8(torch.randn(4, 64), torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2))
    with pytest.raises(TypeError, match="integer"):
        route(torch.rand(3, 2), 4)
    r = route(torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="route the same"):
        grouped_linear(torch.zeros(r.rows + 1, 64), torch.zeros(4, 32, 64), r, GroupedOptions())
    with pytest.raises(ValueError, match="backend='emulated'"):
        resolve_backend(Fp8Config(backend="cublas"), torch.device("cpu"))
    with pytest.warns(UserWarning, match="emulated grouped GEMM"):
        from fp8boost import _state
        _state.reset()
        assert resolve_backend(Fp8Config(), torch.device("cpu")) == "emulated"


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_high_precision_expert_wgrad_is_the_exact_grouped_product(backend):
    """``expert_wgrad="high_precision"``: dW_e = dy_e^T . x_e exactly (FP32 here, from the
    same dy), an expert with no rows gets zeros, and y and dx are the FP8 path's bits; the
    same compiled (one graph)."""
    import dataclasses

    g = torch.Generator().manual_seed(3)
    t, k, e = 40, 2, 4
    x = torch.randn(t, 32, generator=g)
    x[7, 2] = 60.0
    idx = torch.randint(0, e - 1, (t, k), generator=g)  # expert 3 gets no rows
    r = route(idx, e)
    w = torch.randn(e, 48, 32, generator=g)
    dy = torch.randn(t * k, 48, generator=g)
    opts = GroupedOptions()

    def run(o, fn):
        xr = x.repeat_interleave(k, 0).requires_grad_()
        wp = w.clone().requires_grad_()
        rows = torch.zeros(r.rows, 32).index_copy(0, r.pos, xr)
        y = fn(rows, wp, o)
        y[r.pos].backward(dy)
        return y, xr.grad, wp.grad

    def plain(rows, wp, o):
        return grouped_linear(rows, wp, r, o)

    hp = dataclasses.replace(opts, wgrad_fp8=False)
    fn = plain if backend == "eager" else torch.compile(plain, backend=backend, fullgraph=True)
    y8, dx8, dw8 = run(opts, plain)
    y, dx, dw = run(hp, fn)
    assert torch.equal(y, y8) and torch.equal(dx, dx8)
    xs, dys = x.repeat_interleave(k, 0), dy
    want = torch.zeros_like(w)
    for i, ex in enumerate(idx.reshape(-1).tolist()):
        want[ex] += torch.outer(dys[i], xs[i])
    torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-4)
    assert (dw[3] == 0).all() and rel(dw8, want) > 1e-3  # the FP8 one is not exact
    with pytest.raises(ValueError, match="expert_wgrad"):
        Fp8Config(expert_wgrad="bf16")
    assert Fp8Config.from_recipe("rowwise_with_gw_hp").expert_wgrad == "high_precision"
    model = tiny("mixtral")
    convert_to_fp8(model, Fp8Config(backend="emulated", min_numel=0,
                                    expert_wgrad="high_precision"))
    assert all(not m.options(torch.device("cpu")).wgrad_fp8 for m in fp8_experts(model))
    assert "precision=fp8_wgrad_hp" in repr(fp8_experts(model)[0])


@contextlib.contextmanager
def _faked_precision_timing(monkeypatch, fake_ms: dict):
    """The experts' precision choice with faked times (``fake_ms`` per precision, whatever ran
    last), on-disk decisions off, autotuning on; yields the precisions run, in order."""
    from fp8boost import _state
    from fp8boost.fp8.kernels import tuning
    from fp8boost.fp8.moe import choice
    from fp8boost.fp8.moe import experts as experts_mod

    monkeypatch.setenv("FP8BOOST_AUTOTUNE_CACHE", "0")
    ran, real = [], experts_mod.forward_with

    def recording(experts, x, idx, w, precision, device):
        ran.append(precision)
        return real(experts, x, idx, w, precision, device)

    def fake_time(fn):
        fn()
        return fake_ms[ran[-1]]

    monkeypatch.setattr(experts_mod, "forward_with", recording)
    monkeypatch.setattr(tuning, "_time_ms", fake_time)
    monkeypatch.setattr(choice, "TOKENS", 64)
    autotune = _state.setting(tuning._AUTOTUNE)
    tuning.set_autotune(True)
    _state.reset()
    try:
        yield ran
    finally:
        _state.reset()
        tuning.set_autotune(autotune)


def test_precision_is_timed_once_per_shape_and_bf16_kept_where_fp8_is_slower(monkeypatch):
    """fp8.moe.choice on the GPU backend's code path (CPU tensors here, times faked): the
    fastest candidate wins and is cached per shape, BF16 only under the default min_numel
    (warned once, with the times), and BF16 experts compute the HF module's forward."""
    from fp8boost.fp8.moe import choice
    from fp8boost.fp8.moe import experts as experts_mod

    with _faked_precision_timing(monkeypatch, {"fp8": 3.0, "fp8_wgrad_hp": 2.0,
                                               "bf16": 1.0}) as ran:
        hf = tiny("mixtral").model.layers[0].mlp.experts
        spec = find_expert_spec(hf)
        fp8 = Fp8Experts(copy.deepcopy(hf), spec, Fp8Config(backend="emulated"))
        with pytest.warns(UserWarning, match=r"keep BF16 .*\(fp8 3.00 ms, fp8_wgrad_hp 2.00 ms"):
            assert choice.choose(fp8, torch.device("cpu"), "scaled_grouped_mm",
                                 experts_mod.forward_with) == "bf16"
        assert sorted(set(ran)) == ["bf16", "fp8", "fp8_wgrad_hp"] and choice.top_k_of(fp8) == 2
        n = len(ran)
        assert choice.choose(fp8, torch.device("cpu"), "scaled_grouped_mm",
                                 experts_mod.forward_with) == "bf16"
        assert len(ran) == n  # cached: not timed again
        forced = Fp8Experts(copy.deepcopy(hf), spec, Fp8Config(backend="emulated", min_numel=0))
        assert choice.candidates(forced.fp8_config, "scaled_grouped_mm") == ["fp8",
                                                                            "fp8_wgrad_hp"]
        # BF16 experts: transformers' own forward, through the routed layout.
        fp8.precision = "bf16"
        x, idx = torch.randn(10, 64), torch.randint(0, 4, (10, 2))
        w = torch.rand(10, 2).softmax(-1)
        torch.testing.assert_close(fp8(x, idx, w), hf(x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp8_ms, hpw_ms, want", [(1.0, 1.03, "fp8_wgrad_hp"),
                                                   (1.0, 1.10, "fp8")])
def test_all_fp8_needs_a_clear_lead_over_the_bf16_weight_gradient(monkeypatch, fp8_ms, hpw_ms,
                                                                   want):
    """A near tie (all-FP8 3% ahead, as the module timing had Mixtral-8x7B on an H200 while
    the compiled step ran faster with BF16 weight gradients) goes to fp8_wgrad_hp; a 10% lead
    keeps all-FP8 (choice.HANDICAP)."""
    from fp8boost.fp8.moe import choice
    from fp8boost.fp8.moe import experts as experts_mod

    with _faked_precision_timing(monkeypatch, {"fp8": fp8_ms, "fp8_wgrad_hp": hpw_ms,
                                               "bf16": 5.0}):
        hf = tiny("mixtral").model.layers[0].mlp.experts
        fp8 = Fp8Experts(copy.deepcopy(hf), find_expert_spec(hf), Fp8Config(backend="emulated"))
        assert choice.choose(fp8, torch.device("cpu"), "scaled_grouped_mm",
                             experts_mod.forward_with) == want


def test_precision_timing_failure_warns_and_keeps_fp8(monkeypatch):
    """Every candidate failing to run (e.g. out of memory) must not break conversion: FP8,
    with a warning naming the cause."""
    from fp8boost import _state
    from fp8boost.fp8.kernels import tuning
    from fp8boost.fp8.moe import choice
    from fp8boost.fp8.moe import experts as experts_mod

    def broken(*args, **kwargs):
        raise RuntimeError("simulated out of memory")

    monkeypatch.setenv("FP8BOOST_AUTOTUNE_CACHE", "0")
    monkeypatch.setattr(experts_mod, "forward_with", broken)
    autotune = _state.setting(tuning._AUTOTUNE)
    tuning.set_autotune(True)
    _state.reset()
    try:
        hf = tiny("mixtral").model.layers[0].mlp.experts
        fp8 = Fp8Experts(hf, find_expert_spec(hf), Fp8Config(backend="emulated"))
        with pytest.warns(UserWarning, match="simulated out of memory.*train in fp8"):
            assert choice.choose(fp8, torch.device("cpu"), "scaled_grouped_mm",
                                 experts_mod.forward_with) == "fp8"
    finally:
        _state.reset()
        tuning.set_autotune(autotune)
