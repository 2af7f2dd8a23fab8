"""The explain machinery: ``explain``, ``Explainer``, ``Explanation``, the method registry, ``Context`` and the
steps methods share, batching, and context attribution for decoders. The methods themselves are the files
of :mod:`attnroll.methods`, one each, which register themselves with :func:`register`.

``attnroll.explain`` is this package and is callable as its function: ``attnroll.explain(model, inputs,
method="rollout")`` is :func:`explain` (``attnroll._callable``); ``context_attribution`` likewise.

Modules, each named after what it holds: ``registry`` (``register``, ``methods()``, ``method_info``),
``options`` (``check_options`` and the option value rules), ``context`` (``Context``), ``target_scores``
(``resolve_target``, ``require_grad_mode``), ``explainer`` (``explain``, ``Explainer``, ``Prepared``),
``rows`` (the rollout methods' shared steps), ``matrix_free`` (the matrix-free route of the row methods),
``value_aware`` (the value-aware methods' shared wiring), ``explanation`` (``Explanation``), ``batches``
(``explain_batches``, ``iter_explanations``), ``context_attribution``, ``generation_attribution``
(every generated token over the prompt and the earlier generated tokens), ``vlm_generation_attribution``
(the same for a vision-language model's answer: per generated token one map per image), ``prompts`` (their shared prompt
encoding: chat template, readable tokens, the answer's ids).
"""

from .._callable import make_callable as _make_callable
from . import context_attribution, generation_attribution, vlm_generation_attribution
from .batches import BatchScores, batch_size_of, explain_batches, explain_targets, iter_explanations, take_rows
from .context import Context
from .context_attribution import ContextAttribution
from .explainer import Explainer, Prepared, explain
from .explanation import Explanation
from .generation_attribution import GenerationAttribution
from .options import check_options
from .registry import Method, method_info, methods, register
from .vlm_generation_attribution import VLMGenerationAttribution

__all__ = ["explain", "Explainer", "Explanation", "methods", "method_info", "check_options", "register", "Method",
           "Context", "Prepared", "explain_batches", "iter_explanations", "BatchScores", "explain_targets",
           "batch_size_of", "take_rows", "context_attribution", "ContextAttribution",
           "generation_attribution", "GenerationAttribution", "vlm_generation_attribution",
           "VLMGenerationAttribution"]


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
