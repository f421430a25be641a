"""ZeRO stage 1/2: FP32 master weights and optimizer state sharded over data-parallel ranks.

``MasterWeightOptimizer`` is the master-weight optimizer of one data-parallel rank;
``ZeroOptimizer`` adds the sharding over ``dp_group`` on top (and is what the plugins build,
also for a single rank).
"""
from .loss_scaler import DynamicLossScaler
from .master import MasterWeightOptimizer
from .optimizer import ZeroOptimizer
from .sharding import ParamShard, chunk_size, make_shard

__all__ = ["ZeroOptimizer", "MasterWeightOptimizer", "DynamicLossScaler", "ParamShard",
           "chunk_size", "make_shard"]
