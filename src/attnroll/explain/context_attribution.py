"""Context attribution for decoders: which parts of a prompt a generated answer drew on.

``context_attribution(model, tokenizer, prompt, generate=N)`` generates N tokens greedily (or takes a given
``answer``), runs one forward pass over prompt + answer under the model's own attention kernel, and traces
every answer token's predicting row (the row of the token before it) back to the input with the matrix-free
operators: ``rollout`` traces all rows in one right-to-left sweep; ``gae`` / ``grad_rollout`` weight the
attention by the gradient of the answer's total log-probability Σ_t log p(answer_t | prefix) (one backward
pass for the whole span); ``attn_grad`` skips the rollout: each layer's mean over heads of (A ⊙ ∂y/∂A)^+ at
the answer's predicting rows, summed over the layers (the direct read of the prompt, layer by layer);
``gate_grad`` differentiates the answer's log-probability with respect to gates on the attention
paid to each prompt token (``key_gates``: a first-order leave-one-out estimate). The relevance of each prompt
token, summed over the answer tokens, is then summed within tokens, words, sentences or given segments (e.g.
the retrieved passages of a RAG prompt); shares are relative to the prompt's total, so they add up to 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .. import _checks
from .._callable import make_callable as _make_callable
from ..capture.recompute import capture_kernels
from ..core import operators
from ..core import segments as seg
from ..core import sinks as core_sinks
from ..core.residual import residual_coefficients
from ..viz.notebook import NotebookView
from . import checked, matrix_free, prompts
from .context import Context
from .key_gates import check_gateable
from .registry import method_info
from .sinks import detect as detect_sinks

METHODS = ("rollout", "gae", "grad_rollout", "attn_grad", "gate_grad", "checked")


@dataclass
class ContextAttribution(NotebookView):
    """The prompt's units ranked by their share of the answer's relevance.

    Attributes:
        prompt, answer: the texts; ``answer_ids`` the answer's token ids.
        token_scores: (n_prompt,) relevance of each prompt token, summed over the answer tokens.
        units: one dict per unit in prompt order: ``text``, ``span`` (character [start, end)), ``score``,
            ``share`` (score / total); a final "(other)" unit holds tokens outside every unit (special tokens,
            text between given segments) when there are any.
        total: the prompt's total relevance (the sum of ``token_scores``).
        method, unit: how it was made.
        sinks: the prompt positions found to be attention sinks (``attnroll.explain.sinks``); with
            ``sinks="drop"`` (the default) their relevance is left out of ``token_scores`` and the shares.
        sink_share: the sinks' share of the prompt's relevance before they were left out (kept or not).
        tokens: the readable text of each input token (``token_scores``' positions: ``" Tower"``, not
            ``"ĠTower"``); ``answer_tokens`` the same for the answer.
        token_units: each input token's unit (an index into ``units``).
        chat_template: whether the tokenizer's chat template was put around the prompt (then ``input_text``
            is the text the model read, the user's prompt inside it; units still refer to ``prompt``).
    """

    prompt: str
    answer: str
    answer_ids: list[int]
    token_scores: torch.Tensor
    units: list[dict]
    total: float
    method: str
    unit: str
    options: dict = field(default_factory=dict)
    sinks: list[int] = field(default_factory=list)
    sink_share: float = 0.0
    tokens: list[str] = field(default_factory=list)
    answer_tokens: list[str] = field(default_factory=list)
    chat_template: bool = False
    input_text: str = ""
    token_units: list[int] = field(default_factory=list)

    def ranked(self) -> list[dict]:
        """The units sorted by score, largest first (the shares' order when the total is positive; signed
        scores, e.g. gate_grad's, can sum to zero or less, and then every share is 0)."""
        return sorted(self.units, key=lambda u: -u["score"])

    def table(self, top: int | None = None, width: int = 70) -> str:
        """Plain-text ranking: share, then the unit's text (shortened to ``width`` characters)."""
        lines = []
        for u in self.ranked()[:top]:
            text = " ".join(u["text"].split())
            text = text if len(text) <= width else text[: width - 1] + "…"
            lines.append(f"{self.amount(u)}  {text}")
        return "\n".join(lines)

    def amount(self, u: dict) -> str:
        """A unit's share in %, or its signed score in nats where the scores (gate_grad's are signed) sum to
        zero or less and every share is 0."""
        return f"{100 * u['share']:6.2f}%" if self.total > 0 else f"{u['score']:+.3f} nats"

    def to_dict(self) -> dict:
        """Everything as JSON-able values (lists, numbers, strings); ``to_json`` writes it."""
        return {"prompt": self.prompt, "answer": self.answer, "answer_ids": list(self.answer_ids),
                "answer_tokens": list(self.answer_tokens), "method": self.method, "unit": self.unit,
                "options": _jsonable(self.options), "chat_template": self.chat_template, "input_text": self.input_text,
                "total": self.total, "sinks": list(self.sinks), "sink_share": self.sink_share,
                "tokens": list(self.tokens), "token_units": list(self.token_units),
                "token_scores": [float(v) for v in self.token_scores.tolist()],
                "units": [{**u, "span": list(u["span"]) if u["span"] else None} for u in self.units]}

    def to_json(self, path: Any = None, indent: int | None = 1) -> str:
        """:meth:`to_dict` as JSON text; with ``path`` also written there (atomically)."""
        import json

        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, text.encode("utf-8"))
        return text

    def to_html(self, path: Any = None, *, interactive: bool = True, title: str | None = None) -> str:
        """The viewer page (``interactive=True``: the prompt's units ranked, each opening onto its tokens
        coloured by relevance) or a compact HTML ranking without script; with ``path`` also written there."""
        from ..viz.viewer.context import context_html

        page = context_html(self.to_dict(), interactive=interactive, title=title)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, page.encode("utf-8"))
        return page

    # In a notebook: the interactive page, sandboxed (NotebookView); show() prints the ranking elsewhere.
    def _notebook_html(self) -> str:
        return self.to_html(interactive=True)

    def _plain_text(self) -> str:
        return f"answer: {self.answer!r} ({self.method}, by {self.unit})\n{self.table()}"


def _jsonable(x: Any) -> Any:
    from .explanation import jsonable

    return jsonable(x)


def context_attribution(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    *,
    generate: int | None = None,
    answer: str | Sequence[int] | None = None,
    unit: str = "sentence",
    segments: Sequence[str] | None = None,
    method: str | None = None,
    sinks: str = "drop",
    chat_template: bool | None = None,
    **options: Any,
) -> ContextAttribution:
    """Attribute a decoder's answer to the parts of its prompt.

    Args:
        model: a transformers decoder-only LM (GPT-2, Llama, Mistral, Gemma 2, ...), any attention kernel.
        tokenizer: its tokenizer (a fast one: character offsets place tokens in words and sentences).
        prompt: the prompt text.
        generate: number of tokens to generate greedily as the answer; or give ``answer`` (text, or token ids
            such as a :func:`~attnroll.explain.generation_attribution` result's ``answer_ids``) instead.
        unit: "token" | "word" | "sentence" (ignored when ``segments`` is given).
        segments: consecutive pieces of the prompt (e.g. retrieved passages), in order; text outside them
            goes to "(other)".
        method: "checked" (default: gate_grad's ranking whose top ``r`` units, option ``r`` default 4, are
            verified by exact leave-one-out, r more forwards without gradient; option ``base`` "gate_grad" or
            "attn_grad"; ``explain.checked``), "gate_grad" (∂ log p(answer) / ∂m_j of a gate m_j on the
            attention paid to unit j's tokens in every layer, head and row, averaged over m = 1 and 0.25: a
            leave-one-out estimate, signed, in nats; option ``scales``, default (1.0, 0.25); needs the eager or
            sdpa kernel and no sliding window shorter than the input; ``key_gates``), "attn_grad" (gradient ×
            attention at the answer's rows, summed over heads and layers, without rollout; any kernel; options
            ``clamp``, ``start_layer``, ``end_layer``), "gae", "grad_rollout" or "rollout". The default: measured
            against exact leave-one-out on SmolLM2 QA (EVALUATION.md); "attn_grad", warned, where gates can't act.
        sinks: "drop" (default): prompt tokens found to be attention sinks on the captured attention (the
            first token of most decoders; ``attnroll.explain.sinks``) get no share, their share of the
            relevance recorded in ``sink_share``; "keep": they keep it.
        chat_template: None (default): put the tokenizer's chat template around the prompt (as the user's
            message, with the assistant's turn opened) when the tokenizer has one and the prompt is not already
            templated; True / False: always / never. Units and spans still refer to ``prompt``; the template's
            own tokens (its text and special tokens) form the unit "(chat template)".
        **options: rollout's ``head_fusion``, ``alpha``, ``residual_mode``; ``start_layer``/``end_layer``.

    Returns:
        a :class:`ContextAttribution`; its units' shares add up to 1.
    """
    prompts.check_decoder(model, "context attribution")
    if method is not None:
        _checks.check_choice("method", method, METHODS)
    _checks.check_choice("sinks", sinks, ("drop", "keep"))
    if segments is None:
        _checks.check_choice("unit", unit, seg.UNITS)
    enc = prompts.encode_prompt(tokenizer, prompt, chat_template)
    prompt_ids, offsets = prompts.on_model(model, enc.ids), enc.offsets
    answer_ids = prompts.answer_ids(model, tokenizer, prompt_ids, generate, answer)
    ids = torch.cat([prompt_ids, torch.tensor([answer_ids], dtype=prompt_ids.dtype, device=prompt_ids.device)], dim=1)
    n_prompt, T = prompt_ids.shape[1], len(answer_ids)
    rows = [n_prompt - 1 + t for t in range(T)]  # the row that predicts answer token t
    owner = token_units(prompt, offsets, unit, segments)
    method = _resolve(method, model, ids.shape[1])
    base, r, base_options = checked.split_options(options) if method == "checked" else (method, 0, options)
    with checked.FullProbe(model, ids, answer_ids) as probe:  # f(all) off the base's plain forward, for "checked"
        R, layers = _base_relevance(model, tokenizer, ids, rows, answer_ids, owner, base, base_options)
    scores = R[:, :n_prompt].sum(dim=0).to(torch.float32).cpu()
    found = sink_positions(layers, ids.shape[1])[:n_prompt]
    _, share = core_sinks.drop_columns(scores, found)
    if sinks == "drop":
        scores = torch.where(found, torch.zeros(()), scores)  # not rescaled: the shares are relative anyway
    units = _units(prompt, offsets, scores, unit, segments)
    if method == "checked":  # the base's top r units verified by exact leave-one-out
        scores = _verified(model, tokenizer, prompt, enc.templated, units, scores, owner, answer_ids, r, probe)
        units = _units(prompt, offsets, scores, unit, segments)  # their sums: the combined scores
    template = [enc.templated and o == (0, 0) for o in offsets]  # the chat template's tokens
    units, owner = _template_unit(units, owner, scores, template)
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    return ContextAttribution(prompt, text, answer_ids, scores, units, float(scores.sum()), method,
                              "segments" if segments is not None else unit, {**options, "sinks": sinks},
                              sinks=torch.nonzero(found).reshape(-1).tolist(), sink_share=float(share),
                              tokens=enc.pieces, answer_tokens=prompts.answer_pieces(tokenizer, answer_ids),
                              chat_template=enc.templated, input_text=enc.text, token_units=owner)


def _resolve(method: str | None, model: nn.Module, n: int) -> str:
    """``method``, or where it is None the measured default "checked" (gate_grad's ranking, its top units verified
    by exact leave-one-out) where the key gates apply to ``model`` at ``n`` tokens, else "attn_grad", warned."""
    if method is not None:
        return method
    try:
        check_gateable(model, n)
    except ValueError as e:
        warnings.warn(f"the default method 'checked' ranks by gate_grad, which does not apply here ({e}); "
                      f"'attn_grad' is used instead", UserWarning, stacklevel=3)
        return "attn_grad"
    return "checked"


def _base_relevance(model, tokenizer, ids, rows, answer_ids, owner, method, options) -> tuple[torch.Tensor, list]:
    """((1 or T, n) relevance, the captured layers) of a method other than "checked"."""
    if method == "gate_grad":  # the units' tokens are gated (not the chat template's, nor the answer's)
        gated = torch.tensor([o >= 0 for o in owner] + [False] * len(answer_ids))
        return _gate_relevance(model, ids, rows, answer_ids, gated, options)  # (1, n)
    return _relevance(model, tokenizer, ids, rows, answer_ids, method, options)  # (T, n)


def _verified(model, tokenizer, prompt, templated, units, scores, owner, answer_ids, r, probe) -> torch.Tensor:
    """"checked": token scores whose unit sums are :func:`checked.combine` of the units' base scores and the
    exact leave-one-out drops of the ``r`` highest (``checked``)."""
    real = [u for u in units if u["span"] is not None]
    base = [u["score"] for u in real]
    chosen = checked.choose(base, r)
    drops = checked.exact_drops(model, tokenizer, prompt, [u["span"] for u in real], chosen, answer_ids,
                                templated, probe)
    return checked.reweight(scores, owner, base, checked.combine(base, drops))


#: The unit of the chat template's tokens (its text around the user's prompt and its special tokens).
TEMPLATE_UNIT = "(chat template)"


def _template_unit(units: list[dict], owner: list[int], scores: torch.Tensor,
                   template: list[bool]) -> tuple[list[dict], list[int]]:
    """The chat template's tokens taken out of "(other)" into their own unit; every token's unit index."""
    spans = [u for u in units if u["span"] is not None]
    rest = [i for i, o in enumerate(owner) if o < 0 and not template[i]]
    tmpl = [i for i, o in enumerate(owner) if o < 0 and template[i]]
    if not tmpl:
        return units, [o if o >= 0 else len(spans) for o in owner]
    total = float(scores.sum())
    out = list(spans)
    for name, idx in (("(other)", rest), (TEMPLATE_UNIT, tmpl)):
        if idx:
            v = float(scores[idx].sum())
            out.append({"text": name, "span": None, "score": v, "share": v / total if total > 0 else 0.0})
    at = {"(other)": len(spans), TEMPLATE_UNIT: len(out) - 1}
    return out, [o if o >= 0 else at[TEMPLATE_UNIT if template[i] else "(other)"] for i, o in enumerate(owner)]


def sink_positions(layers: list, n: int) -> torch.Tensor:
    """(n,) bool: the attention sinks of the one example's captured ``layers`` (``explain.sinks.detect``)."""
    return detect_sinks(layers, None, 1, n)[0][0]


_is_decoder_lm = prompts.is_decoder_lm  # the shared helpers, under the names this module had
_answer_ids = prompts.answer_ids


def _relevance(model, tokenizer, ids, rows, answer_ids, method, options) -> torch.Tensor:
    """((T, n) the relevance rows of the answer's predicting positions, the captured layers)."""
    inputs = {"input_ids": ids}
    allowed = {"rollout": ("head_fusion", "alpha", "residual_mode", "start_layer", "end_layer"),
               "gae": ("start_layer", "end_layer"),
               "grad_rollout": ("clamp", "alpha", "residual_mode", "start_layer", "end_layer"),
               "attn_grad": ("clamp", "start_layer", "end_layer")}[method]
    for k in options:
        if k not in allowed:
            raise ValueError(f"context attribution with method {method!r} has no option {k!r}; options: {allowed}")
    if method == "rollout":
        rec = capture_kernels(model, inputs)
        rule = operators.fused_probs(options.get("head_fusion", "mean"))
        mode, alpha = options.get("residual_mode", "blend"), options.get("alpha", 0.5)
    else:
        r_idx, tok = torch.tensor(rows), torch.tensor(answer_ids)

        def target(outputs):  # Σ_t log p(answer_t | prefix): the whole span at once
            logp = outputs.logits[:, r_idx].float().log_softmax(dim=-1)
            return logp[:, torch.arange(len(rows)), tok].sum(dim=-1)

        ctx = Context(model, inputs, target, method_info("gae" if method == "attn_grad" else method), {}, tokenizer)
        rec = matrix_free.grad_record(ctx, "recompute", None)
        rule = operators.weighted_probs(options.get("clamp", "per_head"))
        mode = "add" if method == "gae" else options.get("residual_mode", "renorm")
        alpha = 0.5 if method == "gae" else options.get("alpha", 0.5)
    layers = matrix_free.layers_of(rec, "self" if "self" in rec.operators else rec.stream_names()[0])
    a, c = residual_coefficients(alpha, mode)
    from ..core.rollout import layer_range

    start, end = layer_range(len(layers), options.get("start_layer", 0), options.get("end_layer"))
    if method == "attn_grad":
        return answer_rows_relevance(layers[start:end], rows, rule), layers
    if method == "rollout":  # the same refusal of non-stochastic rows (attention sinks) as explain's rollout
        matrix_free.check_stochastic(layers, start, end, options.get("head_fusion", "mean"), None)
    E = torch.zeros(1, len(rows), ids.shape[1], dtype=torch.float32, device=layers[0].q.device)
    E[0, torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    R = operators.rollout_rows(layers, E, rule, a=a, c=c, renorm=mode == "renorm", start=start, end=end)
    return R[0], layers


def _gate_relevance(model, ids, rows, answer_ids, gated, options) -> tuple[torch.Tensor, list]:
    """gate_grad: ((1, n) ∂f/∂m per token from the key gates (``key_gates``), the layers of one plain capture
    for the sinks)."""
    for k in options:
        if k != "scales":
            raise ValueError(f"context attribution with method 'gate_grad' has no option {k!r}; options: ('scales',)")
    from .key_gates import DEFAULT_SCALES, gate_gradients

    g = gate_gradients(model, ids, rows, answer_ids, gated, options.get("scales", DEFAULT_SCALES))
    rec = capture_kernels(model, {"input_ids": ids})
    layers = matrix_free.layers_of(rec, "self" if "self" in rec.operators else rec.stream_names()[0])
    return g.reshape(1, -1), layers


def answer_rows_relevance(layers: list, rows: list[int], rule, per_copy: bool = False) -> torch.Tensor:
    """(T, n): Σ over ``layers`` of the block ``rule`` at the answer's predicting ``rows`` only, no rollout
    (for "attn_grad": mean over heads of (A ⊙ ∂y/∂A)^+, each layer's direct read of the prompt). ``per_copy``:
    row i is read from example i of the batch (one gradient target per copy), else every row from example 0."""
    n = layers[0].shape[3]
    R = torch.zeros(len(rows), n, dtype=torch.float32, device=layers[0].q.device)
    for lay in layers:
        for i, r in enumerate(rows):
            R[i] += rule(lay, r, r + 1, 0, n)[i if per_copy else 0, 0].float()
    return R


def _spans(prompt, offsets, unit, given) -> list[tuple[int, int]]:
    """The units' character spans in the prompt."""
    if given is not None:
        return seg.segment_spans(prompt, given)
    if unit == "token":
        return [o for o in offsets if o[1] > o[0]]
    if unit == "word":
        return seg.word_spans(prompt)
    return seg.sentence_spans(prompt)


def token_units(prompt: str, offsets, unit: str, given) -> list[int]:
    """Each input token's unit (an index into the units, −1 for "(other)")."""
    return seg.assign(offsets, prompt, _spans(prompt, offsets, unit, given))


def _units(prompt, offsets, scores, unit, given) -> list[dict]:
    spans = _spans(prompt, offsets, unit, given)
    owner = seg.assign(offsets, prompt, spans)
    sums, other = seg.aggregate(scores, owner, len(spans))
    total = float(scores.sum())
    share = (lambda v: v / total) if total > 0 else (lambda v: 0.0)
    units = [{"text": prompt[s:e], "span": (s, e), "score": float(v), "share": share(float(v))}
             for (s, e), v in zip(spans, sums.tolist())]
    if any(o < 0 for o in owner):
        units.append({"text": "(other)", "span": None, "score": float(other), "share": share(float(other))})
    return units


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
