"""Attention capture: run a model and keep its per-layer attention probabilities.

``capture(model, inputs)`` runs one forward pass and returns an :class:`AttentionRecord`;
``capture(model)`` (no inputs) returns a context manager recording the forward passes run inside it::

    rec = attnroll.capture(model, inputs)              # function
    with attnroll.capture(model) as rec:                # context manager
        logits = model(**inputs).logits
    rec.attentions  # list of L tensors (B, H, n, n)

Adapters (one per model family) live in ``hf.py``, ``timm.py``, ``torch_mha.py``, ...; the family registry
(``registry.py``) says which one a model gets; the generic ``modules=`` / ``to_probs=`` path and the session
machinery are in ``hooks.py``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .. import _checks
from .._callable import make_callable as _make_callable
from . import registry
from .hooks import Adapter, Capture, ModulesAdapter, run_forward
from .record import AttentionRecord, ModelFacts, Readout, StreamInfo, config_token_ids
from .registry import SUPPORTED_FAMILIES

__all__ = [
    "capture", "model_facts", "AttentionRecord", "StreamInfo", "Readout", "ModelFacts", "Capture", "CaptureError",
    "SUPPORTED_FAMILIES",
]

CaptureError = _checks.CaptureError


def capture(
    model: nn.Module,
    inputs: Any = None,
    *,
    fuse_heads: Any = None,
    keep_grad: bool = False,
    dtype: Any = None,
    modules: Any = None,
    to_probs: Callable | None = None,
    tokenizer: Any = None,
    eval_mode: bool = True,
) -> AttentionRecord | Capture:
    """Capture the attention probabilities of every layer of ``model``.

    Args:
        model: a transformers model (ViT, DeiT, BEiT, DINOv2, BERT, RoBERTa, DistilBERT, ELECTRA, GPT-2,
            Llama, CLIP, T5, BART, Marian, LLaVA, PaliGemma, ...), a timm VisionTransformer, a model built from
            ``nn.MultiheadAttention``, or any model together with ``modules=``.
        inputs: what the model's processor / tokenizer returns (a dict or BatchEncoding, passed as keyword
            arguments), a tensor (passed positionally, e.g. pixels (B, 3, H, W)), or a tuple of positional
            arguments. ``None``: return a context manager instead (see the module docstring).
        fuse_heads: None keeps every head, (B, H, n, n) per layer. "mean" | "max" | "min" | a per-head weight
            vector fuses the heads inside the hook, so only (B, n, n) per layer is ever kept (H times less
            memory than ``output_attentions=True``).
        keep_grad: keep the per-head tensors in the autograd graph (the forward runs with gradients
            enabled); after ``backward()`` their gradients are in ``tensor.grad`` / ``record.gradients()``.
            Without it the forward of the function form runs under ``torch.no_grad()`` and the tensors are
            detached. Cannot be combined with ``fuse_heads`` or ``dtype``.
        dtype: cast the stored tensors to float32 / float64; None keeps the model's dtype.
        modules: override the adapters: modules, their qualified names, or a regular expression matched
            with ``re.fullmatch`` against qualified module names; one module per layer, layers in module
            order. Their forward output is the attention unless ``to_probs`` says otherwise.
        to_probs: with ``modules``: ``f(module, args, output) -> (B, H, n_q, n_k)`` probabilities
            (a 3-D result is read as (B, n_q, n_k), one head).
        tokenizer: fills ``record.tokens`` (and ``extra["decoder_tokens"]``) from ``input_ids`` via
            ``convert_ids_to_tokens``.
        eval_mode: run in eval mode (dropout off); the caller's train/eval flags are restored afterwards.

    Returns:
        an :class:`AttentionRecord` (with ``inputs``), or a :class:`Capture` context manager whose
        ``__enter__`` returns the record (without).

    Raises:
        UnsupportedModelError: no adapter knows the model (the message lists the supported families).
        CaptureError: a layer's attention was missing or captured twice in one forward pass.

    Nothing about the model changes for good: hooks, the attention implementation (transformers),
    ``fused_attn`` flags (timm), MultiheadAttention forwards and the fast-path flag (torch), and train/eval
    flags are all restored, also when the forward raises.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_checks.describe(model)}")
    _checks.check_model_device(model)
    fuse = _checks.check_fuse_heads(fuse_heads)
    keep_grad = _checks.check_bool("keep_grad", keep_grad)
    eval_mode = _checks.check_bool("eval_mode", eval_mode)
    dt = _checks.check_dtype(dtype)
    _check_combination(keep_grad, fuse, fuse_heads, dt, dtype, modules, to_probs)

    def new_session() -> Capture:
        return Capture(model, _select_adapter(model, modules, to_probs), fuse=fuse, keep_grad=keep_grad, dtype=dt,
                       eval_mode=eval_mode, tokenizer=tokenizer)

    session = new_session()
    if inputs is None:
        return session
    session.adapter.check_inputs(inputs)
    return _run_once(model, inputs, session, new_session, keep_grad)


def _check_combination(keep_grad: bool, fuse: Any, fuse_heads: Any, dt: Any, dtype: Any, modules: Any,
                       to_probs: Any) -> None:
    """The options of ``capture`` that exclude each other: keep_grad with fusion or a dtype, to_probs
    without modules."""
    if keep_grad and fuse is not None:
        raise ValueError(
            f"keep_grad=True keeps the per-head tensors for their gradients; it cannot be combined with "
            f"fuse_heads={fuse_heads!r} (fuse after the backward pass instead)"
        )
    if keep_grad and dt is not None:
        raise ValueError(
            f"keep_grad=True keeps the model's own tensors (so their .grad fills in); dtype={dtype!r} would store "
            "copies instead. Pass dtype=None and cast after the backward pass."
        )
    if to_probs is not None and modules is None:
        raise ValueError("to_probs needs modules=: the modules whose (args, output) it turns into probabilities")


def _run_once(model: nn.Module, inputs: Any, session: Capture, new_session: Callable[[], Capture],
              keep_grad: bool) -> AttentionRecord:
    """One forward pass under ``session``. A model that replaces its attention modules inside its forward
    (BigBird switching from block-sparse to full attention on short inputs) leaves the hooked modules behind:
    then the new ones are found and the pass is run once more."""
    for attempt in range(2):
        try:
            with session as record:
                with torch.enable_grad() if keep_grad else torch.no_grad():
                    run_forward(model, session.adapter.call_inputs(inputs), session.adapter.input_hint)
            break
        except CaptureError:
            live = {id(m) for m in model.modules()}
            if attempt or all(id(s.module) in live for s in session.site_list):
                raise
            session = new_session()
    if session.passes == 0:
        raise CaptureError(
            "the forward pass finished without the model's own forward returning (no pass was recorded)"
        )
    return record


def model_facts(model: nn.Module, *, anatomy: bool = True) -> ModelFacts:
    """Facts about ``model`` that need no forward pass (how it is called, its embedding layer, its special
    tokens, its layer anatomy; see :class:`ModelFacts`). Works for models the capture refuses too (evaluation only runs
    them).
    ``anatomy=False`` leaves ``anatomy`` None and ``anatomy_reason`` "" (the anatomy probes every block: callers
    that only need how the model is called skip it)."""
    from .anatomy import anatomy_or_reason

    facts = _family_facts(model)
    if anatomy:
        facts.anatomy, facts.anatomy_reason = anatomy_or_reason(model)
    return facts


def _family_facts(model: nn.Module) -> ModelFacts:
    facts = registry.facts_for(model)  # the first family (registry order) with facts of its own
    if facts is not None:
        return facts
    try:
        facts = _select_adapter(model, None, None).facts()
    except _checks.UnsupportedModelError:
        facts = ModelFacts(family="module", keyword_call=False)
    # A plain module may still carry a config object with token ids (duck-typed).
    facts.special_token_ids, facts.pad_token_id = config_token_ids(getattr(model, "config", None))
    return facts


def _select_adapter(model: nn.Module, modules: Any, to_probs: Callable | None) -> Adapter:
    if modules is not None:
        return ModulesAdapter(model, modules, to_probs)
    adapter = registry.adapter_for(model)  # the first family (registry order) that detects the model
    if adapter is None:
        raise _checks.UnsupportedModelError(
            f"attnroll.capture does not know where the attention of {type(model).__name__} is. "
            f"Supported: {SUPPORTED_FAMILIES}"
        )
    return adapter


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
