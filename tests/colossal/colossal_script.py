"""A Colossal-AI training script after the one import edit (run by test_torchrun.py).

Written as Colossal-AI's own Llama benchmark (examples/language/llama/benchmark.py) is: the
plugin picked by ``-p``, lazy init for the sharded plugins, HF activation checkpointing,
``prepare_dataloader``, ``execute_pipeline`` with ``criterion=lambda outputs, inputs:
outputs[0]`` at pp > 1, HybridAdam + CosineAnnealingWarmupLR, LoRA through
``booster.enable_lora``. Everything below the imports is Colossal-AI's API; undoing the edit
(``fp8boost.colossal`` -> ``colossalai``) leaves no fp8boost name behind.

Prints one JSON line per step from the rank that holds the loss: {"plugin", "step", "loss", "lr"}
and, after training, {"plugin", "fp8_layers", "linear_layers"} from every rank 0 / last stage.

Examples:
    torchrun --nproc_per_node 2 tests/colossal/colossal_script.py -p zero2 --use-fp8
    torchrun --nproc_per_node 4 tests/colossal/colossal_script.py -p 3d --tp 2 --pp 2 --use-fp8
"""
import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecision
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import fp8boost.colossal as colossalai
from fp8boost.colossal.accelerator import get_accelerator
from fp8boost.colossal.booster import Booster
from fp8boost.colossal.booster.plugin import (GeminiPlugin, HybridParallelPlugin,
                                              LowLevelZeroPlugin, TorchDDPPlugin,
                                              TorchFSDPPlugin)
from fp8boost.colossal.cluster import DistCoordinator
from fp8boost.colossal.lazy import LazyInitContext
from fp8boost.colossal.logging import get_dist_logger
from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
from fp8boost.colossal.nn.optimizer import HybridAdam
from fp8boost.colossal.shardformer import PipelineGradientCheckpointConfig

MODELS = {
    # hidden, intermediate, layers, heads, kv heads, vocab
    "tiny": (64, 128, 4, 4, 2, 256),
    "7b-2l": (4096, 11008, 2, 32, 32, 32000),
}


class RandomDataset(Dataset):
    """Colossal-AI's benchmark data: random token ids, labels = input_ids."""

    def __init__(self, num_samples: int, max_length: int, vocab_size: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.input_ids = torch.randint(0, vocab_size, (num_samples, max_length), generator=gen)
        self.attention_mask = torch.ones_like(self.input_ids)

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def __getitem__(self, idx: int) -> dict:
        return {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx],
                "labels": self.input_ids[idx]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--plugin", default="gemini",
                        choices=["gemini", "zero1", "zero2", "ddp", "fsdp", "3d"])
    parser.add_argument("-c", "--config", default="tiny", choices=sorted(MODELS))
    parser.add_argument("-b", "--batch_size", type=int, default=2)
    parser.add_argument("-s", "--num_steps", type=int, default=3)
    parser.add_argument("-l", "--max_length", type=int, default=32)
    parser.add_argument("-g", "--grad_checkpoint", action="store_true")
    parser.add_argument("--lazy", action="store_true", help="LazyInitContext for the model")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--pp_style", default="1f1b", choices=["1f1b", "interleaved", "zbv"])
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--sp_mode", default="all_to_all",
                        choices=["all_to_all", "split_gather"])
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--use_fp8", "--use-fp8", action="store_true")
    parser.add_argument("--use_fp8_comm", action="store_true")
    parser.add_argument("--save_dir", default=None, help="save model/optimizer/lr_scheduler")
    parser.add_argument("--load_checkpoint", default=None, help="resume from a --save_dir")
    return parser.parse_args()


def save_checkpoint(save_dir, booster, model, optimizer, lr_scheduler, lora) -> None:
    """As Colossal-LLaMA's colossal_llama/utils/ckpt_io.py saves."""
    if lora:
        booster.save_lora_as_pretrained(model, os.path.join(save_dir, "modeling"))
    else:
        booster.save_model(model, os.path.join(save_dir, "modeling"), shard=True)
    booster.save_optimizer(optimizer, os.path.join(save_dir, "optimizer"), shard=True)
    booster.save_lr_scheduler(lr_scheduler, os.path.join(save_dir, "lr_scheduler"))


def load_checkpoint(load_dir, booster, model, optimizer, lr_scheduler) -> None:
    """As Colossal-LLaMA's colossal_llama/utils/ckpt_io.py loads."""
    booster.load_model(model=model, checkpoint=os.path.join(load_dir, "modeling"))
    booster.load_optimizer(optimizer=optimizer, checkpoint=os.path.join(load_dir, "optimizer"))
    booster.load_lr_scheduler(lr_scheduler=lr_scheduler,
                              checkpoint=os.path.join(load_dir, "lr_scheduler"))


@torch.no_grad()
def eval_loss(model, vocab: int, length: int, device) -> float:
    """The loss of one fixed batch (a resumed run must see what the saving run saw)."""
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(7))
    ids = ids.to(device)
    return model(input_ids=ids, labels=ids)[0].item()


def build_plugin(args: argparse.Namespace):
    """As Colossal-AI's benchmark builds its plugins (same argument names and values)."""
    fp8 = dict(use_fp8=args.use_fp8, fp8_communication=args.use_fp8_comm)
    if args.plugin == "gemini":
        return GeminiPlugin(precision="bf16", shard_param_frac=1.0, initial_scale=2**16,
                            max_norm=1.0, enable_fused_normalization=False,
                            enable_flash_attention=False, max_prefetch=0,
                            enable_async_reduce=True, **fp8)
    if args.plugin in ("zero1", "zero2"):
        return LowLevelZeroPlugin(stage=int(args.plugin[-1]), precision="bf16",
                                  initial_scale=2**16, max_norm=1.0, **fp8)
    if args.plugin == "ddp":
        return TorchDDPPlugin(broadcast_buffers=True, find_unused_parameters=False,
                              check_reduction=False, use_fp8=args.use_fp8)
    if args.plugin == "fsdp":
        return TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                              reduce_dtype=torch.float32,
                                                              buffer_dtype=torch.bfloat16),
                               **fp8)
    ckpt_config = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5) \
        if args.grad_checkpoint and args.pp > 1 else None
    return HybridParallelPlugin(
        tp_size=args.tp, pp_size=args.pp, pp_style=args.pp_style, zero_stage=args.zero,
        sp_size=args.sp, enable_sequence_parallelism=args.sp > 1,
        sequence_parallelism_mode=args.sp_mode, enable_fused_normalization=False,
        enable_flash_attention=False, microbatch_size=args.mbs, precision="bf16",
        enable_metadata_cache=True, overlap_allgather=False,
        num_model_chunks=2 if args.pp_style in ("interleaved", "zbv") else 1,
        gradient_checkpoint_config=ckpt_config, **fp8)


def main() -> None:
    args = parse_args()
    colossalai.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    logger = get_dist_logger()
    plugin = build_plugin(args)
    booster = Booster(plugin=plugin)

    hidden, inter, layers, heads, kv, vocab = MODELS[args.config]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, max_position_embeddings=4096)
    dataset = RandomDataset(args.batch_size * args.num_steps * coordinator.world_size,
                            args.max_length, vocab)
    dataloader = plugin.prepare_dataloader(dataset, batch_size=args.batch_size, shuffle=True,
                                           drop_last=True, seed=42)
    init_ctx = LazyInitContext(default_device=get_accelerator().get_current_device()) \
        if args.lazy else nullcontext()
    with init_ctx:
        model = LlamaForCausalLM(config)
    if args.grad_checkpoint:
        model.gradient_checkpointing_enable()
    if args.lora:
        from peft import LoraConfig
        model = booster.enable_lora(model, lora_config=LoraConfig(
            task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    optimizer = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    lr_scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=args.num_steps, warmup_steps=1)
    torch.set_default_dtype(torch.bfloat16)
    model, optimizer, _, dataloader, lr_scheduler = booster.boost(
        model, optimizer, dataloader=dataloader, lr_scheduler=lr_scheduler)
    torch.set_default_dtype(torch.float32)
    logger.info(f"boosted on {get_accelerator().get_current_device()}, world size "
                f"{coordinator.world_size}", ranks=[0])

    pipelined = isinstance(plugin, HybridParallelPlugin) and args.pp > 1
    device = get_accelerator().get_current_device()
    if args.load_checkpoint:
        load_checkpoint(args.load_checkpoint, booster, model, optimizer, lr_scheduler)
        if not pipelined:
            loss = eval_loss(model, vocab, args.max_length, device)
            coordinator.print_on_master(json.dumps({"plugin": args.plugin, "eval_start": loss}))
    train(args, plugin, booster, model, optimizer, lr_scheduler, dataloader, coordinator)
    if args.save_dir:
        if not pipelined:
            loss = eval_loss(model, vocab, args.max_length, device)
            coordinator.print_on_master(json.dumps({"plugin": args.plugin, "eval_end": loss}))
        save_checkpoint(args.save_dir, booster, model, optimizer, lr_scheduler, args.lora)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fp8 = [m for m in linear if type(m).__name__ == "Fp8Linear"]
    if dist.get_rank() == 0:
        print(json.dumps({"plugin": args.plugin, "fp8_layers": len(fp8),
                          "linear_layers": len(linear)}), flush=True)
    if args.lora:
        booster.save_lora_as_pretrained(
            model, os.path.join(tempfile.gettempdir(), f"colossal_script_lora_{args.plugin}"))
    coordinator.block_all()
    coordinator.print_on_master("colossal script done")
    coordinator.destroy()


def train(args, plugin, booster, model, optimizer, lr_scheduler, dataloader, coordinator):
    """Colossal-AI's benchmark loop: execute_pipeline at pp > 1, else forward + backward."""
    pipelined = isinstance(plugin, HybridParallelPlugin) and args.pp > 1
    device = get_accelerator().get_current_device()
    data_iter = iter(dataloader)
    for step in range(1, args.num_steps + 1):
        lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        if pipelined:
            outputs = booster.execute_pipeline(data_iter, model,
                                               criterion=lambda outputs, inputs: outputs[0],
                                               optimizer=optimizer, return_loss=True)
            loss = outputs["loss"]
            show = plugin.stage_manager.is_last_stage() and plugin.dp_rank == 0 \
                and dist.get_rank() % max(args.tp, 1) == 0
        else:
            batch = {k: v.to(device) for k, v in next(data_iter).items()}
            loss = model(**batch)[0]
            booster.backward(loss, optimizer)
            show = coordinator.is_master()
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        if show:
            value = loss.item()  # waits for the step's kernels
            print(json.dumps({"plugin": args.plugin, "step": step, "loss": value, "lr": lr,
                              "sec": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
