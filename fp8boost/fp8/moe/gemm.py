"""Grouped FP8 GEMMs of the experts: ``torch._scaled_grouped_mm`` on CUDA, emulated anywhere.

Two forms, both over the routing's row layout (``fp8boost.fp8.moe.routing``):

* ``grouped_mm``: ``out[r] = a[r] . b[e(r)]^T`` for the rows ``r`` of expert ``e`` (fprop
  and dgrad): ``a [rows, K]`` FP8 with a scale per row, ``b [E, N, K]`` FP8 with a scale per
  expert row.
* ``grouped_mm_wgrad``: ``out[e] = a_e . b_e^T`` over the rows of expert ``e`` (the weight
  gradient): ``a [M, rows]``, ``b [N, rows]``, each scaled per (expert, row of the operand).

The contract of ``torch._scaled_grouped_mm`` (torch 2.13 ``_meta_grouped_mm_common``): both
operands ``float8_e4m3fn`` (no e5m2); ``mat_a`` row-major, ``mat_b`` column-major (both K-major:
``b.transpose(-2, -1)`` of a row-major ``[E, N, K]`` or ``[N, rows]``); strides multiples of 16
bytes (K, N and the row count multiples of 16); FP32 inverse scales, contiguous: 2-D x 3-D
takes ``scale_a [rows]`` and ``scale_b [E, N]``, 2-D x 2-D takes ``scale_a [E*M]`` and
``scale_b [E*N]`` (group-major); ``offs`` int32 cumulative group ends; output BF16 only; no
bias. Rows past ``offs[-1]`` are left unwritten: callers mask them (``Routing.group == E``).
Each group starts at a multiple of 16 rows (the routing pads groups) so the 2-D x 2-D form's
per-group K slices stay 16-byte aligned. A one-time probe per device runs both forms on a
small problem against the emulated result before the first use; if it fails, the experts run
emulated with a warning saying why.

The emulated path dequantizes to FP32 and runs ``torch._grouped_mm`` (CPU, FP32: torch 2.13
has a CPU kernel) or, on other devices (whose ``_grouped_mm`` takes BF16 only), one batched
matmul over experts padded to the largest group.

Compile: the emulated GEMMs are custom ops (``fp8boost::moe_emulated_mm`` and ``_wgrad``,
with fake implementations), opaque to ``torch.compile``. Traced inline they could not compile:
``torch._grouped_mm``'s meta function takes BF16 only (the FP32 CPU kernel exists, its fake
tensor check refuses it: an error under ``fullgraph``, else a graph break), and the padded
``bmm`` reads the largest group size on the host (``.item()``). Eager and compiled runs call
the same kernels on the same bytes. The CUDA GEMMs are custom ops too
(``fp8boost::moe_scaled_mm`` and ``_wgrad``): the GEMM is the one opaque call of a compiled
expert, as of a compiled linear layer. Each op runs the faster of torch's kernel and
fp8boost's Triton one (:mod:`fp8boost.fp8.kernels.grouped_mm`, ``grouped_wgrad``), timed once
per shape class.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from fp8boost import _state

from ..config import Fp8Config
from .routing import route

BACKENDS = ("emulated", "scaled_grouped_mm")


def _dense(x: torch.Tensor, group: torch.Tensor, local: torch.Tensor, groups: int):
    """Rows of ``x [rows, C]`` into ``[groups + 1, P, C]`` by (group, local index)."""
    p = int(local.max().item()) + 1 if local.numel() else 1
    out = x.new_zeros(groups + 1, p, x.shape[1])
    out[group, local] = x
    return out


def _use_grouped_mm(t: torch.Tensor, grouped: Optional[bool]) -> bool:
    return t.device.type == "cpu" if grouped is None else grouped


def emulated_mm(a, a_inv, b, b_inv, offsets, group, local,
                grouped: Optional[bool] = None) -> torch.Tensor:
    """``grouped_mm`` emulated: dequantize to FP32, multiply each row by its expert's weight.

    ``grouped``: use ``torch._grouped_mm`` (FP32; the default on CPU) or, False, one batched
    matmul over experts padded to the largest group (the default elsewhere). Runs as the custom
    op ``fp8boost::moe_emulated_mm`` (see the module docstring: compile).

    Example:
        >>> from fp8boost.fp8.moe.routing import route
        >>> r = route(torch.tensor([[0], [1]]), 2)
        >>> a = torch.ones(r.rows, 16).to(torch.float8_e4m3fn)
        >>> b = torch.ones(2, 32, 16).to(torch.float8_e4m3fn)
        >>> out = emulated_mm(a, torch.ones(r.rows), b, torch.ones(2, 32), r.offsets, r.group,
        ...                   r.local)
        >>> tuple(out.shape), out[r.pos[0], 0].item()
        ((32, 32), 16.0)
    """
    return _emulated_mm_op(a, a_inv, b, b_inv, offsets, group, local,
                           _use_grouped_mm(a, grouped))


def emulated_mm_wgrad(a, a_inv, b, b_inv, offsets, group, local,
                      grouped: Optional[bool] = None) -> torch.Tensor:
    """``grouped_mm_wgrad`` emulated: dequantize to FP32, one product per expert group
    (``grouped`` as in :func:`emulated_mm`; the custom op ``fp8boost::moe_emulated_mm_wgrad``).
    """
    return _emulated_wgrad_op(a, a_inv, b, b_inv, offsets, group, local,
                              _use_grouped_mm(a, grouped))


@torch.library.custom_op("fp8boost::moe_emulated_mm", mutates_args=())
def _emulated_mm_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                    offsets: torch.Tensor, group: torch.Tensor, local: torch.Tensor,
                    grouped: bool) -> torch.Tensor:
    da = a.float() * a_inv.view(-1, 1)
    db = b.float() * b_inv.unsqueeze(-1)
    e = db.shape[0]
    if grouped:
        out = torch._grouped_mm(da, db.transpose(-2, -1), offs=offsets)
        # Rows past offsets[-1] are left unwritten (whatever the allocator held): zero them,
        # so that the op is a function of its inputs (eager and compiled runs agree).
        return torch.where((group < e).unsqueeze(1), out, 0)
    dense = _dense(da, group, local, e)
    db = torch.cat([db, db.new_zeros(1, *db.shape[1:])])
    return torch.bmm(dense, db.transpose(1, 2))[group, local]


@_emulated_mm_op.register_fake
def _(a, a_inv, b, b_inv, offsets, group, local, grouped):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.float32)


@torch.library.custom_op("fp8boost::moe_emulated_mm_wgrad", mutates_args=())
def _emulated_wgrad_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor,
                       b_inv: torch.Tensor, offsets: torch.Tensor, group: torch.Tensor,
                       local: torch.Tensor, grouped: bool) -> torch.Tensor:
    e = a_inv.shape[0]

    def deq(x, inv):
        inv = torch.cat([inv, inv.new_zeros(1, inv.shape[1])])  # rows of no group: zero
        return x.float() * inv[group].t()

    da, db = deq(a, a_inv), deq(b, b_inv)
    if grouped:
        out = torch._grouped_mm(da, db.t(), offs=offsets)
        # An expert with no rows: an empty reduction, set to zero rather than trusted.
        sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
        return torch.where((sizes > 0).view(-1, 1, 1), out, 0)
    ga, gb = _dense(da.t(), group, local, e), _dense(db.t(), group, local, e)
    return torch.bmm(ga.transpose(1, 2), gb)[:e]


@_emulated_wgrad_op.register_fake
def _(a, a_inv, b, b_inv, offsets, group, local, grouped):
    return a.new_empty(a_inv.shape[0], a.shape[0], b.shape[0], dtype=torch.float32)


def scaled_mm(a, a_inv, b, b_inv, offsets, fast_accum: bool) -> torch.Tensor:
    """``grouped_mm`` on ``torch._scaled_grouped_mm`` (BF16 out; rows past the groups unset).

    Runs as the custom op ``fp8boost::moe_scaled_mm``: under ``torch.compile`` the GEMM is
    one opaque call on the bytes eager mode gives it (the casts around it stay torch ops for
    inductor to fuse), not a traced ``_scaled_grouped_mm`` that inductor may lower to a kernel
    of its own.
    """
    return _scaled_mm_op(a, a_inv, b, b_inv, offsets, fast_accum)


def scaled_mm_wgrad(a, a_inv, b, b_inv, offsets, fast_accum: bool) -> torch.Tensor:
    """``grouped_mm_wgrad`` on ``torch._scaled_grouped_mm`` (``[E, M, N]`` BF16; the custom
    op ``fp8boost::moe_scaled_mm_wgrad``, as :func:`scaled_mm`).

    An expert that got no rows has an empty reduction: its ``[M, N]`` block is set to zero
    here rather than trusting the kernel to write it."""
    out = _scaled_wgrad_op(a, a_inv, b, b_inv, offsets, fast_accum)
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.where((sizes > 0).view(-1, 1, 1), out, out.new_zeros(()))


@torch.library.custom_op("fp8boost::moe_scaled_mm", mutates_args=())
def _scaled_mm_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
                  offsets: torch.Tensor, fast_accum: bool) -> torch.Tensor:
    def torch_mm() -> torch.Tensor:
        # contiguous: the layout the fake below declares (a no-op for the K-aligned shapes)
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), a_inv, b_inv, offs=offsets,
                                        out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum).contiguous()

    kernels = _state.probe("moe-gemm-triton", _import_triton_gemms)
    if kernels is None:
        return torch_mm()
    # The faster of torch's kernel and fp8boost's Triton M-grouped one, timed per shape class.
    return kernels[0].grouped_mm(a, a_inv, b, b_inv, offsets, fast_accum, torch_mm)


@_scaled_mm_op.register_fake
def _(a, a_inv, b, b_inv, offsets, fast_accum):
    return a.new_empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)


@torch.library.custom_op("fp8boost::moe_scaled_mm_wgrad", mutates_args=())
def _scaled_wgrad_op(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor,
                     b_inv: torch.Tensor, offsets: torch.Tensor,
                     fast_accum: bool) -> torch.Tensor:
    def torch_wgrad() -> torch.Tensor:
        return torch._scaled_grouped_mm(a, b.t(), a_inv.reshape(-1), b_inv.reshape(-1),
                                        offs=offsets, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum).contiguous()

    kernels = _state.probe("moe-gemm-triton", _import_triton_gemms)
    if kernels is None:
        return torch_wgrad()
    # The faster of torch's kernel and fp8boost's Triton K-grouped one, timed per shape class.
    return kernels[1].grouped_wgrad(a, a_inv, b, b_inv, offsets, fast_accum, torch_wgrad)


def _import_triton_gemms():
    """``(grouped_mm, grouped_wgrad)`` kernel modules, or None (logged once) without Triton."""
    try:  # optional dependency: without (a working) Triton, torch's kernels run alone
        # lazy: the kernels import triton, which is optional
        from ..kernels import grouped_mm, grouped_wgrad
    except Exception as e:  # noqa: BLE001
        _state.log_once(logging.getLogger("fp8boost.fp8.moe"), "moe-gemm-import",
                        f"fp8boost: the Triton expert GEMM kernels are unavailable "
                        f"({type(e).__name__}: {e}); torch._scaled_grouped_mm runs alone")
        return None
    return grouped_mm, grouped_wgrad


@_scaled_wgrad_op.register_fake
def _(a, a_inv, b, b_inv, offsets, fast_accum):
    return a.new_empty(a_inv.shape[0], a.shape[0], b.shape[0], dtype=torch.bfloat16)


def probe_problem(device: torch.device) -> Optional[str]:
    """Why ``torch._scaled_grouped_mm`` cannot run the experts on ``device``, else None.

    Runs both forms on a small problem (uneven groups, an empty one, distinct scales) and
    compares them with the emulated result.
    """
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        r = route(torch.tensor([0] * 5 + [2] * 20, device=device), 3)
        e4 = torch.float8_e4m3fn

        def rnd(*shape, rows_dim=None):
            x = torch.randn(*shape, device=device, generator=gen)
            if rows_dim is not None:  # padding rows hold zeros, as the routing's buffers do
                mask = (r.group < 3).view(*[-1 if d == rows_dim else 1
                                            for d in range(len(shape))])
                x = torch.where(mask, x, 0.0)
            return x.to(e4)

        def inv(*shape):
            return torch.rand(*shape, device=device, generator=gen) + 0.5

        a, ai, b, bi = rnd(r.rows, 32, rows_dim=0), inv(r.rows), rnd(3, 48, 32), inv(3, 48)
        valid = (r.group < 3).unsqueeze(1)
        got = torch.where(valid, scaled_mm(a, ai, b, bi, r.offsets, False).float(), 0)
        want = torch.where(valid, emulated_mm(a, ai, b, bi, r.offsets, r.group, r.local), 0)
        wa, wai = rnd(48, r.rows, rows_dim=1), inv(3, 48)
        wb, wbi = rnd(32, r.rows, rows_dim=1), inv(3, 32)
        got_w = scaled_mm_wgrad(wa, wai, wb, wbi, r.offsets, False).float()
        want_w = emulated_mm_wgrad(wa, wai, wb, wbi, r.offsets, r.group, r.local)
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        return f"torch._scaled_grouped_mm failed on {device}: {type(exc).__name__}: {exc}"
    for name, g, w in (("fprop", got, want), ("wgrad", got_w, want_w)):
        err = ((g - w).norm() / w.norm().clamp_min(1e-6)).item()
        if not err < 2e-2:
            return (f"torch._scaled_grouped_mm's {name} differs from the emulated result on "
                    f"{device} (relative error {err:.3g})")
    return None


def resolve_backend(config: Fp8Config, device: torch.device) -> str:
    """The grouped-GEMM backend the experts use on ``device``: one of :data:`BACKENDS`.

    ``emulated`` when asked for; else ``scaled_grouped_mm`` where the one-time probe passes
    (CUDA), and otherwise ``emulated`` with a one-time warning saying why (a CPU tensor under
    ``backend='auto'``, or a probe failure). ``triton``/``cublas`` on a CPU tensor raise, as
    they do for linear layers.

    Example:
        >>> resolve_backend(Fp8Config(backend="emulated"), torch.device("cpu"))
        'emulated'
    """
    device = torch.device(device)
    if config.backend == "emulated":
        return "emulated"
    if device.type != "cuda":
        if config.backend != "auto":
            raise ValueError(f"Fp8Config(backend={config.backend!r}) needs CUDA tensors, the "
                             f"experts got {device}; use backend='emulated' or 'auto'")
        why = f"the experts' tensors are on {device}"
    else:
        why = _state.probe(f"moe-scaled-grouped-mm:{device}", lambda: probe_problem(device))
    if why is None:
        return "scaled_grouped_mm"
    _state.warn_once(f"moe-grouped-emulated:{why}",
                     f"fp8boost: FP8 experts run the emulated grouped GEMM ({why}): FP8 "
                     "numerics, no speed-up")
    return "emulated"
