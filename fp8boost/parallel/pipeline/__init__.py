"""Pipeline parallelism (``torch.distributed.pipelining`` stages and schedules)."""
