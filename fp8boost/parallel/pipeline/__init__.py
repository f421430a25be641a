"""Pipeline parallelism: HF decoder LMs split by hand into ``torch.distributed.pipelining`` stages.

* :mod:`.layout`: which layers each stage holds and which rank runs it (1F1B, interleaved, ZB-V);
* :mod:`.split`: strip a model to one rank's parts and wrap them as stage modules;
* :mod:`.boundary`: FP8 activations (e4m3) and gradients (e5m2) across stage boundaries;
* :mod:`.runner`: micro-batched steps through torch's schedules;
* :mod:`.stage_manager`: Colossal-AI's ``PipelineStageManager`` (``plugin.stage_manager``).
"""
from .boundary import BoundaryPlan, decode_fp8, encode_fp8
from .layout import PP_STYLES, PipelineLayout, check_pipeline_options, make_layout
from .runner import PipelineRunner, microbatch_count
from .stage_manager import PipelineStageManager
from .split import (DecoderStage, build_stage_modules, check_pipeline_model, strip_to_rank,
                    tied_embedding)

__all__ = ["BoundaryPlan", "decode_fp8", "encode_fp8", "PP_STYLES", "PipelineLayout",
           "check_pipeline_options", "make_layout", "PipelineRunner", "microbatch_count",
           "DecoderStage", "build_stage_modules", "check_pipeline_model", "strip_to_rank",
           "tied_embedding", "PipelineStageManager"]
