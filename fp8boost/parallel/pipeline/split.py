"""Split an HF decoder causal LM (Llama / Mistral / Qwen2 structure) into pipeline stages.

The model must have ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and
``model.lm_head``. ``torch.distributed.pipelining``'s tracer fails on HF models with rotary
embeddings, so the split is done by hand, in two steps:

1. :func:`strip_to_rank` removes from the user's model everything this pipeline rank does not
   run (decoder layers of other stages; the embeddings unless it holds the first stage; the
   final norm and ``lm_head`` unless it holds the last). ``model.model.layers`` becomes an
   ``nn.ModuleDict`` keyed by the *global* layer index, so parameter names stay the HF names
   (``model.layers.5.mlp.up_proj.weight``) and kept ``Parameter`` objects keep their identity.
2. After FP8 conversion and the tensor-parallel split, :func:`build_stage_modules` wraps the
   kept parts in one :class:`DecoderStage` per stage (they reference the model's modules).

The last stage returns logits (a tensor: that is what the pipeline schedules pass on);
:class:`CausalLMOutputs` turns them, per micro-batch, into the output ``model(**batch)`` would
have returned (the HF loss when the batch has ``labels``, and the logits), which is what the
criterion of ``execute_pipeline`` receives.

Example:
    >>> from fp8boost.parallel.pipeline import make_layout, strip_to_rank   # doctest: +SKIP
    >>> layout = make_layout(model.config.num_hidden_layers, pp=2)         # doctest: +SKIP
    >>> strip_to_rank(model, layout, rank=pp_rank)                          # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from fp8boost.fp8.moe.detect import router_aux_loss_on

from .boundary import BoundaryPlan
from .layout import PipelineLayout

if TYPE_CHECKING:
    from transformers.utils import ModelOutput

__all__ = ["CausalLMOutputs", "DecoderStage", "TiedWeight", "check_pipeline_model",
           "strip_to_rank", "build_stage_modules", "tied_embedding"]


def check_pipeline_model(model: nn.Module) -> int:
    """Raise ``ValueError`` unless ``model`` has the HF decoder structure (and, for an MoE
    model, adds no router aux loss: :func:`_check_router_aux_loss`); returns its layer count."""
    base = getattr(model, "model", None)
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb")
               if not isinstance(getattr(base, n, None), nn.Module)]
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        missing.append("lm_head")
    if base is None or missing or not isinstance(base.layers, nn.ModuleList):
        raise ValueError(
            f"pipeline parallelism splits HF decoder causal LMs structured like Llama, Mistral "
            f"and Qwen2 (model.model.embed_tokens/layers/norm/rotary_emb and model.lm_head); "
            f"{type(model).__name__} lacks {missing or ['a ModuleList at model.model.layers']}")
    _check_router_aux_loss(model)
    return len(base.layers)


def _check_router_aux_loss(model: nn.Module) -> None:
    """Refuse an MoE model that adds its router aux loss: the last stage cannot compute it.

    HF computes the load-balancing loss from the router logits of *every* decoder layer
    (``outputs.router_logits``), a product of means that does not split into per-stage terms;
    the last stage only sees the hidden states, so it would silently train without the term.
    """
    if router_aux_loss_on(model):
        raise ValueError(
            f"{type(model).__name__} adds its router load-balancing loss "
            "(config.output_router_logits=True), computed from the router logits of all decoder "
            "layers at once; pipeline stages do not pass router logits on, so the last stage "
            "would train without it. Set model.config.output_router_logits=False (and add a "
            "per-stage balancing loss of your own if needed) or use pp_size=1")


def tied_embedding(model: nn.Module) -> bool:
    """Whether ``lm_head`` shares its weight with the input embedding (before any split)."""
    return model.lm_head.weight is model.model.embed_tokens.weight


class TiedWeight(nn.Module):
    """Holds a tied embedding weight on a rank that runs ``lm_head`` but not the embeddings.

    Registered as ``model.model.embed_tokens`` (no forward), so the shared ``Parameter`` keeps
    its first, canonical name ``model.embed_tokens.weight`` as in the unsplit model: state
    dicts, checkpoints and optimizer state are keyed alike at every pipeline split.
    """

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, *args, **kwargs):
        raise RuntimeError("the input embedding runs on the first pipeline stage")


def strip_to_rank(model: nn.Module, layout: PipelineLayout, rank: int) -> None:
    """Remove from ``model`` (in place) every part that pipeline ``rank`` does not run."""
    base = model.model
    stages = layout.stages_of(rank)
    keep = sorted(i for s in stages for i in layout.layers[s])
    tied = tied_embedding(model)
    base.layers = nn.ModuleDict({str(i): base.layers[i] for i in keep})
    last = layout.num_stages - 1 in stages
    if 0 not in stages:
        base.embed_tokens = TiedWeight(model.lm_head.weight) if tied and last else None
    if not last:
        base.norm = None
        model.lm_head = None


def _layer_kinds(config, indices) -> dict[int, str]:
    """``full_attention`` or ``sliding_attention`` per layer, as the HF models choose masks."""
    types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) is not None
    return {i: types[i] if types is not None else
            ("sliding_attention" if sliding else "full_attention") for i in indices}


class DecoderStage(nn.Module):
    """One pipeline stage of an HF decoder LM: [embed] -> layers -> [norm -> lm_head].

    ``forward(*inputs, position_ids, attention_mask=None)``: the first stage takes
    ``input_ids``, the others what the previous stage returned (its hidden states, or their
    FP8 message, see ``boundary.py``); the last stage returns logits, the others the boundary
    tensor. Every stage gets ``position_ids`` (and the optional 2-D padding ``attention_mask``)
    of the micro-batch and builds its own rotary embeddings and causal mask, as the HF model
    does once for all layers.

    Args:
        model: the stripped HF model (:func:`strip_to_rank`).
        index: stage index; num_stages: stages in the pipeline.
        layer_ids: global indices of this stage's decoder layers.
        boundaries: the FP8 decision per boundary.
        act_dtype: dtype of the hidden states (the training dtype).
        seq_shards: the hidden states between stages are split this many ways along the
            sequence (tensor-parallel size under sequence parallelism, else 1).
    """

    def __init__(self, model: nn.Module, index: int, num_stages: int, layer_ids: tuple,
                 boundaries: BoundaryPlan, act_dtype: torch.dtype, seq_shards: int = 1) -> None:
        super().__init__()
        base = model.model
        self.index, self.num_stages, self.layer_ids = index, num_stages, tuple(layer_ids)
        self.config = model.config
        self.embed = base.embed_tokens if index == 0 else None
        self.layers = nn.ModuleList([base.layers[str(i)] for i in layer_ids])
        self.rotary = base.rotary_emb
        last = index == num_stages - 1
        self.norm = base.norm if last else None
        self.head = model.lm_head if last else None
        self.kinds = _layer_kinds(model.config, self.layer_ids)
        self.boundaries, self.seq_shards = boundaries, seq_shards
        self.hidden, self.act_dtype = model.config.hidden_size, act_dtype

    def act_shape(self, batch: int, seq: int) -> tuple:
        """Shape of the hidden states entering / leaving this stage for a micro-batch."""
        return (batch, seq // self.seq_shards, self.hidden)

    def forward(self, *inputs: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq = position_ids.shape
        if self.embed is not None:
            h = self.embed(inputs[0])
        else:
            h = self.boundaries.decode(inputs[0], self.index - 1, self.act_shape(batch, seq),
                                       self.act_dtype)
        rope = self.rotary(h, position_ids=position_ids)
        masks = self._masks(h, batch, seq, attention_mask, position_ids)
        for i, layer in zip(self.layer_ids, self.layers):
            out = layer(h, attention_mask=masks[self.kinds[i]], position_embeddings=rope,
                        position_ids=position_ids, use_cache=False)  # no cache: its default
            h = out[0] if isinstance(out, tuple) else out
        if self.head is not None:
            return self.head(self.norm(h))
        return self.boundaries.encode(h, self.index)

    def _masks(self, h, batch, seq, attention_mask, position_ids) -> dict:
        # lazy: transformers takes seconds to import; only HF models get here
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)
        # The mask helpers read only batch, query length, dtype and device from inputs_embeds;
        # under sequence parallelism h holds a sequence shard, so give them the full length.
        shape_only = torch.empty((batch, seq, 1), dtype=h.dtype, device=h.device)
        out = {}
        for kind in set(self.kinds.values()):
            fn = create_sliding_window_causal_mask if kind == "sliding_attention" else \
                create_causal_mask
            # The cache (None) goes by position: transformers 5.17 names it past_key_values,
            # 5.24 cache (and warns a FutureWarning on every rank for the old name).
            out[kind] = fn(self.config, shape_only, attention_mask, None,
                           position_ids=position_ids)
        return out


def build_stage_modules(model: nn.Module, layout: PipelineLayout, rank: int,
                        boundaries: BoundaryPlan, act_dtype: torch.dtype,
                        seq_shards: int = 1) -> list[DecoderStage]:
    """One :class:`DecoderStage` per stage of ``rank`` (ascending stage index)."""
    return [DecoderStage(model, s, layout.num_stages, layout.layers[s], boundaries, act_dtype,
                         seq_shards) for s in layout.stages_of(rank)]


def _output_class(model: nn.Module) -> type:
    """The ``ModelOutput`` class ``model.forward`` is annotated to return, if it has ``loss``
    and ``logits`` fields; else ``CausalLMOutputWithPast``, which is what every HF decoder LM
    that :func:`check_pipeline_model` accepts (Llama, Mistral, Qwen2 ...) returns."""
    # lazy: transformers takes seconds to import; only HF models get here
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    ann = inspect.signature(type(model).forward).return_annotation
    # transformers 4.x annotates ``Union[tuple, CausalLMOutputWithPast]``, 5.x the class alone
    for cls in (ann, *typing.get_args(ann)):
        if not (isinstance(cls, type) and issubclass(cls, ModelOutput)
                and dataclasses.is_dataclass(cls)):
            continue
        if {"loss", "logits"} <= {f.name for f in dataclasses.fields(cls)}:
            return cls
    return CausalLMOutputWithPast


class CausalLMOutputs:
    """Builds the last stage's HF output for one micro-batch: ``outputs(logits, inputs)``.

    Returns what the unsplit ``model(**inputs)`` returns (its own output class, e.g.
    ``CausalLMOutputWithPast``): ``logits``, and when ``inputs`` has ``labels`` the ``loss``
    of the model's own ``loss_function`` on them, called as HF's ``*ForCausalLM.forward``
    calls it. So ``outputs.loss``, ``outputs["loss"]`` and ``outputs[0]`` are the loss (with
    labels; ``outputs[0]`` is the logits without), ``outputs.logits`` / ``outputs["logits"]``
    the logits.

    Under tensor parallelism (with the built-in HF plan, or any plan that splits ``lm_head``)
    the last stage's ``lm_head`` is vocabulary-parallel, exactly as on the non-pipeline
    plugin: ``logits`` is this rank's vocabulary slice ``[mb, seq,
    vocab / tp]`` (columns from ``tp_rank * vocab / tp`` on), never gathered, and
    ``loss_function`` is then :class:`~fp8boost.parallel.tp.HfVocabParallelLoss`, so ``loss``
    is the full-vocabulary loss, equal on every tp rank.

    The loss is computed whenever labels are present, as HF's forward does, even when the
    criterion then uses only the logits (one more cross-entropy per micro-batch; its autograd
    graph is freed with the output).

    Args:
        model: the HF causal LM after the pipeline strip and the tensor-parallel split;
            ``model.loss_function`` is read at every call, so a loss function set on the model
            later is used.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.output_class = _output_class(model)

    def __call__(self, logits: torch.Tensor, inputs: dict) -> ModelOutput:
        labels = inputs.get("labels")
        loss = None
        if labels is not None:
            loss = self.model.loss_function(logits=logits, labels=labels,
                                            vocab_size=self.model.config.vocab_size)
        return self.output_class(loss=loss, logits=logits)
