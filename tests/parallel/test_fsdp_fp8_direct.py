"""FSDP2 FP8 all-gather feeding Fp8Linear's FP8 GEMM directly (gloo, 2 ranks, emulated backend).

What "direct" promises, and how each promise is checked:
* the unsharded weight FSDP installs is an ``Fp8WeightTensor`` whose bytes are exactly the e4m3
  cast of the full weight with the scale from the global amax (the layer's own scaling rule),
  and the forward output is bit-identical to a single-process ``Fp8Linear`` holding the full
  weight (which casts it itself, with the same scale);
* ``Fp8Linear`` never quantizes the weight on that path (its ``casts.quantize(role="weight")`` calls counted);
* training parity: FSDP on 2 ranks vs one process running the two ranks' batches as two
  micro-batches (same FP8 casts of inputs and output gradients, gradients averaged). The only
  possible difference is the order of the FP32 gradient average, well under 1 ulp per step
  here, so losses and weights must agree to 1e-6 relative (they are bit-identical in practice);
* one all-reduce per ``precompute_fp8_all_gather_scales`` call, and none in forward/backward
  once scales are precomputed (the per-weight all-reduce fallback only runs before);
* the second and later steps take FSDP's ``out=`` refill path (same unsharded weight object,
  new bytes) and are still exact;
* delayed scaling, plain ``nn.Linear`` consumers and a mismatched wire format take the logged
  dequantize path and still train.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

from tests.dist_utils import run_distributed
from tests.parallel.cast_spy import CastSpy

E4M3 = torch.float8_e4m3fn


def _cfg(**kw):
    from fp8boost.fp8 import Fp8Config
    return Fp8Config(backend="emulated", min_numel=0, **kw)


def _model(cfg, seed: int = 0) -> nn.Sequential:
    from fp8boost.fp8 import Fp8Linear
    torch.manual_seed(seed)
    return nn.Sequential(Fp8Linear(32, 64, config=cfg), nn.Tanh(), Fp8Linear(64, 48, config=cfg),
                         nn.Tanh(), Fp8Linear(48, 16, config=cfg))


LIN = (0, 2, 4)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=g) * (1 + rank), torch.randn(8, 16, generator=g)


def _shard(model, mesh, comm, **kw):
    from torch.distributed.fsdp import fully_shard

    from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather
    names = enable_fp8_all_gather(model, comm)
    for mod in model:
        if mod._parameters.get("weight") is not None:
            fully_shard(mod, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return names


def _expected_bytes(full_w: torch.Tensor, cfg):
    """The e4m3 cast of the full weight with the scale from its (global) amax."""
    from fp8boost.fp8.scaling import amax, cast_to_fp8, scale_from_amax
    scale = scale_from_amax(amax(full_w), E4M3, cfg.margin, cfg.power_of_2_scale)
    return cast_to_fp8(full_w, scale, E4M3), scale.reciprocal()


def _check_direct(rank: int, ws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fp8boost.fp8.prequantized import Fp8WeightTensor
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.fp8_all_gather import precompute_fp8_all_gather_scales

    cfg = _cfg()
    model = _model(cfg)
    ref = copy.deepcopy(model)  # single process, whole weights, both ranks' batches
    mesh = init_device_mesh("cpu", (ws,))
    assert _shard(model, mesh, Fp8CommConfig(min_payload_numel=0)) == [f"{i}.weight" for i in LIN]
    seen: dict = {}
    for i in LIN:
        model[i].register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, (m.weight, m.weight.fp8_data.clone(),
                                                   m.weight.inv_scale.clone())))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    first = {}
    for step in range(3):
        x, y = _batch(rank, step)
        full = {i: model[i].weight.full_tensor().detach() for i in LIN}
        # (a) single process holding the full weights: it casts them itself
        single = copy.deepcopy(ref)
        for i in LIN:
            single[i].weight.data.copy_(full[i])
        with CastSpy() as spy:
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            loss.backward()
        assert torch.equal(out, single(x)), f"step {step}: output not bit-identical"
        for i in LIN:
            w, data, inv = seen[i]
            assert isinstance(w, Fp8WeightTensor) and w.dtype == torch.float32, type(w)
            want, want_inv = _expected_bytes(full[i], cfg)
            assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), (step, i)
            assert torch.equal(inv, want_inv), (step, i)
            first.setdefault(i, w)
            assert w is first[i], "(d) later steps must refill the same unsharded weight (out=)"
        # (b) no weight quantize in the FSDP model; inputs and grads are still quantized
        ids = {id(model[i].casts) for i in LIN}
        roles = [r for lid, r in spy.casts if lid in ids]
        assert "weight" not in roles and roles.count("input") == 3 and roles.count("grad") == 3
        # per-weight amax all-reduces only before the first precompute
        assert bool(spy.reduces) == (step == 0), (step, spy.reduces)
        # (c) reference: the ranks' batches as micro-batches of one process
        ref_losses = []
        for r in range(ws):
            xr, yr = _batch(r, step)
            lr_ = nn.functional.mse_loss(ref(xr), yr)
            (lr_ / ws).backward()
            ref_losses.append(lr_.item())
        assert loss.item() == pytest.approx(ref_losses[rank], rel=1e-6, abs=1e-7)
        for i in LIN:  # averaged gradient of the full weight
            g = model[i].weight.grad.full_tensor()
            assert type(g) is torch.Tensor and g.dtype == torch.float32
            torch.testing.assert_close(g, ref[i].weight.grad, rtol=1e-6, atol=1e-8)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with CastSpy() as spy:
            assert precompute_fp8_all_gather_scales(model) == 3
        assert len(spy.reduces) == 1, "(c) precompute must issue exactly one all-reduce"
        for i in LIN:  # inductor would copy a misaligned scale input at every call
            pre = model[i].weight._local_tensor._precomputed
            assert pre[0].data_ptr() % 16 == 0 and pre[1].data_ptr() % 16 == 0, i
    for i in LIN:
        torch.testing.assert_close(model[i].weight.full_tensor(), ref[i].weight,
                                   rtol=1e-6, atol=1e-8)


def _check_bf16_params(rank: int, ws: int) -> None:
    """MixedPrecisionPolicy(bf16): the carrier presents bf16, its bytes come from the FP32 master
    (one rounding), and the output is bit-identical to a single-process layer given bf16 input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fp8boost.fp8.prequantized import Fp8WeightTensor
    from fp8boost.parallel.comm.config import Fp8CommConfig

    from torch.distributed.fsdp import fully_shard

    from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather
    model = _model(_cfg(), seed=3)
    single = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (ws,))
    enable_fp8_all_gather(model, Fp8CommConfig(min_payload_numel=0))
    # one FSDP unit holding all three layers (as a plugin shards a transformer block)
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    seen = {}
    model[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("w", m.weight))
    x, y = _batch(rank, 0)
    out = model(x)
    assert isinstance(seen["w"], Fp8WeightTensor) and seen["w"].dtype == torch.bfloat16
    assert out.dtype == torch.bfloat16 and torch.equal(out, single(x.bfloat16()))
    nn.functional.mse_loss(out.float(), y).backward()
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad.full_tensor()).all()


def _dequantize_run(model, comm, rank: int, ws: int, steps: int = 1) -> tuple[list, object]:
    from torch.distributed.device_mesh import init_device_mesh

    from fp8boost.parallel.fsdp.fp8_all_gather import precompute_fp8_all_gather_scales
    mesh = init_device_mesh("cpu", (ws,))
    _shard(model, mesh, comm)
    seen = {}
    model[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("w", m.weight))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, 0)  # the same batch: the loss must go down
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute_fp8_all_gather_scales(model)
        losses.append(loss.item())
    return losses, seen["w"]


def _logged_dequantize(word: str) -> bool:
    from fp8boost import _state
    return any(isinstance(k, tuple) and k[0] == "fsdp-fp8-ag-dequantize" and word in k[1]
               for k in _state._LOGGED)


def _check_dequantize_paths(rank: int, ws: int) -> None:
    from fp8boost.fp8.prequantized import Fp8WeightTensor
    from fp8boost.parallel.comm.config import Fp8CommConfig

    comm = Fp8CommConfig(min_payload_numel=0)
    # (e) delayed scaling: logged dequantize path, still trains
    losses, w = _dequantize_run(_model(_cfg(recipe="delayed")), comm, rank, ws, steps=5)
    assert type(w) is nn.Parameter and _logged_dequantize("delayed")
    assert all(map(lambda v: v == v and abs(v) < 1e3, losses)) and losses[-1] < losses[0], losses
    # a plain nn.Linear consumer, and a wire format that is not the GEMM's
    torch.manual_seed(0)
    _, w = _dequantize_run(nn.Sequential(nn.Linear(32, 16)), comm, rank, ws)
    assert type(w) is nn.Parameter and _logged_dequantize("not an Fp8Linear")
    _, w = _dequantize_run(_model(_cfg()), comm.replace(param_dtype=torch.float8_e5m2), rank, ws)
    assert not isinstance(w, Fp8WeightTensor) and _logged_dequantize("param_dtype")


def _worker(rank: int, ws: int) -> bool:
    # the carrier never falls back to a dequantized read on the direct path
    warnings.filterwarnings("error", message=".*Fp8WeightTensor.*")
    _check_direct(rank, ws)
    _check_bf16_params(rank, ws)
    warnings.resetwarnings()
    _check_dequantize_paths(rank, ws)
    return True


def test_fsdp_fp8_all_gather_feeds_the_gemm_2_ranks():
    assert run_distributed(_worker, 2) == [True, True]


# ---- single process: the carrier and Fp8Linear -------------------------------------------

def _carrier_layer(cfg=None, dtype=torch.float32):
    from fp8boost.fp8 import Fp8Linear
    from fp8boost.fp8.prequantized import Fp8WeightTensor
    cfg = cfg or _cfg()
    torch.manual_seed(0)
    ref = Fp8Linear(32, 48, config=cfg)
    data, inv = _expected_bytes(ref.weight.detach(), cfg)
    layer = copy.deepcopy(ref)
    layer.weight = nn.Parameter(Fp8WeightTensor(data, inv, dtype))
    return layer, ref


def test_fp8linear_uses_a_prequantized_weight_as_is():
    from fp8boost.fp8.prequantized import Fp8WeightTensor
    layer, ref = _carrier_layer()
    assert isinstance(layer.weight, Fp8WeightTensor) and layer.weight.requires_grad
    x = torch.randn(2, 5, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with CastSpy() as spy:
            y = layer(x)
            y.square().sum().backward()
    y2 = ref(x2)
    y2.square().sum().backward()
    assert (id(layer.casts), "weight") not in spy.casts
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert type(layer.weight.grad) is torch.Tensor and torch.equal(layer.weight.grad, ref.weight.grad)
    with torch.no_grad():  # forward only: no transpose is made or saved
        assert torch.equal(layer(x), y)


def test_carrier_reads_fall_back_to_the_dequantized_value_and_writes_raise():
    layer, ref = _carrier_layer()
    w = layer.weight
    with pytest.warns(UserWarning, match="aten.mul.Tensor"):
        doubled = w * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, 2 * w.dequantize())
    d = w.detach()  # views keep the FP8 payload (same storage, same scale)
    assert type(d) is type(w) and d.fp8_data.data_ptr() == w.fp8_data.data_ptr()
    assert d.inv_scale is w.inv_scale
    with pytest.raises(RuntimeError, match="write into an Fp8WeightTensor"):
        with torch.no_grad():
            w.add_(1.0)
    with pytest.raises(TypeError, match="FP8 data"):
        type(w)(torch.ones(2, 2), torch.tensor(1.0), torch.float32)


def test_delayed_fp8linear_requantizes_a_carrier_with_a_warning():
    layer, _ = _carrier_layer(cfg=_cfg(recipe="delayed"))
    with pytest.warns(UserWarning, match="delayed scaling"):
        with CastSpy() as spy:
            layer(torch.randn(4, 32)).sum().backward()
    assert (id(layer.casts), "weight") in spy.casts


def test_gather_plan_reasons():
    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.gather_plan import choose_plan
    comm = Fp8CommConfig()
    lin = _model(_cfg())[0]
    plan = choose_plan(comm, False, lin, None)
    assert plan.direct and plan.fp8_dtype == E4M3 and not plan.power_of_2
    assert "tied" in choose_plan(comm, True, lin, None).reason
    assert "not 2-D" in choose_plan(comm, False, lin, torch.Size([16, 32])).reason  # TP-local
    assert "delayed" in choose_plan(comm, False, _model(_cfg(recipe="delayed"))[0], None).reason
    plain = choose_plan(comm, False, nn.Linear(32, 64), None)
    assert not plain.direct and plain.power_of_2 == comm.power_of_2_wire_scale


def test_compiled_fp8linear_consumes_the_carrier():
    """torch.compile (aot_eager) traces the carrier: no graph break, same numbers as eager."""
    import torch._dynamo
    layer, ref = _carrier_layer()
    x = torch.randn(8, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():  # no dequantized read of the carrier while tracing
        warnings.filterwarnings("error", message=".*Fp8WeightTensor.*")
        compiled(x).square().sum().backward()
    ref(x2).square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer.weight.grad, ref.weight.grad)


def _check_stacked_amax(device: str) -> None:
    from fp8boost.fp8.scaling import amax
    from fp8boost.parallel.fsdp.fp8_all_gather import _stacked_amax

    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(64, 48, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
          torch.empty(0, 4), torch.randn(33, 5, generator=g)]
    ts[0][5, 7] = -4.0e4  # an outlier decides the max, with its sign dropped
    ts = [t.to(device) for t in ts]
    got = _stacked_amax(ts)
    assert got.dtype == torch.float32 and got.shape == (4,)
    assert torch.equal(got, torch.stack([amax(t) for t in ts]))
    assert got[0].item() == 4.0e4 and got[2].item() == 0.0
    ts[3][2, 1] = float("nan")  # corruption stays visible in the scale
    assert torch.isnan(_stacked_amax(ts)[3]) and not torch.isnan(_stacked_amax(ts)[:3]).any()


def test_precompute_amaxes_equal_the_per_weight_amax():
    """precompute's one stacked reduction pass equals amax() per weight: max |x| (outliers,
    bf16 and empty tensors) and NaN propagation."""
    _check_stacked_amax("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompute_amaxes_equal_the_per_weight_amax_on_cuda():
    """The same on the GPU, where vector_norm(inf) is a different reduction kernel."""
    _check_stacked_amax("cuda")


def test_precomputed_scales_are_16_byte_aligned():
    """Each precomputed scale and inverse is its own 16-byte aligned 0-dim tensor (inductor copies
    misaligned graph inputs on every call) holding exactly the per-weight value."""
    from fp8boost.fp8.scaling import aligned_scalars

    v = torch.tensor([1.0, 448.0 / 3.5, float("nan"), 2.0 ** -20, 7.0])
    got = aligned_scalars(v)
    assert len(got) == 5 and all(t.dim() == 0 for t in got)
    assert all(t.data_ptr() % 16 == 0 for t in got)
    torch.testing.assert_close(torch.stack(got), v, rtol=0, atol=0, equal_nan=True)


def test_pre_all_gather_signature_is_not_rebuilt_per_gather():
    """FSDP2 inspects fsdp_pre_all_gather's signature before every all-gather of every weight:
    the hook hands inspect its 5-parameter form ready-made (the same object every time) and
    still runs as the bound method."""
    import inspect

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.fp8_all_gather import Fp8AllGatherWeight

    w = Fp8AllGatherWeight(torch.randn(4, 4), Fp8CommConfig())
    sig = inspect.signature(w.fsdp_pre_all_gather)
    assert list(sig.parameters) == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]
    assert inspect.signature(w.fsdp_pre_all_gather) is sig
    assert w.fsdp_pre_all_gather.args == (w,)  # bound to this weight, not to the class
    assert Fp8AllGatherWeight.fsdp_pre_all_gather.__name__ == "fsdp_pre_all_gather"
