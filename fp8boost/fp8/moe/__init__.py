"""FP8 experts of transformers MoE models: grouped FP8 GEMMs over tokens sorted by expert.

``detect``: structural detection of fused-expert modules; ``routing``: the sort by expert;
``quantize``: rowwise expert operands; ``gemm``: the grouped GEMMs (``torch._scaled_grouped_mm``
or emulated); ``function``: their autograd function; ``experts``: :class:`Fp8Experts`;
``choice``: the precision (FP8, FP8 with a BF16 weight gradient, or BF16) each module trains
in on a GPU, timed once per shape; ``convert``: the hook ``convert_to_fp8`` /
``convert_from_fp8`` call.
"""
from .convert import experts_back, experts_decision, experts_skip_reason
from .detect import ExpertSpec, find_expert_spec
from .experts import Fp8Experts, fp8_experts, is_fp8_experts
from .function import GroupedOptions, grouped_linear
from .routing import Routing, route

__all__ = ["ExpertSpec", "Fp8Experts", "GroupedOptions", "Routing", "experts_back",
           "experts_decision", "experts_skip_reason", "find_expert_spec", "fp8_experts",
           "grouped_linear", "is_fp8_experts", "route"]
