"""``fp8boost.colossal.testing`` keeps the contract of ``colossalai.testing`` that Colossal-AI's
own tests (and users' tests written like them) rely on: ``parameterize`` loops inside a spawned
function and hides its arguments from pytest, ``spawn`` passes ``rank, world_size, port``,
``rerun_*`` retry only matching failures, ``check_state_dict_equal`` recurses."""
from __future__ import annotations

import inspect
import os

import pytest
import torch

import fp8boost.colossal as colossalai
from fp8boost.colossal.testing import (DummyDataloader, check_state_dict_equal,
                                       clear_cache_before_run, free_port, parameterize,
                                       rerun_if_address_is_in_use, rerun_on_exception, seed_all,
                                       skip_if_not_enough_gpus, spawn)


def test_reached_as_colossalai_testing():
    assert colossalai.testing.spawn is spawn
    from fp8boost.colossal.testing.random import seed_all as seed_all_2
    from fp8boost.colossal.testing.utils import spawn as spawn_2
    assert (seed_all_2, spawn_2) == (seed_all, spawn)


def test_parameterize_loops_outermost_first_and_passes_keywords():
    calls = []

    @clear_cache_before_run()
    @parameterize("a", [1, 2])
    @parameterize("b", ["x", "y"])
    def f(a, b, c):
        calls.append((a, b, c))

    assert f(c=0) is None
    assert calls == [(1, "x", 0), (1, "y", 0), (2, "x", 0), (2, "y", 0)]
    # pytest reads the signature: the parameterized names must not look like fixtures
    assert list(inspect.signature(f).parameters) == ["c"]


@clear_cache_before_run()
@parameterize("value", [3, 4])
def test_parameterized_test_is_collected_without_fixtures(value):
    assert value in (3, 4)


def test_rerun_on_exception_retries_only_matching_failures():
    tries = []

    @rerun_on_exception(RuntimeError, pattern=r"^retry me$", max_try=3)
    def flaky(msg):
        tries.append(msg)
        raise RuntimeError(msg)

    with pytest.raises(RuntimeError):
        flaky("retry me")
    assert len(tries) == 3  # max_try calls in all, then the error
    tries.clear()
    with pytest.raises(RuntimeError):
        flaky("other")
    assert len(tries) == 1  # no match: raised at once
    with pytest.raises(TypeError):
        rerun_on_exception(max_try=1.5)


def test_rerun_if_address_is_in_use_keeps_the_signature():
    @rerun_if_address_is_in_use()
    def test_x(a, b=1):
        return a + b

    assert test_x(1) == 2 and list(inspect.signature(test_x).parameters) == ["a", "b"]


def test_skip_if_not_enough_gpus_does_not_run():
    ran = []
    skip_if_not_enough_gpus(10_000)(lambda: ran.append(1))()
    skip_if_not_enough_gpus(0)(lambda: ran.append(2))()
    assert ran == [2]


def _record(rank, world_size, port, folder):
    with open(os.path.join(folder, str(rank)), "w") as f:
        f.write(f"{world_size} {port}")


def test_spawn_passes_rank_world_size_and_one_port(tmp_path):
    spawn(_record, nprocs=2, folder=str(tmp_path))
    seen = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(seen) == ["0", "1"] and seen["0"] == seen["1"]
    world_size, port = map(int, seen["0"].split())
    assert world_size == 2 and 20000 <= port <= 65000
    assert 20000 <= free_port() <= 65000


def test_check_state_dict_equal_recurses_and_fails_on_difference():
    a = {"w": torch.ones(3), "state": {0: {"step": 2, "exp_avg": torch.zeros(2)}},
         "groups": [{"lr": 0.1, "params": [0]}]}
    b = {"w": torch.ones(3, dtype=torch.float64), "state": {0: {"step": 2,
         "exp_avg": torch.zeros(2) + 1e-5}}, "groups": [{"lr": 0.1, "params": [0]}]}
    check_state_dict_equal(a, b, ignore_dtype=True)
    with pytest.raises(AssertionError):
        check_state_dict_equal(a, b)  # dtypes differ
    with pytest.raises(AssertionError):
        check_state_dict_equal(a, {**b, "w": torch.full((3,), 2.0)}, ignore_dtype=True)
    with pytest.raises(AssertionError):
        check_state_dict_equal(a, {"w": torch.ones(3)})


def test_seed_all_and_dummy_dataloader():
    seed_all(5)
    x = torch.rand(2)
    seed_all(5)
    assert torch.equal(x, torch.rand(2))
    loader = DummyDataloader(lambda: torch.zeros(1), length=3)
    assert len(loader) == 3 and len(list(loader)) == 3 and len(list(loader)) == 3
