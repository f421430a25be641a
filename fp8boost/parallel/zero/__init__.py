"""ZeRO stage 1/2: FP32 master weights and optimizer state sharded over data-parallel ranks."""
from .loss_scaler import DynamicLossScaler
from .optimizer import ZeroOptimizer
from .sharding import ParamShard, chunk_size, make_shard

__all__ = ["ZeroOptimizer", "DynamicLossScaler", "ParamShard", "chunk_size", "make_shard"]
