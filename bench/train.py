"""Training throughput of fp8boost plugins against FSDP2 BF16 (and torchao float8 + FSDP2).

For a Llama-7B-shaped model with 8 layers (h4096, FFN 11008, 32 heads, vocab 32000; micro
batch 2 x 4096 tokens per GPU by default) it measures, for each config, tokens/s/GPU, TFLOP/s
per GPU and peak memory: warm-up steps, then the median of the timed steps' wall times (each
step ends with a device synchronize). AdamW everywhere, no gradient clipping, no activation
checkpointing; random tokens (throughput only). TFLOP/s counts 6*N + attention FLOPs per
token (PaLM accounting, see examples/metrics.py).

Configs (``--configs``, comma separated; default: all but ``single_*``; ``all``: every one)::

    fsdp2_bf16                     torch FSDP2 fully_shard per decoder layer, BF16 compute,
                                   FP32 params and reductions (the baseline users know)
    torchao_fsdp2                  torchao float8 (tensorwise) + FSDP2 with FP8 all-gather;
                                   recorded as skipped when torchao does not import
    single_bf16, single_fp8        Booster(mixed_precision=...), no plugin (1 process only)
    single_torchao                 single_bf16 + torchao float8 (tensorwise) linears
    ddp_bf16, ddp_fp8, ddp_fp8_comm                TorchDDPPlugin
    zero1_bf16, zero1_fp8, zero1_fp8_comm          LowLevelZeroPlugin(stage=1)
    zero2_bf16, zero2_fp8, zero2_fp8_comm          LowLevelZeroPlugin(stage=2)
    zero1_fp8_comm_rs, zero2_fp8_comm_rs, gemini_fp8_comm_rs   ... fp8_reduce_scatter=True
    zero{1,2}_{bf16,fp8,fp8_comm}_ovl              ... overlap_allgather=True
    gemini_bf16, gemini_fp8, gemini_fp8_comm       GeminiPlugin (ZeRO-3 on FSDP2)
    torchfsdp_bf16, torchfsdp_fp8, torchfsdp_fp8_comm   TorchFSDPPlugin (plain FSDP2)
    tp2_bf16, tp2_fp8, tp2_fp8_comm                HybridParallelPlugin(tp_size=2, zero_stage=1)
    tp2sp_bf16, tp2sp_fp8, tp2sp_fp8_comm          ... with sequence parallelism

Tensor-parallel configs keep the per-GPU token count of the others: each model replica takes a
micro batch of ``--batch-size x tp`` sequences (the same global batch on the same GPUs), and the
tp ranks of a replica read the same tokens.

Compiled runs (``--compile``) prove they compiled: each decoder layer is compiled in place,
dynamo's recompile limit is raised above the layer count and a hit fails the config instead
of silently running eager (``fail_on_recompile_limit_hit``), and the JSON records dynamo's
counters (graphs captured, graph breaks); a compiled config that captured no graph is
reported as ``not_compiled``. The model trains with ``use_cache=False`` (no KV cache guards).
Each result also records ``first_step_s`` / ``warmup_s`` (the first warm-up step and all of
them, compile and kernel autotuning included) and ``mfu`` (TFLOP/s over the device's dense
BF16 peak, ``peak_bf16_tflops`` in the JSON; null for an unknown device).
Run with plain python, every config runs in its own torchrun (``--isolate`` is the default
there), so compile caches, limits and allocator state never leak between configs.

Usage::

    torchrun --nproc_per_node=2 bench/train.py                      # every config, in turn
    torchrun --nproc_per_node=2 bench/train.py --configs fsdp2_bf16,zero2_bf16,zero2_fp8
    python bench/train.py --isolate --nproc 2 --configs ...        # one torchrun per config
    python bench/single_gpu.py                  # 1 GPU: shapes x (bf16, torchao, fp8) table
    torchrun --nproc_per_node=2 bench/train.py --device cpu --preset tiny   # CPU smoke test

An out-of-memory error (or any other error) in one config is recorded in the JSON and the run
goes on with the next config; this needs every rank to fail alike (OOM normally does, the
ranks being symmetric): a rank failing alone leaves the others waiting in a collective until
the 10-minute timeout. ``--isolate`` launches one torchrun per config with a time limit, so
even a hang or a crash costs only that config (at ~15 s of start-up per config). The JSON (device, torch/triton/transformers
versions, date, command, world size, every config's numbers) goes to ``$OUT`` when set, else
``bench/results/``; a short table is printed last on rank 0.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
if str(_ROOT / "bench") not in sys.path:  # last: bench/'s module names must not shadow others
    sys.path.append(str(_ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _single  # noqa: E402  (bench/_single.py)
# Model setup per config lives in bench/_setup.py; re-exported: scale.py and tests use train.*
from _setup import (FUSED_LM_LOSS_CHOICES, _nothing, compile_evidence,  # noqa: E402,F401
                    compile_layers, fp8_config_of, fp8_options, fused_lm_loss_setting,
                    setup_booster,
                    setup_fsdp2, tp_of)
import presets  # noqa: E402  (examples/presets.py)
from metrics import flops_per_token, matmul_params  # noqa: E402  (examples/metrics.py)

PLUGIN_CONFIGS = [f"{p}_{v}" for p in ("ddp", "zero1", "zero2", "gemini", "torchfsdp", "tp2",
                                        "tp2sp")
                  for v in ("bf16", "fp8", "fp8_comm")]
# *_fp8_comm_rs: FP8 communication with FP8 gradient reduce-scatter too (off by default).
RS_CONFIGS = ["zero1_fp8_comm_rs", "zero2_fp8_comm_rs", "gemini_fp8_comm_rs"]
# *_ovl: ZeRO's post-step parameter all-gather overlapped with the next forward
# (LowLevelZeroPlugin(overlap_allgather=True)); off by default.
OVL_CONFIGS = [f"zero{s}_{v}_ovl" for s in (1, 2) for v in ("bf16", "fp8", "fp8_comm")]
ALL_CONFIGS = ["fsdp2_bf16", "torchao_fsdp2", "single_bf16", "single_fp8", "single_torchao",
               *PLUGIN_CONFIGS, *RS_CONFIGS, *OVL_CONFIGS]
TORCHAO_CONFIGS = ("torchao_fsdp2", "single_torchao")
DEFAULT_CONFIGS = ["fsdp2_bf16", "torchao_fsdp2", *PLUGIN_CONFIGS]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated subset of {ALL_CONFIGS}, or 'all'")
    p.add_argument("--preset", default="7b-8l", choices=list(presets.PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--hidden", type=int, default=None, help="override the preset's width")
    p.add_argument("--ffn", type=int, default=None, help="override the preset's FFN size")
    p.add_argument("--heads", type=int, default=None, help="override heads (and kv heads)")
    p.add_argument("--kv-heads", type=int, default=None, help="override kv heads (GQA)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--batch-size", type=int, default=2, help="micro batch per GPU")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (256 for tiny/small)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--fp8-min-numel", type=int, default=None,
                   help="Fp8Config.min_numel for the fp8 configs (default: the library default)")
    p.add_argument("--torchao-recipe", default=None,
                   choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                   help="single_torchao / torchao_fsdp2: torchao's named recipe")
    p.add_argument("--fp8-options", default=None,
                   help="extra Fp8Config fields for the fp8 configs, e.g. "
                        "'compiled_casts=kernel,share_input_casts=False' (ablations)")
    p.add_argument("--bucket-m", type=float, default=None,
                   help="ZeRO reduce_bucket_size_in_m (default: the plugin's: 12, 64 with FP8 comm)")
    p.add_argument("--lr", type=float, default=1e-5, help="small: random data, speed only")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer (all configs)")
    p.add_argument("--fused-adamw", action="store_true",
                   help="AdamW(fused=True) on CUDA (default off: earlier results used foreach)")
    p.add_argument("--master-step", default=None, choices=("fused", "two-pass"),
                   help="single_* configs: MixedPrecision.fused_master_step True / False "
                        "(default: the library's, fused wherever it applies)")
    p.add_argument("--fused-lm-loss", default="on", choices=FUSED_LM_LOSS_CHOICES,
                   help="fused_lm_loss of every fp8boost config (single_* and plugins; not "
                        "fsdp2_bf16/torchao_fsdp2): on/off = True/False, fp8-rowwise/"
                        "fp8-blockwise = FusedLmLossConfig(fp8_recipe=...), an FP8 lm_head; "
                        "on is the library's default")
    p.add_argument("--fused-norm", action="store_true",
                   help="every config: fp8boost.norm.install_fused_rms_norms on the model "
                        "before boost (HF's Llama RMSNorm through F.rms_norm in eager mode)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: profile this many extra steps; kernel ms/step by category")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--output", default=None, help="JSON path (default: $OUT or bench/results)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one torchrun per config (default when run with plain python; "
                        "--no-isolate runs every config in this process)")
    p.add_argument("--nproc", type=int, default=None,
                   help="--isolate: processes per config (default: all visible GPUs, or 2 on CPU)")
    p.add_argument("--config-timeout", type=int, default=600, help="--isolate: seconds per config")
    args = p.parse_args(argv)
    if args.isolate is None:
        args.isolate = "RANK" not in os.environ and not (
            len(args.configs.split(",")) == 1 and args.configs != "all")
    args.configs = ALL_CONFIGS if args.configs == "all" else [
        c.strip() for c in args.configs.split(",") if c.strip()]
    if args.seq_len is None:
        args.seq_len = 256 if args.preset in ("tiny", "small") else 4096
    return args


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Bad options raise before any process group or model exists."""
    unknown = [c for c in args.configs if c not in ALL_CONFIGS]
    if unknown or not args.configs:
        raise ValueError(f"unknown configs {unknown}; choose from {ALL_CONFIGS}")
    for flag in ("batch_size", "seq_len", "steps", "vocab_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    single = [c for c in args.configs if c.startswith("single_")]
    if single and world_size > 1:
        raise ValueError(f"{single} run one process without a plugin; launch them without "
                         "torchrun (or --isolate --nproc 1)")
    if args.isolate and "RANK" in os.environ:
        raise ValueError("--isolate launches torchrun itself: run it with plain python")


def setup_env_and_device(device_arg: str) -> tuple[int, int, torch.device]:
    """NCCL settings the lent machines need, then (rank, world size, device)."""
    # NVLink multicast (NVLS) is unavailable on the lent machines: keep it off everywhere.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), device


def init_group(world_size: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(minutes=10)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain python: a one-rank group so the plugins run unchanged
        store = os.path.join(tempfile.mkdtemp(prefix="fp8boost_bench_"), "store")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0,
                                world_size=world_size, timeout=timeout)


# --------------------------------------------------------------------------- model and configs


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The benchmark model in FP32 on ``device``, identical on every rank (seeded)."""
    overrides: dict[str, int] = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    if args.hidden is not None:
        overrides["hidden_size"] = args.hidden
    if args.ffn is not None:
        overrides["intermediate_size"] = args.ffn
    if args.heads is not None:
        overrides.update(num_attention_heads=args.heads, num_key_value_heads=args.heads)
    if getattr(args, "kv_heads", None) is not None:
        overrides["num_key_value_heads"] = args.kv_heads
    model = presets.build_model(args.preset, args.vocab_size, max(args.seq_len, 2048),
                                device=device, seed=0, **overrides)
    model.config.use_cache = False  # training: no KV cache (and no guards on it under compile)
    return model


# --------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(name: str, args, device: torch.device, rank: int) -> dict[str, Any]:
    """Build, warm up and time one config on this rank; raises on any failure."""
    # Memory still held when a config starts (leaked by an earlier one) inflates its peak.
    start_mem = torch.cuda.memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    args._fp8_layers = None  # set by the setup of an FP8 config (not left from an earlier one)
    args._fused_lm_loss_status = None  # set by setup_booster: "fused" or why not
    model = build_model(args, device)
    fused_norms = None
    if getattr(args, "fused_norm", False):
        from fp8boost.norm import install_fused_rms_norms  # lazy, as every fp8boost import here
        fused_norms = len(install_fused_rms_norms(model).fused)
    if name in ("fsdp2_bf16", "torchao_fsdp2"):
        model, optimizer, backward, post_step = setup_fsdp2(model, args, device,
                                                            torchao=name == "torchao_fsdp2")
    else:
        model, optimizer, backward, post_step = setup_booster(model, name, args, device)
    tp = tp_of(name)
    # Each replica its own (random) batch; the tp ranks of a replica share it.
    gen = torch.Generator().manual_seed(1234 + rank // tp)
    tokens = torch.randint(0, args.vocab_size, (args.batch_size * tp, args.seq_len), generator=gen)
    tokens = tokens.to(device)

    def step() -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        post_step()
        return loss.detach()

    _sync(device)
    t_warm, first_step = time.perf_counter(), None
    for i in range(args.warmup):
        step()
        if i == 0:  # compile and kernel autotuning land in the first step
            _sync(device)
            first_step = time.perf_counter() - t_warm
    _sync(device)
    warmup_s = time.perf_counter() - t_warm
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        _sync(device)  # count the queued GPU work in the step that issued it
        times.append(time.perf_counter() - t0)
    loss_values = [float(x) for x in losses]
    if device.type == "cuda":
        peak, reserved = (torch.cuda.max_memory_allocated(device) / 2 ** 30,
                          torch.cuda.max_memory_reserved(device) / 2 ** 30)
    else:
        import resource  # CPU: the process's peak RSS (covers earlier configs too)
        peak, reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, None
    extra: dict[str, Any] = {}
    if args.compile:
        extra["compile"] = compile_evidence()
    if getattr(args, "_fp8_layers", None):
        extra["fp8_layers"] = args._fp8_layers
    if getattr(args, "_fused_lm_loss_status", None):
        extra["fused_lm_loss_status"] = args._fused_lm_loss_status
    if fused_norms is not None:
        extra["fused_norms"] = fused_norms
    if getattr(args, "profile_steps", 0) and device.type == "cuda":
        import _profile  # bench/_profile.py
        extra["kernels"] = _profile.kernel_breakdown(step, args.profile_steps, device)
        if rank == 0:
            print(_profile.format_breakdown(name, extra["kernels"]), flush=True)
    extra["fused_master_step"] = bool(getattr(optimizer, "uses_fused_step", False))
    return dict(extra, first_step_s=times[0] if first_step is None else first_step,
                warmup_s=warmup_s,
                median_step_s=statistics.median(times), mean_step_s=statistics.fmean(times),
                min_step_s=min(times), max_step_s=max(times), peak_mem_gib=peak,
                peak_reserved_gib=reserved, start_mem_gib=start_mem, first_loss=loss_values[0],
                last_loss=loss_values[-1], finite=all(map(_finite, loss_values)))


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _oom_types() -> tuple[type, ...]:
    types: list[type] = [torch.cuda.OutOfMemoryError]
    if hasattr(torch, "OutOfMemoryError"):
        types.append(torch.OutOfMemoryError)
    return tuple(types)


def run_config(name: str, args, device: torch.device, rank: int, world_size: int,
               tokens_flops: int) -> dict[str, Any]:
    """One config on every rank: a result dict (status ok / oom / error / skipped)."""
    result: dict[str, Any] = dict(config=name, status="ok")
    if name in TORCHAO_CONFIGS:
        try:
            __import__("torchao.float8")
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
            return dict(result, status="skipped", error=f"torchao not importable: {exc}")
    _free_memory(device)
    try:
        result.update(measure(name, args, device, rank))
    except _oom_types() as exc:
        result.update(status="oom", error=str(exc).splitlines()[0][:300])
    except Exception:  # noqa: BLE001 - record, keep benchmarking the other configs
        result.update(status="error", error=traceback.format_exc()[-2000:])
    _free_memory(device)
    if result["status"] == "ok" and args.compile and not result["compile"]["unique_graphs"]:
        result.update(status="not_compiled",
                      error="--compile but dynamo captured no graph: this row ran eager")
    return _combine_ranks(result, world_size, device, args, tokens_flops)


def _combine_ranks(result: dict[str, Any], world_size: int, device: torch.device, args,
                   tokens_flops: int) -> dict[str, Any]:
    """Slowest rank's median and the largest peak memory; failed if any rank failed."""
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, result)
    else:
        gathered = [result]
    failed = [r for r in gathered if r["status"] != "ok"]
    if failed:
        first = dict(failed[0])
        first["failed_ranks"] = [i for i, r in enumerate(gathered) if r["status"] != "ok"]
        return first
    out = dict(gathered[0], world_size=world_size)
    out["median_step_s"] = max(r["median_step_s"] for r in gathered)
    out["peak_mem_gib"] = max(r["peak_mem_gib"] for r in gathered)
    if out.get("peak_reserved_gib") is not None:
        out["peak_reserved_gib"] = max(r["peak_reserved_gib"] for r in gathered)
    out["finite"] = all(r["finite"] for r in gathered)
    tok_s = args.batch_size * args.seq_len / out["median_step_s"]
    out["tokens_per_s_per_gpu"] = tok_s
    out["tokens_per_s_total"] = tok_s * world_size
    out["tflops_per_gpu"] = tok_s * tokens_flops / 1e12
    peak = _single.peak_bf16_tflops(device)
    out["mfu"] = out["tflops_per_gpu"] / peak if peak else None
    return out


# --------------------------------------------------------------------------- report


def model_info(args: argparse.Namespace) -> dict[str, Any]:
    """Shape, parameter counts and training FLOPs per token, from a meta-device model."""
    model = build_model(args, torch.device("meta"))
    cfg = model.config
    n_matmul = matmul_params(model)
    return dict(preset=args.preset, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
                heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                ffn=cfg.intermediate_size, vocab=cfg.vocab_size,
                attn_implementation=getattr(cfg, "_attn_implementation", None),
                params=sum(p.numel() for p in model.parameters()), matmul_params=n_matmul,
                flops_per_token=flops_per_token(n_matmul, cfg.num_hidden_layers,
                                                cfg.hidden_size, args.seq_len))


def environment(device: torch.device, world_size: int) -> dict[str, Any]:
    """Device and software versions for the JSON header."""
    import transformers

    env: dict[str, Any] = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), world_size=world_size,
        device=torch.cuda.get_device_name(device) if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        torch=torch.__version__, transformers=transformers.__version__,
        python=platform.python_version(), cuda=torch.version.cuda,
        nccl=_nccl_version() if device.type == "cuda" else None,
        # NCCL_P2P/SHM_DISABLE=1: the network-transport rows (issue 36); recorded, not implied.
        env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                              "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")})
    for mod in ("triton", "torchao"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - optional packages
            env[mod] = None
    return env


def _nccl_version() -> Optional[str]:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - informational only
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def command_line(world_size: int) -> str:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    prefix = f"torchrun --nproc_per_node={local} " if local else "python "
    nodes = world_size // int(local) if local else 1
    if nodes > 1:
        prefix = prefix.replace("torchrun ", f"torchrun --nnodes={nodes} ")
    return prefix + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def add_speedups(results: list[dict[str, Any]]) -> None:
    """Each config's tokens/s relative to FSDP2 BF16 and to its own plugin's BF16 run."""
    speed = {r["config"]: r.get("tokens_per_s_per_gpu") for r in results
             if r["status"] == "ok"}
    for r in results:
        if r["status"] != "ok":
            continue
        base = speed.get("fsdp2_bf16")
        r["speedup_vs_fsdp2_bf16"] = r["tokens_per_s_per_gpu"] / base if base else None
        own = speed.get(r["config"].split("_", 1)[0] + "_bf16")
        r["speedup_vs_own_bf16"] = r["tokens_per_s_per_gpu"] / own if own else None


def output_path(args: argparse.Namespace) -> Path:
    if args.output:
        return Path(args.output)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else _ROOT / "bench" / "results"
    return folder / f"train_{stamp}.json"


def format_table(report: dict[str, Any]) -> str:
    m = report["model"]
    lines = [f"{report['device']} x{report['world_size']}, Llama h{m['hidden']} "
             f"L{m['layers']} ffn{m['ffn']} vocab{m['vocab']}, bs {report['batch_size']} x seq "
             f"{report['seq_len']} per GPU, median of {report['steps']} steps after "
             f"{report['warmup']} warm-up",
             f"{'config':<16} {'status':<8} {'ranks':>5} {'tok/s/GPU':>10} {'TFLOP/s':>8} "
             f"{'peak GiB':>9} {'vs fsdp2':>9} {'vs bf16':>8} {'compiled':>9} {'fp8 lin':>7}"]
    for r in report["results"]:
        if r["status"] != "ok":
            error = str(r.get("error") or "").strip()
            lines.append(f"{r['config']:<16} {r['status']:<8} "
                         + (error.splitlines()[-1][:70] if error else ""))
            continue
        rel = {k: f"{r[k]:.2f}x" if r.get(k) else "-"
               for k in ("speedup_vs_fsdp2_bf16", "speedup_vs_own_bf16")}
        lines.append(f"{r['config']:<16} {'ok' if r['finite'] else 'NaN!':<8} "
                     f"{r.get('world_size', report['world_size']):>5} "
                     f"{r['tokens_per_s_per_gpu']:>10.0f} {r['tflops_per_gpu']:>8.3g} "
                     f"{r['peak_mem_gib']:>9.2f} {rel['speedup_vs_fsdp2_bf16']:>9} "
                     f"{rel['speedup_vs_own_bf16']:>8} {_compiled_cell(r):>9} "
                     f"{r.get('fp8_layers', {}).get('converted', '-'):>7}")
    return "\n".join(lines)


def _compiled_cell(r: dict[str, Any]) -> str:
    ev = r.get("compile")
    if not ev:
        return "eager"
    return f"{ev['unique_graphs']}g" + (f"/{ev['graph_breaks']}br" if ev["graph_breaks"] else "")


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))


# --------------------------------------------------------------------------- drivers


def run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """Every config in turn in this process group (torchrun or plain python)."""
    rank, world_size, device = setup_env_and_device(args.device)
    validate(args, world_size)
    info = model_info(args)  # meta device: a bad shape fails here, before any collective
    init_group(world_size, device)
    try:
        report: dict[str, Any] = dict(benchmark="train_throughput",
                                      command=command_line(world_size),
                                      **environment(device, world_size), model=info,
                                      batch_size=args.batch_size, seq_len=args.seq_len,
                                      zero_bucket_m=args.bucket_m, fp8_min_numel=args.fp8_min_numel,
                                      fp8_options=args.fp8_options,
                                      fused_lm_loss=args.fused_lm_loss,
                                      warmup=args.warmup, steps=args.steps,
                                      compile=args.compile,
                                      optimizer="AdamW" + (" (fused)" if _single.fused_adamw(
                                          args, device) else ""),
                                      peak_bf16_tflops=_single.peak_bf16_tflops(device),
                                      fsdp2_policy="param bf16, reduce fp32", results=[])
        for name in args.configs:
            if rank == 0:
                print(f"[bench] {name} ...", flush=True)
            result = run_config(name, args, device, rank, world_size, info["flops_per_token"])
            report["results"].append(result)
            if rank == 0:
                write_report(report, output_path(args))  # partial results survive a time-out
                speed = result.get("tokens_per_s_per_gpu")
                print(f"[bench] {name}: {result['status']}"
                      + (f", {speed:.0f} tokens/s/GPU, {result['peak_mem_gib']:.2f} GiB"
                         if speed else ""), flush=True)
        add_speedups(report["results"])
        if rank == 0:
            path = output_path(args)
            write_report(report, path)
            print(f"[bench] JSON written to {path}\n" + format_table(report), flush=True)
        dist.barrier()  # see examples/train_llama.py: no early teardown while a peer finishes
        return report
    finally:
        dist.destroy_process_group()


def child_argv_for(args: argparse.Namespace, config: str, output: str,
                   optional: tuple[str, ...], switches: tuple[str, ...]) -> list[str]:
    """One config's child command line (``--isolate``), for train.py and bench/scale.py.

    The arguments every bench shares, then each ``optional`` attribute that is set (None
    means unset; 0 is a value) and each ``switches`` flag that is on."""
    argv = ["--configs", config, "--output", output, "--preset", args.preset,
            "--vocab-size", str(args.vocab_size), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
            "--steps", str(args.steps), "--lr", str(args.lr), "--device", args.device]
    for flag in optional:
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + [f"--{flag.replace('_', '-')}" for flag in switches if getattr(args, flag)]


def _child_argv(args: argparse.Namespace, config: str, output: str) -> list[str]:
    return child_argv_for(args, config, output,
                          ("bucket_m", "fp8_min_numel", "fp8_options", "profile_steps", "layers",
                           "hidden", "ffn", "heads", "kv_heads", "master_step",
                           "fused_lm_loss", "torchao_recipe"),
                          ("compile", "fused_adamw", "fused_norm"))


def run_isolated(args: argparse.Namespace) -> dict[str, Any]:
    """One ``torchrun`` per config with a time limit: a crash or hang costs one config."""
    validate(args, 1)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    nproc = args.nproc or (torch.cuda.device_count() if use_cuda else 2)
    report: Optional[dict[str, Any]] = None
    results = []
    with tempfile.TemporaryDirectory(prefix="fp8boost_bench_") as tmp:
        for name in args.configs:
            out = os.path.join(tmp, f"{name}.json")
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={1 if name.startswith('single_') else nproc}"]
            cmd = launcher + [os.path.abspath(__file__)] + _child_argv(args, name, out)
            print(f"[bench] {' '.join(cmd[2:])}", flush=True)
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=args.config_timeout)
                tail, rc = proc.stdout[-3000:], proc.returncode
            except subprocess.TimeoutExpired as exc:
                tail, rc = (exc.stdout or b"")[-3000:], "timeout"
                tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            print(tail[-1500:], flush=True)
            if os.path.exists(out):
                child = json.loads(Path(out).read_text())
                report = report or child
                results.extend(child["results"])
            else:
                status = "timeout" if rc == "timeout" else "crashed"
                results.append(dict(config=name, status=status, returncode=rc, error=tail))
    if report is None:  # every config crashed: still write what we know
        report = dict(benchmark="train_throughput", device="unknown", world_size=nproc,
                      model={}, batch_size=args.batch_size, seq_len=args.seq_len,
                      steps=args.steps, warmup=args.warmup)
    report.update(results=results, world_size=nproc, command="python " + " ".join(
        [os.path.relpath(sys.argv[0])] + sys.argv[1:]), isolated=True)
    add_speedups(results)
    path = output_path(args)
    write_report(report, path)
    if report.get("model"):
        print(f"[bench] JSON written to {path}\n" + format_table(report), flush=True)
    else:
        print(f"[bench] every config failed; JSON written to {path}", flush=True)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    # Failed configs are recorded in the JSON and the table; the run itself succeeded.
    run_isolated(args) if args.isolate else run_in_process(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
