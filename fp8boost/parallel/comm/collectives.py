"""FP8 collectives: real FP8 bytes on the wire, high-precision tensors in and out.

Every function takes and returns ordinary FP32/BF16/FP16 tensors; in between, the payload
travels as FP8 (1 byte per element) in ``torch.uint8`` buffers, because NCCL and gloo reject
float8 dtypes. The layout (FP8 bytes + a 16-byte trailer holding the FP32 inverse scale per
chunk) is described in :mod:`fp8boost.parallel.comm.wire`.

* all-gather: each rank casts its shard and the scale travels in the same all-gather
  (``Fp8CommConfig.all_gather_scale="per_rank"``: one collective, best precision), or one scale
  shared by the group from an all-reduce(MAX) of the amaxes (``"shared"``).
* reduce-scatter: one scale per destination chunk, an all-to-all of the FP8 chunks, FP32 sum on
  the receiver. A rank's own chunk never goes on the wire and is added in full precision.
* all-reduce = FP8 reduce-scatter + FP8 all-gather (any numel: padded to the world size). Every
  rank decodes the same gathered bytes, so results are bit-identical across ranks.
* all-to-all (even and uneven splits) and point-to-point send/recv, one scale per chunk.

All-gather, reduce-scatter and all-reduce are pipelined (``Fp8CommConfig.pipeline_bytes``):
the payload is cut into up to 8 column stages, each with its own scales; stage k+1 is cast
while stage k is on the wire and stage k is decoded while k+1 is, so the casts (which move
about as many HBM bytes as FP8 saves on the link) overlap the transfer instead of adding to it.

Defaults: e4m3 for activations and parameters (all-gather, all-to-all, send/recv), e5m2 for
gradients (reduce-scatter, all-reduce), from :class:`Fp8CommConfig`; ``fp8_dtype=`` overrides.

Where the plain collective runs instead, it runs in the input's own dtype and is logged once
per collective and reason (logger ``fp8boost.parallel.fp8_comm``): world size 1 (local math, no
communication), ``config.enabled=False``, a non-floating-point input, or a payload below
``config.min_payload_numel``. Float8 inputs are refused (they are already 1 byte: send
``t.view(torch.uint8)`` with the plain collective).

``async_op=True`` returns an :class:`Fp8Work`; its ``wait()`` completes the communication and
the dequantization and returns the result tensor. As with ``torch.distributed``, inputs must
not be modified before ``wait()``. All ranks must pass equal shapes (per the collective's rules)
and equal configs. ``group=None`` means the default (WORLD) group; ranks in ``send_fp8`` /
``recv_fp8`` are global ranks, as in ``torch.distributed.send``.

Implemented by concern: :mod:`.all_gather`, :mod:`.reduce` (reduce-scatter, all-reduce),
:mod:`.all_to_all`, :mod:`.p2p` (send/recv), over the stage pipeline of :mod:`.pipeline` and
the shared checks and async handle of :mod:`._utils`. This module is their common face.
"""
from ._utils import Fp8Work
from .all_gather import all_gather_fp8, all_gather_into_tensor_fp8
from .all_to_all import all_to_all_fp8
from .p2p import irecv_fp8, isend_fp8, recv_fp8, send_fp8
from .reduce import all_reduce_fp8, reduce_scatter_fp8, reduce_scatter_tensor_fp8

__all__ = ["Fp8Work", "all_gather_fp8", "all_gather_into_tensor_fp8", "reduce_scatter_fp8",
           "reduce_scatter_tensor_fp8", "all_reduce_fp8", "all_to_all_fp8", "send_fp8",
           "recv_fp8", "isend_fp8", "irecv_fp8"]
