"""A group fp8boost created is destroyed at interpreter exit when the script did not: about one
run in ten of the README's 2-rank example aborted in teardown without it ("terminate called
without an active exception" after its last line)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit
import torch.distributed as dist
from fp8boost.parallel.distributed import init_distributed
init_distributed()
assert dist.is_initialized()
atexit._run_exitfuncs()  # what interpreter exit runs
print("destroyed" if not dist.is_initialized() else "still initialized")
"""


def test_group_created_by_fp8boost_is_destroyed_at_exit():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("destroyed")


def test_leaving_without_peers_says_so(monkeypatch, caplog):
    """A teardown barrier that fails (a peer exited or crashed) is not swallowed silently:
    the rank logs that it leaves without its peers, then destroys its group."""
    import logging

    import torch.distributed as dist

    from fp8boost import _state
    from fp8boost.parallel import distributed

    destroyed = []

    def barrier(*_a, **_k):
        raise RuntimeError("Rank 0 timed out in monitoredBarrier")

    for name, fn in (("get_backend", lambda *a: "gloo"), ("get_world_size", lambda *a: 2),
                     ("get_rank", lambda *a: 1), ("monitored_barrier", barrier),
                     ("destroy_process_group", lambda *a: destroyed.append(True))):
        monkeypatch.setattr(dist, name, fn)
    _state.forget_logged("leave-barrier-failed")
    with caplog.at_level(logging.WARNING, logger="fp8boost.plugins.distributed"):
        distributed.leave_process_group()
    assert destroyed == [True]
    assert "rank 1 leaves the process group without its peers" in caplog.text, caplog.text
    assert "timed out in monitoredBarrier" in caplog.text


def _leave_subgroup(rank: int, world: int) -> list:
    import torch
    import torch.distributed as dist

    from fp8boost.colossal.cluster import DistCoordinator

    sub = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    calls = []
    real = dist.monitored_barrier
    dist.monitored_barrier = lambda *a, **k: calls.append(k.get("group")) or real(*a, **k)
    try:
        DistCoordinator().destroy(sub)  # the subgroup's ranks meet, then destroy it
    finally:
        dist.monitored_barrier = real
    dist.all_reduce(t)  # the default group is untouched
    return [calls == [sub], t.item()]


def test_coordinator_destroys_a_subgroup_with_its_ranks_together():
    from tests.dist_utils import run_distributed
    assert run_distributed(_leave_subgroup, 2) == [[True, 4.0], [True, 4.0]]
