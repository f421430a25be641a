"""The Plugin base class: everything a training strategy controls, in one place.

A plugin decides, for one training run:

* **model wrapping** - dtype of the working parameters, FP8 conversion of linear layers
  (``use_fp8``), the engine wrapper (DDP, ZeRO hooks, ...), device placement;
* **optimizer wrapping** - master weights, sharding of optimizer state, loss scaling,
  gradient clipping (``max_norm``), how gradients are reduced (and in which format);
* **dataloader sharding** - each data-parallel rank sees its own part of the data and the
  ranks of one replica the same part (a seeded ``DistributedSampler``, also with one
  replica); ``prepare_dataloader`` builds one from a dataset;
* **backward / no_sync** - how a loss is backpropagated and how gradient accumulation skips
  communication;
* **checkpoint IO** - which process group coordinates a save, who writes, the unwrapped model
  whose ``state_dict`` is saved, and what must be refreshed after a load.

The ``Booster`` holds one plugin and owns no strategy logic of its own.
"""
from __future__ import annotations

import contextlib
from abc import ABC
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, \
    RandomSampler, SequentialSampler

from fp8boost import _state
from fp8boost.checkpoint_io import GeneralCheckpointIO
from fp8boost.checkpoint_io.pretrained import load_remembered
from fp8boost.loss import install_fused_lm_loss
from fp8boost.norm import FusedNormReport, install_fused_rms_norms
from fp8boost.parallel.comm.plan import CommPlan, build_comm_plan
from fp8boost.parallel.comm.report import CommReport
from fp8boost.parallel.distributed import default_device, init_distributed
from fp8boost.parallel.fsdp import wiring
from fp8boost.parallel.mesh import ParallelDims, Topology, device_type_of
from fp8boost.parallel.wrappers import DTYPES, ModelWrapper

from .options import OPTION_NAMES, PluginOptions
from .precision import convert_model, move_and_cast, validate_optimizer, wrap_optimizer

Boosted = tuple  # (model, optimizer, criterion, dataloader, lr_scheduler)


def check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler) -> None:
    """Type checks shared by every plugin; raise before anything is moved or communicated."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, ModelWrapper):
        raise ValueError("this model was already boosted; pass the original model to boost() once")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer built on model.parameters(), "
                        f"got {type(optimizer).__name__}")
    if criterion is not None and not callable(criterion):
        raise TypeError(f"criterion must be callable, got {type(criterion).__name__}")
    if dataloader is not None and not isinstance(dataloader, DataLoader):
        raise TypeError(f"dataloader must be a torch DataLoader, got {type(dataloader).__name__}")
    if lr_scheduler is not None and optimizer is None:
        raise ValueError("an lr_scheduler needs its optimizer: pass optimizer= as well")
    if lr_scheduler is not None and getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("lr_scheduler was built on a different optimizer than the one passed")
    if optimizer is not None:
        model_params = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in model_params:
                    raise ValueError("the optimizer holds a tensor that is not a parameter of the "
                                     "model; build it from model.parameters()")


def check_meta(model: nn.Module) -> None:
    """Raise (before any collective) if ``model`` is partly on the meta device in a way that
    cannot be materialized (see ``wiring.check_meta_model``); nothing for a real model."""
    if wiring.on_meta(model):
        wiring.check_meta_model(model)


def materialize_replica(model: nn.Module, optimizer, device: torch.device) -> None:
    """Allocate a whole meta-device model on ``device`` and run its own initialisation, in place.

    The plugins that keep a full replica per rank call it in ``build_model`` (the FSDP plugins
    materialize only their shards instead). Parameters get the model's own init (HF
    ``_init_weights``, else ``reset_parameters``) drawn from a seed taken from the global RNG,
    so ranks seeded alike agree (and ``parallelize`` broadcasts rank 0's replica anyway);
    meta buffers are rebuilt as construction makes them (rotary ``inv_freq``); tied parameters
    stay tied. ``optimizer``'s param groups are pointed at the new parameters. A model built
    by ``from_pretrained`` inside ``LazyInitContext`` then reads its checkpoint
    (``checkpoint_io.pretrained.load_remembered``). Nothing happens for a real model.
    """
    if not wiring.on_meta(model):
        return
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    aliases: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(n)
    wiring.materialize(model, device)
    for first, *others in (a for a in aliases.values() if len(a) > 1):
        tied = model.get_parameter(first)  # to_empty gave each alias its own tensor: re-tie
        for name in others:
            mod_name, _, pname = name.rpartition(".")
            setattr(model.get_submodule(mod_name), pname, tied)
    load_remembered(model)
    if optimizer is not None:
        new = dict(model.named_parameters(remove_duplicate=False))
        for group in optimizer.param_groups:
            group["params"] = [new[names[id(p)]] for p in group["params"]]


def _plain_sampler(dataloader: DataLoader) -> bool:
    """True for the samplers ``DataLoader(shuffle=...)`` builds itself, on a map-style dataset
    with ``batch_size`` batching: what ``shard_dataloader`` converts at any world size."""
    sampler = dataloader.sampler
    if type(sampler) is RandomSampler:  # _num_samples: None unless num_samples= was given
        plain = not sampler.replacement and sampler._num_samples is None
    else:
        plain = type(sampler) is SequentialSampler
    return (plain and dataloader.batch_size is not None
            and not isinstance(dataloader.dataset, IterableDataset))


def shard_dataloader(dataloader: Optional[DataLoader], world: int, rank: int,
                     seed: int = 1024) -> Optional[DataLoader]:
    """Rebuild ``dataloader`` so that each of ``world`` data-parallel ranks reads a disjoint part.

    Every world size, 1 included, gets the same semantics: the loader's sampler becomes a
    ``DistributedSampler(num_replicas=world, rank=rank, seed=seed)``, shuffled when it was a
    ``RandomSampler`` (``DataLoader(shuffle=True)``), so the order is seeded (the same in every
    process and run; the DataLoader's ``generator`` does not drive it) and changes only with
    ``loader.sampler.set_epoch(epoch)``, to be called each epoch. Ranks that pass the same
    ``rank`` (the tp/pp ranks of one replica) read identical batches. The per-rank batch size
    stays the loader's ``batch_size`` (global batch = world x it).

    Kept unchanged: a loader whose sampler already is a ``DistributedSampler`` (the user
    sharded it), and, with ``world == 1``, one with its own sampler, ``batch_sampler`` or an
    ``IterableDataset`` (nothing to shard: it is used as the user built it). With
    ``world > 1`` other samplers are replaced by a ``DistributedSampler`` (shuffled only if
    it was a ``RandomSampler``), and an ``IterableDataset`` or ``batch_sampler`` raises.

    Example:
        >>> loader = shard_dataloader(DataLoader(list(range(8)), batch_size=2, shuffle=True), 1, 0)
        >>> loader.sampler.set_epoch(1); sorted(int(v) for b in loader for v in b)
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if dataloader is None or isinstance(dataloader.sampler, DistributedSampler):
        return dataloader
    if world == 1 and not _plain_sampler(dataloader):
        return dataloader  # one replica reads everything: the user's own sampling stands
    if isinstance(dataloader.dataset, IterableDataset):
        raise TypeError("cannot shard an IterableDataset with DistributedSampler: shard it per rank "
                        "yourself and pass dataloader=None to boost()")
    if dataloader.batch_size is None:
        raise TypeError("cannot shard a DataLoader built with a custom batch_sampler: pass a "
                        "DataLoader with batch_size=..., or shard it yourself")
    if not _plain_sampler(dataloader):
        _state.warn_once(("shard-dataloader-replaces", type(dataloader.sampler).__name__),
                         f"fp8boost: the dataloader's {type(dataloader.sampler).__name__} is "
                         f"replaced by a DistributedSampler over {world} data-parallel replicas "
                         "(its weights, replacement or num_samples are not kept); to keep your "
                         "sampling, build a sampler that shards by plugin.dp_rank / "
                         "plugin.dp_size yourself (a DistributedSampler subclass is kept as is)")
    sampler = DistributedSampler(dataloader.dataset, num_replicas=world, rank=rank,
                                 shuffle=isinstance(dataloader.sampler, RandomSampler), seed=seed,
                                 drop_last=dataloader.drop_last)
    extra = {}
    if dataloader.num_workers > 0:
        extra = {"prefetch_factor": dataloader.prefetch_factor,
                 "persistent_workers": dataloader.persistent_workers}
    # Everything else the user set carries over (with one replica the loader used to be
    # returned as built, so its worker context, generator and ordering must not be lost).
    return DataLoader(dataloader.dataset, batch_size=dataloader.batch_size, sampler=sampler,
                      num_workers=dataloader.num_workers, collate_fn=dataloader.collate_fn,
                      pin_memory=dataloader.pin_memory, drop_last=dataloader.drop_last,
                      timeout=dataloader.timeout, worker_init_fn=dataloader.worker_init_fn,
                      multiprocessing_context=dataloader.multiprocessing_context,
                      generator=dataloader.generator,
                      pin_memory_device=dataloader.pin_memory_device, in_order=dataloader.in_order,
                      **extra)


class Plugin(ABC):
    """Base class of every training strategy (see the module docstring for what it controls).

    The constructor keeps the shared options, validated, as ``self.options``
    (:class:`~fp8boost.plugins.options.PluginOptions`; ``self.precision``, ``self.use_fp8``, ...
    read them). ``boost`` runs :meth:`configure`, one fixed sequence of steps; a plugin
    overrides the steps its strategy changes, never the sequence. The defaults fit one model
    replica per rank whose optimizer wrapper implements ``backward``/``no_sync``/
    ``clip_grad_norm_`` and the checkpoint protocol.

    Example (a plugin of its own: one process, every shared option, one step overridden):
        >>> import torch
        >>> from fp8boost.plugins import Plugin
        >>> from fp8boost.plugins.options import takes_plugin_options
        >>> @takes_plugin_options()
        ... class OnCpu(Plugin):
        ...     def __init__(self, **options):
        ...         super().__init__(**options)
        ...     def setup_distributed(self, device):
        ...         return torch.device("cpu")  # no process group
        >>> plugin = OnCpu(precision="bf16", max_norm=1.0)
        >>> layer = torch.nn.Linear(4, 4)
        >>> model, opt, *_ = plugin.configure(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
        >>> model.unwrap().weight.dtype, model.boosted_optimizers == [opt], plugin.max_norm
        (torch.bfloat16, True, 1.0)
    """

    #: precisions this plugin accepts
    supported_precisions: tuple[str, ...] = ("fp32", "bf16", "fp16")

    def __init__(self, **options) -> None:
        self.options = PluginOptions(**options)
        self.fp8_report = None  # the last boost's ConversionReport (None without use_fp8)
        # which collectives the last boost put in FP8, and why not (None before a boost)
        self.comm_plan: Optional[CommPlan] = None

    @property
    def comm_report(self) -> CommReport:
        """What the last boost put on the wire in FP8, and why not: :attr:`comm_plan` as a
        ``CommReport`` (an empty one before ``boost``)."""
        return self.comm_plan.report() if self.comm_plan is not None else CommReport()

    def control_precision(self) -> bool:
        """True when the plugin's own ``precision`` argument decides the training dtype."""
        return True

    def set_precision(self, mixed_precision: str) -> None:
        """Adopt ``Booster(mixed_precision=...)``; plugins that control precision refuse."""
        raise ValueError(f"{type(self).__name__} sets precision itself: pass precision=... to the "
                         "plugin and leave Booster(mixed_precision=None)")

    # ---------------------------------------------------------------------------- boost
    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None,
                  lr_scheduler=None, device=None) -> Boosted:
        """Wrap everything for training; returns (model, optimizer, criterion, dataloader,
        lr_scheduler). Called by ``Booster.boost``.

        The steps, in this order (each a method below): ``validate`` (before any collective)
        -> ``setup_distributed`` -> ``build_model`` (move, cast; materialize) -> ``fuse_norms``
        -> ``convert_fp8``
        -> ``plan_comm`` -> ``parallelize`` (broadcast, shard, split) -> ``fuse_lm_loss`` ->
        ``wrap_optimizer`` ->
        ``bind_checkpoint_io``; then the model is wrapped and the dataloader sharded over dp.
        """
        check_boost_args(model, optimizer, criterion, dataloader, lr_scheduler)
        check_meta(model)  # a meta-device (lazily built) model: fit to materialize?
        self.validate(model, optimizer)
        device = self.setup_distributed(device)
        self.build_model(model, optimizer, device)
        self.norm_report = self.fuse_norms(model)
        self.fp8_report = self.convert_fp8(model)
        self.comm_plan = self.plan_comm(model)
        module = self.parallelize(model, device)
        self.fuse_lm_loss(model)
        opt = self.wrap_optimizer(model, optimizer, device) if optimizer is not None else None
        self.bind_checkpoint_io(model, opt)
        wrapped = self.wrap_model(module, opt)
        wrapped.boosted_optimizers = [opt] if opt is not None else []
        wrapped.boosted_by = type(self)
        if opt is not None:
            opt.bind_model(wrapped)  # the optimizer's unwrap_model()
        loader = shard_dataloader(dataloader, self.dp_size, self.dp_rank)
        return wrapped, opt, criterion, loader, lr_scheduler

    def validate(self, model: nn.Module, optimizer) -> None:
        """Step 1: plugin-specific checks of the boost arguments, before any collective runs
        (``check_boost_args`` has run). Default: what the single-replica optimizer wrapper
        needs."""
        validate_optimizer(optimizer, self.precision)

    def setup_distributed(self, device) -> torch.device:
        """Step 2: join the process group and build this run's mesh; returns the device."""
        init_distributed()
        device = torch.device(device) if device is not None else default_device()
        self._topology = None  # a fresh mesh for this run's process group
        self.topology(device)
        return device

    def build_model(self, model: nn.Module, optimizer, device: torch.device) -> None:
        """Step 3: put the user's model on ``device`` in the working ``precision``, in place
        (a plugin that builds, materializes or splits the model does it here). A model on the
        meta device (``LazyInitContext``) is materialized first (:func:`materialize_replica`)."""
        materialize_replica(model, optimizer, device)
        move_and_cast(model, self.precision, device)

    def fuse_norms(self, model: nn.Module) -> Optional[FusedNormReport]:
        """Step 3b: HF's Llama-formula RMSNorms through ``F.rms_norm`` in eager mode
        (``fused_norm``), on the model in its working dtype; the report, or None when off."""
        return install_fused_rms_norms(model) if self.fused_norm else None

    def convert_fp8(self, model: nn.Module):
        """Step 4: swap eligible linears for FP8 ones (``use_fp8``); the ConversionReport.

        ``convert_to_fp8`` warns (once) when nothing converted, saying why."""
        return convert_model(model, self.use_fp8, self.fp8_config)

    #: what reduces gradients and gathers parameters over dp (``parallel/comm/plan.ENGINES``)
    comm_engine: str = "none"

    def plan_comm(self, model: nn.Module) -> CommPlan:
        """Step 4b: decide, once, which collectives go FP8 and why not
        (:func:`~fp8boost.parallel.comm.plan.build_comm_plan` on the converted model, the
        options and the topology); every later step reads ``self.comm_plan``, and
        ``comm_report`` is derived from it."""
        dims = self.topology().dims if self.comm_engine != "none" else ParallelDims()
        return build_comm_plan(model, self.options, dims, engine=self.comm_engine,
                               where=type(self).__name__, **self.comm_plan_args(model))

    def comm_plan_args(self, model: nn.Module) -> dict:
        """What a plugin adds to :func:`build_comm_plan`'s inputs (ZeRO's stage, the
        sequence-parallel mode, the tensor-parallel split): keyword arguments."""
        return {}

    def parallelize(self, model: nn.Module, device: torch.device) -> nn.Module:
        """Step 5: make the replicas equal and shard or split ``model`` (in place); returns
        the module to wrap (e.g. a ``DistributedDataParallel``). Default: one process."""
        return model

    def fuse_lm_loss(self, model: nn.Module) -> Optional[str]:
        """Step 5b: an HF causal LM's ``lm_head`` and loss fused, without the logits
        (``fused_lm_loss``; ``fp8boost.loss.install_fused_lm_loss``), decided once, after the
        split (a vocabulary-parallel ``lm_head`` is fused with its tp loss). Returns why not,
        or None when fused. Pipeline stages keep HF's path: the last stage's loss is computed
        from its logits by ``parallel/pipeline``."""
        blocked = "pipeline stages compute the loss from the last stage's logits" \
            if self.pp_size > 1 else None
        return install_fused_lm_loss(model, self.fused_lm_loss, blocked_by=blocked)

    def wrap_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                       device: torch.device):
        """Step 6: the boosted optimizer over ``model``'s parameters (``optimizer`` is not
        None). Default: single-replica master weights / loss scaling / clipping."""
        return wrap_optimizer(optimizer, self.precision, self.max_norm, self.initial_scale,
                              self.growth_interval, fused_master_step=self.fused_master_step)

    def bind_checkpoint_io(self, model: nn.Module, optimizer) -> None:
        """Step 7: remember what this plugin's checkpoint IO needs from the boost (default:
        nothing; the wrapped model carries its optimizers)."""

    def wrap_model(self, module: nn.Module, optimizer) -> ModelWrapper:
        """The boosted model returned to the user: casts floating inputs to the working dtype."""
        return ModelWrapper(module, DTYPES[self.precision])

    #: ``MixedPrecision.fused_master_step`` for the single-replica optimizer wrapper
    fused_master_step: Optional[bool] = None

    # ---------------------------------------------------------------------------- topology
    #: pipeline / (Ulysses) sequence / tensor parallel sizes; dp takes the rest of the world
    pp_size: int = 1
    sp_size: int = 1
    tp_size: int = 1
    _topology = None

    @property
    def dims(self) -> ParallelDims:
        """The (dp, pp, sp, tp) cut of the initialised world (initialises it if needed)."""
        init_distributed()
        return ParallelDims.for_world(pp=self.pp_size, tp=self.tp_size, sp=self.sp_size)

    def topology(self, device: Optional[torch.device] = None) -> Topology:
        """The named DeviceMesh ("dp", "pp", "tp"), built once (a collective on first call)."""
        if self._topology is None:
            self._topology = self.dims.build_mesh(device_type_of(device))
        return self._topology

    @property
    def dp_group(self):
        """Process group of the data-parallel replicas (None: a single process)."""
        if not dist.is_initialized():
            return None
        if self._topology is not None:
            return self._topology.group("dp")
        return dist.group.WORLD if self.pp_size * self.tp_size * self.sp_size == 1 else None

    @property
    def checkpoint_group(self):
        """Group that coordinates saves: every rank that holds part of the model."""
        return dist.group.WORLD if dist.is_initialized() else None

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas (as Colossal-AI's plugins name it)."""
        if not dist.is_initialized():
            return 1
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the shard of the data it reads."""
        if not dist.is_initialized():
            return 0
        return self.dims.coords(dist.get_rank())["dp"]

    @property
    def dp_world_size(self) -> int:
        """Alias of ``dp_size``."""
        return self.dp_size

    # ------------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, optimizer) -> None:
        optimizer.backward(loss)

    def no_sync(self, model=None, optimizer=None) -> ContextManager:
        return optimizer.no_sync() if optimizer is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, model, optimizer, max_norm: float, norm_type: float = 2.0):
        return optimizer.clip_grad_norm_(max_norm, norm_type)

    def execute_pipeline(self, data_iter, model, criterion=None, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """One pipeline-parallel step; only plugins with pipeline stages implement it."""
        raise NotImplementedError(f"{type(self).__name__} has no pipeline parallelism: use "
                                  "HybridParallelPlugin(pp_size > 1, ...) for execute_pipeline")

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False,
                           seed: int = 1024, drop_last: bool = False, pin_memory: bool = False,
                           num_workers: int = 0, distributed_sampler_cls=None,
                           **kwargs) -> DataLoader:
        """A DataLoader over this data-parallel rank's part of ``dataset`` (``batch_size`` per rank).

        Colossal-AI's signature. Its sampler is a ``DistributedSampler(num_replicas=dp_size,
        rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last)`` at every dp size, 1
        included (see ``shard_dataloader``): ranks that share a dp index (the tp/pp ranks of
        one replica) read the same batches, and the shuffle is the same in every process. With
        ``shuffle=True`` call ``loader.sampler.set_epoch(epoch)`` each epoch (without it every
        epoch repeats the first one's order).

        Args:
            distributed_sampler_cls: a ``DistributedSampler`` subclass (e.g. Colossal-AI's
                ``StatefulDistributedSampler``) built with those same arguments instead of
                ``DistributedSampler``; None: ``DistributedSampler``.
            pin_memory, num_workers, **kwargs: passed to the ``DataLoader``.

        Example:
            >>> from fp8boost.plugins import TorchDDPPlugin
            >>> loader = TorchDDPPlugin().prepare_dataloader(list(range(100)), batch_size=4)  # doctest: +SKIP
        """
        if distributed_sampler_cls is None:
            loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                                drop_last=drop_last, pin_memory=pin_memory,
                                num_workers=num_workers, **kwargs)
            return shard_dataloader(loader, self.dp_size, self.dp_rank, seed)
        if not (isinstance(distributed_sampler_cls, type)
                and issubclass(distributed_sampler_cls, DistributedSampler)):
            raise TypeError("distributed_sampler_cls must be a torch DistributedSampler subclass "
                            f"(built with num_replicas, rank, shuffle, seed, drop_last), got "
                            f"{distributed_sampler_cls!r}")
        if "sampler" in kwargs or "batch_sampler" in kwargs:
            raise ValueError("pass either distributed_sampler_cls or sampler/batch_sampler, "
                             "not both")
        sampler = distributed_sampler_cls(dataset, num_replicas=self.dp_size, rank=self.dp_rank,
                                          shuffle=shuffle, seed=seed, drop_last=drop_last)
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                          pin_memory=pin_memory, num_workers=num_workers, **kwargs)

    # --------------------------------------------------------------------- checkpoint IO
    def get_checkpoint_io(self):
        """The object that saves and loads this plugin's models and optimizers."""
        return GeneralCheckpointIO(self)

    def unwrap_model(self, model: nn.Module) -> nn.Module:
        """The user's model object whose ``state_dict`` is saved and loaded."""
        return model.unwrap() if isinstance(model, ModelWrapper) else model

    def exact_weights(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """``{id(param): tensor}`` to save instead of working params that are lossy copies
        (ZeRO's FP8-gathered weights). Collective: every rank calls it."""
        out: dict[int, torch.Tensor] = {}
        # The optimizers boost() built over this model (none for a model it did not return).
        for opt in (model.boosted_optimizers if isinstance(model, ModelWrapper) else ()):
            out.update(opt.exact_working_params())
        return out

    def after_load_model(self, model: nn.Module) -> None:
        """Refresh derived state (e.g. ZeRO master weights) after model weights were loaded."""
        for opt in (model.boosted_optimizers if isinstance(model, ModelWrapper) else ()):
            opt.sync_master_from_model()


def _option_property(name: str) -> property:
    return property(lambda self: getattr(self.options, name),
                    doc=f"``options.{name}``, read-only (see ``PluginOptions.{name}``).")


# plugin.precision, plugin.use_fp8, ...: every shared option reads plugin.options, so a new
# PluginOptions field is readable on every plugin too, and never out of step with it.
for _name in OPTION_NAMES:
    setattr(Plugin, _name, _option_property(_name))
del _name
