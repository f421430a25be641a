#!/usr/bin/env python
"""Time every FP8 collective (quantize + communicate + dequantize) against the BF16 collective.

Usage (2 GPUs, NCCL):
    torchrun --nproc_per_node=2 bench/comm.py                      # 1 MB .. 1 GB
    torchrun --nproc_per_node=2 bench/comm.py --max-mb 64 --iters 50
CPU smoke test (gloo):
    torchrun --nproc_per_node=2 bench/comm.py --backend gloo --device cpu --max-mb 4

Sizes are the BF16 payload: the all-gather output, the reduce-scatter / all-reduce input, the
all-to-all input, the sent tensor. Per size and variant: ``--warmup`` untimed runs, then
``--iters`` timed runs (CUDA events on GPU, perf_counter on CPU); the reported time is the
median on each rank, then the max over ranks (the slowest rank ends the collective).
Variants: ``bf16`` (the plain collective), ``fp8:<impl>`` (our function, every cast included;
impl = triton / torch; default config, one stage), ``fp8-pipelined:<impl>`` (8 MiB stages),
``fp8-shared:<impl>`` (all-gather with one group-wide scale),
``wire-u8`` (the plain collective on the FP8 byte count: the wire-only lower bound) and
``casts:<impl>`` (quantize + dequantize without communication) and, for all-gather,
``to-fp8-consumer:<impl>`` (quantize + gather, no dequantize: the bytes an FP8 GEMM takes as
they are, the issue-12 "all-gather into an FP8 consumer"). Each fp8 result is checked
against the bf16 one (max error / max |ref|), and triton against torch (bit-equal outputs).

Writes JSON (device, versions, date, command, world size, results, suggested
Fp8CommConfig.min_payload_numel) to ``$OUT/comm_<date>.json`` if ``$OUT`` is set, else
``bench/results/comm_<date>.json``; rank 0 prints a table.
"""
from __future__ import annotations

import os

# Keep NVLink SHARP / multicast off (see the device notes): set before torch.distributed starts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Callable, Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fp8boost.parallel import fp8_comm as fc  # noqa: E402
from fp8boost.parallel.comm._utils import all_gather_single, reduce_scatter_single  # noqa: E402
from fp8boost.parallel.comm.config import Fp8CommConfig  # noqa: E402
from fp8boost.parallel.comm.wire import dequantize_rows, quantize_rows, segment_bytes  # noqa: E402

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
# The pipelined variant (the default before 2026-11-22), timed against the one-stage default.
PIPELINED = 8 << 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="nccl", help="nccl (default) or gloo")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--min-mb", type=float, default=1.0, help="smallest BF16 payload, MB")
    p.add_argument("--max-mb", type=float, default=1024.0, help="largest BF16 payload, MB")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    p.add_argument("--impls", default="auto",
                   help="cast impls to time: auto (triton+torch on sm89+, else torch) or a list")
    p.add_argument("--out", default=None, help="JSON path (default: $OUT or bench/results)")
    return p.parse_args(argv)


def setup(args) -> torch.device:
    if args.device == "cuda":
        # Pick the GPU before the process group exists, so NCCL binds to the right device.
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=600))
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-iteration milliseconds (all ranks start each timed run together)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        dist.barrier()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def max_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _impls(args, device: torch.device) -> list[str]:
    if args.impls != "auto":
        return [s for s in args.impls.split(",") if s]
    fp8_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return ["triton", "torch"] if fp8_gpu else ["torch"]


def _variants(op: str, n: int, ws: int, rank: int, device, impls) -> dict[str, Callable]:
    """Closures for one op and payload size ``n`` (elements of BF16); each returns its output."""
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    rnd = lambda k: torch.randn(k, generator=g, device=device).to(torch.bfloat16)  # noqa: E731
    v: dict[str, Callable] = {}
    cfgs = {i: Fp8CommConfig(min_payload_numel=0, cast_impl=i) for i in impls}
    u8 = lambda k: torch.empty(k, dtype=torch.uint8, device=device)  # noqa: E731
    if op == "all_gather":
        shard, out = rnd(n // ws), torch.empty(n, dtype=torch.bfloat16, device=device)
        send, recv = u8(segment_bytes(n // ws)), u8(ws * segment_bytes(n // ws))
        v["bf16"] = lambda: all_gather_single(out, shard, None, False) or out
        v["wire-u8"] = lambda: all_gather_single(recv, send, None, False)
        for i, cfg in cfgs.items():
            v[f"fp8:{i}"] = lambda cfg=cfg: fc.all_gather_fp8(shard, config=cfg)
            v[f"fp8-pipelined:{i}"] = lambda cfg=cfg: fc.all_gather_fp8(
                shard, config=cfg.replace(pipeline_bytes=PIPELINED))
            v[f"fp8-shared:{i}"] = lambda cfg=cfg: fc.all_gather_fp8(
                shard, config=cfg.replace(all_gather_scale="shared"))
            v[f"casts:{i}"] = lambda i=i: _casts_only(shard, ws, i)
            v[f"to-fp8-consumer:{i}"] = lambda i=i: _gather_for_fp8_consumer(shard, send, recv,
                                                                              i)
    elif op == "reduce_scatter":
        full = rnd(n)
        out = torch.empty(n // ws, dtype=torch.bfloat16, device=device)
        seg = segment_bytes(n // ws)
        send, recv = u8((ws - 1) * seg), u8((ws - 1) * seg)
        splits = [0 if j == rank else seg for j in range(ws)]
        v["bf16"] = lambda: reduce_scatter_single(out, full, None, False) or out
        v["wire-u8"] = lambda: dist.all_to_all_single(recv, send, splits, splits)
        for i, cfg in cfgs.items():
            v[f"fp8:{i}"] = lambda cfg=cfg: fc.reduce_scatter_fp8(full, config=cfg)
            v[f"fp8-pipelined:{i}"] = lambda cfg=cfg: fc.reduce_scatter_fp8(
                full, config=cfg.replace(pipeline_bytes=PIPELINED))
    elif op == "all_reduce":
        src = rnd(n)
        buf = src.clone()
        v["bf16"] = lambda: (buf.copy_(src), dist.all_reduce(buf))[0]
        for i, cfg in cfgs.items():
            v[f"fp8:{i}"] = lambda cfg=cfg: (buf.copy_(src), fc.all_reduce_fp8(buf, config=cfg))[0]
            v[f"fp8-pipelined:{i}"] = lambda cfg=cfg: (buf.copy_(src), fc.all_reduce_fp8(
                buf, config=cfg.replace(pipeline_bytes=PIPELINED)))[0]
    elif op == "all_to_all":
        inp, out = rnd(n).view(ws, -1), torch.empty(ws, n // ws, dtype=torch.bfloat16,
                                                   device=device)
        v["bf16"] = lambda: dist.all_to_all_single(out, inp) or out
        for i, cfg in cfgs.items():
            v[f"fp8:{i}"] = lambda cfg=cfg: (fc.all_to_all_fp8(out, inp, config=cfg), out)[1]
    elif op == "send_recv":
        if ws % 2:
            return {}
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        t = rnd(n) if rank % 2 == 0 else torch.empty(n, dtype=torch.bfloat16, device=device)

        def p2p(cfg: Optional[Fp8CommConfig]):
            if cfg is None:
                (dist.send if rank % 2 == 0 else dist.recv)(t, peer)
            elif rank % 2 == 0:
                fc.send_fp8(t, peer, config=cfg)
            else:
                fc.recv_fp8(t, peer, config=cfg)
            return t

        v["bf16"] = lambda: p2p(None)
        for i, cfg in cfgs.items():
            v[f"fp8:{i}"] = lambda cfg=cfg: p2p(cfg)
    return v


def _gather_for_fp8_consumer(shard: torch.Tensor, send: torch.Tensor, recv: torch.Tensor,
                             impl: str) -> torch.Tensor:
    """All-gather whose FP8 bytes go straight to an FP8 consumer (a GEMM): quantize the shard
    (scale + trailer included), gather the segments, no dequantize."""
    n = shard.numel()
    quantize_rows(shard.view(1, n), send.view(1, -1), torch.float8_e4m3fn, power_of_2=True,
                  impl=impl)
    all_gather_single(recv, send, None, False)
    return recv


def _casts_only(shard: torch.Tensor, ws: int, impl: str) -> torch.Tensor:
    """Quantize one shard and dequantize ``ws`` of them: the cast cost of the all-gather."""
    n = shard.numel()
    packed = torch.empty((ws, segment_bytes(n)), dtype=torch.uint8, device=shard.device)
    quantize_rows(shard.view(1, n), packed[:1], torch.float8_e4m3fn, power_of_2=True, impl=impl)
    packed[1:].copy_(packed[:1].expand(ws - 1, -1))
    out = torch.empty((ws, n), dtype=shard.dtype, device=shard.device)
    dequantize_rows(packed, n, torch.float8_e4m3fn, out, power_of_2=True, impl=impl)
    return out


def bench_op(op: str, size_mb: float, args, device, impls) -> list[dict]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    n = int(size_mb * 2**20) // 2 // (ws * 16) * (ws * 16)  # BF16 elements, divisible by ws*16
    variants = _variants(op, n, ws, rank, device, impls)
    rows, outs = [], {}
    for name, fn in variants.items():
        row = {"op": op, "size_mb": size_mb, "numel": n, "variant": name}
        try:
            times = time_fn(fn, device, args.warmup, args.iters)
            res = fn()  # one more run, kept (cloned: variants share buffers) for checks
            outs[name] = res.clone() if isinstance(res, torch.Tensor) else res
            row.update(median_ms=max_over_ranks(statistics.median(times), device),
                       min_ms=max_over_ranks(min(times), device), iters=len(times))
        except Exception as exc:  # noqa: BLE001 - record and go on (same failure on all ranks)
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        rows.append(row)
    ref = outs.get("bf16")
    for row in rows:
        out = outs.get(row["variant"])
        if ref is not None and isinstance(out, torch.Tensor) and row["variant"].startswith("fp8"):
            row["rel_err_vs_bf16"] = max_over_ranks(rel_err(out, ref), device)
            twin = row["variant"].replace("triton", "torch")
            if row["variant"].endswith(":triton") and twin in outs:
                other = outs[twin]
                row["triton_bit_equal_torch"] = bool(max_over_ranks(
                    float(not torch.equal(out, other)), device) == 0.0)
        if "median_ms" in row and "bf16" in variants and "median_ms" in rows[0]:
            row["speedup_vs_bf16"] = rows[0]["median_ms"] / row["median_ms"]
    return rows


def suggest_min_numel(results: list[dict]) -> dict:
    """Smallest payload from which the best fp8 variant beats bf16 at every larger size."""
    per_op = {}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        sizes = sorted({r["numel"] for r in results if r["op"] == op})
        crossover = None
        for n in reversed(sizes):
            rows = [r for r in results if r["op"] == op and r["numel"] == n]
            bf16 = [r["median_ms"] for r in rows if r["variant"] == "bf16" and "median_ms" in r]
            fp8 = [r["median_ms"] for r in rows if r["variant"].startswith("fp8:")
                   and "median_ms" in r]
            if not bf16 or not fp8 or min(fp8) >= bf16[0]:
                break
            crossover = n
        per_op[op] = crossover  # None: fp8 never wins at the largest size measured
    wins = [v for v in per_op.values() if v is not None]
    return {"per_op": per_op, "min_numel": max(wins) if len(wins) == len(per_op) else None,
            "note": "payload elements; None means FP8 did not win at the largest size"}


def environment(device: torch.device, args) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "world_size": dist.get_world_size(), "backend": dist.get_backend(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": f"torchrun --nproc_per_node={dist.get_world_size()} bench/comm.py "
                      + " ".join(sys.argv[1:]),
           "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"),
           "NCCL_P2P_DISABLE": os.environ.get("NCCL_P2P_DISABLE"),
           "NCCL_SHM_DISABLE": os.environ.get("NCCL_SHM_DISABLE"),
           "warmup": args.warmup, "iters": args.iters, "statistic": "max over ranks of median"}
    try:
        import triton  # noqa: WPS433
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["device"] = torch.cuda.get_device_name(device)
        ver = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, ver)) if isinstance(ver, tuple) else str(ver)
    else:
        env["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


def print_table(results: list[dict]) -> None:
    print(f"{'op':<15}{'MB':>7} {'variant':<20}{'median ms':>11}{'speedup':>9}{'rel err':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['op']:<15}{r['size_mb']:>7g} {r['variant']:<20} ERROR {r['error'][:60]}")
            continue
        sp = f"{r['speedup_vs_bf16']:.2f}x" if "speedup_vs_bf16" in r else ""
        err = f"{r['rel_err_vs_bf16']:.1e}" if "rel_err_vs_bf16" in r else ""
        print(f"{r['op']:<15}{r['size_mb']:>7g} {r['variant']:<20}{r['median_ms']:>11.3f}"
              f"{sp:>9}{err:>10}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    impls = _impls(args, device)
    sizes, s = [], args.min_mb
    while s <= args.max_mb + 1e-9:
        sizes.append(s)
        s *= 2
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown ops {bad}; choose from {OPS}")
    results = []
    for op in ops:
        for size in sizes:
            results.extend(bench_op(op, size, args, device, impls))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = {**environment(device, args), "impls": impls, "results": results,
              "suggested": suggest_min_numel(results)}
    if dist.get_rank() == 0:
        print_table(results)
        print("suggested Fp8CommConfig.min_payload_numel:", json.dumps(report["suggested"]))
        stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
        path = args.out or os.path.join(
            os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results"), f"comm_{stamp}.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print("wrote", path)
    return report


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
