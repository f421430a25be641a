"""Old home of ``MoeHybridParallelPlugin``'s rank layout and gradient reduction.

The layout is now the topology's (:class:`~fp8boost.parallel.mesh.ParallelDims` with ``ep``
and ``moe_dp_outside``; its :class:`~fp8boost.parallel.mesh.Topology` gives the ep and moe-dp
groups), the reduction lives in :mod:`fp8boost.parallel.ep.grads`. Re-exported here because
tests and scripts import these names from ``fp8boost.plugins.moe_grads``.
"""
from fp8boost.parallel.ep.grads import (Stage0Optimizer, average_over_ep,  # noqa: F401
                                        reduce_moe_gradients)
from fp8boost.parallel.mesh import ParallelDims

# ``MoeDims(dp=, pp=, tp=, world_size=, ep=, moe_dp_outside=)`` was ParallelDims with the MoE
# layout; ParallelDims now takes those fields itself, with the same coordinates.
MoeDims = ParallelDims
