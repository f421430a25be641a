"""Distribution: the topology (``mesh``) and one subpackage per concern.

``mesh``      ParallelDims: (dp, pp, tp) validated against the world, a named DeviceMesh
``comm/``     FP8 collectives, wire format, comm config (public: ``fp8_comm``)
``zero/``     our ZeRO-1/2 optimizer over any data-parallel group
``fsdp/``     FSDP2 wiring, FP8 all-gather weights that feed the FP8 GEMM directly
``ddp/``      DDP communication hooks
``tp/``       tensor/sequence parallel (HybridParallelPlugin)
``pipeline/`` pipeline stages and schedules (HybridParallelPlugin)
"""
