"""The rowwise rows cast that also takes column amaxes: the first pass of
:mod:`fp8boost.fp8.kernels.granular_cast`'s ``("colmax", ...)`` candidates for rows + columns^T.

Same numerics and bytes as ``granular_cast`` (see its docstring). Persistent programs walk row
blocks with whole rows in registers (as the rows-only kernel), cast and store each, and keep an
element-wise running maximum of ``|x|`` bit patterns; at the end a program reduces it over its
rows once and stores its column maxima as one row of a ``[programs, C]`` partials buffer (the
caller takes their maximum: integer maxima, exact and order-independent). The transposed,
column-scaled operand is then one pass of ``granular_cast``'s tile kernel in its given-amax mode.

Why not the amax pass over tiles the other candidates start with: on an H200 it took 30-39 us
for an 8192 x 4096 BF16 input (read 64 MiB, ~16 us at copy speed): a cross-warp reduction per
axis per tile and a row and a column atomic per tile. Reducing the column maxima over rows in
every iteration here cost as much; the element-wise running maximum is reduced once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .cast import abs_bits, fp8_bytes, tl_scale_from_amax


@triton.jit
def rows_colmax_kernel(x_ptr, q_ptr, inv_ptr, part_ptr, R, C, stride_r, stride_c, fmax,
                        target, n_blocks, ROWS: tl.constexpr, POW2: tl.constexpr,
                        OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, MANT_BITS: tl.constexpr,
                        MIN_EXP: tl.constexpr, IDX64: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    # Persistent: row blocks pid, pid + programs, ...; whole rows (BLOCK_C >= C) in registers.
    pid = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    if IDX64:
        offs_c = offs_c.to(tl.int64)
    in_c = offs_c < C
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        offs_r = blk * BLOCK_R + tl.arange(0, BLOCK_R)
        if IDX64:
            offs_r = offs_r.to(tl.int64)
        in_r = offs_r < R
        mask = in_r[:, None] & in_c[None, :]
        x = tl.load(x_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask,
                    other=0.0)
        bits = abs_bits(x)
        acc = tl.maximum(acc, bits)
        if ROWS:
            s = tl_scale_from_amax(tl.max(bits, axis=1).to(tl.float32, bitcast=True), target,
                                   POW2)
            tl.store(inv_ptr + offs_r, tl.math.div_rn(1.0, s), mask=in_r)
            q = fp8_bytes(x.to(tl.float32), s[:, None], fmax, OUT_DTYPE, EMULATE, MANT_BITS,
                          MIN_EXP)
            tl.store(q_ptr + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)
    tl.store(part_ptr + pid.to(tl.int64) * C + offs_c, tl.max(acc, axis=0), mask=in_c)
