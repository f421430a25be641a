"""Training throughput at scale (issue 15): LLaMA2-7B/13B and a Command-R-35B shape on 8 GPUs.

Reuses bench/train.py's machinery (plugin setup, FSDP2 / torchao baselines, compile proof,
environment, JSON) with full-size presets (bench/_models.py) and the configs issue 15 lists.
Each config runs in its own torchrun by default (``--isolate``), and reports tokens/s/GPU,
TFLOP/s per GPU (PaLM accounting, examples/metrics.py), MFU against the GPU's dense BF16 peak
(H100 SXM / H800 / H200: 989 TFLOP/s; ``--peak-tflops`` overrides; none on CPU) and peak memory
(``peak_mem_gib`` over the whole config as in bench/train.py, plus ``setup_peak_mem_gib``
before the first step and ``train_peak_mem_gib`` over the steps).

Configs (``--configs``, comma separated; each plugin family in ``bf16``, ``fp8`` = use_fp8 and
``fp8_comm`` = use_fp8 + fp8_communication)::

    fsdp2_bf16_eager   torch FSDP2 per decoder layer, BF16 compute, never compiled
    fsdp2_bf16         the same, compiled with --compile
    torchao_fsdp2      torchao float8 tensorwise + FSDP2 FP8 all-gather (torchtitan's setup)
    zero2_<v>          LowLevelZeroPlugin(stage=2)
    zero2_<v>_ovl      the same with overlap_allgather=True (post-step all-gather overlapped)
    gemini_<v>         GeminiPlugin (ZeRO-3 on FSDP2)
    tpN_<v>, tpNsp_<v> HybridParallelPlugin(tp_size=N, zero_stage=1[, sequence parallel])
    ppN_<v>            HybridParallelPlugin(pp_size=N, num_microbatches=M, zero_stage=1),
                       trained with booster.execute_pipeline(iter([batch]), model, optimizer=opt)

dp is the world size over tp x pp (tp2 on 8 GPUs: tp2 x dp4; on 2 GPUs: tp2 x dp1). Every
GPU processes ``--batch-size`` x ``--seq-len`` tokens per step: a tp/pp replica takes
``batch-size x tp x pp`` sequences (``--replica-batch`` sets it; then each GPU's share is
replica-batch x seq / (tp x pp) tokens, recorded as ``tokens_per_gpu_step``). A pp replica
splits its batch into ``--microbatches`` (default: one sequence each). A config the library
cannot run yet (``NotImplementedError``, e.g. pipeline parallelism before it lands) is
recorded as ``not_available`` with the reason.

Usage (``python bench/suite.py --list 8gpu`` lists the issue's parts)::

    python bench/scale.py --preset llama2-7b --nproc 8 --compile --configs zero2_bf16,zero2_fp8
    python bench/scale.py --merge a.json b.json --scale 7b --output all.json   # one table
    torchrun --nproc_per_node=2 bench/scale.py --device cpu --preset tiny --vocab-size 256 \
        --seq-len 64 --configs tp2_fp8,pp2_bf16     # CPU check (BF16 matmuls are slow on CPU)

``--activation-checkpointing`` is a memory fallback (the recompute is not in TFLOP/s or MFU).
With ``--isolate`` each row also records ``process_wall_s``: its torchrun's wall time (start-up,
build, compile and steps), to size later runs.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

_BENCH = Path(__file__).resolve().parent
if str(_BENCH) not in sys.path:
    sys.path.insert(0, str(_BENCH))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _models  # noqa: E402  (bench/_models.py)
import _scale_report as rep  # noqa: E402  (bench/_scale_report.py)
import train  # noqa: E402  (bench/train.py: setup, compile proof, environment, JSON)
from _scale_configs import (MATRIX_35B, MATRIX_7B, layout_of,  # noqa: E402,F401
                            pp_chunks, setup_pipeline)

BF16_BUILD = ("command-r-35b",)  # presets whose FP32 copy does not fit one GPU (140 GB)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--configs", default=",".join(MATRIX_7B), help="comma-separated configs")
    presets = list(train.presets.PRESETS) + list(_models.SCALE_PRESETS)
    p.add_argument("--preset", default="llama2-7b", choices=presets)
    p.add_argument("--layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
    p.add_argument("--batch-size", type=int, default=2, help="sequences per GPU per step")
    p.add_argument("--replica-batch", type=int, default=None,
                   help="tp/pp configs: sequences per replica (default batch-size x tp x pp)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pp configs: micro-batches per step (default: one sequence each)")
    p.add_argument("--pp-style", default="1f1b", choices=("1f1b", "interleaved", "zbv"),
                   help="ppN configs: the pipeline schedule")
    p.add_argument("--pp-chunks", type=int, default=None,
                   help="ppN configs: model chunks per rank (default 1 for 1f1b, else 2)")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096 (256 for small presets)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--fp8-min-numel", type=int, default=None)
    p.add_argument("--fp8-options", default=None,
                   help="extra Fp8Config fields for the FP8 configs, e.g. 'backend=cublas' "
                        "(torch._scaled_mm in compiled graphs) or 'named=rowwise'")
    p.add_argument("--fused-lm-loss", default="on", choices=train.FUSED_LM_LOSS_CHOICES,
                   help="the Booster configs' lm_head + loss (bench/train.py's flag)")
    p.add_argument("--bucket-m", type=float, default=None, help="ZeRO reduce bucket (M elements)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="compile each decoder layer (all configs but fsdp2_bf16_eager)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="HF gradient checkpointing of every decoder layer (memory fallback; "
                        "TFLOP/s and MFU still count model FLOPs only, not the recompute)")
    p.add_argument("--build-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="dtype the full model is built in before the plugin shards it (auto: "
                        f"bf16 for {BF16_BUILD}, else fp32 as bench/train.py)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense BF16 peak per GPU for MFU (default: from the device name)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="CUDA: profile this many extra steps per config (rank 0's kernel ms by "
                        "category and its compute/NCCL overlap go into the JSON)")
    p.add_argument("--profile-trace", default=None, metavar="DIR",
                   help="with --profile-steps: rank 0's Chrome trace per config, gzipped, here")
    p.add_argument("--profile-cpu", action="store_true",
                   help="with --profile-steps: record CPU ops too (FSDP's ranges in the trace)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--output", default=None, help="JSON path (default: $OUT or bench/results)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one torchrun per config (default under plain python)")
    p.add_argument("--nproc", type=int, default=None, help="--isolate: processes per config")
    p.add_argument("--config-timeout", type=int, default=600, help="--isolate: s per config")
    p.add_argument("--best-of", nargs="*", default=None, metavar="JSON",
                   help="run [family_bf16, best FP8 config] of these earlier results instead "
                        "of --configs (default family zero2 when they hold no FP8 row)")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge part JSONs into one report (--output) and print its table")
    p.add_argument("--scale", default=None, choices=("7b", "13b", "35b"),
                   help="--merge: which published ratio the targets use")
    args = p.parse_args(argv)
    if args.best_of is not None:
        args.configs, args.best_reason = rep.best_pair(args.best_of)
    else:
        args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.isolate is None:
        args.isolate = "RANK" not in os.environ and len(args.configs) > 1
    if args.seq_len is None:
        args.seq_len = 256 if args.preset in _models.SMALL_PRESETS else 4096
    if args.vocab_size is None:
        args.vocab_size = _models.default_vocab(args.preset)
    if args.build_dtype == "auto":
        args.build_dtype = "bf16" if args.preset in BF16_BUILD else "fp32"
    # bench/train.py's helpers read these
    args.hidden = args.ffn = args.heads = None
    return args


def validate(args: argparse.Namespace, world_size: int) -> list[dict[str, Any]]:
    """Bad options raise before any process group or model exists; returns the layouts."""
    if not args.configs:
        raise ValueError("no configs given")
    for flag in ("batch_size", "seq_len", "steps", "vocab_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    if args.isolate and "RANK" in os.environ:
        raise ValueError("--isolate launches torchrun itself: run it with plain python")
    layouts = [layout_of(c, world_size) for c in args.configs]
    for lay in layouts:
        if lay["plugin"] in ("fsdp2", "torchao") and args.build_dtype != "fp32":
            raise ValueError(f"{lay['config']} keeps FP32 parameters (its baseline setup): it "
                             "needs --build-dtype fp32")
        rb = args.replica_batch or args.batch_size * lay["tp"] * lay["pp"]
        if lay["pp"] > 1 and rb % (args.microbatches or rb):
            raise ValueError(f"{lay['config']}: --microbatches {args.microbatches} must divide "
                             f"the replica batch {rb}")
        if lay["sp"] and args.seq_len % lay["tp"]:
            raise ValueError(f"{lay['config']}: --seq-len must be divisible by tp={lay['tp']}")
    return layouts


# --------------------------------------------------------------------------- one config


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The model on ``device``, identical on every rank (seeded); no KV cache."""
    over = {"num_hidden_layers": args.layers} if args.layers is not None else {}
    max_pos = max(args.seq_len, 2048)
    if args.preset in _models.SCALE_PRESETS:
        model = _models.build_model(args.preset, args.vocab_size, max_pos, device, seed=0,
                                    dtype=getattr(torch, "float32" if args.build_dtype == "fp32"
                                                  else "bfloat16"), **over)
    else:
        model = train.presets.build_model(args.preset, args.vocab_size, max_pos, device=device,
                                          seed=0, **over)
        if args.build_dtype == "bf16":
            model = model.to(torch.bfloat16)
    model.config.use_cache = False
    return model


def model_info(args: argparse.Namespace) -> dict[str, Any]:
    """Shape, parameter counts and training FLOPs per token, from a meta-device model."""
    model = build_model(args, torch.device("meta"))
    cfg = model.config
    n_matmul = train.matmul_params(model)
    return dict(preset=args.preset, arch=cfg.model_type, hidden=cfg.hidden_size,
                layers=cfg.num_hidden_layers, heads=cfg.num_attention_heads,
                kv_heads=cfg.num_key_value_heads, ffn=cfg.intermediate_size,
                vocab=cfg.vocab_size, tied_embeddings=bool(cfg.tie_word_embeddings),
                params=sum(p.numel() for p in model.parameters()), matmul_params=n_matmul,
                build_dtype=args.build_dtype,
                flops_per_token=train.flops_per_token(n_matmul, cfg.num_hidden_layers,
                                                      cfg.hidden_size, args.seq_len))


def measure(name: str, args, device: torch.device, rank: int, world_size: int) -> dict[str, Any]:
    """Build, set up, warm up and time one config on this rank; raises on failure."""
    lay = layout_of(name, world_size)
    replica = lay["tp"] * lay["pp"]
    replica_batch = args.replica_batch or args.batch_size * replica
    cuda = device.type == "cuda"
    start_mem = torch.cuda.memory_allocated(device) / 2 ** 30 if cuda else None
    model = build_model(args, device)
    if args.activation_checkpointing:  # before compile: the layers' __call__ checkpoints
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
    post_step = train._nothing
    if lay["plugin"] in ("fsdp2", "torchao"):
        model, optimizer, backward, post_step = train.setup_fsdp2(
            model, args, device, torchao=lay["plugin"] == "torchao")
    elif lay["pp"] > 1:
        booster, model, optimizer = setup_pipeline(model, lay, args, device, replica_batch)
    else:
        model, optimizer, backward, post_step = train.setup_booster(model, name, args, device)
    # Each replica its own (random) batch; the tp/pp ranks of a replica share it.
    gen = torch.Generator().manual_seed(1234 + rank // replica)
    tokens = torch.randint(0, args.vocab_size, (replica_batch, args.seq_len), generator=gen)
    tokens = tokens.to(device)

    def step() -> torch.Tensor:
        if lay["pp"] > 1:
            loss = booster.execute_pipeline(iter([dict(input_ids=tokens, labels=tokens)]),
                                            model, optimizer=optimizer)["loss"]
        else:
            loss = model(input_ids=tokens, labels=tokens).loss
            backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        post_step()
        return loss.detach()

    setup_peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    train._sync(device)
    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        train._sync(device)  # count the queued GPU work in the step that issued it
        times.append(time.perf_counter() - t0)
    values = [float(x) for x in losses]
    if cuda:
        train_peak = torch.cuda.max_memory_allocated(device) / 2 ** 30
        peak = max(setup_peak, train_peak)
        reserved = torch.cuda.max_memory_reserved(device) / 2 ** 30
    else:
        import resource  # CPU: the process's peak RSS
        train_peak = peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        reserved = None
    extra: dict[str, Any] = {}
    if args.profile_steps and cuda:  # after the timed steps: the profiler's cost is not timed
        import _profile  # bench/_profile.py
        trace = (str(Path(args.profile_trace) / f"trace_{name}_rank0.json.gz")
                 if args.profile_trace and rank == 0 else None)
        if trace:
            Path(args.profile_trace).mkdir(parents=True, exist_ok=True)
        extra["kernels"] = _profile.kernel_breakdown(step, args.profile_steps, device,
                                                     trace=trace, cpu=args.profile_cpu)
        if rank == 0:
            print(_profile.format_breakdown(name, extra["kernels"]), flush=True)
    if args.compile:
        extra["compile"] = train.compile_evidence()
    if getattr(args, "_fp8_layers", None):
        extra["fp8_layers"] = args._fp8_layers
    return dict(extra, **{k: lay[k] for k in ("tp", "pp", "dp", "sp")}, replica_batch=replica_batch,
                microbatches=(args.microbatches or replica_batch) if lay["pp"] > 1 else None,
                tokens_per_gpu_step=replica_batch * args.seq_len / replica,
                median_step_s=statistics.median(times), mean_step_s=statistics.fmean(times),
                min_step_s=min(times), max_step_s=max(times), peak_mem_gib=peak,
                setup_peak_mem_gib=setup_peak, train_peak_mem_gib=train_peak,
                peak_reserved_gib=reserved, start_mem_gib=start_mem, first_loss=values[0],
                last_loss=values[-1], finite=all(map(train._finite, values)))


def run_config(name: str, args, device, rank: int, world_size: int,
               info: dict[str, Any]) -> dict[str, Any]:
    """One config on every rank: status ok / oom / not_available / skipped / error."""
    cfg_args = copy.copy(args)
    cfg_args.compile = args.compile and name != "fsdp2_bf16_eager"
    cfg_args._fp8_layers = None
    result: dict[str, Any] = dict(config=name, status="ok")
    if cfg_args.compile:  # in-process runs: fresh dynamo caches, limits and counters per config
        import torch._dynamo
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
    if name == "torchao_fsdp2":
        try:
            import torchao.float8  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
            result.update(status="skipped", error=f"torchao not importable: {exc}")
    train._free_memory(device)
    if result["status"] == "ok":
        try:
            result.update(measure(name, cfg_args, device, rank, world_size))
        except train._oom_types() as exc:
            result.update(status="oom", error=str(exc).splitlines()[0][:300])
        except NotImplementedError as exc:  # e.g. pipeline parallelism not in this checkout
            result.update(status="not_available", error=f"NotImplementedError: {exc}")
        except Exception:  # noqa: BLE001 - record, keep benchmarking the other configs
            result.update(status="error", error=traceback.format_exc()[-2000:])
    train._free_memory(device)
    if result["status"] == "ok" and cfg_args.compile and not result["compile"]["unique_graphs"]:
        result.update(status="not_compiled",
                      error="--compile but dynamo captured no graph: this row ran eager")
    return combine_ranks(result, world_size, args, info)


def combine_ranks(result: dict[str, Any], world_size: int, args, info) -> dict[str, Any]:
    """Slowest rank's median and the largest peaks; failed if any rank failed; MFU."""
    gathered: list[Any] = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(gathered, result)
    else:
        gathered = [result]
    failed = [r for r in gathered if r["status"] != "ok"]
    if failed:
        return dict(failed[0], failed_ranks=[i for i, r in enumerate(gathered)
                                             if r["status"] != "ok"])
    out = dict(gathered[0], world_size=world_size)
    for key in ("median_step_s", "peak_mem_gib", "setup_peak_mem_gib", "train_peak_mem_gib",
                "peak_reserved_gib"):
        if out.get(key) is not None:
            out[key] = max(r[key] for r in gathered)
    out["finite"] = all(r["finite"] for r in gathered)
    tok_s = out["tokens_per_gpu_step"] / out["median_step_s"]
    out.update(tokens_per_s_per_gpu=tok_s, tokens_per_s_total=tok_s * world_size,
               tflops_per_gpu=tok_s * info["flops_per_token"] / 1e12)
    peak = getattr(args, "_peak_tflops", None)
    out["mfu"] = out["tflops_per_gpu"] / peak if peak else None
    return out


# --------------------------------------------------------------------------- drivers


def output_path(args: argparse.Namespace) -> Path:
    if args.output:
        return Path(args.output)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else _BENCH / "results"
    return folder / f"scale_{args.preset}_{stamp}.json"


def run_in_process(args: argparse.Namespace) -> dict[str, Any]:
    """Every config in turn in this process group (torchrun, or one plain process)."""
    rank, world_size, device = train.setup_env_and_device(args.device)
    validate(args, world_size)
    info = model_info(args)  # meta device: a bad shape fails here, before any collective
    train.init_group(world_size, device)
    env = train.environment(device, world_size)
    args._peak_tflops = args.peak_tflops or rep.dense_bf16_peak(env["device"])
    try:
        report: dict[str, Any] = dict(
            benchmark="scale_throughput", issue=15, command=train.command_line(world_size), **env,
            model=info, batch_size=args.batch_size, replica_batch=args.replica_batch,
            seq_len=args.seq_len, microbatches=args.microbatches, zero_bucket_m=args.bucket_m,
            pp_style=args.pp_style, pp_chunks=pp_chunks(args),
            fp8_min_numel=args.fp8_min_numel, fp8_options=args.fp8_options,
            fused_lm_loss=args.fused_lm_loss, warmup=args.warmup, steps=args.steps,
            compile=args.compile, activation_checkpointing=args.activation_checkpointing,
            optimizer="AdamW", peak_bf16_tflops=args._peak_tflops,
            fsdp2_policy="param bf16, reduce fp32", results=[])
        if getattr(args, "best_reason", None):
            report["best_of"] = args.best_reason
        for name in args.configs:
            if rank == 0:
                print(f"[scale] {name} ...", flush=True)
            result = run_config(name, args, device, rank, world_size, info)
            report["results"].append(result)
            if rank == 0:
                train.write_report(report, output_path(args))  # partial results survive
                speed = result.get("tokens_per_s_per_gpu")
                print(f"[scale] {name}: {result['status']}"
                      + (f", {speed:.0f} tokens/s/GPU, {result['peak_mem_gib']:.2f} GiB"
                         if speed else ""), flush=True)
        rep.add_speedups(report["results"])
        if rank == 0:
            path = output_path(args)
            train.write_report(report, path)
            print(f"[scale] JSON written to {path}\n" + rep.format_table(report), flush=True)
        dist.barrier()  # no early teardown while a peer finishes
        return report
    finally:
        dist.destroy_process_group()


def child_argv(args: argparse.Namespace, config: str, output: str) -> list[str]:
    argv = train.child_argv_for(args, config, output,
                                ("build_dtype", "layers", "replica_batch", "microbatches",
                                 "fp8_min_numel", "bucket_m", "peak_tflops", "profile_steps",
                                 "profile_trace", "fp8_options", "fused_lm_loss", "pp_style",
                                 "pp_chunks"),
                                ("activation_checkpointing", "profile_cpu"))
    return argv + (["--compile"] if args.compile and config != "fsdp2_bf16_eager" else [])


def run_isolated(args: argparse.Namespace) -> dict[str, Any]:
    """One ``torchrun`` per config with a time limit: a crash or hang costs one config."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    nproc = args.nproc or (torch.cuda.device_count() if use_cuda else 2)
    validate(args, nproc)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    report: Optional[dict[str, Any]] = None
    results = []
    with tempfile.TemporaryDirectory(prefix="fp8boost_scale_") as tmp:
        for name in args.configs:
            out = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", os.path.abspath(__file__),
                   *child_argv(args, name, out)]
            print(f"[scale] {' '.join(cmd[2:])}", flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, timeout=args.config_timeout)
                tail, rc = proc.stdout[-3000:], proc.returncode
            except subprocess.TimeoutExpired as exc:
                tail, rc = (exc.stdout or b"")[-3000:], "timeout"
                tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            wall = time.perf_counter() - t0
            print(tail[-1500:], flush=True)
            if os.path.exists(out):
                child = json.loads(Path(out).read_text())
                report = report or child
                for r in child["results"]:
                    r["process_wall_s"] = round(wall, 1)
                results.extend(child["results"])
            else:
                results.append(dict(config=name, status="timeout" if rc == "timeout" else
                                    "crashed", returncode=rc, error=tail,
                                    process_wall_s=round(wall, 1),
                                    **_layout_or_empty(name, nproc)))
    if report is None:  # every config crashed: still write what we know
        report = dict(benchmark="scale_throughput", issue=15, device="unknown", model={},
                      batch_size=args.batch_size, seq_len=args.seq_len, steps=args.steps,
                      warmup=args.warmup)
    report.update(results=results, world_size=nproc, isolated=True, command="python " + " ".join(
        [os.path.relpath(sys.argv[0])] + sys.argv[1:]))
    if getattr(args, "best_reason", None):
        report["best_of"] = args.best_reason
    rep.add_speedups(results)
    path = output_path(args)
    train.write_report(report, path)
    print(f"[scale] JSON written to {path}\n" + rep.format_table(report), flush=True)
    return report


def _layout_or_empty(name: str, world_size: int) -> dict[str, Any]:
    lay = layout_of(name, world_size)
    return {k: lay[k] for k in ("tp", "pp", "dp")}


def run_merge(args: argparse.Namespace) -> dict[str, Any]:
    scale = args.scale or next((s for s in ("35b", "13b", "7b") if s in args.preset), "7b")
    report = rep.merge(args.merge, scale)
    path = output_path(args)
    train.write_report(report, path)
    missing = f" (missing, left out: {report['missing']})" if report["missing"] else ""
    print(f"[scale] merged {len(report['merged_from'])} JSONs into {path}{missing}\n"
          + rep.format_table(report), flush=True)
    return report


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        run_merge(args)
    elif args.isolate:
        run_isolated(args)
    else:
        run_in_process(args)
    return 0  # failed configs are recorded in the JSON and the table: the run succeeded


if __name__ == "__main__":
    sys.exit(main())
