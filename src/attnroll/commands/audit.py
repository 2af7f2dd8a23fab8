"""``attnroll audit``: compare what two checkpoints rely on, on the same inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ._args import load_safety_options, method_and_options
from ._data import check_data, load_data, load_eval_model, load_files, load_image_model
from ._group import cli
from ._maps import batch_kind, batch_maps, batch_model, batch_text_inputs, is_batch_output
from ._output import Failure, prepare_out, write


def _viewer(report: Any, d: dict, la: Any, lb: Any, examples: int) -> str:
    """The interactive page: the most-changed examples, both models' maps and their difference."""
    from ..viz import view

    order = [int(i) for i in report.order[:examples]]
    return view(report, d["images"], masks=d["masks"], names=(la.name, lb.name), index=order,
                title=f"attnroll audit: {la.name} vs {lb.name}",
                notes=f"{report.method}; the {len(order)} examples whose maps changed most (JS divergence)").html


@cli.command("audit", short_help="Compare what two checkpoints rely on, on the same inputs.")
@click.argument("model_a", metavar="MODEL_A")
@click.argument("model_b", metavar="MODEL_B")
@click.option("--data", default="shapes-marker", show_default=True,
              help="shapes | shapes-marker (generated; regions object / marker / background) | a folder of images "
                   "(regions centre / border / corners).")
@click.option("--n", "n", default=200, show_default=True, type=click.IntRange(1), help="How many images.")
@click.option("--seed", default=12345, show_default=True, type=click.IntRange(0), help="Seed of generated images.")
@click.option("--method", "-m", default="rollout", show_default=True, help="The method whose maps are compared.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE", help="An option of the method.")
@click.option("--examples", default=8, show_default=True, type=click.IntRange(1, 64),
              help="How many most-changed examples the picture shows.")
@click.option("--format", "fmt", default="html", show_default=True, type=click.Choice(["html", "png"]),
              help="Report format.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-audit"), show_default=True,
              help="Output folder (created): audit.html or audit.png, audit.json and audit.view.html (interactive).")
@click.option("--js-threshold", default=0.05, show_default=True, type=click.FloatRange(0, 1),
              help="Flag when the mean Jensen-Shannon divergence exceeds this (raise it for noisy gradient maps).")
@click.option("--shift-threshold", default=0.05, show_default=True, type=click.FloatRange(0, 1),
              help="Flag when a region's mean mass shift exceeds this and its 95% CI excludes 0.")
@click.option("--fail-if-flagged", is_flag=True, help="Exit with code 3 when the audit flags a shift (for CI).")
@load_safety_options
def audit_cmd(model_a, model_b, data, n, seed, method, options, examples, fmt, out, js_threshold, shift_threshold,
              fail_if_flagged) -> int:
    """Explain the same inputs with MODEL_A and MODEL_B (shapes | shapes-marker | a transformers image-model
    folder | an 'attnroll batch' output, whose maps are read instead of computed, on its images) and report
    how the maps differ: per example Jensen-Shannon divergence, rank correlation and top-k
    overlap; the mass moving between regions with bootstrap confidence intervals; a verdict; and a picture of the
    examples that changed most. Exit code 3 with --fail-if-flagged when a shift is flagged."""
    from ..evaluate.audit import audit, shapes_regions
    from ..methods import methods

    if method not in methods():
        raise click.UsageError(f"--method {method!r} is unknown; see 'attnroll methods'")
    opts = method_and_options(method, options)  # names and values, before any model is loaded
    check_data(data)
    out = prepare_out(out)
    batches = [p for p in (model_a, model_b) if is_batch_output(p)]
    text = any(batch_kind(Path(p), "MODEL") == "text" for p in batches)
    if text and fmt == "png":
        raise click.UsageError("--format png draws image maps; an audit of texts writes --format html")
    live = load_eval_model if text else load_image_model
    la, lb = (batch_model(Path(p), "MODEL") if is_batch_output(p) else live(p) for p in (model_a, model_b))
    if la.kind != lb.kind:
        raise click.UsageError(f"MODEL_A is a{'n image' if la.kind == 'image' else ' text'} model and MODEL_B is not: "
                               "an audit compares two models of the same inputs")
    maps = {}
    if batches:
        if click.get_current_context().get_parameter_source("data") is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError("a batch output as MODEL brings its own inputs; leave --data out")
        if opts and len(batches) == 2:
            raise click.UsageError("--option: both MODELs are batch outputs, whose maps were made with the options "
                                   "in their manifests")
        inputs, found = batch_maps([(Path(p), method) for p in batches], n, "MODEL")
        if text:
            enc, found = batch_text_inputs(inputs, la, found, "MODEL")
            d = {"x": enc, "images": None, "masks": None, "marker": None}
        else:
            d = load_files(inputs, la)
        maps = dict(zip(batches, found))
        data = f"the inputs of {', '.join(batches)}"
    else:
        d = load_data(data, la, n, seed)
    # without masks audit() falls back to grid_regions (centre / border / corners)
    regions = shapes_regions(d["masks"], d["marker"]) if d["masks"] is not None else None
    report = audit(la.model, lb.model, d["x"], method=method, regions=regions, js_threshold=js_threshold,
                   shift_threshold=shift_threshold, maps_a=maps.get(model_a), maps_b=maps.get(model_b), **opts)
    count = f"{len(d['x']['input_ids'])} texts" if text else f"{d['x'].shape[0]} images"
    click.echo(f"A = {la.name}\nB = {lb.name}\ndata = {data} ({count}), method = {method}")
    click.echo(report.summary())
    names = [la.labels.get(i, str(i)) for i in range(max(la.labels or {0: 0}) + 1)] if la.labels else None
    target = out / f"audit.{fmt}"
    try:
        report.save(target, images=d["images"], n=examples, class_names=names)
    except OSError as e:
        raise Failure(f"cannot write {target}: {e.strerror or e}") from None
    meta = {"model_a": la.name, "model_b": lb.name, "data": data, "n": n, "seed": seed, "method": method,
            "options": opts}
    write(out / "audit.json", json.dumps({**meta, **report.as_dict()}, indent=1, default=float))
    written = [target, out / "audit.json"]
    if not text:  # the interactive viewer draws image maps
        written.append(write(out / "audit.view.html", _viewer(report, d, la, lb, examples)))
    click.echo("\n".join(f"wrote {p}" for p in written))
    return 3 if (fail_if_flagged and report.flagged) else 0
