"""The fused lm_head + loss for HF causal LMs: which models take it, and the forward that uses it.

``boost`` calls :func:`install_fused_lm_loss` once (``Plugin.fuse_lm_loss``, after the tensor-
parallel split). For a model whose ``*ForCausalLM.forward`` is the standard one (checked on its
source, below), ``model.forward`` becomes :class:`FusedLossForward` (an instance attribute:
parameters, ``state_dict`` keys and tied weights are untouched). A call with ``labels`` while
autograd records runs the base model, then :func:`chunked_linear_cross_entropy` on its last
hidden state and ``lm_head.weight``, with HF's semantics (``ForCausalLMLoss``): labels shifted by
one unless ``shift_labels`` is given, ``ignore_index`` (-100) skipped, mean over counted tokens
or sum / ``num_items_in_batch``. It returns the model's own output class with the loss and
``logits=None``: the logits are what it avoids building. Every other call (no labels,
``torch.no_grad()``, ``logits_to_keep``, ``return_dict=False``, router logits on) runs HF's
forward unchanged, logits included.

"Standard" means, read from the forward's source with ``ast`` (so a family that adds a z-loss or
post-processes the logits some other way keeps HF's path instead of a silently different loss):
the base model is called with the forward's own arguments, ``logits = self.lm_head(hidden)``,
``loss = self.loss_function(logits, labels, ...)``, and nothing else touches the logits but the
known transforms: Cohere's ``logit_scale``, Granite's ``/ logits_scaling``, Gemma-2's
``final_logit_softcapping`` (the fused loss applies them in FP32). In transformers 5.17-5.24 that
is Llama, Mistral, Qwen2/3, Phi-3, Gemma, Gemma-2, OLMo, Granite, Cohere, the MoE families with
``output_router_logits=False``, and 50 more.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from fp8boost import _state
from fp8boost.fp8.record import recorded_linear

from .fp8_head import HEAD_RECIPES
from .linear_cross_entropy import VocabParallel, chunked_linear_cross_entropy

__all__ = ["FusedLmLossConfig", "FusedLossForward", "HeadRecipe", "head_recipe",
           "install_fused_lm_loss", "resolve_fused_lm_loss"]

logger = logging.getLogger("fp8boost.loss")

HEAD_CALLS = ("self.lm_head(hidden_states)", "self.lm_head(hidden_states[:, slice_indices, :])")
HIDDEN_STEPS = ("slice_logits_to_keep(hidden_states, logits_to_keep)",)
SOFTCAP_STEPS = ("logits = logits / self.config.final_logit_softcapping",
                 "logits = torch.tanh(logits)",
                 "logits = logits * self.config.final_logit_softcapping")
SCALES = ("logits = logits * self.logit_scale",            # Cohere
          "logits = logits / self.config.logits_scaling")  # Granite
NOT_PASSED_ON = ("self", "labels", "logits_to_keep")


@dataclass(frozen=True, kw_only=True)
class FusedLmLossConfig:
    """How the fused lm_head + loss runs (``fused_lm_loss=FusedLmLossConfig(...)``).

    Example:
        >>> from fp8boost.loss import FusedLmLossConfig
        >>> FusedLmLossConfig(chunk_size=2048).chunk_size
        2048
    """

    chunk_size: Optional[int] = None
    """Tokens per chunk; None: about 2**27 logits at once (1024 tokens at a 128k vocabulary,
    ``auto_chunk_size``). Larger chunks: fewer weight-gradient updates, more memory."""
    fp8_recipe: Optional[str] = None
    """``"rowwise"`` or ``"blockwise"``: the head's logits and input-gradient GEMMs in FP8 with
    that recipe's scales, the weight gradient in BF16 (:mod:`fp8boost.loss.fp8_head`); None
    (default): the head's GEMMs in the training dtype. Independent of ``use_fp8``: layer
    conversion never makes the lm_head FP8 by default."""

    def __post_init__(self) -> None:
        c = self.chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"chunk_size must be an int >= 1 or None (auto), got {c!r}")
        if self.fp8_recipe is not None and self.fp8_recipe not in HEAD_RECIPES:
            raise ValueError(f"fp8_recipe must be None or one of {HEAD_RECIPES}, got "
                             f"{self.fp8_recipe!r}")


def resolve_fused_lm_loss(value: object) -> Optional[FusedLmLossConfig]:
    """``True`` -> the default config, ``False`` -> None (off), a config -> itself.

    Example:
        >>> from fp8boost.loss import resolve_fused_lm_loss
        >>> resolve_fused_lm_loss(True), resolve_fused_lm_loss(False)
        (FusedLmLossConfig(chunk_size=None, fp8_recipe=None), None)
    """
    if isinstance(value, FusedLmLossConfig):
        return value
    if isinstance(value, bool):
        return FusedLmLossConfig() if value else None
    raise TypeError("fused_lm_loss must be True, False or a fp8boost.loss.FusedLmLossConfig, "
                    f"got {type(value).__name__}")


@dataclass(frozen=True)
class HeadRecipe:
    """What a standard ``*ForCausalLM.forward`` does around its base model (see module doc)."""

    base: str
    """Attribute of the base model (``model.model``)."""
    output_cls: type
    """The HF output class the forward returns (``CausalLMOutputWithPast``, ...)."""
    logit_scale: float = 1.0
    softcap: Optional[float] = None


def _forward_tree(model: nn.Module):
    fn = inspect.unwrap(type(model).forward)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise TypeError("forward is not a plain function")
    return fn, node


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _base_call(stmt: ast.stmt, prefix: str, params: dict[Optional[str], str]) -> Optional[str]:
    """The variable ``stmt`` assigns the base model's output to, if it is
    ``out = self.<prefix>(p=p for every forward parameter p, **kwargs)`` (``params``: keyword
    -> the name passed, None -> the ``**kwargs`` name)."""
    value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
    if not (isinstance(value, ast.Call) and ast.unparse(value.func) == f"self.{prefix}"):
        return None
    passed = {kw.arg: ast.unparse(kw.value) for kw in value.keywords}
    if value.args or passed != params:
        return None
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    return target.id if isinstance(target, ast.Name) else None


def _role(stmt: ast.stmt, text: str, out_var: Optional[str]) -> str:
    """What one simple statement of the forward does: ``head``, ``loss``, ``softcap``,
    ``scale``, ``ok`` (nothing to the logits or the hidden states), or ``bad``."""
    if any(text == f"logits = {call}" for call in HEAD_CALLS):
        return "head"
    if text.startswith("loss = self.loss_function(logits"):
        return "loss"
    if text in SOFTCAP_STEPS:
        return "softcap"
    if text in SCALES:
        return "scale"
    if _mentions(stmt, "logits"):
        return "bad"
    if not _mentions(stmt, "hidden_states"):
        return "ok"
    value = text.removeprefix("hidden_states = ")
    taken = (f"{out_var}.last_hidden_state", f"{out_var}[0]")
    return "ok" if value != text and (value in HIDDEN_STEPS or value in taken) else "bad"


def _classify(model: nn.Module, node: ast.FunctionDef, fn) -> Union[HeadRecipe, str]:
    params = inspect.signature(fn).parameters.values()
    passed = {(None if p.kind is p.VAR_KEYWORD else p.name): p.name for p in params
              if p.name not in NOT_PASSED_ON}  # None: the **kwargs keyword
    prefix = getattr(model, "base_model_prefix", "model")
    out_var, seen, scale, softcap_steps = None, {"head": 0, "loss": 0}, 1.0, []
    for stmt in ast.walk(node):
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)):
            continue
        text = ast.unparse(stmt)
        found = _base_call(stmt, prefix, passed)
        if found is not None:
            out_var = found
            continue
        role = _role(stmt, text, out_var)
        if role == "bad" and out_var is None and text.startswith("hidden_states = "):
            return f"its forward does not pass its own arguments on to self.{prefix}(...)"
        if role == "bad":
            return f"its forward does `{text}` to the logits or hidden states"
        if role in seen:
            seen[role] += 1
        elif role == "softcap":
            softcap_steps.append(text)
        elif role == "scale":
            scale = float(model.logit_scale) if text == SCALES[0] \
                else 1.0 / float(model.config.logits_scaling)
    if out_var is None or seen != {"head": 1, "loss": 1}:
        return ("its forward is not base model -> lm_head -> self.loss_function (base call "
                f"found: {out_var is not None}, {seen})")
    softcap = None
    if softcap_steps:
        if sorted(softcap_steps) != sorted(SOFTCAP_STEPS):
            return "its forward soft-caps the logits in a way fp8boost does not know"
        softcap = getattr(model.config, "final_logit_softcapping", None)
    out_cls = _output_class(node, fn)
    if isinstance(out_cls, str):
        return out_cls
    return HeadRecipe(base=prefix, output_cls=out_cls, logit_scale=scale,
                      softcap=None if softcap is None else float(softcap))


def _output_class(node: ast.FunctionDef, fn) -> Union[type, str]:
    calls = [r.value for r in ast.walk(node) if isinstance(r, ast.Return)
             and isinstance(r.value, ast.Call) and isinstance(r.value.func, ast.Name)]
    classes = {fn.__globals__.get(c.func.id) for c in calls}
    if len(classes) != 1:
        return "its forward does not return one HF output class"
    cls = classes.pop()
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if not {"loss", "logits"} <= names:
        return f"its output class {getattr(cls, '__name__', cls)!r} has no loss and logits fields"
    return cls


def head_recipe(model: nn.Module) -> Union[HeadRecipe, str]:
    """The :class:`HeadRecipe` of an HF causal LM, or why the fused loss does not apply.

    Example:
        >>> import transformers
        >>> from fp8boost.loss import head_recipe
        >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
        >>> head_recipe(transformers.LlamaForCausalLM(cfg)).base
        'model'
    """
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not hasattr(type(model), "loss_function"):
        return "it is not an HF causal LM (no lm_head and loss_function)"
    if type(head) is not nn.Linear:
        return f"its lm_head is a {type(head).__name__}, not an nn.Linear"
    if head.weight.dtype == torch.float16:
        return ("it trains in FP16: the fused loss computes the gradients in forward, before "
                "the loss scale multiplies them, where small ones would underflow")
    if getattr(model.config, "output_router_logits", False):
        return "it adds the router load-balancing loss (config.output_router_logits=True)"
    if "forward" in vars(model):
        return ("its forward was already replaced (e.g. Ulysses sequence parallelism, which "
                "computes its own loss)")
    try:
        fn, node = _forward_tree(model)
    except (OSError, TypeError, SyntaxError) as e:
        return f"its forward's source cannot be read ({e})"
    return _classify(model, node, fn)


class FusedLossForward:
    """``model.forward`` with the fused lm_head + loss (see the module docstring)."""

    def __init__(self, model: nn.Module, recipe: HeadRecipe, config: FusedLmLossConfig,
                 vocab_parallel: Optional[VocabParallel] = None) -> None:
        self.model, self.inner = model, model.forward
        self.recipe, self.config, self.vocab_parallel = recipe, config, vocab_parallel
        self.signature = inspect.signature(self.inner)
        self.var_kw = next((p.name for p in self.signature.parameters.values()
                            if p.kind is p.VAR_KEYWORD), None)
        # Read once: under torch.compile(model, fullgraph=True) dataclasses.fields() breaks.
        self.passed_on = frozenset(f.name for f in dataclasses.fields(recipe.output_cls)) \
            - {"loss", "logits"}

    def _fused_call(self, args: tuple, kwargs: dict) -> Optional[dict]:
        """The base model's keyword arguments and the loss's, or None for HF's own forward."""
        if not torch.is_grad_enabled():
            return None
        arguments = dict(self.signature.bind(*args, **kwargs).arguments)
        extra = arguments.pop(self.var_kw, {}) if self.var_kw else {}
        labels = arguments.pop("labels", None)
        keep = arguments.pop("logits_to_keep", 0)
        if labels is None or not (isinstance(keep, int) and keep == 0) \
                or extra.get("return_dict") is False or arguments.get("output_router_logits"):
            return None
        return {"base": {**arguments, **extra}, "labels": labels, "extra": extra}

    def __call__(self, *args, **kwargs):
        call = self._fused_call(args, kwargs)
        if call is None:
            return self.inner(*args, **kwargs)
        out = getattr(self.model, self.recipe.base)(**call["base"])
        loss = self.loss(out[0], call["labels"], **call["extra"])
        rest = {k: v for k, v in out.items() if k in self.passed_on}
        return self.recipe.output_cls(loss=loss, logits=None, **rest)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, *,
             num_items_in_batch=None, ignore_index: int = -100,
             shift_labels: Optional[torch.Tensor] = None, **_ignored) -> torch.Tensor:
        """HF's ``ForCausalLMLoss`` of ``lm_head(hidden)`` without the logits."""
        if shift_labels is None:  # tokens < n predict n; the last one predicts nothing
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        vp = self.vocab_parallel
        if vp is not None and vp.head_input is not None:
            hidden = vp.head_input(hidden)  # what lm_head's pre-hook does under tp
        head = self.model.lm_head
        return chunked_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, shift_labels.reshape(-1),
            bias=head.bias, ignore_index=ignore_index, chunk_size=self.config.chunk_size,
            reduction="mean" if num_items_in_batch is None else "sum",
            num_items_in_batch=num_items_in_batch, logit_scale=self.recipe.logit_scale,
            softcap=self.recipe.softcap, vocab_parallel=vp, fp8_recipe=self.config.fp8_recipe)


def _hf_model(model: nn.Module) -> nn.Module:
    """The HF model inside a peft model (peft calls its ``forward``), else ``model``."""
    inner = model.get_base_model() if callable(getattr(type(model), "get_base_model", None)) \
        else model
    return inner if isinstance(inner, nn.Module) else model


def _loss_kind(model: nn.Module) -> Union[Optional[VocabParallel], str]:
    """None: HF's own ``ForCausalLMLoss``; a VocabParallel: tp's vocabulary-parallel loss
    (``fp8boost.parallel.tp.HfVocabParallelLoss``); a string: why neither."""
    fn = model.loss_function
    vp = getattr(fn, "vocab_parallel", None)
    if isinstance(vp, VocabParallel):
        return vp if vp.head_input is not None else \
            "its vocabulary-parallel loss does not say which collective feeds the lm_head"
    try:
        # lazy: transformers takes seconds to import; only HF models get here
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return "transformers is not installed"
    if fn is ForCausalLMLoss:
        return None
    return f"its loss_function is {getattr(fn, '__name__', type(fn).__name__)}, not HF's " \
           "ForCausalLMLoss"


def install_fused_lm_loss(model: nn.Module, setting: object = True, *,
                          blocked_by: Optional[str] = None) -> Optional[str]:
    """Decide once whether ``model`` trains with the fused lm_head + loss, and install it.

    Logged once per model class at INFO (a FP8 ``lm_head`` warns): what was chosen, or why
    not. Models that are no HF causal LM are left alone without a word.

    Args:
        model: the model (a peft model: the HF model inside), after any tp split.
        setting: ``True``, ``False`` or a :class:`FusedLmLossConfig`.
        blocked_by: a reason the caller already knows (e.g. pipeline stages).

    Returns:
        None when installed (or already), else the reason it was not.

    Example:
        >>> import transformers
        >>> from fp8boost.loss import install_fused_lm_loss
        >>> cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
        ...     num_attention_heads=2, num_hidden_layers=1, vocab_size=64)
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> install_fused_lm_loss(model) is None, type(model.forward).__name__
        (True, 'FusedLossForward')
    """
    config = resolve_fused_lm_loss(setting)
    hf = _hf_model(model)
    if isinstance(vars(hf).get("forward"), FusedLossForward):
        return None
    if not isinstance(getattr(hf, "lm_head", None), nn.Module) \
            or not hasattr(type(hf), "loss_function"):
        return "not an HF causal LM"
    name = type(hf).__name__
    if config is not None and recorded_linear(hf.lm_head):
        _state.warn_once(("fused-lm-loss-fp8-head", name),
                         f"fp8boost: {name}'s lm_head runs in FP8, so its loss is not fused with "
                         "it; the full logits are built as HF does. For an FP8 head with the "
                         "fused loss keep lm_head out of FP8 conversion and pass "
                         "fused_lm_loss=FusedLmLossConfig(fp8_recipe='rowwise')")
        return "its lm_head is an FP8 layer"
    why = "fused_lm_loss=False" if config is None else blocked_by
    if why is None:
        recipe = head_recipe(hf)
        kind = _loss_kind(hf) if not isinstance(recipe, str) else None
        why = recipe if isinstance(recipe, str) else kind if isinstance(kind, str) else None
    if why is not None:
        _state.log_once(logger, ("fused-lm-loss", name, why),
                        f"fp8boost: {name} trains with HF's lm_head + loss (full logits): {why}",
                        level=logging.INFO)
        return why
    hf.forward = FusedLossForward(hf, recipe, config, kind)
    tp = " (vocabulary-parallel over tp)" if kind is not None else ""
    _state.log_once(logger, ("fused-lm-loss", name, "on"),
                    f"fp8boost: {name} trains with the fused lm_head + loss{tp}: chunked linear "
                    "+ cross-entropy, no [tokens, vocab] logits; a forward with labels under "
                    "autograd returns logits=None (fused_lm_loss=False keeps them)",
                    level=logging.INFO)
    return None
