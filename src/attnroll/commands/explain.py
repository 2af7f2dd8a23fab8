"""``attnroll explain``: explain images (files or folders) or a text [and a pair]; write one file per input
and format, print each input's top units."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import click

from .._names import safe_name
from ._args import method_and_options, method_options, methods_list, parse_options, parse_target
from ._data import check_cmap, check_inputs, echo_notes, expand_images, input_options, load_for, read_image
from ._default import announce, check_early, chosen_options, default_choice
from ._group import cli
from ._output import Failure, one_line, output_file, png_bytes, prepare_out, progress, save_npz, write
from ._text import explain_text, shown, slug

FORMATS = ("png", "html", "json", "npz")


def top_units(expl: Any, k: int, skip: Any = ()) -> str:
    """The k highest-scoring units of example 0: tokens (those in ``skip`` left out), or patches as (row, col)."""
    import torch

    s = expl.scores[0].to(torch.float64)
    if expl.attention_mask is not None:
        s = torch.where(expl.attention_mask[0, expl.prefix:].bool(), s, torch.full_like(s, float("-inf")))
    if expl.tokens is not None and skip:
        toks = expl.tokens[0][expl.prefix:]
        keep = torch.tensor([t not in skip for t in toks[: s.numel()]] + [True] * max(0, s.numel() - len(toks)))
        s = torch.where(keep, s, torch.full_like(s, float("-inf")))
        k = min(k, int(torch.isfinite(s).sum()))
    vals, idx = torch.topk(s, min(k, s.numel()))
    parts = []
    for v, i in zip(vals.tolist(), idx.tolist()):
        if expl.grid is not None:
            parts.append(f"({i // expl.grid[1]},{i % expl.grid[1]}) {v:.3g}")
        else:
            tok = expl.tokens[0][expl.prefix + i] if expl.tokens else f"#{i}"
            parts.append(f"{tok} {v:.3g}")
    return ", ".join(parts)


def json_record(expl: Any, source: str, lm: Any) -> dict:
    """Example 0 of an Explanation as the JSON record ``--format json`` writes."""
    from ..explain.explanation import jsonable

    rec = {
        "input": source,
        "model": lm.name,
        "method": expl.method,
        "options": jsonable(expl.options),
        "target": jsonable(expl.target),
        "target_label": lm.label(expl.target),
        "grid": list(expl.grid) if expl.grid is not None else None,
        "prefix": expl.prefix,
        "scores": expl.scores[0].tolist(),
    }
    if expl.tokens is not None:
        rec["tokens"] = list(expl.tokens[0][expl.prefix:])
    return rec


def _image_html(title: str, overlay_img: Any, expl: Any, lm: Any) -> str:
    data = base64.b64encode(png_bytes(overlay_img)).decode("ascii")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body style='font-family:system-ui,sans-serif;margin:24px'>"
        f"<h1 style='font-size:1.2em'>{html.escape(title)}</h1>"
        f"<p>model {html.escape(lm.name)}, method {html.escape(expl.method)}, "
        f"target {html.escape(lm.label(expl.target))}</p>"
        f"<img alt='overlay' style='image-rendering:auto;max-width:100%' src='data:image/png;base64,{data}'>"
        f"{expl.to_html(0)}</body></html>\n"
    )


def distinct_stems(files: list[Path]) -> None:
    """Two different input files must not write the same output file (``a/x.png`` and ``b/x.png``; ``x.png``
    and ``X.png`` on a case-insensitive disk): a usage error naming them, before anything is written."""
    seen: dict[str, Path] = {}
    for f in files:
        key = safe_name(f.stem).lower()
        other = seen.setdefault(key, f)
        if other != f and other.resolve() != f.resolve():
            raise click.UsageError(f"{other} and {f} would write the same output files ({safe_name(f.stem)}.*); "
                                   "explain them into separate --out folders")


def _parse_formats(ctx: Any, param: Any, value: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for v in value:
        for f in v.split(","):
            f = f.strip().lower()
            if f not in FORMATS:
                raise click.BadParameter(f"{f!r} is not one of {', '.join(FORMATS)}")
            if f not in out:
                out.append(f)
    return tuple(out)


def _explain_texts(lm: Any, text: str, pair: str | None, method: str, opts: dict, tgt: Any, out: Path,
                   formats: tuple[str, ...], top: int) -> list[Path]:
    E = explain_text(lm, text, pair, method, opts, tgt)
    stem = f"{safe_name(slug(text))}.{safe_name(method)}"
    special = set(getattr(lm.tokenizer, "all_special_tokens", ()) or ())
    for label, e in E.items():
        click.echo(f"{label}: {method} target={lm.label(e.target)}  top tokens: {top_units(e, top, special)}")
    written: list[Path] = []
    if "html" in formats:
        from ..viz import tokens_html

        notes = (f"text: {shown(text)}" + (f" | pair: {shown(pair)}" if pair else "")
                 + "; special tokens are left uncoloured and out of the scaling")
        page = tokens_html(E, title=f"attnroll {method}: {lm.name}", notes=notes, skip=special)
        written.append(write(output_file(out, f"{stem}.html"), page))
    if "json" in formats:
        recs = {label: json_record(e, label, lm) for label, e in E.items()}
        written.append(write(output_file(out, f"{stem}.json"), json.dumps(recs, indent=1)))
    if "npz" in formats:
        for i, e in enumerate(E.values()):
            e.extra = {**(e.extra or {}), "model": lm.name}
            written.append(save_npz(e, output_file(out, f"{stem}.npz" if i == 0 else f"{stem}.pair.npz")))
    return written


def _overlay_size(size: int | None, img: Any) -> tuple[int, int] | None:
    """``--size``: the longer side of the overlay in pixels, the other one keeping the image's aspect."""
    if size is None:
        return None
    # At least one pixel on the short side: a 1x400 strip at --size 16 is 16x1, not 16x0.
    if img.width >= img.height:
        return size, max(1, round(size * img.height / img.width))
    return max(1, round(size * img.width / img.height)), size


def _explain_image(f: Path, lm: Any, method: str, opts: dict, tgt: Any, out: Path, formats: tuple[str, ...],
                   top: int, look: dict) -> list[Path]:
    from ..methods import explain
    from ..viz import overlay

    img = read_image(f)
    e = explain(lm.model, lm.prepare_image(img), method, tgt, **opts)
    e.extra = {**(e.extra or {}), "model": lm.name}  # the file says which model made the map
    stem = f"{safe_name(f.stem)}.{safe_name(method)}"
    if top:
        click.echo(f"{f}: {method} target={lm.label(e.target)}  top patches (row,col): {top_units(e, top)}")
    ov = None
    if "png" in formats or "html" in formats:
        ov = overlay(e, img, cmap=look["cmap"], alpha=look["alpha"], size=_overlay_size(look["size"], img))
    written: list[Path] = []
    if "png" in formats:
        meta = {"attnroll:model": lm.name, "attnroll:method": method, "attnroll:target": lm.label(e.target)}
        written.append(write(output_file(out, f"{stem}.png"), png_bytes(ov, meta)))
    if "html" in formats:
        written.append(write(output_file(out, f"{stem}.html"), _image_html(f"{f.name}: {method}", ov, e, lm)))
    if "json" in formats:
        written.append(write(output_file(out, f"{stem}.json"), json.dumps(json_record(e, str(f), lm), indent=1)))
    if "npz" in formats:
        written.append(save_npz(e, output_file(out, f"{stem}.npz")))
    return written


def _generate(images, text, pair, target, formats, method, options, model_spec, weights, out, generate, unit,
              segments, top) -> None:
    """``explain --generate N``: checks, then context attribution of the generated answer."""
    if images or text is None or pair is not None or target is not None:
        raise click.UsageError("--generate needs --text (a prompt or a prompt file), without IMAGE..., "
                               "--pair or --target (the generated answer is the target)")
    if any(f != "json" for f in formats):
        raise click.UsageError("--generate writes json (the ranked units); other formats are not available")
    if method is not None and method not in GENERATE_METHODS:
        raise click.UsageError(f"--generate takes one method, -m {', '.join(GENERATE_METHODS)}, got {method!r}")
    # attn_grad / gate_grad are context attribution's own methods (no `explain` method): it checks their options
    opts = (parse_options(options) if method in (None, "attn_grad", "gate_grad", "checked")
            else method_and_options(method, options))
    prompt = text  # --text: a file's text was read when the option was parsed
    out = prepare_out(out)
    lm = load_for(model_spec, weights, "text")
    written = _context_attribution(lm, prompt, generate, method, opts, unit, segments, out, top)
    echo_notes(model_spec, lm)
    click.echo(f"wrote {len(written)} file to {out}/")


def _context_attribution(lm: Any, prompt: str, generate: int, method: str | None, opts: dict, unit: str,
                         segments: tuple[str, ...], out: Path, top: int) -> list[Path]:
    """``--generate N``: generate the answer, print it and the prompt's units ranked by share; write JSON."""
    from ..explain.context_attribution import context_attribution

    try:
        ca = context_attribution(lm.model, lm.tokenizer, prompt, generate=generate, unit=unit,
                                 segments=list(segments) or None, method=method, **opts)
    except (TypeError, ValueError) as e:
        raise Failure(one_line(str(e))) from None
    click.echo(f"answer ({len(ca.answer_ids)} tokens): {ca.answer}")
    method = ca.method  # the default resolved: checked where its gates apply, else attn_grad (warned)
    click.echo(f"prompt {ca.unit} ranked by share of the answer's {method} relevance:")
    click.echo(ca.table(top=top or None))
    rec = {"model": lm.name, "method": method, "options": opts, "unit": ca.unit, "answer": ca.answer,
           "answer_ids": ca.answer_ids, "total": ca.total,
           "units": [{**u, "span": list(u["span"]) if u["span"] else None} for u in ca.units]}
    return [
        write(
            output_file(out, f"{safe_name(slug(prompt))}.context.{safe_name(method)}.json"), json.dumps(rec, indent=1)
        )
    ]


#: The methods of ``--generate`` (context attribution's), its default first: measured on SmolLM2 against exact
#: leave-one-out (EVALUATION.md, "Context attribution on SmolLM2-135M-Instruct").
GENERATE_METHODS = ("checked", "gate_grad", "attn_grad", "gae", "grad_rollout", "rollout")


def _decoder_default() -> None:
    """``--generate`` without ``-m``: None, context attribution's measured default (``attnroll context``'s too):
    checked (gate_grad's ranking, its top passages verified by exact leave-one-out) where the gates apply to the
    model, else attn_grad (warned)."""
    return None


def _methods_and_options(method: str, options: tuple[str, ...]) -> tuple[list[str], dict[str, dict]]:
    """``-m`` (one method, or several comma-separated, as ``view`` / ``batch`` / ``evaluate`` take them) and
    the ``-o`` options of each: a usage error for an unknown method or an option no method takes."""
    names = methods_list(method) if "," in method else [method.strip()]
    if len(names) == 1:
        return names, {names[0]: method_and_options(names[0], options)}
    per_method = method_options(options, names)
    return names, {m: per_method.get(m, {}) for m in names}


@cli.command("explain", short_help="Explain images or a text; write pictures / data, print top units.")
@input_options
@click.option("--method", "-m", metavar="METHOD[,METHOD...]",
              help="A method from 'attnroll methods', or several comma-separated (-m rollout,gae): one output "
                   "file per input, method and format [default: the measured default of the model's kind, "
                   "attnroll.explain.defaults, see EVALUATION.md; printed].")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE",
              help="A method option, repeatable: -o alpha=0.9 -o head_fusion=max -o discard_ratio=0.9; with "
                   "several methods -o KEY=VALUE goes to every method that takes it, -o gae.alpha=0.9 to one.")
@click.option("--target", help="Class index or name to explain (default: the predicted class).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-out"), show_default=True,
              help="Output folder (created).")
@click.option("--format", "formats", multiple=True, callback=_parse_formats, metavar="png|html|json|npz",
              help="Output formats, repeatable or comma-separated [default: png for images, html for text].")
@click.option("--top", default=5, show_default=True, type=click.IntRange(0), help="How many top units to print.")
@click.option("--size", type=click.IntRange(16, 4096), help="Side of the PNG overlay in pixels [default: the image's "
                                                            "size].")
@click.option("--cmap", default="jet", show_default=True, help="Matplotlib colormap of the overlay.")
@click.option("--overlay-alpha", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="Weight of the map over the image.")
@click.option("--generate", type=click.IntRange(1), metavar="N",
              help="Decoders: generate N tokens after the prompt (--text: a text or a file) and rank the prompt's "
                   "parts by their share of the answer (context attribution). With IMAGE... and a vision-language "
                   "model: explain each generated token over the images and the prompt (a viewer page: click an "
                   "answer token for its map over each image).")
@click.option("--unit", type=click.Choice(["token", "word", "sentence"]), default="sentence", show_default=True,
              help="With --generate: the prompt's units.")
@click.option("--segment", "segments", multiple=True, metavar="TEXT",
              help="With --generate: a piece of the prompt (e.g. a retrieved passage), repeatable, in order; "
                   "replaces --unit.")
def explain_cmd(images, text, pair, model_spec, weights, method, options, target, out, formats, top, size, cmap,
                overlay_alpha, generate, unit, segments) -> None:
    """Explain IMAGE... (files or folders of images) or --text TEXT [--pair TEXT]; write one file per input
    and format into --out and print each input's top units.

    \b
    Files: <image stem>.<method>.png|html|json|npz; for text <first words>.<method>.html|json|npz (a stem
    that is not a plain lower-case file name gets ~ and a short hash). --text FILE explains the file's text.
    Examples:
      attnroll explain photos/ --model ./vit-base-local -m rollout,gae --format png,json
      attnroll explain cat.jpg --model vit_small_patch16_224 --weights vit_s.safetensors
      attnroll explain --text "A man plays guitar." --pair "Someone makes music." -m gae
      attnroll explain --model ./llama-local --text prompt.txt --generate 20 --unit sentence
      attnroll explain photo.jpg --model ./llava-local --text "What is in the picture?" --generate 12
    """
    if generate is not None and images:  # a vision-language model's answer, per generated token over the images
        from ._vlm_answer import check_vlm_request, explain_vlm_answer

        if segments:
            raise click.UsageError("--segment is for a text prompt's parts; with IMAGE... leave it out")
        method = check_vlm_request(images, text, pair, target, method, formats)
        written = explain_vlm_answer(images, text, method, options, model_spec, weights, out, generate,
                                     formats or ("html",), top)
        click.echo(f"wrote {len(written)} file{'s' if len(written) != 1 else ''} to {out}/")
        return
    if generate is not None:
        method = method or _decoder_default()
        if method is not None and "," in method:
            raise click.UsageError(f"--generate takes one method ({', '.join(GENERATE_METHODS)}), got -m {method}")
        _generate(images, text, pair, target, formats, method, options, model_spec, weights, out, generate, unit,
                  segments, top)
        return
    if segments:
        raise click.UsageError("--segment needs --generate")
    kind = check_inputs(images, text, pair)
    names, opts = _methods_and_options(method, options) if method is not None else (None, None)
    if method is None:
        check_early(options)
    formats = formats or (("png",) if kind == "image" else ("html",))
    if kind == "text" and "png" in formats:
        raise click.UsageError("--format png is for images; text gives html, json or npz")
    if kind == "image":
        check_cmap(cmap)
    files = expand_images(images) if kind == "image" else []
    for f in files:  # every input is checked before anything is written
        read_image(f)
    distinct_stems(files)
    out = prepare_out(out)
    lm = load_for(model_spec, weights, kind)
    tgt = parse_target(target, lm)
    choice = None
    if names is None:  # no -m: the kind's measured default, said on stderr once done
        choice = default_choice(lm, text=text, pairs=pair is not None)
        names, opts = [choice.method], {choice.method: chosen_options(choice, options)}
    written: list[Path] = []
    if kind == "text":
        for m in names:
            written += _explain_texts(lm, text, pair, m, opts[m], tgt, out, formats, top)
    else:
        look = {"cmap": cmap, "alpha": overlay_alpha, "size": size}
        with progress(len(files) * len(names)) as bar:
            task = bar.add_task(",".join(names), total=len(files) * len(names)) if bar is not None else None
            for f in files:
                for m in names:
                    written += _explain_image(f, lm, m, opts[m], tgt, out, formats, top, look)
                    if bar is not None:
                        bar.advance(task)
    echo_notes(model_spec, lm)
    announce(choice)
    click.echo(f"wrote {len(written)} file{'s' if len(written) != 1 else ''} to {out}/")
