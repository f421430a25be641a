"""The fused master-weight AdamW step (fp8boost/parallel/zero/fused_step.py), on CPU.

Oracle: the two-pass master-weight step (BF16 gradient copied to FP32, torch's AdamW on the FP32
masters, masters copied back). On the CPU the fused path runs torch's single-tensor AdamW
arithmetic op for op, so the two must agree bit for bit; the Triton kernel is checked in the
interpreter against that arithmetic.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from fp8boost.booster import Booster, MixedPrecision
from fp8boost.parallel.zero import ZeroOptimizer

_CHILD = os.environ.get("FP8BOOST_FUSED_STEP_INTERP_CHILD") == "1"


def _train(fused, steps: int = 4, max_norm: float = 0.0, make_opt=None, precision="bf16",
           device: str = "cpu"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 8)).to(device)
    model[2].weight.requires_grad_(True)
    params = list(model.parameters())
    opt = (make_opt or (lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1)))(params)
    booster = Booster(mixed_precision=MixedPrecision(precision, max_norm=max_norm,
                                                     fused_master_step=fused),
                      device=device)
    model, opt, *_ = booster.boost(model, opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(16, 24, generator=gen).to(device)
        loss = model(x).float().pow(2).mean() * (50.0 if step == 1 else 1.0)  # step 1 clips
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        for group in opt.param_groups:  # a scheduler's change is picked up
            group["lr"] *= 0.7
    return model, opt


def _same(a, b) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.dtype == q.dtype == torch.bfloat16 and torch.equal(p, q), n


@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_fused_step_equals_the_default_master_step_bit_for_bit(max_norm):
    ref_model, ref_opt = _train(False, max_norm=max_norm)
    model, opt = _train(True, max_norm=max_norm)
    assert opt._fused and not ref_opt._fused
    _same(ref_model, model)
    for m, r in zip(opt.masters, ref_opt.masters):
        assert torch.equal(m, r)
    # The state is torch's own: same keys, dtypes, devices and values (checkpoints portable).
    for m, r in zip(opt.masters, ref_opt.masters):
        s, t = opt.optim.state[m], ref_opt.optim.state[r]
        assert s.keys() == t.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for k in s:
            assert (s[k].dtype, s[k].device) == (t[k].dtype, t[k].device)
            assert torch.equal(s[k], t[k]), k
    # The state dict loads into the default path, which then continues identically.
    state = opt.optim.state_dict()
    ref_opt.optim.load_state_dict(state)
    assert float(ref_opt.optim.state[ref_opt.masters[0]]["step"]) == 4.0


def test_fused_step_falls_back_with_a_reason():
    def sgd(ps):
        return torch.optim.SGD(ps, lr=0.1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _train(True, steps=2, make_opt=sgd)
    assert not opt._fused
    assert any("fused_master_step=True does not apply (SGD is not torch.optim.AdamW"
               in str(w.message) for w in caught), [str(w.message) for w in caught]
    ref_model, _ = _train(False, steps=2, make_opt=sgd)
    _same(ref_model, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, opt = _train(True, steps=1, make_opt=lambda ps: torch.optim.AdamW(ps, amsgrad=True))
    assert not opt._fused and any("amsgrad=True" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(True, steps=1, precision="fp32")
    assert any("does not apply (precision fp32" in str(w.message) for w in caught)
    with pytest.raises(TypeError, match="fused_master_step must be None, True or False"):
        MixedPrecision("bf16", fused_master_step="yes")


def test_default_fuses_where_it_applies_and_falls_back_without_a_warning(caplog):
    """MixedPrecision's default (None): AdamW takes the fused step, SGD and fp32 the usual one,
    with no warning (nobody asked for the fused step), the reason logged once at INFO; False
    keeps the two-pass step."""
    from fp8boost import _state
    _state.forget_logged("fused-master-step-auto-SGD is not torch.optim.AdamW or Adam")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        _, adamw = _train(None, steps=1)
        _, sgd = _train(None, steps=1, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1))
        _train(None, steps=1, precision="fp32")
        _, off = _train(False, steps=1)
    assert adamw._fused and not sgd._fused and not off._fused
    assert not [w for w in caught if "fused_master_step" in str(w.message)], \
        [str(w.message) for w in caught]
    assert "fused master step does not apply (SGD is not torch.optim.AdamW" in caplog.text
    assert ZeroOptimizer(torch.optim.AdamW(nn.Linear(4, 4).to(torch.bfloat16).parameters())
                         )._fused is False  # direct ZeroOptimizer use keeps its old default


def test_zero_optimizer_fused_step_needs_one_rank_and_masters():
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = ZeroOptimizer(torch.optim.AdamW(layer.parameters()), master_weights=False,
                            fused_master_step=True)
    assert not opt._fused and any("master_weights=False" in str(w.message) for w in caught)


def test_triton_fused_adamw_kernel_in_the_interpreter():
    """Runs the kernel test below in a child process with ``TRITON_INTERPRET=1``."""
    if _CHILD:
        pytest.skip("already inside the interpreter child process")
    env = {**os.environ, "TRITON_INTERPRET": "1", "FP8BOOST_FUSED_STEP_INTERP_CHILD": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{os.path.abspath(__file__)}::test_kernel_matches_torch_arithmetic"],
                          env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0 and "1 passed" in tail and "skipped" not in tail, tail


def test_kernel_matches_torch_arithmetic():
    if not _CHILD:
        pytest.skip("runs in a child process (see test_triton_fused_adamw_kernel_in_the_interpreter)")
    from fp8boost.parallel.zero import fused_step

    torch.manual_seed(0)
    n = 3 * 2048 + 77  # ragged tail: the mask
    master = torch.randn(n + 5)  # padded past n, as a master chunk may be
    param = master[:n].to(torch.bfloat16).clone()
    opt = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.05)
    ref_master = master.clone()
    ref_state = {"exp_avg": torch.zeros(n + 5), "exp_avg_sq": torch.zeros(n + 5)}
    for step in (1, 2, 3):
        grad = (torch.randn(n) * 10 ** (step - 2)).to(torch.bfloat16)
        version = param._version
        fused_step.fused_adamw_step(opt, [master], [grad], [param], grad_mul=0.75)
        assert param._version > version  # the FP8 weight cache sees the new weight
        fused_step._torch_update(grad, ref_master[:n], ref_state["exp_avg"][:n],
                                 ref_state["exp_avg_sq"][:n], 1e-2, 0.9, 0.999, 1e-8, 0.05,
                                 float(step), 0.75)
        torch.testing.assert_close(master, ref_master, rtol=2e-6, atol=1e-8)
        # m + (1-b1)(g - m) rounds differently from torch's CPU lerp where g ~ m: FP32 noise
        torch.testing.assert_close(opt.state[master]["exp_avg"], ref_state["exp_avg"],
                                   rtol=2e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[master]["exp_avg_sq"], ref_state["exp_avg_sq"],
                                   rtol=2e-6, atol=1e-9)
        assert torch.equal(master[n:], ref_master[n:])  # padding untouched
        # The interpreter truncates BF16 stores: within one BF16 ulp of the rounded master.
        ulp = ref_master[:n].abs().clamp_min(1e-30) * 2 ** -7
        assert ((param.float() - ref_master[:n]).abs() <= ulp).all()
    assert float(opt.state[master]["step"]) == 3.0
    # A strided parameter cannot be indexed flat: torch ops update it, with a warning.
    w = torch.randn(64, 32).to(torch.bfloat16).t()  # [32, 64], not contiguous
    m2 = w.float().reshape(-1).clone()
    opt2 = torch.optim.AdamW([m2], lr=1e-2)
    g2 = torch.randn(w.numel()).to(torch.bfloat16)
    ref = m2.clone()
    with pytest.warns(UserWarning, match="non-contiguous parameter or gradient with torch ops"):
        fused_step.fused_adamw_step(opt2, [m2], [g2], [w])
    fused_step._torch_update(g2, ref, torch.zeros_like(ref), torch.zeros_like(ref), 1e-2, 0.9,
                             0.999, 1e-8, 1e-2, 1.0, 1.0)
    assert torch.equal(m2, ref) and torch.equal(w, ref.view(32, 64).to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_step_kernel_on_cuda_matches_torch_fused_adamw():
    """On the GPU the Triton kernel against torch's fused AdamW (the bench's optimizer), with a
    clipped step: FP32 masters and moments to FP32 rounding noise, parameters to one BF16 ulp."""
    def adamw(ps):
        return torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.1, fused=True)

    ref_model, ref_opt = _train(False, steps=5, max_norm=0.5, make_opt=adamw, device="cuda")
    model, opt = _train(True, steps=5, max_norm=0.5, make_opt=adamw, device="cuda")
    assert opt._fused and not ref_opt._fused
    for m, r in zip(opt.masters, ref_opt.masters):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
        s, t = opt.optim.state[m], ref_opt.optim.state[r]
        assert s["step"].device == t["step"].device and float(s["step"]) == float(t["step"]) == 5
        torch.testing.assert_close(s["exp_avg"], t["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(s["exp_avg_sq"], t["exp_avg_sq"], rtol=1e-5, atol=1e-9)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == torch.bfloat16
        ulp = q.float().abs().clamp_min(1e-30) * 2 ** -7
        assert ((p.float() - q.float()).abs() <= ulp).all()
        assert not torch.equal(p, torch.zeros_like(p))
