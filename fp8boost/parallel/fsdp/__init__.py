"""FSDP2 (``fully_shard``) wiring: FP8 weights all-gathered as FP8, FP8 gradient reduce-scatter."""
