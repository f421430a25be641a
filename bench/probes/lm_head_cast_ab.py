"""Probe (2026-11-29): bench/lm_head.py with the rowwise/blockwise cast candidates of before
the split/colmax/one-pass-16384 change (``AB=old``: the candidate lists monkeypatched back) or
as now (``AB=new``), one process per run. Both time the candidates by GPU time (the caches of
that change); "old" is the candidate lists of 37585f4, not its timer. E.g.
``AB=old python bench/probes/lm_head_cast_ab.py --cells fused_fp8_rowwise --reps 15``.
"""
import os, sys
sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
if os.environ.get("AB") == "old":
    import triton
    from fp8boost.fp8.kernels import granular_cast as gc, granular_configs as cf
    def old_rows(c):
        w = triton.next_power_of_2(c)
        one = tuple(cfg for cfg in ((2, w, 8), (1, w, 4), (4, w, 8), (1, w, 8)) if w <= 8192 and cfg[0] * w <= 16384)
        return one + cf.ROWS_LOOP_CONFIGS
    gc.rows_configs = old_rows
    gc.rows_cols_configs = lambda c: cf.ROWWISE_TILE_CONFIGS
    gc.tile_configs = lambda block, weight, rows, cols: cf.BLOCK_WARPS if block >= 128 else cf.BLOCK_WARPS_SMALL
import lm_head

sys.exit(lm_head.main(sys.argv[1:]))
