"""Rank 0's conversion of a full-precision HF folder into an FP8 layout, one tensor at a time.

The plugin's own HF export (its gathering, one parameter at a time, with the exact weights it
saves: FP32 masters where its working copy is FP8-rounded) first writes the full-precision
folder into the new checkpoint's temp directory; this module then streams every tensor of it
through the layout's quantizer into the final files and deletes it. Two passes over the local
files: scales first (q/k/v and gate/up share the max of their amaxes), then the tensors.
No more than one full-precision tensor is in memory at a time.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch
from safetensors import safe_open

from ..checkpoint_io import hf_sharded as hf
from ..checkpoint_io.formats import MODEL_INDEX
from .calibrate import to_scale
from .layouts import ExportSpec, quantization_config
from .quantize import QuantTarget, group_amaxes, quantize_weight, weight_amax


class Source:
    """The full-precision folder: ``{key: file}`` and lazy reads."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.files = hf.checkpoint_files(directory)
        self.where: dict[str, str] = {}
        self.meta: dict[str, torch.Tensor] = {}
        for fname in self.files:
            with safe_open(os.path.join(directory, fname), "pt") as f:
                for k in f.keys():
                    sl = f.get_slice(k)
                    dtype = getattr(torch, {"F32": "float32", "BF16": "bfloat16", "F16": "float16",
                                            "F64": "float64"}.get(sl.get_dtype(), "uint8"))
                    self.where[k] = fname
                    self.meta[k] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")

    def read(self, key: str) -> torch.Tensor:
        with safe_open(os.path.join(self.directory, self.where[key]), "pt") as f:
            return f.get_tensor(key)


def compute_scales(src: Source, targets: list[QuantTarget], spec: ExportSpec) -> dict:
    """Pass 1: ``{key: multiplier}`` of every quantized weight."""
    if spec.strategy != "tensor":
        return {t.key: quantize_weight(src.read(t.key), t.conv1d, spec.strategy)[1]
                for t in targets}
    amaxes = {t.key: weight_amax(src.read(t.key)) for t in targets}
    return group_amaxes(amaxes, targets)


def plan_outputs(src: Source, targets: dict[str, QuantTarget], scales: dict, spec: ExportSpec,
                 extras: dict[str, torch.Tensor]) -> list[list[tuple[str, torch.Tensor]]]:
    """Per source file, the output entries (key, meta), widest dtype first (alignment)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    for n, fname in enumerate(src.files):
        entries = []
        for k, fname_k in src.where.items():
            if fname_k != fname:
                continue
            m = src.meta[k]
            if k in targets:
                entries.append((k, torch.empty(m.shape, dtype=torch.float8_e4m3fn, device="meta")))
                shape = spec.scalar_shape if spec.strategy == "tensor" else scales[k].shape
                entries.append((k[: -len("weight")] + spec.scale_name,
                                torch.empty(shape, dtype=torch.float32, device="meta")))
            else:
                entries.append((k, m))
        if n == 0:
            entries += [(k, torch.empty(v.shape, dtype=torch.float32, device="meta"))
                        for k, v in extras.items()]
        out.append(sorted(entries, key=lambda e: -e[1].element_size()))
    return out


def produce(key: str, src: Source, targets: dict[str, QuantTarget], scales: dict,
            spec: ExportSpec, extras: dict) -> torch.Tensor:
    """Pass 2: the output tensor ``key`` (one source tensor read, quantized if it is a weight)."""
    if key in extras:
        return extras[key]
    if key in src.where and key not in targets:
        return src.read(key)
    if key in targets:
        t = targets[key]
        amax = scales[key] if spec.strategy == "tensor" else None
        return quantize_weight(src.read(key), t.conv1d, spec.strategy, amax)[0]
    weight_key = key[: -len(spec.scale_name)] + "weight"
    s = scales[weight_key]
    if spec.strategy == "tensor":  # the multiplier of the shared amax, as quantize_weight
        t = targets[weight_key]
        s = quantize_weight(torch.zeros(1, 1), t.conv1d, "tensor", s)[1]
        return s.reshape(spec.scalar_shape)
    return s


def static_extras(stats: dict[str, torch.Tensor], targets: dict[str, QuantTarget],
                  spec: ExportSpec) -> dict[str, torch.Tensor]:
    """``input_scale`` / ``k_scale`` / ``v_scale`` tensors from observed amaxes."""
    out = {}
    for key, a in sorted(stats.items()):
        if key.endswith(".input_scale"):
            if spec.activation_scheme != "static" or f"{key[:-len('input_scale')]}weight" \
                    not in targets:
                continue
        elif not spec.kv_cache_scales:
            continue
        out[key] = to_scale(a).reshape(spec.scalar_shape)
    # q/k/v (gate/up) read one input: their input scales are equal already.
    return out


def convert(scratch: str, directory: str, targets: list[QuantTarget], ignored: list[str],
            spec: ExportSpec, stats: Optional[dict], shard: bool) -> None:
    """Write the FP8 folder ``directory`` from the full-precision folder ``scratch``."""
    src = Source(scratch)
    tmap = {t.key: t for t in targets if t.key in src.where and src.meta[t.key].dim() == 2}
    scales = compute_scales(src, list(tmap.values()), spec)
    extras = static_extras(stats or {}, tmap, spec)
    plan = plan_outputs(src, tmap, scales, spec, extras)
    sink = hf.Sink(directory)
    total, weight_map = 0, {}
    for fname, entries in zip(src.files, plan):
        sink.open(fname, entries)
        for key, meta in entries:
            t = produce(key, src, tmap, scales, spec, extras)
            sink.write(key, t)
            total += meta.numel() * meta.element_size()
            weight_map[key] = fname
        sink.close()
    if sink.failure is not None:
        raise sink.failure
    if shard:
        with open(os.path.join(directory, MODEL_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    write_config(scratch, directory, quantization_config(spec, ignored))


def write_config(scratch: str, directory: str, qconfig: dict) -> None:
    """``config.json`` with ``quantization_config``; other config files copied as they are."""
    for name in os.listdir(scratch):
        if name.endswith(".json") and name not in (MODEL_INDEX, "config.json") \
                and not name.startswith("fp8boost"):
            shutil.copy(os.path.join(scratch, name), os.path.join(directory, name))
    path = os.path.join(scratch, "config.json")
    if not os.path.exists(path):
        raise ValueError("an FP8 export needs the model's config.json: export a transformers "
                         "PreTrainedModel (its .config is written beside the weights)")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
