"""``attnroll view``: explain images or a text with several methods and write one interactive viewer page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ._args import method_options, methods_list, parse_target
from ._data import check_inputs, echo_notes, expand_images, input_options, load_for, read_image
from ._default import announce, check_early, default_choice
from ._group import cli
from ._output import output_file, prepare_out, write
from ._text import explain_text, shown

#: Methods the page shows beside the model kind's default (attnroll.explain.defaults), for comparison.
DEFAULT_METHODS = {"image": "rollout,gae,per_head_rollout", "text": "rollout,gae"}


def with_layers(names: list[str], options: dict[str, dict]) -> dict[str, dict]:
    """Each method's options, plus ``return_layers=True`` for the methods that have per-layer rows (the
    viewer's layer slider)."""
    from ..methods import check_options

    out = {}
    for m in names:
        o = dict(options.get(m, {}))
        try:
            check_options(m, {**o, "return_layers": True})
            o.setdefault("return_layers", True)
        except ValueError:
            pass  # flow, Captum baselines...: no per-layer product, the page shows their final map only
        out[m] = o
    return out


def _image_page(files: list[Path], lm: Any, names: list[str], opts: dict, tgt: Any) -> Any:
    import torch

    from ..methods import explain
    from ..viz import view

    pics = [read_image(f) for f in files]
    x = torch.cat([lm.prepare_image(p) for p in pics])
    E = {m: explain(lm.model, x, m, tgt, **opts[m]) for m in names}
    first = next(iter(E.values()))
    targets = first.target if isinstance(first.target, list) else [first.target] * len(files)
    labels = [f"{f.name} · target {lm.label(t)}" for f, t in zip(files, targets)]
    return view(E, pics, labels=labels, title=f"attnroll: {lm.name}", notes=f"methods: {', '.join(names)}")


def _text_page(lm: Any, text: str, pair: str | None, names: list[str], opts: dict, tgt: Any) -> Any:
    from ..viz import view

    sections: dict[str, dict] = {}
    for m in names:
        for label, e in explain_text(lm, text, pair, m, opts[m], tgt).items():
            sections.setdefault(label, {})[m] = e
    special = set(getattr(lm.tokenizer, "all_special_tokens", ()) or ())
    notes = (f"text: {shown(text)}" + (f" | pair: {shown(pair)}" if pair else "")
             + "; special tokens are left uncoloured")
    group = next(iter(sections.values())) if len(sections) == 1 else sections
    return view(group, skip=special, title=f"attnroll: {lm.name}", notes=notes)


def _has_class_scores(lm: Any, text: str) -> bool:
    """Whether a text model gives class scores (logits) for ``text``: without them a gradient method needs a
    scalar to explain (``--pair``: the similarity of two sentences)."""
    import torch

    from ..capture.outputs import main_logits

    with torch.no_grad():
        return main_logits(lm.model(**lm.tokenizer([text], return_tensors="pt"))) is not None


def default_methods(lm: Any, kind: str, text: str | None, pair: str | None) -> tuple[list[str], Any]:
    """No ``-m``: the model kind's measured default first, then :data:`DEFAULT_METHODS`; and the choice."""
    choice = default_choice(lm, text=text, pairs=pair is not None)
    return [choice.method] + [m for m in methods_list(DEFAULT_METHODS[kind]) if m != choice.method], choice


def applicable_defaults(names: list[str], lm: Any, text: str | None, pair: str | None) -> tuple[list[str], str]:
    """The default methods that apply to this model, and the note that says what was left out ("" when
    nothing): a text model with no class scores and no ``--pair`` has no scalar for the gradient methods."""
    from ..methods import method_info

    if text is None or pair is not None or _has_class_scores(lm, text):
        return names, ""
    kept = [m for m in names if not method_info(m).needs_grad]
    dropped = [m for m in names if m not in kept]
    if not dropped:
        return names, ""
    return kept, (f"note: {', '.join(dropped)} left out of the default methods: {lm.name} has no class scores, "
                  "so there is no scalar to explain; give --pair TEXT (the similarity of two sentences) to add "
                  f"{'it' if len(dropped) == 1 else 'them'}")


def _page_name(name: str | None, stem: str) -> str:
    """The page's file name: ``--name`` (".html" added unless it ends in .html / .htm) or ``<stem>.view.html``,
    its stem made a safe file name (:func:`attnroll._names.safe_name`)."""
    from .._names import safe_name

    if name is None:
        return f"{safe_name(stem)}.view.html"
    for ext in (".html", ".htm"):
        if name.lower().endswith(ext):
            return safe_name(name[: -len(ext)]) + ext
    return safe_name(name) + ".html"


def _answer_page(images, text, pair, model_spec, weights, method_list, options, target, out, name, generate) -> None:
    """``view IMAGE... --text PROMPT --generate N``: a vision-language model's answer, per generated token."""
    from ._vlm_answer import check_vlm_request, explain_vlm_answer

    if not images:
        raise click.UsageError("view --generate needs IMAGE... and --text (a vision-language model's prompt); for a "
                               "text decoder use attnroll context --per-token")
    if name is not None and (not name.strip() or "/" in name):
        raise click.UsageError(f"--name must be a file name (no folder), got {name!r}")
    method = check_vlm_request(images, text, pair, target, method_list, ("html",))
    written = explain_vlm_answer(images, text, method, options, model_spec, weights, out, generate, ("html",), 3,
                                 name=None if name is None else _page_name(name, ""))
    click.echo(f"wrote {written[0]}")


@cli.command("view", short_help="One interactive HTML page: layers, methods, heads, values under the pointer.")
@input_options
@click.option("--methods", "-m", "method_list", metavar="METHODS",
              help="Comma-separated methods [default: the measured default of the model's kind (printed; "
                   "attnroll.explain.defaults, see EVALUATION.md), then rollout,gae,per_head_rollout for images, "
                   "rollout,gae for text; gae is left out for a sentence encoder without --pair (no scalar)].")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE",
              help="A method option, repeatable: -o alpha=0.9 (every method that takes it) or -o gae.alpha=0.9.")
@click.option("--target", help="Class index or name to explain (default: the predicted class).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-view"), show_default=True,
              help="Output folder (created).")
@click.option(
    "--name", help="File name of the page [default: <first image stem>.view.html or <first words>.view.html]."
)
@click.option("--generate", type=click.IntRange(1), metavar="N",
              help="With IMAGE... and --text PROMPT, a vision-language model: generate N tokens and show each one's "
                   "map over every image and its scores over the prompt (click an answer token); one method.")
def view_cmd(images, text, pair, model_spec, weights, method_list, options, target, out, name, generate) -> None:
    """Explain IMAGE... (files or folders) or --text TEXT [--pair TEXT] with every method of --methods and
    write ONE self-contained HTML page: no network, opens from file:// and offline. Images: the map over the
    picture (opacity, colours), a layer slider, a method switcher, per-head maps, the value under the pointer.
    Text: tokens coloured by relevance, values on hover.

    \b
    Examples:
      attnroll view photos/ --model ./vit-base-local -m rollout,gae
      attnroll view --text "A man plays guitar." --pair "Someone makes music."
      attnroll view photo.jpg --model ./qwen2-vl-local --text "Describe the picture." --generate 16
    """
    from .explain import slug

    if generate is not None:
        _answer_page(images, text, pair, model_spec, weights, method_list, options, target, out, name, generate)
        return

    kind = check_inputs(images, text, pair)
    names = methods_list(method_list) if method_list is not None else None
    opts = with_layers(names, method_options(options, names)) if names is not None else None
    if names is None:
        check_early(options)
    files = expand_images(images) if kind == "image" else []
    for f in files:  # every input is checked before anything is written
        read_image(f)
    if name is not None and (not name.strip() or "/" in name):
        raise click.UsageError(f"--name must be a file name (no folder), got {name!r}")
    out = prepare_out(out)
    lm = load_for(model_spec, weights, kind)
    tgt = parse_target(target, lm)
    note, choice = "", None
    if method_list is None:
        names, choice = default_methods(lm, kind, text, pair)
        names, note = applicable_defaults(names, lm, text, pair)
        opts = with_layers(names, method_options(options, names))
    if kind == "image":
        page = _image_page(files, lm, names, opts, tgt)
        stem = files[0].stem + (f"+{len(files) - 1}" if len(files) > 1 else "")
    else:
        page = _text_page(lm, text, pair, names, opts, tgt)
        stem = slug(text)
    path = write(output_file(out, _page_name(name, stem)), page.html)
    echo_notes(model_spec, lm)
    announce(choice)
    if note:  # after the work: a failure stays one error line
        click.echo(note, err=True)
    click.echo(f"wrote {path} ({page.nbytes:,} bytes; methods {', '.join(names)})")
