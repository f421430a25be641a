"""The on-disk formats shared by every plugin: file names, index keys and their layout.

Model (a directory, written by data-parallel rank 0 only)::

    model.safetensors.index.json            {"metadata": {"total_size": N}, "weight_map": {...}}
    model-00001-of-00003.safetensors ...    (or a single model.safetensors with shard=False)
    config.json                             (when the model has an HF ``.config``)

``transformers``' ``from_pretrained`` loads it directly. Tensors sharing storage (tied weights)
are written once, as ``save_pretrained`` does; loading re-ties them through the model.

Optimizer (a directory; every rank that holds a shard writes its own file)::

    optimizer.index.json                    format, saved world size, param_groups, per-param
                                            shape/numel and which state keys are sharded
    optimizer-rank00000-of-00002.safetensors  "<param index>/<key>": rank r's piece of the
                                            flattened full-size state, elements
                                            [r*c, min((r+1)*c, numel)), c = ceil(numel/world)
    optimizer-replicated.safetensors        replicated tensors (e.g. Adam's "step")

Because a piece is a plain range of the flattened full tensor, a checkpoint saved by W ranks
loads into any other world size (each rank reads only the ranges it needs) and into a plain
unsharded optimizer; ``master_param`` pieces restore FP32 master weights exactly.

Every directory is saved atomically (``atomic``) with SHA-256 checksums of its files recorded
under ``CHECKSUM_KEY`` in its JSON index, or in ``CHECKSUM_FILE`` when it has none
(``checksums``).

Where the code is:

``coordination``  which rank writes, and agreeing on a failure so that every rank raises alike;
``atomic``        the atomic directory swap (``atomic_save_dir``) and ``require``;
``checksums``     recording and verifying the SHA-256 checksums;
``tensor_files``  safetensors file helpers shared by model and optimizer I/O;
``model_io``      ``write_model`` / ``read_model`` (replicated models, HF layout);
``optimizer_io``  ``write_optimizer`` / ``read_optimizer`` (the re-shardable optimizer format).
"""
from __future__ import annotations

MODEL_INDEX = "model.safetensors.index.json"
MODEL_SINGLE = "model.safetensors"
OPTIM_INDEX = "optimizer.index.json"
DCP_OPTIM_MARKER = "fp8boost_dcp_optimizer.json"  # DCP optimizer dirs (Gemini, TorchFSDP)
HYBRID_OPTIM_MARKER = "fp8boost_hybrid_optimizer.json"  # HybridParallel optimizer dirs
MOE_OPTIM_INDEX = "moe_optimizer.index.json"  # MoeHybridParallel optimizer dirs
# An optimizer save may replace an optimizer checkpoint of any plugin: Colossal-AI's tests (and
# users switching plugins) save a TorchDDP optimizer over a Gemini one at the same path. Any other
# non-empty directory is refused (``atomic.check_target``), so a save never deletes user files.
OPTIMIZER_MARKERS = (OPTIM_INDEX, DCP_OPTIM_MARKER, HYBRID_OPTIM_MARKER, MOE_OPTIM_INDEX)
OPTIM_REPLICATED = "optimizer-replicated.safetensors"
OPTIM_FORMAT = "fp8boost-optimizer-v1"
CHECKSUM_KEY = "fp8boost_checksums"       # in a directory's JSON index
CHECKSUM_FILE = "fp8boost_checksums.json"  # for directories without a JSON index
