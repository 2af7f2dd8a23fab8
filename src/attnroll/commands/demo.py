"""``attnroll demo``: pictures from the embedded models, no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ._args import methods_list
from ._data import load
from ._group import cli
from ._output import Failure, echo_written, prepare_out, write
from ._text import explain_text

DEMO_METHODS = ("rollout", "gae", "grad_rollout", "raw", "flow")
DEMO_PAIR = ("A man is playing a guitar on stage.", "Someone performs music in front of an audience.")


def _text_page(out: Path) -> list[Path]:
    """The MiniLM sentence-pair page (rollout and gae); skipped with a message without the text extra."""
    from ..viz import print_tokens, tokens_html

    try:
        tm = load("minilm", None, "text")
    except Failure as e:
        click.echo(f"skipped the text page: {e.format_message()}")
        return []
    a, b = DEMO_PAIR
    special = set(tm.tokenizer.all_special_tokens)
    T: dict[str, Any] = {}
    for m in ("rollout", "gae"):
        for label, e in explain_text(tm, a, b, m, {}, None).items():
            T[f"{m}: {label}"] = e
    page = write(out / "minilm_pair.html", tokens_html(
        T, title="all-MiniLM-L6-v2: which words make these sentences similar",
        notes=f"'{a}' vs '{b}'. rollout: class-agnostic flow into the [CLS] row; gae: relevance for the "
              "cosine similarity of the mean-pooled sentence embeddings. Special tokens ([CLS], [SEP]) are "
              "left uncoloured and out of the scaling.", skip=special))
    click.echo("MiniLM pair, gae for the cosine similarity:")
    for label, e in T.items():
        if label.startswith("gae"):
            print_tokens(e, skip=special)
    return [page]


def _viewer_page(out: Path, E: dict, model: Any, x: Any, images: Any, masks: Any, rows: list[str]) -> Path:
    """The interactive page: every panel method with its per-layer rows, plus the per-head rollout."""
    from ..methods import explain
    from ..viz import view
    from .view import with_layers

    names = list(dict.fromkeys([*E, "per_head_rollout"]))
    opts = with_layers(names, {})
    full = {m: explain(model, x, m, **opts[m]) if opts[m] or m not in E else E[m] for m in names}
    page = view(full, images, masks=masks, labels=rows, title="attnroll demo: the embedded shapes ViT",
                notes="true → predicted class; white outline = ground-truth object. Move the layer slider, "
                      "switch methods, point at a patch for its value, open 'per head'.")
    return write(out / "viewer.html", page.html)


@cli.command("demo", short_help="Pictures from the embedded models into ./attnroll-demo/.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-demo"), show_default=True,
              help="Output folder (created).")
@click.option("--images", "n_images", default=4, show_default=True, type=click.IntRange(1, 16),
              help="How many generated images.")
@click.option("--seed", default=7, show_default=True, type=click.IntRange(0), help="Seed of the generated images.")
@click.option("--methods", "method_list", default=",".join(DEMO_METHODS), show_default=True,
              help="Comma-separated methods of the panel.")
@click.option("--text/--no-text", default=True, show_default=True,
              help="Also the MiniLM sentence-pair page (when the text extra is installed).")
def demo_cmd(out, n_images, seed, method_list, text) -> None:
    """Pictures from the embedded models, no download: a panel of several methods on generated shape images
    with the ground-truth outline, the per-layer rollout and per-head maps, one interactive viewer page
    (viewer.html: layer slider, method switcher, per-head grid, values under the pointer), and (text extra)
    an HTML page of token maps for a sentence pair. Prints the paths it wrote."""
    import torch

    from ..methods import explain
    from ..models import shapes
    from ..viz import panel, plot_heads, plot_layers

    names = methods_list(method_list)
    out = prepare_out(out)
    lm = load("shapes", None, "image")
    images, labels, masks = shapes.make_dataset(n_images, seed)
    x = shapes.preprocess(images)
    with torch.no_grad():
        pred = lm.model(pixel_values=x).logits.argmax(-1)
    E = {m: explain(lm.model, x, m) for m in names}
    rows = [f"{shapes.CLASSES[int(y)]} → {shapes.CLASSES[int(p)]}" for y, p in zip(labels, pred)]
    written = [write(out / "shapes_panel.png", panel(E, images, outlines=masks, row_labels=rows, cell=150))]
    lay = explain(lm.model, x[:1], "rollout", return_layers=True)
    written.append(write(out / "shapes_layers.png", plot_layers(lay, images[0], cell=130)))
    heads = explain(lm.model, x[:1], "per_head_rollout")
    written.append(write(out / "shapes_heads.png", plot_heads(heads, images[0], cell=130)))
    written.append(_viewer_page(out, E, lm.model, x, images, masks, rows))
    acc = float((pred == labels).float().mean())
    click.echo(f"shapes ViT: {n_images} generated images (seed {seed}), {acc:.0%} classified right; methods: "
               f"{', '.join(names)}; white outline = ground-truth object")
    if text:
        written += _text_page(out)
    echo_written(written)
