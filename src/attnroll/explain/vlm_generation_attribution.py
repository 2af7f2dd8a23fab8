"""Generation-time attribution for vision-language models: every generated token of the answer explained against
the images (one map per image, in the coordinates of the image the user gave) and the prompt's text tokens and the
tokens generated before it.

``vlm_generation_attribution(model, inputs, generate=N)`` takes what the model's processor returns for the images
and the prompt (``input_ids``, ``pixel_values``, ...), generates N tokens greedily through the model's own
``generate`` (or takes a given ``answer``), and explains the prediction of each generated token t (the row of
the token before it, as :func:`~attnroll.explain.generation_attribution` does for text decoders):

- ``matrix`` (T × n_source): the language row of each prediction over the n_source = n_input + T − 1 positions
  it reads (the prompt with its image tokens, then the generated tokens but the last); zero from column
  n_input + t on;
- ``image_maps[t]``: one map per image, the shares of the row's image tokens composed down the vision tower
  onto that image's patch grid (or onto the canvas of its tiles), as ``explain`` composes a VLM
  (:mod:`attnroll.explain.linked`, :mod:`attnroll.explain.qwen_vl`);
- ``image_share[t] + text_share[t]`` = the row's total (1 for rollout): each image's map sums to its share.

``rollout`` (and ``raw``): one capture of prompt + answer and one sweep of the language model for all T rows;
each row is then composed with the vision tower's relevance, which does not depend on the row. ``gae`` /
``grad_rollout``: the target of row t is log p(answer_t | prefix), so each row has its own gradient; the
inputs (images included) are copied ``batch_size`` times into the batch axis, copy b explaining row b: one
forward and one backward pass per ``batch_size`` generated tokens.

Because the language model is causal, row t equals ``explain`` on the prompt + answer[:t] alone (the last
token's row; for the gradient methods with that target; tested to 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .. import _checks
from .._callable import make_callable as _make_callable
from ..capture.readout import resolve_readout
from ..core.rollout import rollout as core_rollout
from ..viz.notebook import NotebookView
from . import prompts, qwen_vl
from .context import Context
from .explanation import Explanation
from .options import check_options
from .registry import method_info
from .rows import ROLLOUT_OPTIONS, prefix_default

__all__ = ["VLMGenerationAttribution", "vlm_generation_attribution", "METHODS", "answer_inputs"]

#: The methods: rollout in one sweep, the gradient methods by batched copies.
METHODS = ("rollout", "gae", "grad_rollout")
#: Per-token inputs a prompt may carry besides input_ids / attention_mask, and the value a generated token gets
#: (None: the prompt's last value repeated, as transformers' generation does, unless the family says otherwise:
#: ``capture.vlm.GENERATED_TOKEN_TYPE``).
_PER_TOKEN = {"token_type_ids": None, "mm_token_type_ids": 0}


@dataclass
class VLMGenerationAttribution(NotebookView):
    """Each generated token's relevance over the images and the tokens before it.

    Attributes:
        answer, answer_ids: the generated (or given) answer and its token ids.
        matrix: (T, n_source) float32: row t = the language row of generated token t's prediction over the
            source positions (image tokens hold their shares; see ``image_positions``).
        image_positions: the source positions of image tokens (their shares are pushed onto ``image_maps``).
        image_maps: per generated token, one (h, w) map per image of the prompt, each summing to that image's
            share of the row.
        image_share, text_share: (T,) the row's share on the images / on the text positions; their sum is the
            row's total (1 for rollout).
        unplaced_share: (T,) the part of ``image_share`` that the vision tower leaves on tokens with no place on
            the image (LLaVA's CLS token, tile padding); the maps hold the rest.
        tokens: readable text of the n_input + T tokens (the prompt as the model read it, then the answer).
        n_input: the prompt's token count (image tokens included).
        method, options: how it was made.
        images: the user's images, when given (the viewer page lays the maps over them).
    """

    answer: str
    answer_ids: list[int]
    matrix: torch.Tensor
    image_positions: list[int]
    image_maps: list[list[torch.Tensor]]
    image_share: torch.Tensor
    text_share: torch.Tensor
    unplaced_share: torch.Tensor
    tokens: list[str]
    n_input: int
    method: str
    options: dict = field(default_factory=dict)
    images: list | None = None

    @property
    def source_tokens(self) -> list[str]:
        return self.tokens[: self.matrix.shape[1]]

    @property
    def answer_tokens(self) -> list[str]:
        return self.tokens[self.n_input:]

    def text_matrix(self) -> torch.Tensor:
        """(T, n_source): ``matrix`` with the image tokens' columns set to 0 (the text positions' shares)."""
        out = self.matrix.clone()
        out[:, self.image_positions] = 0
        return out

    def table(self, top: int = 3, width: int = 16) -> str:
        """One line per generated token: its text, its share on the images, its ``top`` text sources."""
        from .generation_attribution import _short

        lines, text = [], self.text_matrix()
        for t, row in enumerate(text):
            tot = float(self.image_share[t] + self.text_share[t])
            k = min(top, int((row != 0).sum()))
            vals, idx = torch.topk(row, k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
            parts = [f"{_short(self.tokens[i], width)} {100 * v / tot if tot else 0:.1f}%"
                     for v, i in zip(vals.tolist(), idx.tolist())]
            img = 100 * float(self.image_share[t]) / tot if tot else 0.0
            lines.append(f"{t:4d} {_short(self.answer_tokens[t], width):<{width + 2}} images {img:5.1f}%  "
                         f"top text: {', '.join(parts)}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Everything as JSON-able values (the images themselves are not included)."""
        from .explanation import jsonable

        return {"answer": self.answer, "answer_ids": list(self.answer_ids), "method": self.method,
                "options": jsonable(self.options), "n_input": self.n_input, "tokens": list(self.tokens),
                "source_tokens": self.source_tokens, "answer_tokens": self.answer_tokens,
                "image_positions": list(self.image_positions),
                "image_share": [float(v) for v in self.image_share.tolist()],
                "text_share": [float(v) for v in self.text_share.tolist()],
                "unplaced_share": [float(v) for v in self.unplaced_share.tolist()],
                "matrix": [[float(v) for v in row] for row in self.matrix.tolist()],
                "image_maps": [[m.tolist() for m in maps] for maps in self.image_maps]}

    def to_json(self, path: Any = None, indent: int | None = None) -> str:
        """:meth:`to_dict` as JSON text; with ``path`` also written there (atomically)."""
        import json

        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, text.encode("utf-8"))
        return text

    def to_html(self, path: Any = None, *, images: Any = None, title: str | None = None) -> str:
        """The viewer page: clicking a generated token shows its map over each image and its scores over the
        prompt's tokens; ``images`` (the user's, PIL or arrays; default ``self.images``) lie under the maps.
        With ``path`` also written there."""
        from ..viz.viewer.context import vlm_generation_html

        page = vlm_generation_html(self.to_dict(), images=self.images if images is None else images, title=title)
        if path is not None:
            from .._io import atomic_write

            atomic_write(path, page.encode("utf-8"))
        return page

    def _notebook_html(self) -> str:
        return self.to_html()

    def _plain_text(self) -> str:
        images = len(self.image_maps[0]) if self.image_maps else 0
        return (f"{self.method}: {len(self.answer_ids)} generated token(s) over {images} image(s) and "
                f"{self.matrix.shape[1]} source positions\n" + self.table())


def vlm_generation_attribution(
    model: nn.Module,
    inputs: Any,
    *,
    generate: int | None = None,
    answer: Sequence[int] | str | None = None,
    method: str = "rollout",
    tokenizer: Any = None,
    images: Any = None,
    batch_size: int = 8,
    **options: Any,
) -> VLMGenerationAttribution:
    """Explain every generated token of a VLM's answer against the images and the tokens before it.

    Args:
        model: a vision-language model attnroll composes (LLaVA, PaliGemma, VipLLaVA, Gemma 3, Idefics3,
            SmolVLM, InternVL, Aya Vision, Mistral 3, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL, Qwen2.5-VL,
            Qwen3-VL).
        inputs: what its processor returns for one prompt with its images (``input_ids`` (1, n), ``pixel_values``,
            ``attention_mask``, ``image_sizes`` / ``image_grid_thw`` / ``token_type_ids`` as the family has them).
        generate: tokens to generate greedily (``model.generate``); or ``answer``: token ids (or a text, with
            ``tokenizer``) to explain instead.
        method: "rollout" (default; one sweep for all tokens), "gae" or "grad_rollout" (one backward per
            ``batch_size`` tokens).
        tokenizer: the processor or its tokenizer: readable tokens, a text ``answer``.
        images: the user's images (kept for :meth:`VLMGenerationAttribution.to_html`).
        **options: the method's options as ``explain`` takes them (``head_fusion``, ``alpha``, ...).

    Returns:
        a :class:`VLMGenerationAttribution`.
    """
    _checks.check_choice("method", method, METHODS)
    size = _checks.check_int("batch_size", batch_size)
    if size < 1:
        raise ValueError(f"batch_size must be >= 1 (generated tokens per backward pass), got {size}")
    for k in ("position", "readout", "stream", "return_layers"):
        if k in options:
            raise ValueError(f"vlm_generation_attribution sets {k}= itself (one row per generated token); leave it out")
    check_options(method, options)
    inputs = _check_inputs(model, inputs)
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    ans = _answer_ids(model, inputs, tok, generate, answer)
    n_input, T = inputs["input_ids"].shape[1], len(ans)
    full = answer_inputs(model, inputs, ans[:-1])
    rows = [n_input - 1 + t for t in range(T)]
    if method == "rollout":
        expls = _rollout(model, full, rows, tok, options)
    else:
        expls = _copies(model, full, rows, ans, tok, method, options, size)
    return _collect(expls, ans, rows, n_input, tok, full["input_ids"][0].tolist(), method, options, images)


def _check_inputs(model: nn.Module, inputs: Any) -> dict:
    """The processor's output as a dict of one prompt (input_ids (1, n)); TypeError / ValueError otherwise."""
    if not hasattr(inputs, "keys") or "input_ids" not in inputs:
        raise TypeError(f"inputs must be the processor's output for one prompt (a dict with input_ids, pixel_values, "
                        f"...), got {_checks.describe(inputs)}")
    inputs = dict(inputs)
    ids = inputs["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.shape[0] != 1:
        raise ValueError("inputs['input_ids'] must be a (1, n) tensor: one prompt (explain its answer per prompt), got "
                         f"{tuple(getattr(ids, 'shape', ()))}")
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError("inputs['attention_mask'] has padding; give the prompt unpadded (one prompt per call)")
    n = ids.shape[1]
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and k not in ("input_ids", "attention_mask", *_PER_TOKEN) and \
                v.ndim == 2 and tuple(v.shape) == (1, n) and k != "image_sizes":
            raise ValueError(f"inputs[{k!r}] is one value per prompt token, which attnroll does not know how to extend "
                             "over the generated tokens; leave it out")
    return inputs


def answer_inputs(model: nn.Module, inputs: dict, ids: Sequence[int]) -> dict:
    """``inputs`` with the token ids ``ids`` appended to the prompt, as the model's generation extends them:
    attention_mask 1, token_type_ids the prompt's last value (PaliGemma: 1, its causal suffix), mm_token_type_ids
    0 (text)."""
    out = dict(inputs)
    base = inputs["input_ids"]
    add = torch.tensor([list(ids)], dtype=base.dtype, device=base.device).reshape(1, -1)
    out["input_ids"] = torch.cat([base, add], dim=1)
    k = add.shape[1]
    if isinstance(inputs.get("attention_mask"), torch.Tensor):
        m = inputs["attention_mask"]
        out["attention_mask"] = torch.cat([m, m.new_ones(1, k)], dim=1)
    from ..capture.vlm import GENERATED_TOKEN_TYPE

    own = GENERATED_TOKEN_TYPE.get(getattr(getattr(model, "config", None), "model_type", ""))
    for key, fill in _PER_TOKEN.items():
        v = inputs.get(key)
        if isinstance(v, torch.Tensor) and v.ndim == 2:
            val = own if own is not None and key == "token_type_ids" else (v[:, -1:] if fill is None else fill)
            out[key] = torch.cat([v, (v.new_zeros(1, k) + val)], dim=1)
    return out


def _answer_ids(model: nn.Module, inputs: dict, tok: Any, generate: int | None, answer: Any) -> list[int]:
    """The answer's ids: given (ids, or a text with a tokenizer) or generated greedily."""
    if (generate is None) == (answer is None):
        raise ValueError("give exactly one of generate=N (tokens to generate) and answer=token ids or text")
    if answer is not None:
        if isinstance(answer, str):
            if tok is None:
                raise ValueError("answer= as text needs tokenizer= (the processor or its tokenizer); or give token ids")
            answer = tok(answer, add_special_tokens=False)["input_ids"]
        ids = list(answer) if isinstance(answer, (list, tuple)) else None
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"answer must be a text or a non-empty list of token ids, got {answer!r}")
        return ids
    return prompts.greedy(model, inputs, generate)


def _rollout(model: nn.Module, inputs: dict, rows: list[int], tok: Any, options: dict) -> list[Explanation]:
    """rollout: one capture, the language rows in one sweep, each composed onto the images."""
    info = method_info("rollout")
    opts = check_options(info, options)
    ctx = Context(model, inputs, None, info, opts, tok)
    ctx.check_mixers()
    if qwen_vl.applies(model):
        return qwen_vl.explain_qwen_vl_rows(ctx, opts, rows)
    fuse = "mean" if isinstance(opts["head_fusion"], str) and opts["head_fusion"] == "mean" else None
    rec = ctx.record(fuse_heads=fuse)
    s = ctx.stream(rec)
    core = {k: opts[k] for k in ROLLOUT_OPTIONS if k not in ("protect_prefix", "return_layers")}
    core["head_fusion"] = None if fuse is not None else _checks.check_head_fusion(
        "head_fusion", opts["head_fusion"], allow_none=False)
    pp = prefix_default(opts["protect_prefix"], ctx.info(rec, s))
    R = core_rollout(rec.streams[s], rows=rows, attention_mask=ctx.mask(rec, s), protect_prefix=pp, **core)
    src = _vision_source(ctx, rec, core, opts["protect_prefix"])
    out = []
    for t, r in enumerate(rows):
        ctx.options, ctx.target_desc = {**opts, "position": r}, None
        ro = resolve_readout([r], batch=1, n=R.shape[-1], mask=None, source="position")
        out.append(ctx.build(rec, R[:, t], ro, s, source=src,
                             options={**opts, "position": r, "protect_prefix": pp, "attention": "dense"}))
    return out


def _vision_source(ctx: Context, rec: Any, core: dict, protect_prefix: Any) -> Any:
    """The ``source=`` of ``Context.build`` (as :func:`~attnroll.explain.rows.source_rows` makes it for rollout),
    with the vision stream rolled out once per (stream, layers) for all its rows and reused by every generated
    token's row (the vision relevance does not depend on the row): f(stream, readout, k) -> weights @ R."""
    full: dict = {}

    def rows(stream: str, readout: Any, k: int) -> torch.Tensor:
        if k == 0:  # the projector reads the embeddings: no vision layer mixes the tokens
            return readout.weights
        if (stream, k) not in full:
            n = rec.stream_shape(stream)[-1]
            pp = prefix_default(protect_prefix, ctx.info(rec, stream))
            full[(stream, k)] = core_rollout(list(rec.stream(stream))[:k], rows=list(range(n)),
                                             attention_mask=ctx.mask(rec, stream), protect_prefix=pp, **core)
        R = full[(stream, k)]
        return torch.einsum("bj,bjn->bn", readout.weights.to(device=R.device, dtype=R.dtype), R)

    return rows


def _copies(model: nn.Module, inputs: dict, rows: list[int], ans: list[int], tok: Any, method: str, options: dict,
            size: int) -> list[Explanation]:
    """gae / grad_rollout: per chunk of ``size`` generated tokens, the inputs copied once per token, copy b's
    target log p(answer_b | its prefix) at its row; one forward + backward per chunk."""
    from ..capture.vlm_maps import ONE_VISION_SEQUENCE
    from .explainer import explain

    if getattr(getattr(model, "config", None), "model_type", "") in ONE_VISION_SEQUENCE:
        size = 1  # all images of a call are one vision sequence: one prompt (one copy) per call
    out = []
    for lo in range(0, len(rows), size):
        r, tk = rows[lo:lo + size], ans[lo:lo + size]

        def target(outputs, r=r, tk=tk):  # copy b: log p(answer_b | its prefix)
            logits = outputs.logits[torch.arange(len(r)), torch.tensor(r)].float()
            return logits.log_softmax(dim=-1)[torch.arange(len(r)), torch.tensor(tk)]

        e = explain(model, _repeat(inputs, len(r)), method, target, tokenizer=tok, position=r, **options)
        out += [_take(e, b) for b in range(len(r))]
    return out


def _repeat(inputs: dict, B: int) -> dict:
    """Every tensor of one prompt's inputs repeated B times along its first axis, in blocks (the prompt's images,
    packed patches and sizes each once per copy, in order)."""
    return {k: torch.cat([v] * B) if isinstance(v, torch.Tensor) and v.ndim >= 1 else v for k, v in inputs.items()}


def _take(e: Explanation, b: int) -> dict:
    """Copy b of a batched Explanation: its maps, language row and shares."""
    return {"maps": _maps_of(e, b), "row": e.extra["language_row"][b], "image_share": float(e.extra["image_share"][b]),
            "text_share": float(e.extra["text_share"][b]), "positions": e.extra["image_positions"][b],
            "unplaced": float(e.full_row[b, : e.prefix].sum()) if "image_maps" not in e.extra else 0.0}


def _maps_of(e: Explanation, b: int) -> list[torch.Tensor]:
    """Example b's image maps: ``extra["image_maps"]`` (several images per prompt), else its one map on the grid."""
    if "image_maps" in (e.extra or {}):
        return [m.detach().to(torch.float32).cpu() for m in e.extra["image_maps"][b]]
    if e.grid is None:
        raise ValueError(f"the composed map of {e.method} has no grid to lay over the image")
    return [e.scores[b].detach().to(torch.float32).cpu().reshape(tuple(e.grid))]


def _collect(expls: list, ans: list[int], rows: list[int], n_input: int, tok: Any, ids: list[int], method: str,
             options: dict, images: Any) -> VLMGenerationAttribution:
    """The per-row results gathered into the attribution."""
    parts = [p if isinstance(p, dict) else _take(p, 0) for p in expls]
    n_src = n_input + len(ans) - 1
    matrix = torch.zeros(len(ans), n_src)
    for t, p in enumerate(parts):
        matrix[t, : rows[t] + 1] = p["row"].to(torch.float32)[: rows[t] + 1]
    from .prompts import answer_pieces

    tokens = _pieces(tok, ids[:n_input]) + (answer_pieces(tok, ans) if tok is not None else [f"#{i}" for i in ans])
    answer = tok.decode(ans, skip_special_tokens=True) if tok is not None else " ".join(map(str, ans))
    return VLMGenerationAttribution(
        answer, list(ans), matrix, sorted(set(parts[0]["positions"])), [p["maps"] for p in parts],
        torch.tensor([p["image_share"] for p in parts]), torch.tensor([p["text_share"] for p in parts]),
        torch.tensor([p["unplaced"] for p in parts]), tokens, n_input, method, dict(options),
        None if images is None else _as_list(images))


def _pieces(tok: Any, ids: list[int]) -> list[str]:
    """Readable text of each prompt token (its decoded piece; ``#id`` without a tokenizer)."""
    if tok is None:
        return [f"#{i}" for i in ids]
    return [tok.decode([i]) for i in ids]


def _as_list(images: Any) -> list:
    return list(images) if isinstance(images, (list, tuple)) else [images]


_make_callable(__name__)  # attnroll._callable: the module is callable as its function of the same name
