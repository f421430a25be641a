"""ZeRO's FP8 parameter all-gather feeding Fp8Linear's FP8 GEMM directly (gloo, 2 ranks, emulated).

What is checked (one spawn, many assertions):
* (a) the bytes each tensorwise layer receives equal ``cast_to_fp8(full_master, scale, e4m3)``
  bit for bit, with ``scale`` from the global amax by the layer's own rule, and the inverse
  scale is exactly ``1/scale``; the working BF16 weight is decoded from the same bytes; those
  bytes are the weight's own all-gather output (gathered in place, never copied);
* (b) the layer's forward/dgrad with those bytes equal a manual FP8 GEMM with the full cast,
  and the layer never quantizes its weight nor fills its weight-cast cache;
* (c) a write to the weight drops the bytes (warned) and the layer casts its weight itself
  again; another optimizer's step leaves them in use (ZeRO hands them over again: the weight
  is unchanged), unless the weight was written too; a delayed-scaling layer keeps the regular
  path;
* (d) LowLevelZeroPlugin stage 1 and 2 with use_fp8 + fp8_communication and the direct path
  bound still match the single-process FP8 run within the existing parity tolerances;
* (e) exactly one all-reduce (MAX, one entry per direct weight) per optimizer step.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_distributed
from tests.parallel.cast_spy import CastSpy

E4M3 = torch.float8_e4m3fn


def _cfgs(**kw):
    from fp8boost.fp8 import Fp8Config
    from fp8boost.parallel.comm.config import Fp8CommConfig
    return Fp8Config(backend="emulated", min_numel=0, **kw), Fp8CommConfig(min_payload_numel=0)


def _model():
    from fp8boost.fp8 import Fp8Linear
    cfg, _ = _cfgs()
    delayed, _ = _cfgs(recipe="delayed")
    torch.manual_seed(0)
    return nn.Sequential(Fp8Linear(32, 64, config=cfg), nn.Tanh(),
                         Fp8Linear(64, 48, config=delayed), nn.Tanh(),
                         Fp8Linear(48, 16, config=cfg)).to(torch.bfloat16)


def _step(model, opt, rank: int, step: int) -> CastSpy:
    g = torch.Generator().manual_seed(10 * step + rank)
    x = (torch.randn(8, 32, generator=g) * (1 + rank)).to(torch.bfloat16)
    loss = model(x).float().pow(2).mean()
    opt.backward(loss)
    with CastSpy() as spy:
        opt.step()
    opt.zero_grad()
    return spy


def _expected(full: torch.Tensor, cfg):
    from fp8boost.fp8.scaling import amax, cast_to_fp8, scale_from_amax
    scale = scale_from_amax(amax(full), E4M3, cfg.margin, cfg.power_of_2_scale)
    return cast_to_fp8(full, scale, E4M3), scale


def _check_bytes(model, opt) -> None:
    """(a): bytes, inverse scale and the decoded working weight, for every tensorwise layer."""
    from fp8boost.fp8.scaling import dequantize
    full = opt.full_master_params()
    for idx in (0, 4):
        layer = model[idx]
        i = next(k for k, p in enumerate(opt.params) if p is layer.weight)
        q, scale = _expected(full[i], layer.fp8_config)
        pre = layer.prequantized_weight
        data, inv = pre.data, pre.inv_scale
        assert data.dtype == E4M3 and data.shape == layer.weight.shape
        assert torch.equal(data.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(inv, scale.reciprocal())
        assert torch.equal(layer.weight.detach(), dequantize(q, inv, torch.bfloat16))
        # No copy out of a bucket: the operand is the weight's own all-gather output, padding
        # (2 ranks, odd numel or not) past its end.
        w = opt.fp8_direct.plan().weights[opt.fp8_direct.plan().slot[i]]
        assert data.data_ptr() == w.wire.data_ptr(), "operand is not the gather buffer"
        assert w.wire.numel() == 2 * opt.shards[i].chunk >= data.numel()
    assert model[2].prequantized_weight is None  # delayed scaling: regular FP8 gather


def _check_forward(model) -> None:
    """(b): forward and dgrad equal a manual GEMM with the full cast; no weight amax/cast."""
    layer = model[0]
    pre = layer.prequantized_weight
    data, inv = pre.data, pre.inv_scale
    be, cfg = layer.fp8_backend, layer.fp8_config
    x = torch.randn(6, 32).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(6, 64).to(torch.bfloat16)
    layer.operands.invalidate()
    with CastSpy() as spy:
        y = layer(x)
        y.backward(dy)
    assert all(role != "weight" for _, role in spy.casts), spy.casts
    assert layer.operands.cache is None
    xq = layer.casts.quantize("input", x.detach(), cfg.fwd_dtype, with_transpose=False)
    y_ref = be.mm(xq.data, data, xq.inv_scale, inv, bias=layer.bias.to(x.dtype),
                  out_dtype=x.dtype, use_fast_accum=cfg.fast_accum_fprop)
    assert torch.equal(y.detach(), y_ref)
    dyq = layer.casts.quantize("grad", dy, cfg.grad_dtype, with_transpose=False)
    dx_ref = be.mm(dyq.data, data.t().contiguous(), dyq.inv_scale, inv, out_dtype=x.dtype,
                   use_fast_accum=cfg.fast_accum_dgrad)
    assert torch.equal(x.grad, dx_ref)


def _casts_weight(layer) -> bool:
    with CastSpy() as spy, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        layer(torch.randn(2, layer.in_features).to(torch.bfloat16))
    return (id(layer.casts), "weight") in spy.casts


def _check_invalidation(model, opt, rank: int) -> None:
    """(c): a weight write drops the bytes; another optimizer's step alone does not."""
    layer = model[4]
    assert not _casts_weight(layer)
    with torch.no_grad():
        layer.weight.mul_(1)  # bumps the version
    assert _casts_weight(layer) and layer.prequantized_weight is None
    _step(model, opt, rank, 7)  # a ZeRO step hands fresh bytes
    assert not _casts_weight(layer)
    other = torch.zeros(1, requires_grad=True)
    other.grad = torch.ones(1)
    sgd = torch.optim.SGD([other], lr=0.1)
    sgd.step()  # bumps the process-wide step count; this weight is untouched
    assert not _casts_weight(layer)  # still the gathered bytes (a second run must not drift)
    sgd.step()
    with torch.no_grad():
        layer.weight.mul_(1)  # a step and a write: the bytes are stale, never handed over again
    assert _casts_weight(layer)


def _zero_direct(rank: int, world: int) -> None:
    from fp8boost.parallel.comm.plan import CommPlan, CommRoute
    from fp8boost.parallel.zero import ZeroOptimizer
    _, comm = _cfgs()
    plan = CommPlan(requested=True, engine="zero", config=comm,
                    param_all_gather=CommRoute(fp8=True, why_not=""))
    for stage in (2, 1):
        model = _model()
        opt = ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            dp_group=dist.group.WORLD, stage=stage, comm_plan=plan,
                            fp8_params=[model[i].weight for i in (0, 2, 4)],
                            reduce_bucket_numel=2000)
        opt.bind_fp8_layers(model)
        for step in range(3):
            spy = _step(model, opt, rank, step)
            # (e) the amax all-reduce is the step's only all-reduce (stage 2: none for grads)
            mine = [r for r in spy.reduces if r == (dist.ReduceOp.MAX, 2)]
            assert len(mine) == 1, spy.reduces
            if stage == 2:
                assert len(spy.reduces) == 1, spy.reduces
            _check_bytes(model, opt)
        _check_forward(model)
        _check_invalidation(model, opt, rank)


def _plugin_parity(rank: int, world: int) -> dict:
    """(d): the plugin's parity against a single process, with the direct path bound."""
    from fp8boost.booster import Booster
    from fp8boost.fp8 import Fp8Linear
    from tests.plugins import helpers as H
    from tests.plugins.test_plugins_distributed import STEPS, TOL, _plugin, _references, _sgd
    ref_losses, ref_weights = _references(("fp8",))["fp8"]
    init = list(H.make_mlp().parameters())
    out = {}
    for name in ("zero1", "zero2"):
        booster = Booster(plugin=_plugin(name, "fp8", True))
        model = H.make_mlp()
        model, opt, *_ = booster.boost(model, _sgd(model))
        opt.bind_fp8_layers(model)
        with CastSpy() as spy:
            losses = H.train(booster, model, opt, rank, world, STEPS)
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 3 and all(m.prequantized_weight is not None for m in layers)
        assert sum(r == (dist.ReduceOp.MAX, 3) for r in spy.reduces) == STEPS, spy.reduces
        dl = H.max_rel(losses, ref_losses)
        dw = H.rel_update_error(H.true_weights(model, opt), ref_weights, init)
        tl, tw = TOL["comm"]
        assert dl <= tl and dw <= tw, (name, dl, dw)
        out[name] = (dl, dw)
    return out


def _worker(rank: int, world: int) -> dict:
    _zero_direct(rank, world)
    return _plugin_parity(rank, world)


def test_zero_fp8_gather_feeds_the_gemm_directly():
    results = run_distributed(_worker, 2, timeout=300)
    print("zero fp8 direct parity (loss, weights):", results[0])


def test_compiled_layer_uses_the_prequantized_weight_without_a_graph_break():
    """Under torch.compile the validity key is not readable: the set bytes are used as is (no
    graph break, no self-cast), and ``load_state_dict`` drops them."""
    import torch._dynamo

    from fp8boost.fp8 import Fp8Linear
    cfg, _ = _cfgs()
    torch.manual_seed(0)
    layer = Fp8Linear(32, 16, config=cfg)
    # Bytes of a *different* weight (2x): the output tells which operand the GEMM read.
    w8 = (2 * layer.weight.detach() * 8).clamp(-448, 448).to(E4M3)
    inv = torch.tensor(1 / 8)
    x = torch.randn(4, 32)
    layer.set_prequantized_weight(w8, inv)
    eager_pre = layer(x).detach()
    layer.set_prequantized_weight(w8, inv)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)  # raises on a break
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fp8boost")  # no "casts its weight itself"
        got = compiled(x).detach()
    assert torch.equal(got, eager_pre)
    plain = layer.__class__(32, 16, config=cfg)
    plain.load_state_dict(layer.state_dict())
    assert not torch.equal(got, plain(x).detach())  # the 2x bytes were read, not the weight
    layer.load_state_dict(layer.state_dict())
    assert layer.prequantized_weight is None
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_copy_gathered_equals_reshape_and_drops_padding(dtype):
    """The all-gather unpack copies each weight straight out of the [world, total] buffer (in
    8-byte words where aligned): the same values as the reshape it replaces, padding dropped,
    for whole, padded, unaligned and single-rank-spanning chunks."""
    from fp8boost.parallel.zero.sharding import copy_gathered

    g = torch.Generator().manual_seed(0)
    cases = [(4, 64, 8, 16, 64), (4, 64, 8, 16, 61), (3, 30, 3, 9, 25), (2, 40, 0, 40, 80),
             (4, 64, 8, 16, 48), (4, 64, 1, 15, 59)]
    for world, total, off, chunk, numel in cases:
        rows = torch.randint(0, 255, (world, total), generator=g).to(dtype)
        dst = torch.full((numel,), 7, dtype=dtype)
        copy_gathered(dst, rows, off, chunk)
        assert torch.equal(dst, rows[:, off:off + chunk].reshape(-1)[:numel]), (world, off, numel)
