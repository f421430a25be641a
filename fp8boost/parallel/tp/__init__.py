"""Tensor and sequence parallelism (DTensor styles, HF model policies): HybridParallelPlugin."""
