"""fp8boost.colossal mirrors Colossal-AI's module paths, names and parameter names (issue 25).

Signatures are pinned with ``inspect``: a Colossal-AI script passes the same keywords here.
The expected names are Colossal-AI's (colossalai/initialize.py, accelerator, cluster,
logging, utils, nn/optimizer/hybrid_adam.py, nn/lr_scheduler/cosine.py, booster).
"""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest


def _params(obj) -> list[str]:
    return [n for n in inspect.signature(obj).parameters if n != "self"]


MODULES = {
    "fp8boost.colossal": ["launch_from_torch", "launch"],
    "fp8boost.colossal.initialize": ["launch_from_torch", "launch"],
    "fp8boost.colossal.accelerator": ["get_accelerator", "set_accelerator", "auto_set_accelerator",
                                      "BaseAccelerator", "CudaAccelerator", "CpuAccelerator"],
    "fp8boost.colossal.cluster": ["DistCoordinator"],
    "fp8boost.colossal.logging": ["get_dist_logger", "DistributedLogger",
                                  "disable_existing_loggers"],
    "fp8boost.colossal.utils": ["get_current_device", "set_seed"],
    "fp8boost.colossal.nn": ["optimizer", "lr_scheduler"],
    "fp8boost.colossal.nn.optimizer": ["HybridAdam"],
    "fp8boost.colossal.nn.lr_scheduler": ["CosineAnnealingWarmupLR"],
    "fp8boost.colossal.booster": ["Booster", "Plugin"],
    "fp8boost.colossal.booster.plugin": ["Plugin", "TorchDDPPlugin", "LowLevelZeroPlugin",
                                         "GeminiPlugin", "TorchFSDPPlugin",
                                         "HybridParallelPlugin"],
}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_path_imports_and_names_exist(module):
    mod = importlib.import_module(module)
    for name in MODULES[module]:
        assert hasattr(mod, name), f"{module}.{name} is missing"


def test_signatures_use_colossal_ai_parameter_names():
    from fp8boost.colossal import initialize, launch, launch_from_torch
    from fp8boost.colossal.logging import get_dist_logger
    from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
    from fp8boost.colossal.nn.optimizer import HybridAdam

    assert launch_from_torch is initialize.launch_from_torch
    assert _params(launch_from_torch) == ["backend", "seed", "verbose", "config"]
    sig = inspect.signature(launch_from_torch)
    assert (sig.parameters["backend"].default, sig.parameters["seed"].default,
            sig.parameters["verbose"].default) == ("nccl", 1024, True)
    assert _params(launch) == ["rank", "world_size", "host", "port", "backend", "local_rank",
                               "seed", "verbose", "config"]
    assert _params(HybridAdam.__init__) == [
        "model_params", "lr", "bias_correction", "betas", "eps", "weight_decay", "adamw_mode",
        "nvme_offload_fraction", "nvme_offload_dir", "defaults"]
    hp = inspect.signature(HybridAdam.__init__).parameters
    assert (hp["lr"].default, hp["betas"].default, hp["eps"].default, hp["weight_decay"].default,
            hp["adamw_mode"].default) == (1e-3, (0.9, 0.999), 1e-8, 0, True)
    assert _params(CosineAnnealingWarmupLR.__init__) == [
        "optimizer", "total_steps", "warmup_steps", "eta_min", "last_epoch"]
    assert _params(get_dist_logger) == ["name"]
    assert inspect.signature(get_dist_logger).parameters["name"].default == "colossalai"
    logger = get_dist_logger()
    for method in ("info", "warning", "error", "debug"):
        assert _params(getattr(logger, method)) == ["message", "ranks"]


def test_accelerator_and_coordinator_methods():
    from fp8boost.colossal.accelerator import get_accelerator
    from fp8boost.colossal.cluster import DistCoordinator

    acc = get_accelerator()
    for name in ("get_current_device", "current_device", "set_device", "device_count",
                 "synchronize", "empty_cache", "manual_seed", "manual_seed_all",
                 "max_memory_allocated", "memory_allocated", "reset_peak_memory_stats",
                 "get_rng_state", "set_rng_state", "is_available"):
        assert callable(getattr(acc, name)), name
    assert acc.name == "cpu" and acc.communication_backend == "gloo"  # the CPU test machine
    for name in ("is_master", "is_node_master", "is_last_process", "print_on_master",
                 "print_on_node_master", "block_all", "priority_execution", "on_master_only",
                 "destroy"):
        assert callable(getattr(DistCoordinator, name)), name
    assert _params(DistCoordinator.priority_execution) == ["executor_rank", "process_group"]
    assert _params(DistCoordinator.print_on_master) == ["msg", "process_group"]


def test_import_does_nothing():
    """Importing the package imports no torch (hence probes no device, forms no group)."""
    code = ("import sys, fp8boost.colossal as c; assert 'torch' not in sys.modules; "
            "import logging, fp8boost.colossal.logging as l; "
            "assert logging.getLogger is not None and l is not logging; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"fp8boost.colossal.initialize"}))
def test_docstring_examples_run(module):
    """Every public entry point's example runs (those needing a job are marked +SKIP)."""
    import doctest

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
