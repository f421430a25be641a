"""Which FP8 layers' weights an FP8 parameter all-gather carries (rowwise/blockwise layers).

The decision moved below the plugins, into the communication plan: the code is
:mod:`fp8boost.parallel.comm.granular`; this module keeps the plugins' import path.
"""
from fp8boost.parallel.comm.granular import (GRANULAR_GATHER_WHY, block_gathered, is_granular,
                                             ranks_of, report_granular_gather,
                                             split_fp8_gather_layers)

__all__ = ["GRANULAR_GATHER_WHY", "is_granular", "block_gathered", "ranks_of",
           "split_fp8_gather_layers", "report_granular_gather"]
