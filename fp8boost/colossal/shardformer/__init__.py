"""``colossalai.shardformer`` names that training scripts import: the gradient checkpointing
configs (``fp8boost.colossal.shardformer.shard.grad_ckpt_config``).

Example:
    >>> from fp8boost.colossal.shardformer import PipelineGradientCheckpointConfig
    >>> PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5).get_num_ckpt_layers(0, 1, 8)
    4
"""
from .shard.grad_ckpt_config import GradientCheckpointConfig, PipelineGradientCheckpointConfig

__all__ = ["GradientCheckpointConfig", "PipelineGradientCheckpointConfig"]
