"""The candidate configs that each rowwise/blockwise cast kernel of
:mod:`fp8boost.fp8.kernels.granular_cast` is timed over, once per size class on the GPU (the
first of a list is the untimed default for small inputs). Every candidate gives the same bytes;
``tests/fp8/test_granular_kernels.py`` runs each on the GPU against the reference.
"""
from __future__ import annotations

import triton

# (BLOCK_R, BLOCK_C, num_warps) of the rowwise rows + columns^T kernels (amax pass and cast
# pass), timed once per size class on the GPU; the first is the untimed default.
ROWWISE_TILE_CONFIGS = ((64, 128, 8), (32, 128, 4), (64, 64, 4), (128, 128, 8), (128, 64, 8),
                        (32, 256, 8), (64, 256, 8))
# num_warps of the blockwise tile kernel (one program per block x block tile), timed likewise;
# blocks under 128 start from 4.
BLOCK_WARPS = (8, 4, 16, 2)
BLOCK_WARPS_SMALL = (4, 2, 8)
# ("split", BLOCK_R, num_warps, BLOCK_C2, num_warps2, reload): blockwise activation tiles with
# data^T as two launches, the 1 x block tiles (BLOCK_R rows a program), then the block x 1
# tiles of data^T (block x BLOCK_C2 a program, ``reload``: from a transposed re-read). It reads
# x twice, yet on an H200 (8192 x 4096 BF16) ran 72 us against 84 us for the best one-tile
# kernel, whose 128 x 128 tile reduces along both axes (2026-11-29).
SPLIT_CONFIGS = (("split", 64, 8, 64, 4, True), ("split", 64, 8, 64, 4, False),
                 ("split", 32, 4, 32, 4, True))
# ("rows", BLOCK_R, num_warps): blockwise activation tiles without data^T need no block of
# rows in one program (each row's 1 x block tile is whole in any BLOCK_R).
TILE_ROWS_CONFIGS = (("rows", 32, 4), ("rows", 64, 4), ("rows", 16, 2), ("rows", 64, 8))
# ("colmax", BLOCK_R, num_warps, programs per SM, BLOCK_R2, BLOCK_C2, num_warps2): rowwise rows
# + columns^T as the rows cast taking column amaxes (granular_colmax), then data^T alone; for
# rows whose whole width fits in registers (see one_pass_fits).
COLMAX_CONFIGS = (("colmax", 2, 8, 4, 64, 64, 4), ("colmax", 2, 8, 2, 64, 64, 4),
                  ("colmax", 1, 16, 4, 64, 64, 4), ("colmax", 1, 8, 4, 64, 128, 4))
# (BLOCK_R, BLOCK_C, num_warps) of the rows-only kernel, timed once per size class on the GPU.
# The second sweep over a row block should hit L2: fewer rows per program keep the blocks in
# flight small (16 x 4096 BF16 rows = 128 KiB a program).
ROWS_LOOP_CONFIGS = ((16, 512, 8), (8, 512, 4), (4, 1024, 4), (8, 256, 4))
# Whole rows in registers up to 16384 elements, at most ONE_PASS_MAX_TILE a program and
# ONE_PASS_MAX_PER_THREAD a thread (8192 x 14336 BF16 on an H200: (1, 16384, 16) ran 103 us,
# the best two-sweep loop 145 us).
ONE_PASS_MAX_C = 16384
ONE_PASS_MAX_TILE = 16384
ONE_PASS_MAX_PER_THREAD = 64
ONE_PASS_CONFIGS = ((2, 8), (1, 4), (4, 8), (1, 8), (1, 16))  # (BLOCK_R, num_warps)
# Rows wider than ONE_PASS_MAX_C with few of them (an lm_head's logit gradient: 128256 wide,
# ~1024 rows a chunk) leave most SMs idle under the rows kernel's one program per row block
# (64-256 programs). These candidates split the rows over tiles instead: an amax pass (integer
# atomic max into per-row maxima, as the rows + columns^T path does), then a cast pass.
# ("tiles", BLOCK_R, BLOCK_C, num_warps); offered, and timed, for rows wider than 16384.
WIDE_ROWS_TILE_CONFIGS = (("tiles", 32, 512, 4), ("tiles", 16, 1024, 8), ("tiles", 64, 256, 8))
ROWS_TUNE_MIN_NUMEL = 1 << 24  # smaller inputs take the first config untimed (compiles cost)


def rows_configs(c: int) -> tuple:
    """The rows-only kernel's candidates for rows of ``c`` elements: the whole row in registers
    (one read of x) first where it fits, then the two-sweep loops, then for rows wider than
    :data:`ONE_PASS_MAX_C` the two-kernel tiled pass (:data:`WIDE_ROWS_TILE_CONFIGS`).

    Example:
        >>> rows_configs(4096)[0]
        (2, 4096, 8)
    """
    width = triton.next_power_of_2(c)
    one_pass = tuple((br, width, warps) for br, warps in ONE_PASS_CONFIGS
                     if one_pass_fits(br, width, warps))
    wide = WIDE_ROWS_TILE_CONFIGS if width > ONE_PASS_MAX_C else ()
    return one_pass + ROWS_LOOP_CONFIGS + wide


def one_pass_fits(block_r: int, width: int, warps: int) -> bool:
    """Whether ``block_r`` whole rows of ``width`` (a power of two) fit one program's registers.

    Example:
        >>> one_pass_fits(1, 16384, 16), one_pass_fits(1, 16384, 4)
        (True, False)
    """
    n = block_r * width
    return (width <= ONE_PASS_MAX_C and n <= ONE_PASS_MAX_TILE
            and n <= ONE_PASS_MAX_PER_THREAD * 32 * warps)


def rows_cols_configs(c: int) -> tuple:
    """The rowwise rows + columns^T candidates for rows of ``c`` elements: ``(BLOCK_R, BLOCK_C,
    num_warps)`` (an amax pass over tiles, then a cast pass writing both operands), then where
    whole rows fit in registers ``("colmax", BLOCK_R, num_warps, programs per SM, BLOCK_R2,
    BLOCK_C2, num_warps2)`` (the rows cast with the column amaxes, then data^T alone).

    Example:
        >>> rows_cols_configs(4096)[-1][0]
        'colmax'
    """
    width = triton.next_power_of_2(c)
    colmax = tuple(cfg for cfg in COLMAX_CONFIGS if one_pass_fits(cfg[1], width, cfg[2]))
    return ROWWISE_TILE_CONFIGS + colmax


def tile_configs(block: int, weight: bool, rows: bool, cols: bool) -> tuple:
    """The blockwise candidates: ``num_warps`` of the one-tile-per-program kernel, then for
    activation tiles ``("split", ...)`` (with data^T: two launches) or ``("rows", BLOCK_R,
    num_warps)`` (without: fewer rows a program).

    Example:
        >>> tile_configs(128, False, True, False)[0]
        8
    """
    warps = BLOCK_WARPS if block >= 128 else BLOCK_WARPS_SMALL
    if weight:
        return warps
    if cols:
        return warps + (SPLIT_CONFIGS if block >= 64 else ())
    return warps + tuple(cfg for cfg in TILE_ROWS_CONFIGS if cfg[1] < block)
