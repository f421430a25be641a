"""Peak memory per rank when a sharded plugin loads a pretrained checkpoint from the meta device.

Two steps, two processes, so the writer's memory never counts against the loaders::

    python bench/load_memory.py make --preset 7b-8l --path /tmp/ckpt_7b8l   # HF folder, bf16
    torchrun --nproc_per_node=2 bench/load_memory.py load --path /tmp/ckpt_7b8l --plugin gemini

``load`` builds the model on the meta device, boosts it (each rank allocates only its FP32
shards) and runs ``booster.load_model`` (each rank reads only its part of every tensor). It
reports, per rank: peak host RSS, peak GPU memory, the checkpoint size and the model's FP32
size, then checks a few parameters against the checkpoint (gathered). JSON to ``--output``
(default ``$OUT`` or bench/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import presets  # noqa: E402


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def make(args: argparse.Namespace) -> None:
    model = presets.build_model(args.preset, 32000, 4096, dtype=torch.bfloat16, seed=0)
    model.save_pretrained(args.path, safe_serialization=True, max_shard_size="2GB")
    size = sum(f.stat().st_size for f in Path(args.path).glob("*.safetensors"))
    print(f"[make] {args.preset}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
          f"params, {size / 2 ** 30:.2f} GiB on disk in {args.path}", flush=True)


def load(args: argparse.Namespace) -> dict:
    from fp8boost.booster import Booster
    from fp8boost.plugins import GeminiPlugin, TorchFSDPPlugin

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    rss0 = _rss_gib()
    t0 = time.perf_counter()
    model = presets.build_model(None, 32000, 4096, model_path=args.path,
                                device=torch.device("meta"))
    n_params = sum(p.numel() for p in model.parameters())
    plugin = (GeminiPlugin if args.plugin == "gemini" else TorchFSDPPlugin)(precision="bf16")
    booster = Booster(plugin=plugin, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt, *_ = booster.boost(model, opt)
    booster.load_model(model, args.path)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    gpu_peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    # Correctness spot check: gathered parameters equal the checkpoint's tensors.
    from safetensors import safe_open
    index = json.loads((Path(args.path) / "model.safetensors.index.json").read_text())
    inner = plugin.unwrap_model(model)
    params = dict(inner.named_parameters())
    checked = 0
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "lm_head.weight"):
        if name not in params or name not in index["weight_map"]:
            continue
        p = params[name]
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        with safe_open(str(Path(args.path) / index["weight_map"][name]), "pt") as f:
            ref = f.get_tensor(name)
        assert torch.equal(full.detach().cpu().to(ref.dtype), ref), f"{name} differs"
        checked += 1
    row = dict(rank=rank, host_peak_rss_gib=_rss_gib(), host_rss_at_start_gib=rss0,
               gpu_peak_gib=gpu_peak, seconds=seconds, checked=checked)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    disk = sum(f.stat().st_size for f in Path(args.path).glob("*.safetensors")) / 2 ** 30
    report = dict(benchmark="meta_init_sharded_load", plugin=args.plugin, world_size=world,
                  device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, date=datetime.datetime.now().isoformat(timespec="seconds"),
                  command="torchrun --nproc_per_node=%d bench/load_memory.py load --path %s "
                          "--plugin %s" % (world, args.path, args.plugin),
                  params=n_params, checkpoint_gib=disk, fp32_model_gib=n_params * 4 / 2 ** 30,
                  fp32_share_gib=n_params * 4 / 2 ** 30 / world, ranks=rows)
    if rank == 0:
        out = Path(args.output) if args.output else Path(os.environ.get("OUT", _ROOT / "bench" / "results")) / "load_memory.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"[load] {n_params / 1e9:.2f}B params, checkpoint {disk:.2f} GiB (bf16), FP32 model "
              f"{report['fp32_model_gib']:.2f} GiB, FP32 share per rank {report['fp32_share_gib']:.2f} GiB",
              flush=True)
        for r in rows:
            print(f"[load] rank {r['rank']}: host peak RSS {r['host_peak_rss_gib']:.2f} GiB "
                  f"(at start {r['host_rss_at_start_gib']:.2f}), GPU peak "
                  f"{r['gpu_peak_gib'] if r['gpu_peak_gib'] is None else round(r['gpu_peak_gib'], 2)} GiB, "
                  f"{r['seconds']:.1f} s, {r['checked']} tensors checked", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("make", "load"))
    p.add_argument("--path", required=True)
    p.add_argument("--preset", default="7b-8l", choices=list(presets.PRESETS))
    p.add_argument("--plugin", default="gemini", choices=("gemini", "fsdp"))
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    make(args) if args.mode == "make" else load(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
