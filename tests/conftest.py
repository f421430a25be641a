import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "2")


def _has_fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with FP8 tensor cores (sm89+)")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not _has_fp8_gpu():
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and not (_has_fp8_gpu() and torch.cuda.device_count() >= 2):
            item.add_marker(skip_multi)
