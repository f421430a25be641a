"""Issue 37, item 2: Colossal-AI's wrapper surface on fp8boost's boosted objects.

* ``fp8boost.colossal.interface``: ``isinstance`` holds for what every plugin's ``boost``
  returns, and every ``OptimizerWrapper`` method works on the DDP, LowLevelZero, Gemini,
  TorchFSDP and Hybrid boosted optimizers (2 gloo ranks, ``interface_dist.py``: gradients,
  norms and clipped steps against a single-process torch reference, bit-exact ``state_dict``
  resume), and single-process for bf16/fp16 (loss-scaled) master weights;
* the long module paths import and hold the names Colossal-AI's tests take from them;
* ``checkpoint_io.GeneralCheckpointIO`` round-trips plain torch objects; the accelerator
  methods; ``Linear1D_Col``/``Linear1D_Row`` refuse with the alternative.

Tolerances: FP32 values (norms, gradients) 1e-6; the bf16/fp16 norms are computed from the same
gradients in FP32 on both sides (rel. 1e-6: only the summation order differs); resumes are
compared bit for bit. Runtime: one 2-rank spawn (~10 s) plus ~10 s of single-process tests.
"""
from __future__ import annotations

import importlib
import io
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.colossal import interface_dist
from tests.dist_utils import run_distributed
from tests.plugins import helpers as H

LONG_PATHS = {
    "fp8boost.colossal.interface": ["OptimizerWrapper", "ModelWrapper", "AMPModelMixin"],
    "fp8boost.colossal.interface.optimizer": ["OptimizerWrapper"],
    "fp8boost.colossal.interface.model": ["ModelWrapper", "AMPModelMixin"],
    "fp8boost.colossal.booster.booster": ["Booster"],
    "fp8boost.colossal.booster.plugin.hybrid_parallel_plugin": ["HybridParallelPlugin",
                                                                "HybridParallelModule"],
    "fp8boost.colossal.booster.plugin.moe_hybrid_parallel_plugin": ["MoeHybridParallelPlugin"],
    "fp8boost.colossal.booster.plugin.dp_plugin_base": ["DPPluginBase"],
    "fp8boost.colossal.booster.accelerator": ["Accelerator"],
    "fp8boost.colossal.booster.mixed_precision": ["MixedPrecision", "mixed_precision_factory"],
    "fp8boost.colossal.lazy.lazy_init": ["LazyInitContext", "LazyTensor"],
    "fp8boost.colossal.checkpoint_io": ["CheckpointIO", "GeneralCheckpointIO",
                                        "create_pinned_state_dict"],
    "fp8boost.colossal.checkpoint_io.utils": ["create_pinned_state_dict"],
    "fp8boost.colossal.checkpoint_io.general_checkpoint_io": ["GeneralCheckpointIO"],
    "fp8boost.colossal.shardformer.layer": ["Linear1D_Col", "Linear1D_Row"],
}
DOCTESTED = ("fp8boost.colossal.interface", "fp8boost.colossal.interface.optimizer",
             "fp8boost.colossal.interface.model", "fp8boost.colossal.booster.booster",
             "fp8boost.colossal.booster.accelerator", "fp8boost.colossal.booster.mixed_precision",
             "fp8boost.colossal.checkpoint_io.general_checkpoint_io",
             "fp8boost.colossal.shardformer.layer", "fp8boost.parallel.optimizer_surface",
             "fp8boost.parallel.zero.full_state")


def _boost(precision: str = "fp32", optim=torch.optim.SGD, **mp):
    from fp8boost.booster import Booster, MixedPrecision

    model = H.make_mlp()
    booster = Booster(mixed_precision=MixedPrecision(precision, **mp), device="cpu")
    model, opt, *_ = booster.boost(model, optim(model.parameters(), lr=0.1))
    return booster, model, opt


def _backward(booster, model, opt, step: int = 0) -> None:
    x, y = H.global_batch(step)
    booster.backward(F.mse_loss(model(x).float(), y), opt)


# ------------------------------------------------------------------------ every plugin, 2 ranks
def test_wrapper_surface_on_every_plugin_and_zero_state_loads_in_one_process():
    kinds = ("ddp", "zero2", "gemini", "torchfsdp", "hybrid")
    saved = torch.load(io.BytesIO(run_distributed(interface_dist.run_all, 2, kinds)[0]),
                       weights_only=True)
    # The ZeRO-2 state dict (Adam, 2 ranks) holds torch's layout at full shapes: it loads into
    # a one-process bf16 optimizer, whose FP32 masters and moments then equal it bit for bit.
    state = saved["state"]
    assert [tuple(state["state"][i]["exp_avg"].shape) for i in range(2)] == [(64, 32), (64,)]
    assert all(torch.equal(state["state"][i]["master_param"], w)
               for i, w in enumerate(saved["weights"].values()))
    _, model, opt = _boost("bf16", optim=torch.optim.Adam)
    opt.load_state_dict(state)
    assert all(torch.equal(m, w) for m, w in zip(opt.full_master_params(),
                                                 saved["weights"].values()))
    again = opt.state_dict()["state"]
    assert all(torch.equal(again[i][k], v) for i in state["state"]
               for k, v in state["state"][i].items())
    assert torch.equal(model.unwrap()[0].weight, saved["weights"]["0.weight"].bfloat16())


# ------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("module", sorted(LONG_PATHS))
def test_long_module_paths_import(module):
    mod = importlib.import_module(module)
    for name in LONG_PATHS[module]:
        assert hasattr(mod, name), f"{module}.{name} is missing"


@pytest.mark.parametrize("module", DOCTESTED)
def test_docstring_examples_run(module):
    import doctest

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_isinstance_and_direct_construction():
    from fp8boost.colossal.booster.plugin.hybrid_parallel_plugin import HybridParallelModule
    from fp8boost.colossal.interface import ModelWrapper, OptimizerWrapper

    for precision in ("fp32", "bf16"):  # the plugins' OptimizerWrapper, then a ZeroOptimizer
        _, model, opt = _boost(precision)
        assert isinstance(opt, OptimizerWrapper) and isinstance(model, ModelWrapper)
        assert not isinstance(model, HybridParallelModule)
    layer = torch.nn.Linear(2, 2)
    plain = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert not isinstance(plain, OptimizerWrapper) and not isinstance(layer, ModelWrapper)

    class Mine(OptimizerWrapper):  # a user's subclass keeps plain subclass semantics
        pass

    assert not isinstance(opt, Mine) and isinstance(Mine(plain), OptimizerWrapper)
    wrapped = ModelWrapper(layer)
    assert wrapped.unwrap() is layer and torch.equal(wrapped(torch.ones(1, 2)),
                                                     layer(torch.ones(1, 2)))
    with pytest.raises(TypeError, match="booster.boost"):
        HybridParallelModule(layer)


@pytest.mark.parametrize("precision,norm_type", [("bf16", 2.0), ("fp16", 2.0), ("bf16", "inf")])
def test_clip_grad_by_norm_matches_torch_on_master_weights(precision, norm_type):
    """The norm of the unscaled gradients, as torch computes it over the same FP32 values."""
    booster, model, opt = _boost(precision)
    _backward(booster, model, opt)
    scale = opt.loss_scaler.scale if opt.loss_scaler is not None else 1.0
    grads = [p.grad.float() / scale for p in model.unwrap().parameters()]
    copies = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for c, g in zip(copies, grads):
        c.grad = g.clone()
    want = float(torch.nn.utils.clip_grad_norm_(copies, 0.01, float(norm_type)))
    got = float(opt.clip_grad_by_norm(0.01, norm_type, foreach=True))
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)
    assert opt.get_grad_norm(float(norm_type)) == got
    with pytest.raises(ValueError, match="norm_type"):
        opt.get_grad_norm(1.0)
    with pytest.raises(TypeError, match="unexpected"):
        opt.clip_grad_by_norm(1.0, 2.0, False, "extra")


def test_get_grad_norm_and_nonfinite_check():
    booster, model, opt = _boost("bf16", max_norm=1e-3)
    assert opt.get_grad_norm() is None  # nothing measured yet
    _backward(booster, model, opt)
    opt.step()  # clips: max_norm > 0
    assert isinstance(opt.get_grad_norm(), float) and opt.get_grad_norm() > 1e-3
    booster, model, opt = _boost("fp32")
    _backward(booster, model, opt)
    model.unwrap()[0].weight.grad[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"), \
            pytest.warns(Warning, match="non-finite gradient"):  # the guard skips the step
        opt.clip_grad_by_norm(1.0, error_if_nonfinite=True)


def test_clip_grad_by_value_on_loss_scaled_master_gradients():
    booster, model, opt = _boost("fp16")
    before = [p.detach().float().clone() for p in model.unwrap().parameters()]
    _backward(booster, model, opt)
    scale = opt.loss_scaler.scale
    grads = [p.grad.float() / scale for p in model.unwrap().parameters()]
    opt.clip_grad_by_value(1e-3)  # on the unscaled values, not the scaled ones
    opt.step()
    for b, g, m in zip(before, grads, opt.full_master_params()):
        want = b - 0.1 * g.clamp(-1e-3, 1e-3)
        assert (m - want).abs().max() <= 1e-6


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_state_dict_round_trip_resumes_bit_exactly(precision):
    booster, model, opt = _boost(precision, optim=torch.optim.Adam)
    _backward(booster, model, opt, 0)
    opt.step()
    opt.zero_grad()
    saved_opt = interface_dist.snapshot(opt.state_dict())
    saved_model = interface_dist.snapshot(model.state_dict())
    assert set(saved_opt) == ({"state", "param_groups", "loss_scaler"} if precision == "fp16"
                              else {"state", "param_groups"})
    master = saved_opt["state"][0]["master_param"]
    assert master.dtype == torch.float32 and master.shape == (64, 32)
    runs = []
    for _ in range(2):
        _backward(booster, model, opt, 1)
        opt.step()
        opt.zero_grad()
        runs.append([m.clone() for m in opt.full_master_params()]
                    + [p.detach().clone() for p in model.parameters()])
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_plain_torch_state_dict_loads_and_model_loads_refresh_masters():
    booster, model, opt = _boost("bf16", optim=torch.optim.Adam)
    ref = H.make_mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    F.mse_loss(ref(H.global_batch(0)[0]), H.global_batch(0)[1]).backward()
    ref_opt.step()
    model.unwrap().load_state_dict(ref.state_dict())
    model.update_master_params()  # AMPModelMixin: masters re-read from the loaded weights
    opt.load_state_dict(ref_opt.state_dict())  # no master_param: the masters stay
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], ref_opt.state[ref[0].weight]
                       ["exp_avg"])
    assert torch.equal(opt.full_master_params()[0], ref[0].weight.detach().bfloat16().float())
    with torch.no_grad():
        zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(zeros)  # the wrapper's own load refreshes the masters too
    assert all(float(m.abs().sum()) == 0 for m in opt.full_master_params())
    with pytest.raises(ValueError, match="assign"):
        model.load_state_dict(zeros, assign=True)


def test_unwrap_get_param_grad_and_refusals():
    from fp8boost.colossal.interface import OptimizerWrapper

    booster, model, opt = _boost("bf16")
    assert opt.unwrap_model() is model and opt.unwrap() is opt.optim
    assert opt.parameters == [p for g in opt.optim.param_groups for p in g["params"]]
    x, y = H.global_batch(0)
    loss = F.mse_loss(model(x).float(), y)
    with pytest.raises(TypeError, match="inputs="):
        opt.backward(loss, [model.unwrap()[0].weight])
    first = model.unwrap()[0].weight
    opt.backward(loss, inputs=[first])  # only this one accumulates, as torch's inputs=
    assert first.grad is not None and model.unwrap()[2].weight.grad is None
    assert opt.get_param_grad(first) is first.grad
    assert opt.get_param_grad(model.unwrap()[2].weight) is None
    with pytest.raises(ValueError, match="not trained by this optimizer"):
        opt.get_param_grad(torch.nn.Parameter(torch.zeros(1)))
    with pytest.raises(NotImplementedError, match="param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(RuntimeError, match="knows no model"):
        OptimizerWrapper(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])).unwrap_model()
    with pytest.raises(ValueError, match="get_base_model"):
        _peft_like_unwrap()


def _peft_like_unwrap():
    from fp8boost.colossal.interface import ModelWrapper

    class PeftLike(torch.nn.Linear):  # what unwrap(unwrap_peft=True) recognises
        peft_config = {}

        def get_base_model(self):
            return self

    return ModelWrapper(PeftLike(2, 2)).unwrap(unwrap_peft=True)


def test_general_checkpoint_io_round_trips_plain_torch_objects(tmp_path):
    from fp8boost.colossal.booster import Booster
    from fp8boost.colossal.checkpoint_io import GeneralCheckpointIO
    from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR

    def build():
        model = H.make_mlp(seed=1)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        return model, opt, CosineAnnealingWarmupLR(opt, total_steps=10)

    model, opt, sched = build()
    F.mse_loss(model(H.global_batch(0)[0]), H.global_batch(0)[1]).backward()
    opt.step(), sched.step()
    ckpt = GeneralCheckpointIO()
    ckpt.save_model(model, str(tmp_path / "model.bin"))  # one file (safetensors inside)
    ckpt.save_model(model, str(tmp_path / "sharded"), True, True, "", 10, use_safetensors=True)
    ckpt.save_optimizer(opt, str(tmp_path / "optim.pt"))  # one torch.save file
    ckpt.save_optimizer(opt, str(tmp_path / "optim_dir"), shard=True)
    # Colossal-AI's use_async test names the file .safetensors: torch 2.13's torch.load(path)
    # would read it as safetensors
    ckpt.save_optimizer(opt, str(tmp_path / "optim.safetensors"), use_async=True)
    ckpt.save_lr_scheduler(sched, str(tmp_path / "sched.pt"))
    ckpt._sync_d2h(), ckpt._sync_io()
    for model_path, optim_path in (("model.bin", "optim.pt"), ("sharded", "optim_dir"),
                                   ("model.bin", "optim.safetensors")):
        new, new_opt, new_sched = build()
        ckpt.load_model(new, str(tmp_path / model_path))
        ckpt.load_optimizer(new_opt, str(tmp_path / optim_path))
        ckpt.load_lr_scheduler(new_sched, str(tmp_path / "sched.pt"))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     new.state_dict().values()))
        assert all(torch.equal(opt.state[p]["exp_avg"], new_opt.state[q]["exp_avg"])
                   for p, q in zip(model.parameters(), new.parameters()))
        assert new_sched.state_dict() == sched.state_dict()
    booster = Booster(device="cpu")
    assert isinstance(booster.checkpoint_io, GeneralCheckpointIO)
    assert booster.checkpoint_io.plugin is booster.plugin
    assert os.path.isfile(tmp_path / "model.bin") and os.path.isdir(tmp_path / "optim_dir")


def test_accelerator_methods():
    from fp8boost.colossal.accelerator import get_accelerator, set_accelerator

    set_accelerator("cpu")
    acc = get_accelerator()
    assert acc.name == "cpu" and acc.communication_backend == "gloo" and acc.is_available()
    assert acc.get_current_device() == torch.device("cpu") and acc.device_count() == 1
    acc.synchronize(), acc.empty_cache(), acc.manual_seed(3)
    acc.reset_max_memory_allocated(), acc.reset_max_memory_cached()
    for call in (acc.get_device_capability, acc.current_stream, lambda: acc.stream(None)):
        with pytest.raises(RuntimeError, match="name == 'cuda'"):
            call()


def test_refusals_name_the_alternative():
    from fp8boost.colossal.booster.accelerator import Accelerator
    from fp8boost.colossal.booster.mixed_precision import mixed_precision_factory
    from fp8boost.colossal.booster.plugin.dp_plugin_base import DPPluginBase
    from fp8boost.colossal.checkpoint_io import create_pinned_state_dict
    from fp8boost.colossal.shardformer.layer import Linear1D_Col, Linear1D_Row

    for layer in (Linear1D_Col, Linear1D_Row):
        with pytest.raises(NotImplementedError, match=r"HybridParallelPlugin\(tp_size=N\)"):
            layer.from_native_module(torch.nn.Linear(4, 4), process_group=None)
        with pytest.raises(NotImplementedError, match=layer.__name__):
            layer(4, 4)
    with pytest.raises(ValueError, match="'fp16', 'bf16', 'fp8'"):
        mixed_precision_factory("fp16_apex")
    with pytest.raises(ValueError, match="cpu"):
        Accelerator("tpu")
    assert Accelerator("cpu").configure_model(torch.nn.Linear(2, 2)).weight.device.type == "cpu"
    with pytest.raises(RuntimeError, match="launch_from_torch"):
        DPPluginBase()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            create_pinned_state_dict({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="num_threads"):
        create_pinned_state_dict({}, num_threads=0)
