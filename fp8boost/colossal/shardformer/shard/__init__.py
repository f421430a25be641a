"""``colossalai.shardformer.shard``: the gradient checkpointing configs."""
from .grad_ckpt_config import GradientCheckpointConfig, PipelineGradientCheckpointConfig

__all__ = ["GradientCheckpointConfig", "PipelineGradientCheckpointConfig"]
