"""``colossalai.testing``: the helpers Colossal-AI's own tests (and users' tests written like
them) import: ``spawn`` processes, ``parameterize`` inside a spawned function, rerun on a taken
port, compare state dicts.

Same names, signatures and semantics as Colossal-AI's; on a machine without CUDA the cache
clearing does nothing and spawned ranks form a gloo group through ``colossalai.launch``.

Example:
    >>> from fp8boost.colossal.testing import parameterize
    >>> seen = []
    >>> @parameterize("n", [1, 2])
    ... def f(n):
    ...     seen.append(n)
    >>> f(); seen
    [1, 2]
"""
from .comparison import (assert_close, assert_close_loose, assert_equal, assert_equal_in_group,
                         assert_not_equal, check_state_dict_equal)
from .random import seed_all
from .utils import (DummyDataloader, clear_cache_before_run, free_port, parameterize,
                    rerun_if_address_is_in_use, rerun_on_exception, skip_if_not_enough_gpus,
                    spawn)

__all__ = ["assert_close", "assert_close_loose", "assert_equal", "assert_equal_in_group",
           "assert_not_equal", "check_state_dict_equal", "seed_all", "DummyDataloader",
           "clear_cache_before_run", "free_port", "parameterize", "rerun_if_address_is_in_use",
           "rerun_on_exception", "skip_if_not_enough_gpus", "spawn"]
