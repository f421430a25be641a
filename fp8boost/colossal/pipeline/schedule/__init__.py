"""``colossalai.pipeline.schedule``: ``v_schedule.PipelineGraph`` for ``pp_style="zbv"``."""
