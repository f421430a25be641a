"""Catch the ranks of one model replica being fed different batches.

Under tensor parallelism every tp rank of a replica must run the forward on the *same* batch:
each holds a slice of every layer, and the collectives inside the model combine the slices as
if they had seen one input. Fed different batches (for example each rank built its own
``DataLoader(shuffle=True)``), the forward still returns one loss and training goes on, but
the gradients mix slices computed on different data: nothing fails, the model just learns
worse. The same holds for the pipeline ranks of a replica: the first stage embeds
``input_ids``, every stage reads ``position_ids``/``attention_mask`` and the last stage scores
``labels``, each from its own copy of the batch.

:class:`ReplicaInputGuard` compares a cheap checksum of the integer tensors of the inputs
(token ids, labels, masks, positions) across those ranks: a few int64 sums computed on the
inputs' device and one tiny all-gather per group (tp, then pp). It runs at the first forward
(the first ``execute_pipeline`` step with pipeline parallelism) only, unless the debug switch
``FP8BOOST_DEBUG_TP_INPUTS=1`` is set, in which case it runs at every one (a host sync per step:
for debugging). Floating-point inputs (``inputs_embeds``, pixels) are not compared.

Example:
    >>> import torch
    >>> a = input_checksum((), {"input_ids": torch.tensor([[1, 2, 3]])})
    >>> b = input_checksum((), {"input_ids": torch.tensor([[3, 2, 1]])})
    >>> bool(torch.equal(a, b))  # same sum, other order: the position-weighted sum differs
    False
"""
from __future__ import annotations

import logging
import os
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("fp8boost.parallel.tp")

DEBUG_ENV = "FP8BOOST_DEBUG_TP_INPUTS"
"""Set to ``1`` to compare the inputs at every forward instead of the first only."""

_FIELDS = ("tensors", "elements", "shape", "sum", "weighted_sum")


def debug_every_step(env: Optional[dict] = None) -> bool:
    """Whether ``FP8BOOST_DEBUG_TP_INPUTS`` asks for a check at every step.

    Args:
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: the variable holds something other than ``0``/``1`` (a typo must not
            silently leave the per-step check off).
    """
    value = (os.environ if env is None else env).get(DEBUG_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{DEBUG_ENV}={value!r}: use 1 (compare the tensor/pipeline-parallel ranks' "
                     "inputs at every step) or 0 / unset (at the first step only)")


def _integer_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Integer and bool tensors in (nested) args, in a rank-independent order (dict keys sorted)."""
    if torch.is_tensor(obj):
        if not obj.is_floating_point() and not obj.is_complex():
            yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _integer_tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _integer_tensors(item)


def input_checksum(args: Any, kwargs: Optional[dict] = None) -> torch.Tensor:
    """An int64 checksum of the integer tensors in ``args``/``kwargs``, on the CPU.

    Five numbers (``_FIELDS``): how many tensors, their total elements, a shape signature, the
    sum of all values and a position-weighted sum (``sum(x[i] * (i + 1))`` per tensor, weighted
    by the tensor's index), so reordered rows or tokens change it too. Arithmetic wraps
    around in int64 identically on every rank, so overflow cannot cause a false alarm.
    """
    total = torch.zeros(len(_FIELDS), dtype=torch.int64)
    for k, t in enumerate(_integer_tensors((args, kwargs or {}))):
        flat = t.detach().reshape(-1).to(torch.int64)
        pos = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64)
        shape = sum((i + 1) * 1009 ** i * d for i, d in enumerate(t.shape)) % (1 << 61)
        sums = torch.stack([flat.sum(), (flat * pos).sum()]).cpu()
        total += torch.tensor([1, flat.numel(), (k + 1) * shape, 0, 0], dtype=torch.int64)
        total[3] += sums[0]
        total[4] += (k + 1) * sums[1]
    return total


class ReplicaInputGuard:
    """Raise when the ranks of one model replica receive different inputs.

    Args:
        groups: process groups whose ranks must all see the same batch, innermost first
            (``[tp_group]``, or ``[tp_group, pp_group]`` with pipeline parallelism: gathering
            over tp and then over pp covers every rank of the replica). Groups of one rank are
            skipped.
        device: where the checksums travel (the CUDA device for NCCL groups, else the CPU).
        every_step: compare at every call (default: ``FP8BOOST_DEBUG_TP_INPUTS``); otherwise
            only until the first comparison succeeds.
    """

    def __init__(self, groups: Sequence[Any], device: torch.device,
                 every_step: Optional[bool] = None) -> None:
        self.groups = [g for g in groups if g is not None and dist.get_world_size(g) > 1]
        self.device = torch.device(device)
        self.every_step = debug_every_step() if every_step is None else every_step
        self.checked = False  # a comparison succeeded (then, without every_step, no more)
        self._handle = None

    @property
    def active(self) -> bool:
        """True while a call still compares (always with ``every_step``)."""
        return bool(self.groups) and (self.every_step or not self.checked)

    def check(self, args: Any, kwargs: Optional[dict] = None) -> None:
        """Compare this call's inputs across the groups (collective over them while active).

        Raises:
            ValueError: the ranks' checksums differ. Every rank of the replica raises alike
                (each holds the whole table), so none is left waiting in a collective.
        """
        if not self.active:
            return
        row = torch.cat([torch.tensor([dist.get_rank()], dtype=torch.int64),
                         input_checksum(args, kwargs)]).to(self.device)
        table = row.unsqueeze(0)
        for group in self.groups:  # innermost first: the table grows to the whole replica
            parts = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, table.contiguous(), group=group)
            table = torch.cat(parts)
        table = table.cpu()
        if row[1].item() == 0 and not self.checked:
            logger.info("the tp/pp input check found no integer input tensors (token ids, "
                        "labels) to compare; floating-point inputs are not checked")
        sums = table[:, 1:]
        if not bool((sums == sums[0]).all()):
            raise ValueError(_mismatch_message(table, self.every_step))
        self.checked = True
        if not self.every_step and self._handle is not None:
            self._handle.remove()  # checked once: later forwards pay nothing
            self._handle = None

    def attach(self, module: nn.Module) -> None:
        """Check the inputs of ``module``'s forward (a forward pre-hook) while active."""
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.check(args, kwargs)

        self._handle = module.register_forward_pre_hook(hook, with_kwargs=True)


def _mismatch_message(table: torch.Tensor, every_step: bool) -> str:
    by_sum: dict[tuple, list[int]] = {}
    for row in table.tolist():
        by_sum.setdefault(tuple(row[1:]), []).append(row[0])
    seen = "; ".join(f"ranks {sorted(ranks)}: " + ", ".join(f"{n}={v}" for n, v in zip(_FIELDS, s))
                     for s, ranks in by_sum.items())
    when = "this step" if every_step else "the first step"
    return ("tensor/pipeline-parallel ranks of one model replica were fed different batches at "
            f"{when}: the checksums of their integer inputs (input_ids, labels, ...) differ "
            f"({seen}). Every tp (and pp) rank of a replica must read the same batch; otherwise "
            "each trains its slice of the model on other data while the forward still returns "
            "one loss. Build the loader with plugin.prepare_dataloader(...) or pass it as "
            "booster.boost(dataloader=...): both shard over data-parallel ranks only and seed "
            "the shuffle alike on the ranks of a replica. With your own sampler, give it "
            "num_replicas=plugin.dp_size, rank=plugin.dp_rank and the same seed on every rank. "
            f"({DEBUG_ENV}=1 repeats this check at every step.)")
