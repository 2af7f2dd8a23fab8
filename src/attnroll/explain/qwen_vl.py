"""Image maps of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, composed on the matrix-free route (``rollout``, ``raw``,
``grad_rollout``, ``gae``; other methods refuse, naming why).

For prompt b, the readout's row r (B, n_l) (the last real token by default; ``position=`` another row, e.g. a
generated token's, whose next-token logit is the target) is carried down the language model from the
kernels' queries and keys (:func:`attnroll.core.operators.rollout_rows`). Each image token's share r[b, p_k]
then goes to merged token k of the vision tower, and from there to its m = spatial_merge_size² patches
(:func:`attnroll.core.chunked.spread`): equal shares (¼ for 2×2), a convention as rollout's α = ½ is — the
PatchMerger is an MLP of the concatenated patches, so no patch's measured share exists without a further
rule. Qwen3-VL's deepstack mergers read the tower after the blocks ``deepstack_visual_indexes`` and add to
the same image tokens: the token's share is split equally between the final merger and each deepstack
merger, each part entering the tower's rollout at the layer its merger reads (another stated convention).
The vision tower is rolled out chunk by chunk (:mod:`attnroll.core.chunked`: per image, per window for
Qwen2.5-VL's windowed layers), the window order undone, and each image's patches laid on its own
(grid_h, grid_w) grid: the processor resized the image to (grid_h·patch, grid_w·patch) pixels keeping its
aspect ratio, so the grid stretched over the original image is the map in its coordinates.

Shares: each image's map sums to its image tokens' share of r (rescaled to it, as
:func:`attnroll.core.multimodal.push_through` does, for gradient rules whose rows do not keep their sum);
``extra["image_share"] + extra["text_share"]`` = the row's total, 1 for rollout.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks
from ..capture.qwen_family import is_qwen_vl
from ..capture.qwen_vl import QwenRecord, attach_gradients, capture_qwen_vl, vision_layers
from ..capture.readout import Readout, resolve_readout
from ..core import multimodal, operators
from ..core.chunked import apply_chunked, chunked_rows, spread
from ..core.rollout import LayerPipeline, layer_range
from .context import Context
from .explanation import Explanation
from .target_scores import require_grad_mode, resolve_target

__all__ = ["applies", "explain_qwen_vl", "explain_qwen_vl_rows", "METHODS", "MERGER"]

#: The methods composed for these models.
METHODS = ("rollout", "raw", "grad_rollout", "gae")
#: How a merged token's relevance reaches its patches (recorded in ``extra["merger"]``).
MERGER = "uniform: each language image token passes 1/m of its share to each of its m = merge² patches"


def applies(model: Any) -> bool:
    """Whether ``model`` is explained here (a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model)."""
    return is_qwen_vl(model)


def _refuse(ctx: Context, opts: dict) -> None:
    """ValueError for a method or option this route does not compose, naming why."""
    name, model = ctx.method.name, type(ctx.model).__name__
    if name not in METHODS:
        raise ValueError(
            f"method {name!r} does not compose the streams of {model}: its vision attention is recomputed per "
            "image chunk / window from the kernels' queries and keys (no dense matrices, no layer anatomy of its "
            f"vision blocks), and only the row methods {', '.join(METHODS)} are composed through chunks and the "
            "patch merger")
    for k in ("discard_ratio", "top_k", "threshold"):
        if opts.get(k):
            raise ValueError(f"{k}={opts[k]!r} sparsifies whole attention matrices, which {model}'s vision tower "
                             "never forms (chunked kernels); use the method without it")
    bad = {"return_layers": opts.get("return_layers"), "stream": opts.get("stream"),
           "attention": opts.get("attention") == "dense"}
    why = {"return_layers": "the partial products live on the language tokens, the map on the image patches",
           "stream": "the composed map is the only output (image maps + text scores in extra)",
           "attention": "its vision kernels return no probabilities, so there is no dense route"}
    for k, v in bad.items():
        if v:
            raise ValueError(f"{k}={opts[k]!r} is not available for {model} ({why[k]}); leave it at its default")


def _rules(name: str, opts: dict) -> tuple[Any, float, float, bool]:
    """(block rule, a, c, renorm) of the method."""
    if name == "raw":
        return operators.fused_probs(opts["head_fusion"]), 1.0, 0.0, False
    if name == "rollout":
        how = _checks.check_head_fusion("head_fusion", opts["head_fusion"], allow_none=False)
        rule, alpha, mode = operators.fused_probs(how), opts["alpha"], opts["residual_mode"]
    elif name == "grad_rollout":
        _checks.check_choice("clamp", opts["clamp"], ("per_head", "after_mean"))
        rule, alpha, mode = operators.weighted_probs(opts["clamp"]), opts["alpha"], opts["residual_mode"]
    else:
        rule, alpha, mode = operators.weighted_probs("per_head"), 0.5, "add"
    pipe = LayerPipeline(2, head_fusion=None, alpha=alpha, residual_mode=mode)  # validates, gives a and c
    return rule, pipe.a, pipe.c, pipe.renorm


def explain_qwen_vl(ctx: Context, opts: dict) -> Explanation:
    """The composed Explanation (see the module docstring)."""
    _refuse(ctx, opts)
    name = ctx.method.name
    grad = name in ("grad_rollout", "gae")
    if grad:
        require_grad_mode(name)
    rule, a, c, renorm = _rules(name, opts)
    rec = capture_qwen_vl(ctx.model, ctx.inputs, keep_grad=grad)
    B, _, n, _ = rec.language[0].shape
    readout = _readout(ctx, rec, B, n)
    pos = readout.positions() or _last(rec, B, n)
    with torch.enable_grad() if grad else torch.no_grad():
        y, target = resolve_target(rec.outputs, ctx.target, positions=pos)
    if grad:
        attach_gradients(rec, y)
    row = _language_row(ctx, rec, readout, rule, a, c, renorm, name, opts)
    if rec.geometry is None:  # no image in the call: the prompt's tokens alone
        return _text(ctx, rec, row, readout, target)
    return _build(ctx, rec, row, readout, target, _vision_fn(rec, rule, a, c, renorm, raw=name == "raw"))


def explain_qwen_vl_rows(ctx: Context, opts: dict, rows: list[int]) -> list[Explanation]:
    """One Explanation per language row in ``rows`` of prompt 0 (rollout / raw: no target gradient), from one
    capture, one sweep of the language model and one of the vision tower for all rows; each equals
    ``position=`` that row."""
    _refuse(ctx, opts)
    name = ctx.method.name
    if name not in ("rollout", "raw"):
        raise ValueError(f"several rows in one sweep are for gradient-free methods (rollout, raw), not {name!r}")
    rule, a, c, renorm = _rules(name, opts)
    rec = capture_qwen_vl(ctx.model, ctx.inputs, keep_grad=False)
    n = rec.language[0].shape[-1]
    E = torch.zeros(1, len(rows), n)
    E[0, torch.arange(len(rows)), torch.tensor(rows)] = 1.0
    R = _language_rows(rec, E, rule, a, c, renorm, name, opts)
    V = None
    if rec.geometry is not None:  # every row's vision relevance in one chunked sweep of the tower
        V = _vision_fn(rec, rule, a, c, renorm, raw=name == "raw")(R[0][:, rec.position[rec.example == 0]])
    out = []
    for t, r in enumerate(rows):
        readout = resolve_readout([r], batch=1, n=n, mask=rec.mask, source="the language model's next-token logit "
                                  "at the explained row")
        with torch.no_grad():
            _, target = resolve_target(rec.outputs, ctx.target, positions=[r])
        row = R[:1, t]
        out.append(_text(ctx, rec, row, readout, target) if V is None else
                   _build(ctx, rec, row, readout, target, lambda W, v=V[t]: v))
    return out


def _last(rec: QwenRecord, B: int, n: int) -> list[int]:
    if rec.mask is None:
        return [n - 1] * B
    return [int(m.nonzero().max()) if bool(m.any()) else n - 1 for m in rec.mask]


def _readout(ctx: Context, rec: QwenRecord, B: int, n: int) -> Readout:
    spec = ctx.options.get("readout")
    if spec is None:
        spec = ctx.options.get("position")
    if spec is None:
        spec = "last"
    return resolve_readout(spec, batch=B, n=n, mask=rec.mask, source="the language model's next-token logit at "
                           "the explained row (last real token unless position= / readout=)")


def _language_row(ctx: Context, rec: QwenRecord, readout: Readout, rule: Any, a: float, c: float, renorm: bool,
                  name: str, opts: dict) -> torch.Tensor:
    """(B, n_l) the readout's row carried down the language model (raw: one layer's row)."""
    return _language_rows(rec, readout.weights[:, None, :], rule, a, c, renorm, name, opts)[:, 0]


def _language_rows(rec: QwenRecord, E: torch.Tensor, rule: Any, a: float, c: float, renorm: bool, name: str,
                   opts: dict) -> torch.Tensor:
    """(B, r, n_l): the rows E (B, r, n_l) carried down the language model in one sweep."""
    layers = rec.language
    if name == "raw":
        k = _checks.check_index("layer", opts["layer"], len(layers), "layers")
        start, end = k, k + 1
    else:
        start, end = layer_range(len(layers), opts["start_layer"], opts["end_layer"])
    mask = rec.mask
    mask = None if mask is None or bool(mask.all()) else mask.to(layers[0].device).bool()
    E = E.to(device=layers[0].device, dtype=torch.float32)
    R = operators.rollout_rows(layers, E, rule, a=a, c=c, renorm=renorm, mask=mask, start=start, end=end)
    return R.detach().float().cpu()


def _vision_fn(rec: QwenRecord, rule: Any, a: float, c: float, renorm: bool, raw: bool) -> Any:
    """f(W (K,) shares of the merged tokens) -> (N,) relevance of the vision tokens, original order; W (R, K):
    R rows in one sweep -> (R, N)."""

    def carry(W: torch.Tensor) -> torch.Tensor:
        one = W.ndim == 1
        W = W[None] if one else W
        geo, layers = rec.geometry, vision_layers(rec)
        L = len(layers)
        reads = [L - 1, *[k for k in rec.deepstack if 0 <= k < L]]  # the layers each merger reads after
        N = geo.tower_of.numel()
        dev = layers[0].chunks[0].layer.device
        base = spread(W.to(dev, torch.float32) / len(reads), geo.units.to(dev), N)[None]  # (1, R, N)
        if raw:  # each merger's part through the attention of the layer it reads
            v = sum(apply_chunked(base, layers[k], rule, a=1.0, c=0.0) for k in reads)
        else:
            v = chunked_rows(layers, base, rule, a=a, c=c, renorm=renorm,
                             inject={k: base for k in reads[1:]})
        out = v[0].detach().float().cpu()[:, geo.tower_of]
        return out[0] if one else out

    return carry


def _image_maps(rec: QwenRecord, row: torch.Tensor, carry: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(one (grid_h, grid_w) map per image, each summing to its share; the shares (n_images,))."""
    geo = rec.geometry
    K, m = geo.units.shape
    W = row[rec.example, rec.position]  # (K,) shares of the merged tokens, language order
    item_k = geo.item[torch.arange(K) * m]  # the image of each merged token
    totals = torch.zeros(len(geo.grids)).index_add_(0, item_k, W)
    v = carry(W)
    sums = torch.zeros(len(geo.grids)).index_add_(0, geo.item, v)
    maps = []
    for i, (_, h, w) in enumerate(geo.grids):
        idx = (geo.item == i).nonzero()[:, 0]
        grid = torch.zeros(h * w)
        grid[geo.hw[idx, 0] * w + geo.hw[idx, 1]] = v[idx]
        s = float(sums[i])
        maps.append((grid * (float(totals[i]) / s) if s != 0 else grid * 0).reshape(h, w))
    return maps, totals


def _build(ctx: Context, rec: QwenRecord, row: torch.Tensor, readout: Readout, target: Any,
           carry: Any) -> Explanation:
    B, n = row.shape
    if rec.mask is not None:
        row = torch.where(rec.mask.bool(), row, torch.zeros(()))
    maps, totals = _image_maps(rec, row, carry)
    geo = rec.geometry
    K, m = geo.units.shape
    owners = multimodal.item_examples(rec.example, geo.item[torch.arange(K) * m], len(maps))
    per = [[i for i, o in enumerate(owners) if o == b] for b in range(B)]
    flat = [torch.cat([maps[i].reshape(-1) for i in ids]) if ids else torch.zeros(0) for ids in per]
    width = max(int(f.numel()) for f in flat)
    scores = torch.stack([torch.nn.functional.pad(f, (0, width - f.numel())) for f in flat])
    grids = {tuple(maps[i].shape) for i in range(len(maps))}
    one = all(len(ids) == 1 for ids in per) and len(grids) == 1
    text = multimodal.unlinked(row, rec.example, rec.position)
    patch = int(getattr(ctx.model.config.vision_config, "patch_size", 0))
    extra = {
        "language_row": row, "text_scores": text, "image_share": totals.new_tensor(
            [float(totals[ids].sum()) if ids else 0.0 for ids in per]), "text_share": text.sum(dim=-1),
        "image_positions": [rec.position[rec.example == b].tolist() for b in range(B)],
        "image_maps": [[maps[i] for i in ids] for ids in per],
        "image_grids": [[list(maps[i].shape) for i in ids] for ids in per],
        "image_pixels": [[[maps[i].shape[0] * patch, maps[i].shape[1] * patch] for i in ids] for ids in per],
        "merger": MERGER, "deepstack_layers": list(rec.deepstack),
    }
    tok = ctx.tokenizer
    tokens = None if tok is None else [tok.convert_ids_to_tokens(ids) for ids in rec.input_ids.tolist()]
    return Explanation(
        scores=scores, full_row=scores.clone(), tokens=tokens, grid=next(iter(grids)) if one else None, prefix=0,
        method=ctx.method.name, options={**ctx.options, "attention": "recompute"}, target=target,
        positions=readout.positions(), extra=extra, readout=readout.describe(),
        readout_weights=readout.weights.detach().cpu(),
    )


def _text(ctx: Context, rec: QwenRecord, row: torch.Tensor, readout: Readout, target: Any) -> Explanation:
    """A call without an image: the language row over the prompt's tokens (padding 0)."""
    if rec.mask is not None:
        row = torch.where(rec.mask.bool(), row, torch.zeros(()))
    tok = ctx.tokenizer
    return Explanation(
        scores=row.clone(), full_row=row, tokens=None if tok is None else [
            tok.convert_ids_to_tokens(ids) for ids in rec.input_ids.tolist()],
        method=ctx.method.name, options={**ctx.options, "attention": "recompute"}, target=target,
        positions=readout.positions(), attention_mask=rec.mask, extra={"language_row": row},
        readout=readout.describe(), readout_weights=readout.weights.detach().cpu(),
    )
