"""Distribution: the topology (``mesh``) and one subpackage per concern.

``mesh``      ParallelDims: (dp, pp, sp, tp, ep) validated against the world, named DeviceMeshes
``comm/``     FP8 collectives, wire format, comm config (public: ``fp8_comm``)
``zero/``     our ZeRO-1/2 optimizer over any data-parallel group
``fsdp/``     FSDP2 wiring, FP8 all-gather weights that feed the FP8 GEMM directly
``ddp/``      DDP communication hooks
``tp/``       tensor/sequence parallel (HybridParallelPlugin)
``pipeline/`` pipeline stages and schedules (HybridParallelPlugin)
``ep/``       expert parallelism: token dispatch/combine, expert gradients (MoeHybridParallelPlugin)
"""
