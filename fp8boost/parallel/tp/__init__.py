"""Tensor and sequence parallelism: plans for HF models, the region collectives, the vocab-parallel loss."""
from .apply import TpState, apply_tp
from .loss import HfVocabParallelLoss, vocab_parallel_cross_entropy
from .policy import TpPlan, check_plan, hf_decoder_plan, resolve_plan

__all__ = ["TpPlan", "TpState", "apply_tp", "check_plan", "hf_decoder_plan", "resolve_plan",
           "vocab_parallel_cross_entropy", "HfVocabParallelLoss"]
