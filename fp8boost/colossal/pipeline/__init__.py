"""``colossalai.pipeline`` names that training scripts import (``schedule.v_schedule``)."""
