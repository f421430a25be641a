"""Colossal-AI's ``TorchDDPPlugin`` arguments over fp8boost's (validation)."""
from __future__ import annotations

from fp8boost import plugins

from .common import check_bools, log_tuning, takes_colossal_args


@takes_colossal_args(positional=("use_fp8", "fp8_communication"))
class TorchDDPPlugin(plugins.TorchDDPPlugin):
    """fp8boost's ``TorchDDPPlugin`` that also takes Colossal-AI's ``check_reduction``.

    Args:
        check_reduction: torch's DDP deprecated it (True: INFO once).
        **native: ``fp8boost.plugins.TorchDDPPlugin``'s arguments.
    """

    def __init__(self, *, check_reduction: bool = False, **native) -> None:
        ddp_args(check_reduction=check_reduction)  # before the plugin, as it always ran
        super().__init__(**native)


def ddp_args(*, check_reduction: bool) -> None:
    """Validate Colossal-AI's extra ``TorchDDPPlugin`` arguments (no collectives)."""
    check_bools(check_reduction=check_reduction)
    log_tuning("ddp", [("check_reduction", check_reduction, False,
                     "torch's DistributedDataParallel deprecated it and ignores it")])
