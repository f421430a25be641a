"""A Colossal-AI training script after the one import edit (run by test_torchrun.py).

Everything below the imports is written as for Colossal-AI: launch, coordinator, logger,
HybridAdam, CosineAnnealingWarmupLR, Booster + LowLevelZeroPlugin, 3 steps of a tiny Llama.
Prints one JSON line per step from the master: {"step", "loss", "lr"}.
"""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp8boost.colossal as colossalai
from fp8boost.colossal.booster import Booster
from fp8boost.colossal.booster.plugin import LowLevelZeroPlugin
from fp8boost.colossal.cluster import DistCoordinator
from fp8boost.colossal.logging import get_dist_logger
from fp8boost.colossal.nn.lr_scheduler import CosineAnnealingWarmupLR
from fp8boost.colossal.nn.optimizer import HybridAdam
from fp8boost.colossal.utils import get_current_device


def main() -> None:
    colossalai.launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    logger = get_dist_logger()
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
    optimizer = HybridAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    lr_scheduler = CosineAnnealingWarmupLR(optimizer, total_steps=3, warmup_steps=1)
    plugin = LowLevelZeroPlugin(stage=2, precision="bf16", use_fp8=True)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, lr_scheduler = booster.boost(model, optimizer,
                                                         lr_scheduler=lr_scheduler)
    logger.info(f"boosted on {get_current_device()}, world size {coordinator.world_size}",
                ranks=[0])
    gen = torch.Generator().manual_seed(coordinator.rank)  # each rank its own data
    for step in range(1, 4):
        ids = torch.randint(0, 256, (2, 32), generator=gen).to(get_current_device())
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        if coordinator.is_master():
            print(json.dumps({"step": step, "loss": loss.item(), "lr": lr}), flush=True)
    coordinator.block_all()
    coordinator.print_on_master("colossal script done")
    coordinator.destroy()


if __name__ == "__main__":
    sys.exit(main())
