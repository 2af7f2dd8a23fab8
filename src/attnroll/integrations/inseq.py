"""attnroll methods as inseq attribution methods, registered through inseq's own registry: importing this
module adds ``attnroll_rollout``, ``attnroll_grad_rollout``, ``attnroll_gae``, ... to
``inseq.list_feature_attribution_methods()``, so that

    import attnroll.integrations.inseq
    model = inseq.load_model(hf_model, "attnroll_rollout", tokenizer=tokenizer)
    out = model.attribute(prompt, generation_args={"max_new_tokens": 5})

explains every generated token with attnroll: at each generation step, the step's input ids (prompt and the
tokens generated so far) go through ``attnroll.explain(hf_model, {"input_ids", "attention_mask"}, method,
target=the step's target token)``, and its scores over those tokens are the step's target attributions.
Gradient methods explain the target token's logit (attnroll's target), not inseq's ``attributed_fn``.
Decoder-only transformers models; encoder-decoders are refused (use attnroll's ``encdec_*`` methods).
"""

from __future__ import annotations

from typing import Any

from .. import _checks
from ..methods import explain, method_info

try:
    from inseq.attr.feat.internals_attribution import InternalsAttributionRegistry
    from inseq.data import FeatureAttributionStepOutput
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"attnroll.integrations.inseq needs inseq 0.7 ({e}): pip install --no-deps inseq==0.7.1 treescope "
        "(its declared typeguard<=2.13.3 conflicts with TransformerLens; see README)"
    ) from None

__all__ = ["register", "METHODS", "PREFIX"]

#: The attnroll methods registered on import: those that explain a decoder's next token.
METHODS = ("rollout", "grad_rollout", "gae", "raw", "flow", "per_head_rollout", "attn_gradcam")
PREFIX = "attnroll_"


class _AttnrollStep:
    """One attnroll method as an inseq attribution method (see the module's docstring); mixed into an
    ``InternalsAttributionRegistry`` subclass per method by :func:`register`, so that this base is not one of
    inseq's registered methods itself."""

    method_name = ""  # the subclasses' names: PREFIX + the attnroll method
    attnroll_method = ""
    attnroll_options: dict[str, Any] = {}

    def __init__(self, attribution_model: Any, **kwargs: Any) -> None:
        super().__init__(attribution_model)  # type: ignore[call-arg]  (InternalsAttributionRegistry's)
        if getattr(attribution_model, "is_encoder_decoder", False):
            raise ValueError(f"{self.method_name} explains decoder-only models; for encoder-decoders use attnroll's "
                             "encdec_rollout / encdec_gae through attnroll.explain")
        self.attribute_batch_ids = True  # the step's token ids, not embeddings
        self.forward_batch_embeds = False
        self.use_predicted_target = method_info(self.attnroll_method).class_specific
        self.is_final_step_method = False

    def attribute_step(self, attribute_fn_main_args: dict[str, Any],
                       attribution_args: dict[str, Any] | None = None) -> Any:
        extra = attribute_fn_main_args["additional_forward_args"]
        ids, target_ids, mask = extra[0], extra[1], extra[3]
        e = explain(self.attribution_model.model, {"input_ids": ids, "attention_mask": mask}, self.attnroll_method,
                    target=target_ids.reshape(-1).tolist(), **{**self.attnroll_options, **(attribution_args or {})})
        return FeatureAttributionStepOutput(source_attributions=None, target_attributions=e.scores.detach().cpu(),
                                            step_scores={})


_REGISTERED: dict[str, type] = {}


def register(method: str, name: str | None = None, **options: Any) -> str:
    """Register attnroll ``method`` (with ``options``) as an inseq attribution method called ``name`` (default
    ``"attnroll_" + method``); returns the name. Registering a name again replaces nothing: ValueError."""
    method_info(method)  # an unknown method fails here, listing the known ones
    name = name or PREFIX + method
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {_checks.describe(name)}")
    if name in _REGISTERED or name in InternalsAttributionRegistry.available_classes():
        raise ValueError(f"an inseq attribution method called {name!r} is registered already; pick another name")
    body = {"method_name": name, "attnroll_method": method, "attnroll_options": dict(options), "__module__": __name__}
    cls = type(f"Attnroll_{name}", (_AttnrollStep, InternalsAttributionRegistry), body)
    _REGISTERED[name] = cls
    return name


for _m in METHODS:
    register(_m)
