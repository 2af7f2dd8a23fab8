"""The entry points: ``explain(model, inputs, method, target, **options)``, ``Explainer`` (a model and a method
with fixed options, for many inputs) and ``Prepared`` (the same with what depends only on the model, the
method and the options resolved once: the batch engine's). Each validates the method name and the options,
builds a :class:`~attnroll.explain.context.Context` and calls the registered method function.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

from . import qwen_vl
from .context import Context
from .explanation import Explanation
from .options import COMMON_OPTIONS, check_options
from .registry import method_info
from .target_scores import require_grad_mode

__all__ = ["explain", "Explainer", "Prepared"]


def explain(
    model: nn.Module,
    inputs: Any,
    method: str = "rollout",
    target: Any = None,
    *,
    tokenizer: Any = None,
    **options: Any,
) -> Explanation:
    """Explain what ``model`` looked at for ``inputs`` with a registered method.

    Args:
        model: a model ``attnroll.capture`` supports (transformers ViT/DeiT/BEiT/DINOv2/BERT-likes/GPT-2/
            Llama/CLIP/T5/BART/Marian, timm ViTs, nn.MultiheadAttention models).
        inputs: what the model's processor / tokenizer returns (a dict / BatchEncoding), or a pixel tensor
            (B, 3, H, W).
        method: a name from :func:`methods` ("rollout" by default).
        target: None = the predicted class (argmax of the logits; for decoder-only LMs the argmax next token
            at the explained position); an int = that class / token id for every example; a list of ints =
            one per example; a callable ``f(model_outputs) -> (B,)`` tensor for anything else.
        tokenizer: fills ``Explanation.tokens`` from ``input_ids``.
        **options: the method's options (see ``method_info(name).options``), plus ``position``: the output
            row to explain (an int or one per example; also the position of a token-level target), and
            ``readout``: which output rows, with what weights — "cls", "mean" (the real tokens after the
            prefix), "last", "eot", a position, one position per example, or a weight vector (n,) / (B, n).
            Default: the rows the model's prediction reads, as its adapter declares (CLS for CLS
            classifiers, the mean for mean-pooled encoders, the last real token for decoders, ...); the
            Explanation records it in ``readout`` / ``readout_weights``.

    Returns:
        an :class:`Explanation` (scores (B, units), full_row (B, n), ...).

    Raises:
        ValueError: unknown method (the message lists them), an option the method does not take, a target
            out of range or a callable returning the wrong shape.
        RuntimeError: a gradient method under ``torch.no_grad()`` / ``torch.inference_mode()``.
    """
    return Prepared(model, method, tokenizer=tokenizer, **options)(inputs, target)


class Prepared:
    """``explain(model, inputs, method, target, tokenizer=tokenizer, **options)`` for many calls, with what
    depends only on the model, the method and the options resolved once, at construction: the method's
    registry entry, the options validated and completed with the defaults, and the facts a method reads of
    the model without a forward pass (``Context.facts``: its family, how its attention is computed), which
    are remembered from the first call. Each call then runs only the method itself (the forward, the
    product, the Explanation), with the same result as ``explain``.

    For a model that keeps its structure and attention implementation between calls (the batch engine's
    own, loaded for the run); :func:`explain` makes a fresh one per call. ``overrides`` of a call are
    validated again with the fixed options (e.g. the ``random`` control's per-batch seed)."""

    def __init__(self, model: nn.Module, method: str = "rollout", *, tokenizer: Any = None, **options: Any):
        self.model, self.tokenizer = model, tokenizer
        self.method = method_info(method)
        self.given = dict(options)
        self.options = check_options(self.method, self.given)
        self.memo: dict[Any, Any] = {}  # the model facts of Context.facts, filled by the first call

    @contextlib.contextmanager
    def keep(self) -> Iterator["Prepared"]:
        """Within the block, the calls share one capture session (the recompute route's: its adapter, kernel
        wrapper, hooks and eval mode set up on the first call instead of on each), closed at the end of the
        block, also when it raises; the model is then as before. Results are those of fresh sessions. For the
        batch engine's own model (see the class docstring); one call at a time."""
        if "keep" in self.memo:
            raise RuntimeError("Prepared.keep: already inside a keep() block of this explain")
        with contextlib.ExitStack() as stack:
            self.memo["keep"], self.memo["kept"] = stack, {}  # the sessions, opened by their first call
            try:
                yield self
            finally:
                del self.memo["keep"], self.memo["kept"]

    def __call__(self, inputs: Any, target: Any = None, **overrides: Any) -> Explanation:
        m = self.method
        opts = check_options(m, {**self.given, **overrides}) if overrides else dict(self.options)
        if m.needs_grad:
            require_grad_mode(m.name)
        ctx = Context(self.model, inputs, target, m, opts, self.tokenizer, memo=self.memo)
        ctx.check_mixers()
        if qwen_vl.applies(self.model):  # composed on its own matrix-free route (chunked vision attention)
            return qwen_vl.explain_qwen_vl(ctx, opts)
        return m.fn(ctx, **{k: v for k, v in opts.items() if k not in COMMON_OPTIONS})


class Explainer:
    """A model and a method with fixed options, to explain many inputs: ``Explainer(model, "gae")(inputs)``.

    Options are validated once, at construction."""

    def __init__(self, model: nn.Module, method: str = "rollout", *, tokenizer: Any = None, **options: Any):
        self.model = model
        self.method = method_info(method).name
        check_options(self.method, options)
        self.tokenizer = tokenizer
        self.options = options

    def __call__(self, inputs: Any, target: Any = None, **overrides: Any) -> Explanation:
        return explain(
            self.model, inputs, self.method, target, tokenizer=self.tokenizer, **{**self.options, **overrides}
        )

    def __repr__(self) -> str:
        return f"Explainer({type(self.model).__name__}, method={self.method!r}, options={self.options!r})"
