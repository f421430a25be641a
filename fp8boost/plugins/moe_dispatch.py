"""Old home of expert parallelism's dispatch and combine: now :mod:`fp8boost.parallel.ep`.

Re-exported here because tests and scripts (``examples/moe.py``) import these names from
``fp8boost.plugins.moe_dispatch``; new code imports from ``fp8boost.parallel.ep``.
"""
from fp8boost.parallel.ep.dispatch import E4M3_MAX, AllToAll, fp8_rows_a2a  # noqa: F401
from fp8boost.parallel.ep.experts import (EpExperts, expert_params, expert_spec_of,  # noqa: F401
                                          find_experts, shard_experts)
from fp8boost.parallel.ep.gather import gathered_experts, whole_experts  # noqa: F401
