"""DeepSpeed-Ulysses sequence parallelism: all-to-all attention over an ``sp`` mesh axis.

``seq_to_heads`` / ``heads_to_seq`` are the differentiable all-to-alls (FP8 forward payload on
request); ``apply_ulysses`` wires a HF causal LM (attention function + chunking forward +
global loss); ``check_ulysses`` validates head counts before any collective.
"""
from .all_to_all import heads_to_seq, seq_to_heads
from .attention import ATTN_NAME, UlyssesAttention, ulysses_attention_forward
from .model import UlyssesForward, apply_ulysses, check_ulysses

__all__ = ["seq_to_heads", "heads_to_seq", "ATTN_NAME", "UlyssesAttention",
           "ulysses_attention_forward", "UlyssesForward", "apply_ulysses", "check_ulysses"]
