"""A vision-language model's answer explained per generated token, for ``attnroll explain IMAGE... --text PROMPT
--generate N`` and ``attnroll view IMAGE... --text PROMPT --generate N``: the model loaded with its processor, the
images and the prompt put through it, the answer generated and attributed
(:func:`attnroll.explain.vlm_generation_attribution`), the viewer page (click an answer token: its map over
each image, its scores over the prompt's tokens) and the JSON record written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .._names import safe_name
from ._args import method_and_options
from ._data import echo_notes, expand_images, load, read_image
from ._output import Failure, one_line, output_file, prepare_out, write
from ._text import slug

#: The methods of a VLM's answer, the default first (rollout: one sweep for all tokens; the map of a
#: classifier's measured default, attn_grad, has no vision-tower composition).
VLM_METHODS = ("rollout", "gae", "grad_rollout")


def check_vlm_request(images: tuple, text: str | None, pair: str | None, target: Any, method: str | None,
                      formats: tuple[str, ...]) -> str:
    """The method, or a usage error: IMAGE... and --text (the prompt), no --pair / --target, html / json."""
    if not images or text is None or pair is not None or target is not None:
        raise click.UsageError("--generate with IMAGE... needs --text (the prompt about the images), without --pair "
                               "or --target (the generated answer is the target)")
    bad = [f for f in formats if f not in ("html", "json")]
    if bad:
        raise click.UsageError(f"--generate with images writes html (the viewer page) and json; not {', '.join(bad)}")
    method = method or VLM_METHODS[0]
    if method not in VLM_METHODS:
        raise click.UsageError(f"--generate with images takes one method, -m {', '.join(VLM_METHODS)}, got {method!r}")
    return method


def explain_vlm_answer(images: tuple, text: str, method: str, options: tuple[str, ...], model_spec: str | None,
                       weights: Path | None, out: Path, generate: int, formats: tuple[str, ...], top: int,
                       name: str | None = None) -> list[Path]:
    """Load, generate, attribute; print the answer and each token's share on the images; write the files."""
    from ..explain.vlm_generation_attribution import vlm_generation_attribution
    opts = method_and_options(method, options)
    files = expand_images(images)
    pics = [read_image(f) for f in files]
    out = prepare_out(out)
    lm = load(model_spec, weights, "text")
    if lm.kind != "vlm":
        raise click.UsageError(f"model {lm.name} is not a vision-language model; --generate with IMAGE... needs one "
                               "(a local folder of LLaVA, Qwen2-VL, ... with its processor)")
    try:
        inputs = lm.prompt_inputs(pics, text)
        ga = vlm_generation_attribution(lm.model, inputs, generate=generate, method=method, tokenizer=lm.processor,
                                        images=pics, **opts)
    except (TypeError, ValueError) as e:
        raise Failure(one_line(str(e))) from None
    click.echo(f"answer ({len(ga.answer_ids)} tokens): {ga.answer}")
    click.echo(f"per generated token: its share on the images and its top text sources ({method}):")
    click.echo(ga.table(top=top or 3))
    stem = name or f"{safe_name(files[0].stem)}.{safe_name(slug(text))}.answer.{safe_name(method)}"
    written = []
    if "html" in formats or not formats:
        page = ga.to_html(title=f"attnroll {method}: {lm.name} · {', '.join(f.name for f in files)}")
        written.append(write(output_file(out, stem if stem.endswith((".html", ".htm")) else f"{stem}.html"), page))
    if "json" in formats:
        rec = {"model": lm.name, "images": [str(f) for f in files], "prompt": text, **ga.to_dict()}
        import json

        written.append(write(output_file(out, f"{stem}.json"), json.dumps(rec)))
    echo_notes(model_spec, lm)
    return written
