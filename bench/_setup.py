"""bench/train.py's model setup per config: compiling decoder layers with proof, FSDP2 (+ torchao
float8) as their users set it up, and the fp8boost Booster/plugin configs.

Kept apart from the measuring and reporting code of ``train.py`` (which re-exports these names:
``bench/scale.py`` and the tests call them as ``train.<name>``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

import _single  # noqa: E402  (bench/_single.py)


def compile_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` every decoder layer in place (module identity is kept, so FSDP2 and
    the plugins wrap the same objects).

    The layers share one code object, so each layer is a recompile of the same frame: the
    limit is raised above the layer count, and hitting it raises instead of falling back to
    eager (the fallback that made earlier compiled rows eager without saying so).
    """
    import torch._dynamo.config as dcfg

    layers = model.model.layers
    dcfg.recompile_limit = max(dcfg.recompile_limit, 2 * len(layers) + 8)
    dcfg.accumulated_recompile_limit = max(dcfg.accumulated_recompile_limit, 8 * len(layers))
    dcfg.fail_on_recompile_limit_hit = True
    for layer in layers:
        layer.compile()


def compile_evidence() -> dict[str, Any]:
    """Dynamo's counters for this process: graphs captured, graph breaks, recompiles."""
    from torch._dynamo.utils import counters

    breaks = {str(k)[:200]: v for k, v in counters["graph_break"].items()}
    return dict(unique_graphs=int(counters["stats"].get("unique_graphs", 0)),
                calls_captured=int(counters["stats"].get("calls_captured", 0)),
                frames_ok=int(counters["frames"].get("ok", 0)),
                frames_total=int(counters["frames"].get("total", 0)),
                graph_breaks=sum(breaks.values()), graph_break_reasons=breaks)


def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _nothing() -> None:
    pass


def setup_fsdp2(model, args, device, torchao: bool):
    """FSDP2 per decoder layer + root; BF16 compute, FP32 params and gradient reduction.

    With ``torchao``: linear layers of the decoder become torchao ``Float8Linear``
    (tensorwise dynamic scaling) with FP8 weight all-gather, as torchtitan does.
    Returns (model, optimizer, backward_fn, post_step_fn).
    """
    fully_shard, MixedPrecisionPolicy = _fully_shard()
    post_step: Callable[[], None] = _nothing
    if torchao:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        # same default filter as fp8boost: no lm_head, dims multiple of 16
        args._fp8_layers = _single.convert_torchao(model, enable_fsdp_float8_all_gather=True)
        post_step = lambda: precompute_float8_dynamic_scale_for_fsdp(model)  # noqa: E731
    if args.compile:
        compile_layers(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    optimizer = _single.make_adamw(model.parameters(), args, device)
    return model, optimizer, lambda loss: loss.backward(), post_step


def fp8_options(text: Optional[str]) -> dict[str, Any]:
    """``"a=1,b=False,c=kernel"`` -> ``{"a": 1, "b": False, "c": "kernel"}`` (Fp8Config fields)."""
    from fp8boost.fp8.config import option_value  # lazy, as every fp8boost import here

    out: dict[str, Any] = {}
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--fp8-options item {item!r} is not key=value")
        out[key.strip()] = option_value(value)
    return out


def tp_of(name: str) -> int:
    """Tensor-parallel size of a config (``tp2sp_fp8`` -> 2; 1 for the others)."""
    kind = name.split("_", 1)[0]
    return int(kind[2:].removesuffix("sp")) if kind.startswith("tp") else 1


# bench/train.py --fused-lm-loss: on / off are the library's True / False; fp8-<recipe> puts the
# lm_head's GEMMs in FP8 inside the fused loss (FusedLmLossConfig(fp8_recipe=<recipe>)).
FUSED_LM_LOSS_CHOICES = ("on", "off", "fp8-rowwise", "fp8-blockwise")


def fused_lm_loss_setting(choice: Optional[str]) -> Union[bool, Any]:
    """``--fused-lm-loss`` -> the ``fused_lm_loss`` of MixedPrecision / a plugin (None: "on",
    for callers such as bench/scale.py whose args lack the flag).

    The FusedLmLossConfig is built only for an fp8-* choice, so "on"/"off" runs never depend on
    its newer ``fp8_recipe`` field."""
    if choice is None or choice == "on":
        return True
    if choice == "off":
        return False
    if choice not in FUSED_LM_LOSS_CHOICES:
        raise ValueError(f"--fused-lm-loss {choice!r}: choose from {FUSED_LM_LOSS_CHOICES}")
    from fp8boost.loss import FusedLmLossConfig
    return FusedLmLossConfig(fp8_recipe=choice.removeprefix("fp8-"))


def fp8_config_of(args) -> Optional[Any]:
    """The Fp8Config of ``--fp8-min-numel`` / ``--fp8-options`` (None: the library default);
    ``named=<recipe>`` in the options builds ``Fp8Config.from_recipe``."""
    text = getattr(args, "fp8_options", None)
    if getattr(args, "fp8_min_numel", None) is None and not text:
        return None
    from fp8boost.fp8 import Fp8Config
    extra = fp8_options(text)
    if args.fp8_min_numel is not None:
        extra["min_numel"] = args.fp8_min_numel
    named = extra.pop("named", None)
    return Fp8Config.from_recipe(named, **extra) if named else Fp8Config(**extra)


def setup_booster(model, name: str, args, device):
    """An fp8boost config: ``single_*`` (no plugin), ``ddp_*``, ``zero1_*``, ``zero2_*``.

    ``single_torchao``: ``single_bf16`` whose linears torchao converts first (then compile,
    then boost, the order of every config here). Every config takes ``--fused-lm-loss``
    (``fused_lm_loss_setting``); ``args._fused_lm_loss_status`` then says "fused" or why not."""
    from fp8boost.booster import Booster

    kind, variant = name.split("_", 1)
    use_fp8, fp8_comm = variant.startswith("fp8"), variant.startswith("fp8_comm")
    rs = {"fp8_reduce_scatter": True} if variant == "fp8_comm_rs" else {}
    ovl = {"overlap_allgather": True} if variant.endswith("_ovl") else {}  # ZeRO configs only
    # MixedPrecision and every plugin (PluginOptions) take fused_lm_loss as a keyword.
    lm = {"fused_lm_loss": fused_lm_loss_setting(getattr(args, "fused_lm_loss", None))}
    hf_model = model  # boost fuses the loss on this object in place (wrappers keep it)
    if name == "single_torchao":
        args._fp8_layers = _single.convert_torchao(model, getattr(args, "torchao_recipe", None))
    if args.compile:
        compile_layers(model)
    fp8_cfg = fp8_config_of(args) if use_fp8 else None
    if kind == "single":
        from fp8boost.booster.mixed_precision import MixedPrecision
        booster = Booster(mixed_precision=MixedPrecision(
            "fp8" if use_fp8 else "bf16", fp8_config=fp8_cfg,
            fused_master_step={"fused": True, "two-pass": False}.get(
                getattr(args, "master_step", None)), **lm), device=device)
    elif kind == "ddp":
        from fp8boost.plugins import TorchDDPPlugin
        booster = Booster(plugin=TorchDDPPlugin(use_fp8=use_fp8, fp8_communication=fp8_comm,
                                                precision="bf16", fp8_config=fp8_cfg, **lm),
                          device=device)
    elif kind == "gemini":
        from fp8boost.plugins import GeminiPlugin
        booster = Booster(plugin=GeminiPlugin(precision="bf16", use_fp8=use_fp8,
                                              fp8_communication=fp8_comm, fp8_config=fp8_cfg,
                                              **rs, **lm),
                          device=device)
    elif kind.startswith("tp"):
        from fp8boost.plugins import HybridParallelPlugin
        plugin = HybridParallelPlugin(tp_size=tp_of(name), zero_stage=1, precision="bf16",
                                      enable_sequence_parallelism=kind.endswith("sp"),
                                      use_fp8=use_fp8, fp8_communication=fp8_comm,
                                      reduce_bucket_size_in_m=args.bucket_m, fp8_config=fp8_cfg,
                                      **lm)
        booster = Booster(plugin=plugin, device=device)
    elif kind == "torchfsdp":
        from fp8boost.plugins import TorchFSDPPlugin
        booster = Booster(plugin=TorchFSDPPlugin(precision="bf16", use_fp8=use_fp8,
                                                 fp8_communication=fp8_comm, fp8_config=fp8_cfg,
                                                 **lm),
                          device=device)
    else:
        from fp8boost.plugins import LowLevelZeroPlugin
        plugin = LowLevelZeroPlugin(stage=int(kind[-1]), precision="bf16", use_fp8=use_fp8,
                                    fp8_communication=fp8_comm, **rs, **ovl,
                                    reduce_bucket_size_in_m=args.bucket_m, fp8_config=fp8_cfg,
                                    **lm)
        booster = Booster(plugin=plugin, device=device)
    optimizer = _single.make_adamw(model.parameters(), args, device)
    model, optimizer, *_ = booster.boost(model, optimizer)
    report = getattr(booster.plugin, "fp8_report", None)
    if report is not None:
        args._fp8_layers = dict(converted=len(report.converted), kept=len(report.skipped))
    # Recorded, not implied: "on" silently keeps HF's loss where it does not apply. Asking the
    # plugin again is idempotent: None once installed, else the same reason as in boost.
    args._fused_lm_loss_status = booster.plugin.fuse_lm_loss(hf_model) or "fused"
    return model, optimizer, lambda loss: booster.backward(loss, optimizer), _nothing
