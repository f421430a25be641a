"""Booster: the one object a training script talks to. It holds a Plugin and delegates."""
from __future__ import annotations

import logging
import os
from typing import ContextManager, Optional, Union

import torch
from torch import nn

from fp8boost import _state
from fp8boost.checkpoint_io.single_file import is_file_target, load_model_file, save_model_file
from fp8boost.export.layouts import make_spec
from fp8boost.export.save import save_fp8_model
from fp8boost.hf_model import disable_kv_cache
from fp8boost.parallel.nonfinite import NonFiniteGuard
from fp8boost.plugins.local_plugin import LocalPlugin
from fp8boost.plugins.plugin_base import Plugin

from .lora import drop_frozen_params, enable_lora, is_peft_model, save_lora_as_pretrained
from .mixed_precision import MixedPrecision


class Booster:
    """Boost a model, optimizer, criterion, dataloader and lr scheduler for training.

    Args:
        plugin: the training strategy (``TorchDDPPlugin``, ``LowLevelZeroPlugin``, ...). None
            trains in this one process.
        mixed_precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"`` (= bf16 + FP8 linear
            GEMMs), or a ``MixedPrecision``. Works without a plugin and with plugins that take
            their precision from the Booster (``TorchDDPPlugin(precision=None)``); plugins with
            their own ``precision`` argument refuse it.
        device: where the model lives (default: ``cuda:LOCAL_RANK`` with CUDA, else CPU).
        nonfinite_guard: skip optimizer steps whose loss or gradients hold NaN/Inf, on every
            rank alike, and stop after 3 in a row (``fp8boost.parallel.nonfinite``). True
            (default), False (off), or a ``NonFiniteGuard(max_consecutive=K)``. FP16 keeps its
            loss scaler's overflow handling.

    Example:
        >>> import torch
        >>> from fp8boost.booster import Booster
        >>> model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> booster = Booster(mixed_precision="bf16", device="cpu")
        >>> model, opt, *_ = booster.boost(model, opt)
        >>> loss = model(torch.randn(8, 32)).float().pow(2).mean()
        >>> booster.backward(loss, opt); opt.step(); opt.zero_grad()
    """

    def __init__(self, plugin: Optional[Plugin] = None,
                 mixed_precision: Union[str, MixedPrecision, None] = None,
                 device: Union[str, torch.device, None] = None,
                 nonfinite_guard: Union[bool, "NonFiniteGuard"] = True) -> None:
        if not isinstance(nonfinite_guard, (bool, NonFiniteGuard)):
            raise TypeError("nonfinite_guard must be True, False or a NonFiniteGuard, got "
                            f"{type(nonfinite_guard).__name__}")
        self.nonfinite_guard = NonFiniteGuard() if nonfinite_guard is True else \
            (nonfinite_guard or None)
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be an fp8boost Plugin, got {type(plugin).__name__}")
        if mixed_precision is not None and not isinstance(mixed_precision, (str, MixedPrecision)):
            raise TypeError("mixed_precision must be 'fp32', 'bf16', 'fp16', 'fp8' or a "
                            f"MixedPrecision, got {type(mixed_precision).__name__}")
        if isinstance(mixed_precision, str):
            mixed_precision = MixedPrecision(mixed_precision)
        if device is not None:
            device = torch.device(device)
        if plugin is None:
            plugin = LocalPlugin(mixed_precision or MixedPrecision("fp32"))
        elif mixed_precision is not None:
            if mixed_precision.fp8_config is not None or mixed_precision.max_norm:
                raise ValueError("with a plugin, pass fp8_config/max_norm to the plugin, and "
                                 "mixed_precision as a plain string")
            plugin.set_precision(mixed_precision.precision)
        self.plugin = plugin
        self.device = device

    def __repr__(self) -> str:
        return f"Booster(plugin={self.plugin!r}, device={self.device})"

    def boost(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
              criterion=None, dataloader=None, lr_scheduler=None) -> tuple:
        """Wrap everything for training; returns the same five objects, boosted, in order.

        The model's HF configs get ``use_cache=False`` (training builds no KV cache). The
        returned model casts floating inputs to the training dtype; the returned optimizer
        must be used for ``backward``/``step`` (``booster.backward(loss, optimizer)``); the
        dataloader reads this rank's share of the data; the lr scheduler is returned unchanged
        (it keeps driving the wrapped optimizer's learning rates).
        """
        # Training never builds a KV cache (memory; under torch.compile, per-block cache guards
        # that push blocks past dynamo's recompile limit into eager), whatever the config says.
        if isinstance(model, nn.Module):
            disable_kv_cache(model)
        if is_peft_model(model):  # LoRA: no masters/state for the frozen base (booster/lora.py)
            drop_frozen_params(optimizer)
        boosted = self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler,
                                        device=self.device)
        opt = boosted[1]
        if self.nonfinite_guard is not None and opt is not None:  # every BoostedOptimizer has one
            # Over every rank that steps together (the checkpoint group: the whole job).
            opt.nonfinite_guard = self.nonfinite_guard.bind(
                self.plugin.checkpoint_group, self.plugin.unwrap_model(boosted[0]))
        return boosted

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backpropagate ``loss`` (with loss scaling / gradient reduction as the plugin needs).

        Raises:
            TypeError: ``optimizer`` is not the one ``boost`` returned (e.g. called before boost).
        """
        if not callable(getattr(optimizer, "backward", None)):
            # A raw torch optimizer would fail deep inside the plugin with an AttributeError.
            raise TypeError(
                f"booster.backward got a {type(optimizer).__name__}, not a boosted optimizer; "
                "call `model, optimizer, *_ = booster.boost(model, optimizer)` first and pass "
                "the optimizer it returns")
        self.plugin.backward(loss, optimizer)

    def execute_pipeline(self, data_iter, model: nn.Module, criterion=None, optimizer=None,
                         return_loss: bool = True, return_outputs: bool = False) -> dict:
        """Run one pipeline-parallel step (``HybridParallelPlugin(pp_size > 1)``).

        Takes the next batch (a dict of model inputs) from ``data_iter``, runs its micro-batches
        through the pipeline schedule, and, when ``optimizer`` is given and grad mode is on,
        leaves the gradients ready for ``optimizer.step()``. Under ``torch.no_grad()`` (or with
        ``optimizer=None``) it only runs forward (evaluation).

        ``criterion(outputs, inputs)`` runs on the last stage once per micro-batch and returns
        its loss as a scalar tensor (anything else raises ``TypeError``). ``outputs`` is the
        model's own HF output for the micro-batch (e.g. ``CausalLMOutputWithPast``), as
        ``model(**inputs)`` returns it on the non-pipeline plugins: ``outputs.loss`` (also
        ``outputs["loss"]``, ``outputs[0]``) is the model's causal-LM loss when ``inputs`` has
        ``labels`` (without, ``outputs[0]`` is the logits, as in HF), ``outputs.logits`` the
        logits; ``inputs`` is the micro-batch's dict. So
        ``criterion=lambda o, i: o.loss`` or ``lambda o, i: o[0]`` equal the default (None:
        ``outputs.loss``, needs ``labels``). With ``tp_size > 1``, ``outputs.logits`` is this
        rank's vocabulary slice (as on the non-pipeline plugin) while ``outputs.loss`` is the
        full-vocabulary loss: a criterion computing its own loss from the logits must be
        vocabulary-parallel (``fp8boost.parallel.tp.vocab_parallel_cross_entropy``). Any
        criterion is scaled like the default: the gradient is that of the mean over
        micro-batches of its loss.

        Returns:
            ``{"loss": mean loss over micro-batches (every rank of the pipeline gets the last
            stage's value), "outputs": the last stage's logits (None on other ranks, or when
            return_outputs=False)}``.

        Example:
            >>> it = iter(dataloader)                                           # doctest: +SKIP
            >>> out = booster.execute_pipeline(it, model, optimizer=optimizer)  # doctest: +SKIP
            >>> optimizer.step(); optimizer.zero_grad()                         # doctest: +SKIP
            >>> print(out["loss"].item())                                       # doctest: +SKIP
        """
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer,
                                            return_loss, return_outputs)

    def no_sync(self, model: Optional[nn.Module] = None, optimizer=None) -> ContextManager:
        """Context manager: backward passes inside accumulate gradients without communication."""
        return self.plugin.no_sync(model, optimizer)

    def clip_grad_norm_(self, model: nn.Module, optimizer, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients to a global norm (over all shards); returns the norm before clipping."""
        return self.plugin.clip_grad_norm_(model, optimizer, max_norm, norm_type)

    def enable_lora(self, model: nn.Module, pretrained_dir: Optional[str] = None,
                    lora_config=None, bnb_quantization_config=None,
                    quantize: bool = False) -> nn.Module:
        """Add peft LoRA adapters to ``model`` (before ``boost``); returns the peft model.

        Colossal-AI's signature. With ``use_fp8=True`` on the plugin, ``boost`` runs the frozen
        base layers' GEMMs in FP8 (weight cast cached once, no weight-gradient GEMM) and keeps
        the adapters in the training dtype; the frozen parameters are left out of the optimizer
        (no masters or state). Works with TorchDDP, LowLevelZero, Gemini and
        HybridParallel (tp_size, zero_stage; not pp_size > 1) plugins.

        Args:
            model: the base model (not boosted yet).
            pretrained_dir: a directory of saved adapters to load and keep training.
            lora_config: a ``peft.LoraConfig`` (needed without ``pretrained_dir``).
            bnb_quantization_config, quantize: refused (``ValueError``): fp8boost's cheap
                frozen base is FP8 (``use_fp8=True``), not bitsandbytes.

        Raises:
            ImportError: peft is not installed.
            ValueError / TypeError: a boosted model, a missing or non-peft config, quantize.

        Example:
            >>> from peft import LoraConfig                                     # doctest: +SKIP
            >>> model = booster.enable_lora(model, lora_config=LoraConfig(
            ...     r=8, target_modules=["q_proj", "v_proj"]))                    # doctest: +SKIP
            >>> model, optimizer, *_ = booster.boost(model, optimizer)          # doctest: +SKIP
        """
        return enable_lora(self.plugin, model, pretrained_dir, lora_config,
                           bnb_quantization_config, quantize)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str,
                                use_safetensors: bool = False) -> None:
        """Save only the LoRA adapters, in peft's layout (``PeftModel.from_pretrained`` loads
        them onto a fresh base model). Collective: call it on every rank; rank 0 writes.

        Example:
            >>> booster.save_lora_as_pretrained(model, "adapters/")             # doctest: +SKIP
        """
        save_lora_as_pretrained(self.plugin, model, checkpoint, use_safetensors)

    # ------------------------------------------------------------------------- checkpoints
    # Every save/load is delegated to the plugin's CheckpointIO: only the plugin knows how its
    # model and optimizer are laid out across ranks.
    def save_model(self, model: nn.Module, checkpoint: Optional[str] = None, shard: bool = True,
                   gather_dtensor: bool = True, prefix: Optional[str] = None,
                   size_per_shard: Optional[float] = None,
                   use_safetensors: Optional[bool] = None, use_async: bool = False, *,
                   path: Optional[str] = None, size_per_shard_mb: Optional[float] = None,
                   fp8_export: Optional[str] = None, calibration_batches: Optional[list] = None,
                   activation_scheme: str = "dynamic", weight_strategy: Optional[str] = None,
                   kv_cache_scales: bool = False) -> None:
        """Save the model's weights: a safetensors directory ``from_pretrained`` can load, or
        one file.

        Every plugin writes the same HF layout, gathering sharded parameters one at a time
        (never the whole model on one rank). Collective: call it on every rank. Takes
        Colossal-AI's ``Booster.save_model`` arguments (see docs/PLUGINS.md, "Checkpoints").

        Args:
            model: the boosted model (or the raw one).
            checkpoint: target (``path=`` is accepted too). A directory, replaced atomically
                if it holds an older checkpoint, except with ``shard=False`` and a file name
                (ending in ``.safetensors``, ``.bin``, ``.pt``, ``.pth``, ``.ckpt``, or an
                existing file): then ONE safetensors state-dict file at ``checkpoint``, as
                Colossal-AI writes (no ``config.json``; ``load_model`` reads it back).
            shard: write ``model-0000x-of-0000y.safetensors`` + index (default, unlike
                Colossal-AI's ``shard=False``: the folder ``from_pretrained`` loads); False:
                one ``model.safetensors`` (in the directory, or the file above).
            size_per_shard / size_per_shard_mb: maximum shard size in MiB (Colossal-AI's /
                fp8boost's name; default 1024).
            use_safetensors: fp8boost always writes safetensors; False (Colossal-AI's default,
                a torch pickle there) still writes safetensors, said once at INFO.
            gather_dtensor, prefix, use_async: accepted for Colossal-AI scripts; weights are
                always gathered, file names are HF's and the write is synchronous (a non-default
                value is said once at INFO).
            fp8_export: ``"per_tensor"``, ``"block"`` or ``"compressed_tensors"``: an FP8
                folder inference engines load (``fp8boost.export``; README "Train, export,
                serve"); ``activation_scheme`` (``"static"`` writes ``input_scale``),
                ``weight_strategy`` (compressed_tensors: tensor, channel or block),
                ``kv_cache_scales`` and ``calibration_batches`` (input dicts) go with it.
        """
        path = _one_path(checkpoint, path, "save_model")
        size = _shard_size(size_per_shard, size_per_shard_mb)
        if fp8_export is not None or calibration_batches is not None:
            # make_spec validates before any collective
            spec = make_spec(fp8_export, activation_scheme, weight_strategy, kv_cache_scales,
                             calibration_batches)
            if not isinstance(size, (int, float)) or size <= 0:
                raise ValueError(f"size_per_shard_mb must be > 0, got {size!r}")
            save_fp8_model(self.plugin, model, path, spec, shard, size, calibration_batches)
            return
        _info_ignored("save_model", gather_dtensor=(gather_dtensor, True), prefix=(prefix, None),
                      use_async=(use_async, False))
        if use_safetensors is False:
            _log_info("use_safetensors", "fp8boost: save_model(use_safetensors=False): model "
                      "checkpoints are always safetensors files (load_model reads them)")
        io = self.plugin.get_checkpoint_io()
        if not shard and is_file_target(path):
            if not isinstance(size, (int, float)) or size <= 0:
                raise ValueError(f"size_per_shard_mb must be > 0, got {size!r}")
            save_model_file(io, model, path)
            return
        io.save_model(model, path, shard, size)

    def load_model(self, model: nn.Module, checkpoint: Optional[str] = None, strict: bool = True,
                   low_cpu_mem_mode: bool = True, num_threads: int = 1, *,
                   path: Optional[str] = None) -> None:
        """Load weights saved by ``save_model`` (a directory, or the one file of
        ``shard=False``; or HF ``save_pretrained``'s folder) into the boosted model.

        Sharded plugins read only each rank's part. Load the model before the optimizer: loading
        model weights re-derives master weights, and ``load_optimizer`` then restores the exact
        FP32 masters. ``checkpoint`` may also be passed as ``path=``; ``low_cpu_mem_mode`` and
        ``num_threads`` (Colossal-AI's) change nothing here (files are read tensor by tensor).
        """
        path = _one_path(checkpoint, path, "load_model")
        _info_ignored("load_model", low_cpu_mem_mode=(low_cpu_mem_mode, True),
                      num_threads=(num_threads, 1))
        io = self.plugin.get_checkpoint_io()
        if os.path.isfile(path):
            load_model_file(io, model, path, strict)
            return
        io.load_model(model, path, strict)

    def save_optimizer(self, optimizer, checkpoint: Optional[str] = None, shard: bool = False,
                       gather_dtensor: bool = True, prefix: Optional[str] = None,
                       size_per_shard: float = 1024, use_async: bool = False, *,
                       path: Optional[str] = None) -> None:
        """Save optimizer state into the directory ``checkpoint`` (or ``path=``): one file per
        rank that holds a shard, reloadable into any world size.

        Colossal-AI's arguments are accepted: ``shard`` True or False gives this same
        per-rank directory (the format is always sharded); ``gather_dtensor``, ``prefix``,
        ``size_per_shard``, ``use_async`` change nothing here (said once at INFO when not
        their default).
        """
        path = _one_path(checkpoint, path, "save_optimizer")
        check_bool_arg("shard", shard)
        _info_ignored("save_optimizer", gather_dtensor=(gather_dtensor, True),
                      prefix=(prefix, None), size_per_shard=(size_per_shard, 1024),
                      use_async=(use_async, False))
        self.plugin.get_checkpoint_io().save_optimizer(optimizer, path)

    def load_optimizer(self, optimizer, checkpoint: Optional[str] = None,
                       low_cpu_mem_mode: bool = True, num_threads: int = 1, *,
                       path: Optional[str] = None) -> None:
        """Load optimizer state saved by ``save_optimizer`` with any world size
        (``checkpoint`` or ``path=``; ``low_cpu_mem_mode``/``num_threads`` change nothing)."""
        path = _one_path(checkpoint, path, "load_optimizer")
        _info_ignored("load_optimizer", low_cpu_mem_mode=(low_cpu_mem_mode, True),
                      num_threads=(num_threads, 1))
        self.plugin.get_checkpoint_io().load_optimizer(optimizer, path)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: Optional[str] = None, *,
                          path: Optional[str] = None) -> None:
        """Save ``lr_scheduler.state_dict()`` to the file ``checkpoint`` (or ``path=``;
        atomically, rank 0 writes)."""
        path = _one_path(checkpoint, path, "save_lr_scheduler")
        self.plugin.get_checkpoint_io().save_lr_scheduler(lr_scheduler, path)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: Optional[str] = None, *,
                          path: Optional[str] = None) -> None:
        """Load a scheduler state saved by ``save_lr_scheduler``."""
        path = _one_path(checkpoint, path, "load_lr_scheduler")
        self.plugin.get_checkpoint_io().load_lr_scheduler(lr_scheduler, path)

    def save_checkpoint(self, path: str, model: nn.Module, optimizer=None, lr_scheduler=None,
                        extra: Optional[dict] = None) -> None:
        """Save everything needed to resume training into one directory, atomically.

        Sharded plugins (Gemini, TorchFSDP) write through ``torch.distributed.checkpoint``:
        each rank writes its own shards, and ``load_checkpoint`` reshards to another world
        size. ``extra`` (JSON-serialisable: step, data position, ...) comes back from
        ``load_checkpoint``. A save that dies midway leaves the previous checkpoint loadable.

        Example:
            >>> booster.save_checkpoint("ckpt/step-100", model, optimizer, sched,
            ...                         extra={"step": 100})                  # doctest: +SKIP
            >>> extra = booster.load_checkpoint("ckpt/step-100", model, optimizer, sched)  # doctest: +SKIP
        """
        self.plugin.get_checkpoint_io().save_checkpoint(os.fspath(path), model, optimizer,
                                                        lr_scheduler, extra)

    def load_checkpoint(self, path: str, model: nn.Module, optimizer=None,
                        lr_scheduler=None) -> dict:
        """Restore a directory written by ``save_checkpoint``; returns its ``extra`` dict."""
        return self.plugin.get_checkpoint_io().load_checkpoint(os.fspath(path), model, optimizer,
                                                               lr_scheduler)


# ------------------------------------------------------------- Colossal-AI argument names
_logger = logging.getLogger("fp8boost.booster")


def _one_path(checkpoint, path, method: str) -> str:
    """``checkpoint`` (Colossal-AI's name) or ``path`` (fp8boost's), exactly one of them."""
    if checkpoint is not None and path is not None:
        raise TypeError(f"{method}() got both checkpoint= and path= (the same argument): "
                        "pass one")
    if checkpoint is None and path is None:
        raise TypeError(f"{method}() missing the checkpoint path (checkpoint=...)")
    return os.fspath(checkpoint if checkpoint is not None else path)


def _shard_size(size_per_shard, size_per_shard_mb):
    """Maximum shard size in MiB from Colossal-AI's ``size_per_shard`` or ``size_per_shard_mb``."""
    if size_per_shard is not None and size_per_shard_mb is not None \
            and size_per_shard != size_per_shard_mb:
        raise TypeError("save_model() got size_per_shard and size_per_shard_mb with different "
                        "values (both are MiB): pass one")
    size = size_per_shard if size_per_shard is not None else size_per_shard_mb
    return 1024 if size is None else size


def check_bool_arg(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _log_info(key: str, message: str) -> None:
    _state.log_once(_logger, ("booster-colossal-arg", key), message, level=logging.INFO)


def _info_ignored(method: str, **args) -> None:
    """Say once (INFO) which Colossal-AI arguments were given a value that changes nothing."""
    for name, (value, default) in args.items():
        if name == "gather_dtensor" and not isinstance(value, bool):
            raise TypeError(f"gather_dtensor must be True or False, got {value!r} (the 4th "
                            "positional argument of save_model is Colossal-AI's gather_dtensor; "
                            "pass the shard size as size_per_shard=... or size_per_shard_mb=...)")
        if name in ("use_async", "low_cpu_mem_mode"):
            check_bool_arg(name, value)
        if value != default:
            _log_info(f"{method}.{name}", f"fp8boost: {method}({name}={value!r}) changes "
                      "nothing here (accepted for Colossal-AI scripts; see docs/PLUGINS.md, "
                      "Checkpoints)")
