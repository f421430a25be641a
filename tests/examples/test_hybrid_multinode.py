"""The example with HybridParallelPlugin under a two-node torchrun, simulated on one machine.

Two ``torchrun --nnodes 2 --node_rank 0|1 --nproc_per_node 2`` launchers rendezvous on
localhost: 4 ranks, tp2 x dp2 with sequence parallelism, FP8 and FP8 communication. Ranks,
local ranks and node boundaries come from torchrun's environment (``LOCAL_WORLD_SIZE``): with
tp innermost, each tp group is one node's two processes. The run trains (loss falls, see
test_train_llama.py for the bound), saves, and resumes bit-exactly on the same layout.
"""
from __future__ import annotations

import socket
import subprocess
import sys

from tests.examples.test_train_llama import FAST, ROOT, SCRIPT, _assert_loss_falls, _env, _losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], timeout: float = 300) -> None:
    port = _free_port()
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
            "2", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    procs = [subprocess.Popen(base + ["--node_rank", str(n), str(SCRIPT), *args], cwd=ROOT,
                              env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert "span nodes" not in outs[0] + outs[1]  # tp groups stayed inside the nodes


def test_hybrid_tp2_sp_fp8_two_simulated_nodes_trains_and_resumes(tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    args = [*FAST, "--steps", "16", "--plugin", "hybrid", "--tp", "2", "--sp", "--zero", "1",
            "--use-fp8", "--fp8-comm"]
    _two_nodes(args + ["--out-dir", str(run_a), "--save-every", "8"])
    losses_a = _losses(run_a)
    assert sorted(losses_a) == list(range(1, 17))
    _assert_loss_falls(losses_a)
    _two_nodes(args + ["--out-dir", str(run_b), "--resume",
                       str(run_a / "checkpoints" / "step_00000008")])
    losses_b = _losses(run_b)
    assert {s: losses_a[s] for s in losses_b} == losses_b and sorted(losses_b) == list(range(9, 17))


def test_tp_groups_inside_nodes_follow_local_world_size():
    from fp8boost.plugins.hybrid_parallel_plugin import tp_within_node

    assert tp_within_node(2, 4, {"LOCAL_WORLD_SIZE": "2"})
    assert not tp_within_node(4, 4, {"LOCAL_WORLD_SIZE": "2"})
    assert tp_within_node(4, 8, {"LOCAL_WORLD_SIZE": "8"})
    assert tp_within_node(2, 2, {})  # no torchrun: one node
