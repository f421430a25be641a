"""DistributedDataParallel communication hooks (FP8 gradient all-reduce)."""
