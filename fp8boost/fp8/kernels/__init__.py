"""Triton FP8 kernels: fused amax/scale/cast(+transpose) and a persistent FP8 GEMM.

Importing this package imports nothing heavy; ``triton`` is imported by the submodules, which
are only loaded when the ``triton`` backend is selected
(``fp8boost.fp8.backends.get_backend("triton", device)``).

Submodules:
  * ``cast``    -- tensorwise amax (multi-block reduction), scale and saturating cast to
                   e4m3/e5m2, writing the row-major and optionally the transposed copy in one pass.
  * ``gemm``    -- FP8 x FP8 -> BF16/FP32 GEMM ``a[M,K] @ b[N,K].T`` with per-tensor inverse
                   scales and optional bias in the epilogue; persistent, TMA where available.
  * ``tuning``  -- the once-per-shape config cache both of them use.
  * ``ops``     -- ``torch.library`` custom ops (with fake impls) so ``torch.compile`` traces them.
  * ``backend`` -- ``TritonBackend``, the :class:`fp8boost.fp8.backends.Fp8Backend` they make up.
"""
