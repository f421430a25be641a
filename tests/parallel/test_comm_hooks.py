"""DDP FP8 comm hook and FSDP2 FP8 all-gather / reduce-scatter vs exact references (gloo).

Gradient bound (see test_fp8_comm for the derivation): averaging W ranks' gradients g_r through
FP8 reduce-scatter + all-gather (e5m2: u = 2**-3, h = 2**-17, fp8_max = 57344) errs per element
by at most

    e1 = sum_r (u |g_r| + h * 2 A_r / fp8_max) / W        (each addend quantized once)
    e2 = u (|avg| + e1) + h * 2 (max|avg| + max e1) / fp8_max   (the reduced value, once more)

where A_r bounds the amax of the chunk holding the element (we use the max over all of rank
r's gradients, which only loosens the subnormal term). FSDP's reduce-scatter has only e1.
"""
import copy

import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_distributed

E5M2_U, E5M2_H, E5M2_MAX = 2.0**-3, 2.0**-17, 57344.0


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(),
                         nn.Linear(48, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g) * (1 + rank), torch.randn(8, 4, generator=g)


def _gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _avg_bound(per_rank: list[torch.Tensor], amaxes: list[float], second_pass: bool):
    ws = len(per_rank)
    avg = sum(g.double() for g in per_rank) / ws
    e1 = sum(E5M2_U * g.double().abs() + E5M2_H * 2 * a / E5M2_MAX
             for g, a in zip(per_rank, amaxes)) / ws + ws * 2.0**-24 * avg.abs()
    if not second_pass:
        return avg, e1
    e2 = E5M2_U * (avg.abs() + e1) + E5M2_H * 2 * (avg.abs().max() + e1.max()) / E5M2_MAX
    return avg, e1 + e2


def _check_ddp(rank: int, ws: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.ddp.hooks import register_fp8_comm_hook

    local = _mlp(0)
    fp8_ddp = DDP(copy.deepcopy(local), bucket_cap_mb=0.004)  # several buckets
    register_fp8_comm_hook(fp8_ddp, config=Fp8CommConfig(min_payload_numel=0))
    ref_ddp = DDP(copy.deepcopy(local), bucket_cap_mb=0.004)
    opt_f = torch.optim.SGD(fp8_ddp.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref_ddp.parameters(), lr=0.05)
    losses = []
    for step in range(5):
        x, y = _batch(rank, step)
        if step == 0:  # exact per-rank gradients of the same weights, for the bound
            nn.functional.mse_loss(local(x), y).backward()
            mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
            per_rank = _gather_all(mine)
            amaxes = [g.abs().max().item() for g in per_rank]
        lf = nn.functional.mse_loss(fp8_ddp(x), y)
        lr_ = nn.functional.mse_loss(ref_ddp(x), y)
        lf.backward()
        lr_.backward()
        if step == 0:
            got = torch.cat([p.grad.reshape(-1) for p in fp8_ddp.parameters()])
            avg, bound = _avg_bound(per_rank, amaxes, second_pass=True)
            err = (got.double() - avg).abs()
            assert (err <= bound).all(), f"DDP hook grad error {(err - bound).max():.3g}"
            assert err.max() > 0, "FP8 hook changed nothing: not used?"
            ref_grad = torch.cat([p.grad.reshape(-1) for p in ref_ddp.parameters()])
            assert (ref_grad.double() - avg).abs().max() < 1e-6
        losses.append((lf.item(), lr_.item()))
        opt_f.step()
        opt_r.step()
        opt_f.zero_grad()
        opt_r.zero_grad()
    # Replicas stay bit-identical across ranks (everyone decodes the same bytes).
    flat = torch.cat([p.detach().reshape(-1) for p in fp8_ddp.parameters()])
    assert all(torch.equal(t, flat) for t in _gather_all(flat)), "replicas diverged"
    # Training parity: e5m2 gradient noise (<= ~25% per element, unbiased rounding) moves the
    # loss after 5 small SGD steps by far less than 5% on this problem.
    for lf, lr_ in losses:
        assert abs(lf - lr_) <= 0.05 * lr_, losses


def _check_ddp_first_step(rank: int, ws: int) -> None:
    """A new DDP model's first step reduces in the buckets DDP rebuilds after it (bit-exact
    resume): its gradients equal those of a model whose buckets are rebuilt already. The hook
    registered without ``register_fp8_comm_hook`` keeps DDP's initial single bucket, whose
    FP8 chunks and scales differ (shown, so the comparison is not vacuous)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.ddp.hooks import Fp8CommHookState, fp8_allreduce_hook, \
        register_fp8_comm_hook

    cfg = Fp8CommConfig(min_payload_numel=0)
    local = _mlp(0)
    x, y = _batch(rank, 7)

    def ddp(state=None):
        model = DDP(copy.deepcopy(local), bucket_cap_mb=0.004)  # 1 bucket, then 2 rebuilt
        if state is None:
            return model, register_fp8_comm_hook(model, config=cfg)
        model.register_comm_hook(state, fp8_allreduce_hook)
        return model, state

    def grads(model) -> list[torch.Tensor]:
        nn.functional.mse_loss(model(x), y).backward()
        out = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out

    warm, warm_state = ddp()
    grads(warm)  # its first backward; DDP rebuilds its buckets at the next forward
    rebuilt = grads(warm)
    assert warm._has_rebuilt_buckets and warm_state._layout._done
    assert all(warm_state._layout._predicted.values()), "rebuilt buckets != prediction"
    fresh, fresh_state = ddp()
    assert all(torch.equal(a, b) for a, b in zip(grads(fresh), rebuilt)), \
        "first step of a new DDP model differs from a rebuilt one"
    assert not fresh._has_rebuilt_buckets and not fresh_state._layout._done
    assert all(torch.equal(a, b) for a, b in zip(grads(fresh), rebuilt))
    assert fresh_state._layout._done and not fresh_state._layout._handles
    plain, _ = ddp(Fp8CommHookState(group=None, config=cfg))
    assert not all(torch.equal(a, b) for a, b in zip(grads(plain), rebuilt))
    # Where DDP never rebuilds (find_unused_parameters), nothing is recorded.
    unused = DDP(copy.deepcopy(local), find_unused_parameters=True)
    assert register_fp8_comm_hook(unused, config=cfg)._layout is None


def _quantized_weight(w: torch.Tensor) -> torch.Tensor:
    from fp8boost.fp8.scaling import amax, cast_to_fp8, dequantize, scale_from_amax
    scale = scale_from_amax(amax(w), torch.float8_e4m3fn, 0, True)
    return dequantize(cast_to_fp8(w, scale, torch.float8_e4m3fn), scale.reciprocal())


def _check_fsdp(rank: int, ws: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.fsdp.fp8_all_gather import (enable_fp8_all_gather,
                                            precompute_fp8_all_gather_scales,
                                            set_fp8_reduce_scatter)

    cfg = Fp8CommConfig(min_payload_numel=0)
    torch.manual_seed(1)
    # 33 rows shard unevenly; 3 rows leave rank 3 of 4 an empty shard
    model = nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 3), nn.Tanh(),
                          nn.Linear(3, 4))
    lin = (0, 2, 4)
    ref = copy.deepcopy(model)
    assert enable_fp8_all_gather(model, cfg) == [f"{i}.weight" for i in lin]
    mesh = init_device_mesh("cpu", (ws,))
    for i in lin:
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert set_fp8_reduce_scatter(model, cfg) == 4
    seen = {}
    for i in lin:
        model[i].register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, m.weight.detach().clone()))
    log = []
    saved = {n: getattr(dist, n) for n in ("all_gather_single", "all_gather_into_tensor",
                                           "all_to_all_single", "all_reduce") if hasattr(dist, n)}

    def spy(name, orig):
        def wrapped(*args, **kwargs):
            t = args[0] if name == "all_reduce" else args[1]
            log.append((name, t.dtype, t.numel()))
            return orig(*args, **kwargs)
        return wrapped

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = _batch(rank, step)
        for n, f in saved.items():
            setattr(dist, n, spy(n, f))
        try:
            out = model(x)
            nn.functional.mse_loss(out, y).backward()
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)
        # 1. the unsharded weights are exactly the e4m3 round trip with the group-wide scale
        qref = copy.deepcopy(ref)
        for i in lin:
            with torch.no_grad():
                qref[i].weight.copy_(_quantized_weight(ref[i].weight))
            assert torch.equal(seen[i], qref[i].weight), f"step {step} layer {i} weight"
        assert torch.allclose(out, qref(x), rtol=1e-6, atol=1e-6)
        # 2. parameter all-gathers are uint8 (FP8 weight + raw bias bytes); grads cross as
        # uint8 all-to-all; after precompute, no per-weight amax all-reduce remains.
        gathers = [e for e in log if e[0].startswith("all_gather")]
        assert gathers and all(dt == torch.uint8 for _, dt, _ in gathers), log
        rows = [-(-model[i].out_features // ws) for i in lin]  # padded shard rows
        w_elems = sum(r * model[i].in_features for r, i in zip(rows, lin))  # 1 byte each
        b_bytes = 4 * sum(rows)                                          # FP32 bias shards
        # forward + backward re-gather, each at most 1 byte per weight element (+ alignment)
        assert sum(k for _, _, k in gathers) <= 2 * (w_elems + b_bytes) + 64, gathers
        a2a = [e for e in log if e[0] == "all_to_all_single"]
        assert len(a2a) >= 2 and all(dt == torch.uint8 for _, dt, _ in a2a), log
        n_reduce = len([e for e in log if e[0] == "all_reduce"])
        assert (n_reduce > 0) == (step == 0), log  # amax all-reduces until precomputed
        log.clear()
        # 3. sharded grads = FP8 reduce-scatter average of the exact per-rank grads
        nn.functional.mse_loss(qref(x), y).backward()
        mine = torch.cat([q.grad.reshape(-1) for q in qref.parameters()])
        amaxes = [g.abs().max().item() for g in _gather_all(mine)]
        for (name, p), q in zip(model.named_parameters(), qref.parameters()):
            per_rank = _gather_all(q.grad)
            avg, bound = _avg_bound(per_rank, amaxes, second_pass=False)
            got = p.grad.full_tensor()
            err = (got.double() - avg).abs()
            assert (err <= bound + 1e-7).all(), f"{name}: {(err - bound).max():.3g}"
            assert name.endswith("bias") or err.max() > 0, f"{name}: FP8 reduce-scatter unused?"
        # advance both models identically (same averaged FP8 grads applied to the reference)
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                r.grad = p.grad.full_tensor().clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert precompute_fp8_all_gather_scales(model) == 3
    # MixedPrecisionPolicy: FP32 master shards, BF16 compute weights decoded straight from FP8
    from torch.distributed.fsdp import MixedPrecisionPolicy
    torch.manual_seed(2)
    mp_model = nn.Sequential(nn.Linear(8, 24))
    w_ref = _quantized_weight(mp_model[0].weight.detach().clone())
    enable_fp8_all_gather(mp_model, cfg)
    fully_shard(mp_model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    mp_model[0].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("mp", m.weight.detach().clone()))
    mp_model(torch.randn(2, 8)).sum().backward()
    assert seen["mp"].dtype == torch.bfloat16 and torch.equal(seen["mp"], w_ref.bfloat16())


def _worker(rank: int, ws: int) -> bool:
    _check_ddp(rank, ws)
    _check_ddp_first_step(rank, ws)
    _check_fsdp(rank, ws)
    return True


def test_ddp_hook_and_fsdp2_fp8_2_ranks():
    assert run_distributed(_worker, 2) == [True, True]


def test_ddp_hook_and_fsdp2_fp8_4_ranks():
    assert run_distributed(_worker, 4) == [True] * 4


def test_fsdp_helpers_validate_input():
    import pytest

    from fp8boost.parallel.comm.config import Fp8CommConfig
    from fp8boost.parallel.ddp.hooks import Fp8CommHookState, fp8_allreduce_hook
    from fp8boost.parallel.fsdp.fp8_all_gather import enable_fp8_all_gather, set_fp8_reduce_scatter
    model = nn.Sequential(nn.Linear(4, 4))
    assert enable_fp8_all_gather(model, Fp8CommConfig(enabled=False)) == []
    assert enable_fp8_all_gather(model) == ["0.weight"]
    with pytest.raises(ValueError, match="once"):
        enable_fp8_all_gather(model)
    y = model(torch.randn(2, 4))  # the wrapped weight still computes like a plain tensor
    assert type(y) is torch.Tensor and y.shape == (2, 4)
    with pytest.raises(ValueError, match="fully_shard"):
        set_fp8_reduce_scatter(model)
    with pytest.raises(TypeError, match="Fp8CommConfig"):
        Fp8CommHookState(config={"min_numel": 0})
    with pytest.raises(TypeError, match="Fp8CommHookState"):
        fp8_allreduce_hook("state", None)
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    assert enable_fp8_all_gather(tied) == ["0.weight"]
    assert tied[1].weight is tied[0].weight
