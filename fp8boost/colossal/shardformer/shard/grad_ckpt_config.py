"""``colossalai.shardformer.shard.grad_ckpt_config``: Colossal-AI's gradient checkpointing
configs, defined in :mod:`fp8boost.plugins.grad_ckpt_config` (the plugins read them; this
module only gives them Colossal-AI's path).

Example:
    >>> cfg = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[4, 2])
    >>> cfg.get_num_ckpt_layers(stage=1, num_stages=2, num_layers=6)
    2
"""
from fp8boost.plugins.grad_ckpt_config import (GradientCheckpointConfig,
                                               PipelineGradientCheckpointConfig)

__all__ = ["GradientCheckpointConfig", "PipelineGradientCheckpointConfig"]
