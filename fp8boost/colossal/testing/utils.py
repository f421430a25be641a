"""``colossalai.testing.utils``: run a test function on several processes, once per parameter.

Example:
    >>> from fp8boost.colossal.testing.utils import free_port
    >>> 20000 <= free_port() <= 65000
    True
"""
from __future__ import annotations

import functools
import gc
import inspect
import random
import re
import socket
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.multiprocessing as mp

from fp8boost.colossal.accelerator import get_accelerator

__all__ = ["DummyDataloader", "clear_cache_before_run", "free_port", "parameterize",
           "rerun_if_address_is_in_use", "rerun_on_exception", "skip_if_not_enough_gpus",
           "spawn"]

#: the message a rendezvous gives when another job took the port between choice and bind
ADDRESS_IN_USE = r".*(A|a)ddress already in use.*"


def parameterize(argument: str, values: Sequence[Any]) -> Callable:
    """Call the decorated function once per value of ``argument`` (a loop, not pytest's
    collection: it works inside a spawned process). Stacked decorators nest, outermost first;
    the other arguments must be passed by keyword.

    Example:
        >>> @parameterize("x", [1, 2])
        ... @parameterize("y", ["a"])
        ... def f(x, y, z):
        ...     print(x, y, z)
        >>> f(z=0)
        1 a 0
        2 a 0
    """
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def each(**kwargs: Any) -> None:
            for value in values:
                func(**{argument: value}, **kwargs)
        # what is left to pass (pytest must not take the parameterized names for fixtures)
        sig = inspect.signature(func)
        each.__signature__ = sig.replace(
            parameters=[p for p in sig.parameters.values() if p.name != argument])
        return each
    return wrap


def rerun_on_exception(exception_type: type = Exception, pattern: Optional[str] = None,
                       max_try: Optional[int] = 5) -> Callable:
    """Rerun the decorated function when it raises ``exception_type`` whose message has a line
    matching ``pattern`` (any message when None), up to ``max_try`` calls in all (forever when
    None); the last failure is raised.

    Example:
        >>> calls = []
        >>> @rerun_on_exception(RuntimeError, pattern="^busy$", max_try=3)
        ... def f():
        ...     calls.append(1)
        ...     if len(calls) < 2:
        ...         raise RuntimeError("busy")
        >>> f(); len(calls)
        2
    """
    if max_try is not None and not isinstance(max_try, int):
        raise TypeError(f"max_try must be None or an int, got {type(max_try).__name__}")

    def matches(error: BaseException) -> bool:
        return pattern is None or any(re.match(pattern, line) for line in str(error).split("\n"))

    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            tries = 0
            while True:
                tries += 1
                try:
                    return func(*args, **kwargs)
                except exception_type as error:
                    if (max_try is not None and tries >= max_try) or not matches(error):
                        raise
        # pytest reads the wrapped signature (functools.wraps sets __wrapped__)
        run.__signature__ = inspect.signature(func)
        return run
    return wrap


def rerun_if_address_is_in_use() -> Callable:
    """Rerun a test (up to 5 times) whose spawned process failed because its rendezvous port
    was taken.

    Example:
        >>> @rerun_if_address_is_in_use()
        ... def test_something():
        ...     pass
    """
    return rerun_on_exception(mp.ProcessRaisedException, pattern=ADDRESS_IN_USE)


def skip_if_not_enough_gpus(min_gpus: int) -> Callable:
    """Run the decorated function only when at least ``min_gpus`` devices are visible
    (otherwise it returns None without running, as Colossal-AI's does).

    Example:
        >>> @skip_if_not_enough_gpus(min_gpus=10_000)
        ... def f():
        ...     raise AssertionError("not reached")
        >>> f()
    """
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> Any:
            if get_accelerator().device_count() >= min_gpus:
                return func(*args, **kwargs)
            return None
        return run
    return wrap


def free_port() -> int:
    """A port in [20000, 65000] that could be bound on localhost just now.

    Example:
        >>> isinstance(free_port(), int)
        True
    """
    while True:
        port = random.randint(20000, 65000)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("localhost", port))
            except OSError:
                continue
            return port


def spawn(func: Callable, nprocs: int = 1, **kwargs: Any) -> None:
    """Run ``func(rank, world_size=nprocs, port=<free port>, **kwargs)`` on ``nprocs`` new
    processes and wait for all; a failure in any raises
    ``torch.multiprocessing.ProcessRaisedException`` here. ``func`` usually calls
    ``colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port)``.

    Example:
        >>> def run(rank, world_size, port):
        ...     pass
        >>> spawn(run, nprocs=2)  # doctest: +SKIP
    """
    mp.spawn(functools.partial(func, world_size=nprocs, port=free_port(), **kwargs),
             nprocs=nprocs)


def clear_cache_before_run() -> Callable:
    """Free the device's cached memory, reset its peak counters and collect Python garbage
    before each call (only the garbage collection does anything on the CPU).

    Example:
        >>> @clear_cache_before_run()
        ... def f():
        ...     return 1
        >>> f()
    """
    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def run(*args: Any, **kwargs: Any) -> None:
            acc = get_accelerator()
            acc.empty_cache()
            acc.reset_peak_memory_stats()
            acc.synchronize()
            gc.collect()
            func(*args, **kwargs)  # Colossal-AI's wrapper returns None too
        return run
    return wrap


class DummyDataloader:
    """``length`` batches, each a fresh ``data_gen_fn()``; iterable again from the start.

    Example:
        >>> list(DummyDataloader(lambda: 7, length=2))
        [7, 7]
    """

    def __init__(self, data_gen_fn: Callable[[], Any], length: int = 10) -> None:
        self.data_gen_fn = data_gen_fn
        self.length = length

    def __iter__(self) -> Iterator[Any]:
        return (self.data_gen_fn() for _ in range(self.length))

    def __len__(self) -> int:
        return self.length
