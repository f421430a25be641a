"""Fixtures shared by the Colossal-AI surface tests."""
import pytest
import torch.distributed as dist


@pytest.fixture
def group(monkeypatch):
    """No process group before the test, none after it, and the launcher's environment
    (``RANK``, ``WORLD_SIZE``, ...) restored: ``colossalai.launch`` and the plugins set it."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.setenv(var, "")  # recorded, so teardown restores the environment
        monkeypatch.delenv(var)
    assert not dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
