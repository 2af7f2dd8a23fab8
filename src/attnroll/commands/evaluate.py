"""``attnroll evaluate``: score several methods on one classifier with perturbation and localisation metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ._args import load_safety_options, method_options, methods_list
from ._data import (
    DATASETS,
    TEXT_DATASETS,
    check_data,
    check_fill,
    data_for,
    fill_tensor,
    load_data,
    load_eval_model,
    load_files,
    load_text_data,
)
from ._group import cli
from ._output import echo_written, figure_png, prepare_out, write


def _rich_table(result: Any) -> None:
    """Print the evaluation table with rich when it is installed, else as plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        click.echo(result.summary())
        return
    table = Table(title=f"{result.n} examples" + ("" if result.accuracy is None else
                                                   f", model accuracy {result.accuracy:.3f}"))
    table.add_column("method")
    for k in result.metrics:
        table.add_column(result.heading(k), justify="right")
    table.add_column("seconds", justify="right")
    best = {k: result.best(k) for k in result.metrics}
    for m in result.methods:
        cells = []
        for k in result.metrics:
            s = result.cell(m, k)
            cells.append(f"[bold]{s}[/bold]" if best[k] == m else s)
        table.add_row(m, *cells, f"{result.seconds[m]:.2f}")
    if result.chance:
        table.add_row("[dim](chance)[/dim]", *[f"[dim]{result.chance[k]:.3f}[/dim]" if k in result.chance else ""
                                               for k in result.metrics], "")
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))
    console.print(table)


def _metric_names(metric_list: str | None) -> list[str] | None:
    from ..evaluate import METRICS

    if not metric_list:
        return None
    metrics = [m.strip() for m in metric_list.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise click.UsageError(f"--metrics: unknown {bad or '(none given)'}; choose from {', '.join(METRICS)}")
    return metrics


def _run_suite(model: Any, inputs: Any, names: list[str], **kwargs: Any) -> Any:
    """evaluate_methods with progress on stderr (on a terminal a bar over the whole run with the time left,
    elsewhere one line per method); metrics that do not fit the model's kind are a usage error."""
    import sys

    from ..evaluate.suite import evaluate_methods

    progress = True if sys.stderr.isatty() else (lambda msg: click.echo(msg, err=True))
    try:
        return evaluate_methods(model, inputs, names, progress=progress, **kwargs)
    except ValueError as e:
        if "do not apply" in str(e):
            raise click.UsageError(f"--metrics: {e}") from None
        raise


def _needs_masks(metrics: list[str] | None) -> bool:
    from ..evaluate import metric_info

    return bool(metrics) and any(metric_info(k).needs_masks for k in metrics)


def _no_masks_error(metrics: list[str]) -> click.UsageError:
    """The usage error for mask metrics on data without masks, naming the data that has them."""
    from ..evaluate import metric_info

    if any(metric_info(k).kind == "text" for k in metrics):
        return click.UsageError("--metrics evidence_mass/evidence_pointing/evidence_f1 need evidence tokens, which "
                                "text files do not carry: use --data evidence")
    return click.UsageError("--metrics pointing/mass/iou need object masks: use --data shapes or shapes-marker")


def _evaluate_text(lm: Any, data: str, n: int, seed: int, names: list[str], metrics: Any, opts: dict,
                   batch_size: int) -> tuple[Any, dict]:
    """A text classifier on ``--data evidence`` (generated sentences with evidence tokens: AOPC and the
    rationale metrics) or on a text file (AOPC only). Returns (result, the meta data of evaluation.json)."""
    generated = data in TEXT_DATASETS
    if not generated and _needs_masks(metrics):
        raise _no_masks_error(metrics)
    d = load_text_data(lm, data, n, seed)
    result = _run_suite(lm.model, d["inputs"], names, labels=d["labels"], masks=d["masks"], metrics=metrics,
                        method_options=opts, batch_size=batch_size)
    return result, {"model": lm.name, "data": data, "n": n, **({"seed": seed} if generated else {}), "options": opts}


def _write_results(out: Path, result: Any, meta: dict) -> None:
    """The table on the terminal; evaluation.csv, evaluation.json and (when there are curves) curves.png."""
    from ..viz import deps

    _rich_table(result)
    written = [write(out / "evaluation.csv", result.to_csv()),
               write(out / "evaluation.json", json.dumps({**meta, **result.as_dict()}, indent=1, default=float))]
    if result.curves.get(result.methods[0]):
        plt = deps.pyplot("attnroll evaluate")
        written.append(write(out / "curves.png", figure_png(result.plot(), plt)))
    echo_written(written)


#: The registered metrics of each input kind as (without masks, with masks), in table order, written out so
#: that ``attnroll evaluate --help`` imports no torch; the command validates --metrics against the registry
#: itself, and a test checks this list against ``attnroll.evaluate.metric_names``.
HELP_METRICS = {
    "image": (("deletion", "insertion", "positive", "negative"), ("pointing", "mass", "iou")),
    "text": (("comprehensiveness", "sufficiency"), ("evidence_mass", "evidence_pointing", "evidence_f1")),
}


def _metrics_help() -> str:
    """The --metrics help: the metrics of each input kind, masks-only ones apart."""

    def listing(kind: str) -> str:
        return ", ".join(HELP_METRICS[kind][0])

    def masked(kind: str) -> str:
        return ", ".join(HELP_METRICS[kind][1])

    return (f"Comma-separated subset of {listing('image')} (images) or {listing('text')} (text), with object "
            f"masks {masked('image')}, with evidence tokens {masked('text')} [default: all that apply].")


@cli.command("evaluate", short_help="Score methods with perturbation and localisation metrics.")
@click.option("--model", "model_spec", metavar="MODEL", default="shapes", show_default=True,
              help="shapes | shapes-marker | minilm-evidence | bamba-evidence | mamba2-evidence (embedded; the "
                   "last three text classifiers) | a local transformers image or text classifier folder.")
@click.option("--methods", "-m", "method_list", default="rollout,flow,gae,grad_rollout,raw,integrated_gradients,random",
              show_default=True, help="Comma-separated methods to compare.")
@click.option("--data", default="shapes", show_default=True,
              help="shapes | shapes-marker (generated, with object masks) | a folder of images (no masks: "
                   "perturbation metrics only) | for a text classifier: evidence (generated sentences with "
                   "evidence tokens; the default with the embedded text classifiers) or a text file, one example per "
                   "line.")
@click.option("--n", "n", default=200, show_default=True, type=click.IntRange(1), help="How many images (sentences).")
@click.option("--seed", default=12345, show_default=True, type=click.IntRange(0),
              help="Seed of the generated images or sentences (12345 = the shapes and evidence models' held-out "
                   "test seed).")
@click.option("--metrics", "metric_list", help=_metrics_help())
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE",
              help="A method option, e.g. -o flow.n_jobs=2 or -o alpha=0.6 (every method that takes it).")
@click.option("--fill", default="black", show_default=True, metavar="black|mean|FLOAT",
              help="What replaces removed patches: black pixels (Chefer et al.: zero before normalisation), "
                   "mean (0 in model-input space) or a value in model-input space.")
@click.option("--steps", type=click.IntRange(1), help="Deletion / insertion steps [default: one per patch].")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1),
              help="Inputs per forward pass when explaining; scoring passes take at least this many perturbed "
                   "copies (small images: up to 32 MB of pixels per pass).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-eval"), show_default=True,
              help="Output folder (created): evaluation.csv, evaluation.json, curves.png (perturbation curves).")
@click.option("--maps", "maps_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR",
              help="An 'attnroll batch' output of images or texts: score its maps instead of explaining again (its "
                   "model "
                   "and its inputs; --methods defaults to its methods, others are explained here).")
@load_safety_options
def evaluate_cmd(model_spec, method_list, data, n, seed, metric_list, options, fill, steps, batch_size, out,
                 maps_dir) -> None:
    """Compare methods on one classifier. Images: deletion / insertion AUC, positive / negative perturbation AUC
    and, on generated data with object masks, the pointing game, the relevance mass in the object and the top-k
    IoU. Text classifiers: AOPC comprehensiveness and sufficiency, and on --data evidence (generated sentences
    whose label is decided by known tokens) the evidence-token mass, pointing game and top-k F1. Prints a
    table (mean ± standard error, best in bold) and writes a CSV, a JSON and a figure of the curves."""
    if maps_dir is not None:
        return _evaluate_batch(maps_dir, model_spec, method_list, n, metric_list, options, fill, steps, batch_size,
                               out)
    names = methods_list(method_list)
    opts = method_options(options, names)
    metrics = _metric_names(metric_list)
    check_data(data)
    check_fill(fill)
    data = data_for(model_spec, data)
    if data not in DATASETS + TEXT_DATASETS and _needs_masks(metrics):
        raise _no_masks_error(metrics)
    out = prepare_out(out)
    lm = load_eval_model(model_spec)
    if lm.kind == "text":
        result, meta = _evaluate_text(lm, data, n, seed, names, metrics, opts, batch_size)
        _write_results(out, result, meta)
        return
    d = load_data(data, lm, n, seed)
    masks = None
    if d["masks"] is not None:
        from ..models.shapes import patch_masks

        masks = patch_masks(d["masks"])
    elif _needs_masks(metrics):
        raise _no_masks_error(metrics)
    fill_value = fill_tensor(fill, lm, d["x"])
    result = _run_suite(lm.model, d["x"], names, labels=d["labels"], masks=masks, metrics=metrics,
                        method_options=opts, fill=fill_value, steps=steps, batch_size=batch_size)
    meta = {"model": lm.name, "data": data, "n": n, "seed": seed, "fill": fill, "steps": steps, "options": opts}
    _write_results(out, result, meta)


def _evaluate_batch(folder: Path, model_spec: str, method_list: str, n: int, metric_list: Any, options: Any,
                    fill: str, steps: Any, batch_size: int, out: Path) -> None:
    """``evaluate --maps DIR``: the perturbation metrics of a batch output's maps, on its own images and model."""
    from ._maps import batch_kind, batch_maps, batch_methods, batch_model, batch_text_inputs

    ctx = click.get_current_context()
    explicit = {p: ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT
                for p in ("data", "model_spec", "method_list")}
    if explicit["data"]:
        raise click.UsageError("--maps DIR scores the maps of DIR's own inputs; leave --data out")
    stored = batch_methods(folder, "--maps")
    names = methods_list(method_list) if explicit["method_list"] else stored
    opts = method_options(options, names)
    metrics = _metric_names(metric_list)
    if _needs_masks(metrics):
        raise click.UsageError("--metrics pointing/mass/iou need object masks, which a batch output does not carry")
    given = [m for m in names if m in stored]
    if not given:
        raise click.UsageError(f"--maps {folder} holds maps of {', '.join(stored)}, none of --methods "
                               f"{', '.join(names)}")
    if set(opts) & set(given):
        raise click.UsageError(f"--option for {sorted(set(opts) & set(given))}: their maps in {folder} were made with "
                               "the options in its manifest")
    out = prepare_out(out)
    lm = batch_model(folder, "--maps", model_spec if explicit["model_spec"] else None)
    inputs, maps = batch_maps([(folder, m) for m in given], n, "--maps")
    if batch_kind(folder, "--maps") == "text":
        enc, maps = batch_text_inputs(inputs, lm, maps, "--maps")
        result = _run_suite(lm.model, enc, names, metrics=metrics, method_options=opts, batch_size=batch_size,
                            maps=dict(zip(given, maps)))
    else:
        d = load_files(inputs, lm)
        result = _run_suite(lm.model, d["x"], names, metrics=metrics, method_options=opts, steps=steps,
                            fill=fill_tensor(fill, lm, d["x"]), batch_size=batch_size, maps=dict(zip(given, maps)))
    meta = {"model": lm.name, "maps": str(folder), "n": len(inputs), "fill": fill, "steps": steps, "options": opts,
            "precomputed": given}
    _write_results(out, result, meta)
