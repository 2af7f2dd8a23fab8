"""Generation-time attribution for decoders: every generated token explained against the prompt's tokens and
the tokens generated before it.

``generation_attribution(model, tokenizer, prompt, generate=N)`` generates N tokens greedily (or takes a given
``answer``) and returns a (T × n_source) matrix, the shape of inseq's ``attribute()``: row t is the relevance
of the prediction of generated token t (the row of the token before it), over the n_source = n_input + T − 1
tokens the predictions read (the prompt as the model read it, chat template included, then the generated
tokens but the last). Row t is zero from column n_input + t on (a decoder reads only what came before).

- ``rollout``: one forward pass over prompt + answer and ONE right-to-left matrix-free sweep for all T rows
  (``core.operators.rollout_rows`` with T start rows).
- ``gae`` / ``grad_rollout``: the attention is weighted by the gradient of each token's own log-probability
  log p(answer_t | prefix), so every row has its own gradient. The sequence is copied ``batch_size`` times into
  the batch axis, copy b's target being token b's log-probability: one forward and one backward pass per
  ``batch_size`` generated tokens (``batch_size=1``: one backward per token, the most it takes), then one
  sweep over the batch.

Because the model is causal, row t equals the same method run on the prefix alone (``explain`` on
prompt + answer[:t] with the last token's row; tested to 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .. import _checks
from .._callable import make_callable as _make_callable
from ..capture.recompute import capture_kernels
from ..core import operators
from ..core import sinks as core_sinks
from ..core.residual import residual_coefficients
from ..core.rollout import layer_range
from ..viz.notebook import NotebookView
from . import matrix_free, prompts
from .context import Context
from .key_gates import resolve_default
from .registry import method_info
from .sinks import detect as detect_sinks

__all__ = ["GenerationAttribution", "generation_attribution", "METHODS"]

METHODS = ("rollout", "gae", "grad_rollout", "attn_grad", "gate_grad")
#: Each method's options (their defaults are context attribution's).
OPTIONS = {"rollout": ("head_fusion", "alpha", "residual_mode", "start_layer", "end_layer"),
           "gae": ("start_layer", "end_layer"),
           "grad_rollout": ("clamp", "alpha", "residual_mode", "start_layer", "end_layer"),
           "attn_grad": ("clamp", "start_layer", "end_layer"),
           "gate_grad": ("scales",)}


@dataclass
class GenerationAttribution(NotebookView):
    """Each generated token's relevance over the tokens before it.

    Attributes:
        prompt, answer: the texts; ``answer_ids`` the generated (or given) token ids.
        matrix: (T, n_source) float32: row t = generated token t's relevance over the source tokens.
        tokens: the readable text of the n_input + T tokens (the model's input, then the answer);
            ``source_tokens`` the first n_source of them, ``answer_tokens`` the last T.
        n_input: the number of input tokens (the prompt, chat template and special tokens included).
        method, options: how it was made; ``chat_template``: whether the template was applied.
        sinks: source positions found to be attention sinks; with ``sinks="drop"`` their columns are zero.
        sink_share: (T,) the share of each row the sinks held before they were left out.
    """

    prompt: str
    answer: str
    answer_ids: list[int]
    matrix: torch.Tensor
    tokens: list[str]
    n_input: int
    method: str
    options: dict = field(default_factory=dict)
    chat_template: bool = False
    sinks: list[int] = field(default_factory=list)
    sink_share: torch.Tensor | None = None

    @property
    def source_tokens(self) -> list[str]:
        return self.tokens[: self.matrix.shape[1]]

    @property
    def answer_tokens(self) -> list[str]:
        return self.tokens[self.n_input:]

    def prompt_share(self) -> torch.Tensor:
        """(T,) each row's share on the input tokens (the rest is on the earlier generated tokens)."""
        tot = self.matrix.sum(dim=1)
        return torch.where(tot != 0, self.matrix[:, : self.n_input].sum(dim=1) / tot.where(tot != 0, 1.0), 0.0)

    def table(self, top: int = 3, width: int = 16) -> str:
        """One line per generated token: its text, its share on the prompt, its ``top`` sources with shares."""
        lines, share = [], self.prompt_share()
        for t, row in enumerate(self.matrix):
            tot = float(row.sum())
            k = min(top, int((row != 0).sum()))
            vals, idx = torch.topk(row, k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
            parts = [f"{_short(self.tokens[i], width)} {100 * v / tot if tot else 0:.1f}%"
                     for v, i in zip(vals.tolist(), idx.tolist())]
            lines.append(f"{t:4d} {_short(self.answer_tokens[t], width):<{width + 2}} prompt "
                         f"{100 * float(share[t]):5.1f}%  top: {', '.join(parts)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Everything as JSON-able values; ``matrix`` as a list of T rows."""
        from .explanation import jsonable

        return {"prompt": self.prompt, "answer": self.answer, "answer_ids": list(self.answer_ids),
                "method": self.method, "options": jsonable(self.options), "chat_template": self.chat_template,
                "n_input": self.n_input, "tokens": list(self.tokens), "source_tokens": self.source_tokens,
                "answer_tokens": self.answer_tokens, "sinks": list(self.sinks),
                "sink_share": [] if self.sink_share is None else [float(v) for v in self.sink_share.tolist()],
                "prompt_share": [float(v) for v in self.prompt_share().tolist()],
                "matrix": [[float(v) for v in row] for row in self.matrix.tolist()]}

    def to_json(self, path: Any = None, indent: int | None = None) -> str:
        """:meth:`to_dict` as JSON text; with ``path`` also written there (atomically)."""
        import json

        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, text.encode("utf-8"))
        return text

    def to_html(self, path: Any = None, *, title: str | None = None) -> str:
        """The viewer's source × target page (rows = generated tokens); with ``path`` also written there."""
        from ..viz.viewer.context import generation_html

        page = generation_html(self.to_dict(), title=title)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, page.encode("utf-8"))
        return page


    # In a notebook: the source x target page, sandboxed (NotebookView); show() prints the table elsewhere.
    def _notebook_html(self) -> str:
        return self.to_html()

    def _plain_text(self) -> str:
        return f"{self.method}: {len(self.answer_ids)} generated token(s) over {self.matrix.shape[1]} sources\n" + \
            self.table()


def _short(text: str, width: int) -> str:
    s = repr(text)[1:-1]
    return s if len(s) <= width else s[: width - 1] + "…"


def generation_attribution(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    *,
    generate: int | None = None,
    answer: str | Sequence[int] | None = None,
    method: str | None = None,
    chat_template: bool | None = None,
    sinks: str = "drop",
    batch_size: int = 8,
    **options: Any,
) -> GenerationAttribution:
    """Explain every generated token against the prompt and the tokens generated before it.

    Args:
        model, tokenizer: a transformers decoder-only LM and its (fast) tokenizer.
        prompt: the prompt text; ``chat_template`` as for :func:`~attnroll.explain.context_attribution`.
        generate: tokens to generate greedily; or ``answer`` (text) to explain instead.
        method: "gate_grad" (default, context attribution's: per generated token, ∂ log p(a_t | prefix) / ∂m_k
            of gates on the attention keys, option ``scales`` (1.0, 0.25); eager or sdpa kernel), "attn_grad"
            (gradient × attention at each generated token's predicting row, summed over layers, no rollout),
            "rollout", "gae" or "grad_rollout".
        sinks: "drop" (default): the columns of the attention sinks (found on the captured attention) are
            zeroed, their share recorded per row in ``sink_share``; "keep": left as they are.
        batch_size: gradient methods: how many generated tokens share one forward + backward pass (copies of
            the sequence in the batch axis; memory grows with it).
        **options: rollout's ``head_fusion``, ``alpha``, ``residual_mode``; grad_rollout's ``clamp``,
            ``alpha``, ``residual_mode``; ``start_layer`` / ``end_layer``.

    Returns:
        a :class:`GenerationAttribution` with its (T, n_source) ``matrix``.
    """
    prompts.check_decoder(model, "generation attribution")
    if method == "checked":
        raise ValueError("method 'checked' verifies one answer's top-ranked units by exact leave-one-out of the whole "
                         "answer; generation attribution gives every generated token its own row: use "
                         "context_attribution(..., method='checked'), or here 'gate_grad' / 'attn_grad'")
    if method is not None:
        _checks.check_choice("method", method, METHODS)
    _checks.check_choice("sinks", sinks, ("drop", "keep"))
    size = _checks.check_int("batch_size", batch_size)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1 (generated tokens per backward pass), got {size}")
    for k in options:
        if k not in OPTIONS[method or "gate_grad"]:
            raise ValueError(f"generation attribution with method {method or 'gate_grad'!r} has no option {k!r}; "
                             f"options: {OPTIONS[method or 'gate_grad']}")
    enc = prompts.encode_prompt(tokenizer, prompt, chat_template)
    prompt_ids = prompts.on_model(model, enc.ids)
    ans = prompts.answer_ids(model, tokenizer, prompt_ids, generate, answer)
    n_input, T = prompt_ids.shape[1], len(ans)
    answer_t = torch.tensor([ans], dtype=prompt_ids.dtype, device=prompt_ids.device)
    ids = torch.cat([prompt_ids, answer_t], dim=1)[:, :-1]  # the last token is never read
    rows = [n_input - 1 + t for t in range(T)]
    method = resolve_default(method, model, ids.shape[1])
    if method == "rollout":
        R, layers = _rollout_rows(model, ids, rows, options)
    elif method == "gate_grad":  # the prompt's text tokens gated (not special / template tokens, nor the answer)
        gated = torch.tensor([o[1] > o[0] for o in enc.offsets] + [False] * (T - 1))
        R, layers = _gate_rows(model, ids, rows, ans, gated, options, size)
    else:
        R, layers = _gradient_rows(model, tokenizer, ids, rows, ans, method, options, size)
    R = R.to(torch.float32).cpu()
    found = detect_sinks(layers, None, 1, ids.shape[1])[0][0]
    _, share = core_sinks.drop_columns(R, found)
    if sinks == "drop":
        R = torch.where(found, torch.zeros(()), R)
    tokens = enc.pieces + prompts.answer_pieces(tokenizer, ans)
    return GenerationAttribution(prompt, tokenizer.decode(ans, skip_special_tokens=True), ans, R, tokens, n_input,
                                 method, {**options, "sinks": sinks}, enc.templated,
                                 torch.nonzero(found).reshape(-1).tolist(), share.reshape(-1))


def _sweep(layers: list, rows: list[int], n: int, rule: Any, mode: str, alpha: float, options: dict,
           per_copy: bool) -> torch.Tensor:
    """The rows' relevance in one right-to-left sweep: (R, n). ``per_copy``: example b of the batch starts
    from its own row ``rows[b]`` (gradient copies); else example 0 starts from every row."""
    a, c = residual_coefficients(alpha, mode)
    start, end = layer_range(len(layers), options.get("start_layer", 0), options.get("end_layer"))
    B = layers[0].shape[0]
    E = torch.zeros(B, 1 if per_copy else len(rows), n, dtype=torch.float32, device=layers[0].q.device)
    if per_copy:
        E[torch.arange(B), 0, torch.tensor(rows)] = 1.0
    else:
        E[0, torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    R = operators.rollout_rows(layers, E, rule, a=a, c=c, renorm=mode == "renorm", start=start, end=end)
    return R[:, 0] if per_copy else R[0]


def _direct_rows(layers: list, rows: list[int], n: int, rule: Any, options: dict) -> torch.Tensor:
    """attn_grad: copy b's row ``rows[b]`` of the block ``rule`` summed over the layers, no rollout: (B, n)."""
    from .context_attribution import answer_rows_relevance

    start, end = layer_range(len(layers), options.get("start_layer", 0), options.get("end_layer"))
    return answer_rows_relevance(layers[start:end], rows, rule, per_copy=True)


def _gate_rows(model: nn.Module, ids: torch.Tensor, rows: list[int], ans: list[int], gated: torch.Tensor,
               options: dict, size: int) -> tuple[torch.Tensor, list]:
    """gate_grad: per chunk of ``size`` generated tokens, ∂ log p(a_t | prefix) / ∂m_k of the key gates (one copy
    per token and scale); then one plain capture for the sinks."""
    from .key_gates import DEFAULT_SCALES, gate_gradients

    scales = options.get("scales", DEFAULT_SCALES)
    R = torch.cat([gate_gradients(model, ids, rows[lo:lo + size], ans[lo:lo + size], gated, scales, per_row=True)
                   for lo in range(0, len(rows), size)])
    rec = capture_kernels(model, {"input_ids": ids})
    return R, matrix_free.layers_of(rec, "self" if "self" in rec.operators else rec.stream_names()[0])


def _rollout_rows(model: nn.Module, ids: torch.Tensor, rows: list[int], options: dict) -> tuple[torch.Tensor, list]:
    """rollout: one capture, all rows in one sweep."""
    rec = capture_kernels(model, {"input_ids": ids})
    layers = matrix_free.layers_of(rec, "self" if "self" in rec.operators else rec.stream_names()[0])
    fusion = options.get("head_fusion", "mean")
    start, end = layer_range(len(layers), options.get("start_layer", 0), options.get("end_layer"))
    matrix_free.check_stochastic(layers, start, end, fusion, None)  # refuses rows that sinks leave non-stochastic
    rule = operators.fused_probs(fusion)
    R = _sweep(layers, rows, ids.shape[1], rule, options.get("residual_mode", "blend"), options.get("alpha", 0.5),
               options, per_copy=False)
    return R, layers


def _gradient_rows(model: nn.Module, tokenizer: Any, ids: torch.Tensor, rows: list[int], ans: list[int],
                   method: str, options: dict, size: int) -> tuple[torch.Tensor, list]:
    """gae / grad_rollout: per chunk of ``size`` generated tokens, the sequence copied once per token, each
    copy's target its own token's log-probability; one forward + backward + sweep per chunk."""
    rule = operators.weighted_probs(options.get("clamp", "per_head"))
    mode = "add" if method == "gae" else options.get("residual_mode", "renorm")
    alpha = 0.5 if method == "gae" else options.get("alpha", 0.5)
    out, first_layers = [], None
    for lo in range(0, len(rows), size):
        r, tok = rows[lo:lo + size], ans[lo:lo + size]
        B = len(r)
        r_idx, t_idx = torch.tensor(r), torch.tensor(tok)

        def target(outputs, r_idx=r_idx, t_idx=t_idx):  # copy b: log p(answer_b | its prefix)
            logits = outputs.logits[torch.arange(len(r_idx)), r_idx].float()
            return logits.log_softmax(dim=-1)[torch.arange(len(r_idx)), t_idx]

        info = method_info("gae" if method == "attn_grad" else method)
        ctx = Context(model, {"input_ids": ids.expand(B, -1).clone()}, target, info, {}, tokenizer)
        rec = matrix_free.grad_record(ctx, "recompute", None)
        layers = matrix_free.layers_of(rec, "self" if "self" in rec.operators else rec.stream_names()[0])
        if method == "attn_grad":
            out.append(_direct_rows(layers, r, ids.shape[1], rule, options).detach())
        else:
            out.append(_sweep(layers, r, ids.shape[1], rule, mode, alpha, options, per_copy=True).detach())
        first_layers = first_layers or layers
    return torch.cat(out), first_layers


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
