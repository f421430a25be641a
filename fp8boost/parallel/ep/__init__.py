"""Expert parallelism: experts sharded over the ``ep`` mesh axis, tokens moved to them.

The ep and moe-dp axes are part of the topology (:class:`~fp8boost.parallel.mesh.ParallelDims`
and its :class:`~fp8boost.parallel.mesh.Topology`); this package takes its groups from there.

``dispatch``  the uneven all-to-alls: token dispatch (FP8 rows on request) and combine
``experts``   :class:`EpExperts`: a rank's share of a fused-expert module, routed through them
``gather``    whole experts for checkpoints and exports
``grads``     gradient reduction: non-expert over dp, expert over moe-dp; ZeRO's ep hooks
"""
from .dispatch import AllToAll, Splits, combine, dispatch, fp8_rows_a2a, plan_splits
from .experts import (EpExperts, check_expert_split, expert_params, expert_spec_of, find_experts,
                      shard_experts)
from .gather import full_expert_weights, gathered_experts, whole_experts
from .grads import (Stage0Optimizer, average_over_ep, counted_elsewhere, reduce_moe_gradients,
                    register_ep_hooks)

__all__ = ["AllToAll", "EpExperts", "Splits", "Stage0Optimizer", "average_over_ep",
           "check_expert_split", "combine", "counted_elsewhere", "dispatch", "expert_params",
           "expert_spec_of", "find_experts", "fp8_rows_a2a", "full_expert_weights",
           "gathered_experts", "plan_splits", "reduce_moe_gradients", "register_ep_hooks",
           "shard_experts", "whole_experts"]
