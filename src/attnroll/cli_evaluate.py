"""``attnroll evaluate``, ``attnroll audit`` and ``attnroll sanity``: the evaluation commands (registered on
the ``attnroll`` group by :mod:`attnroll.cli`, which imports this module last). Same conventions as the other
commands: one-line errors, exit codes 0 / 2 (usage) / 1 (failure) / 3 (audit flagged, on request), atomic
writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .cli import Failure, LoadedModel, _write, cli, expand_images, load_model, parse_options, prepare_out, read_image

#: ``--data`` names of the generated datasets.
DATASETS = ("shapes", "shapes-marker")


def _methods_list(value: str) -> list[str]:
    from . import methods

    names = list(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    unknown = [m for m in names if m not in methods()]
    if not names or unknown:
        raise click.UsageError(f"--methods: unknown {unknown or '(none given)'}; see 'attnroll methods'")
    return names


def _method_options(items: tuple[str, ...], names: list[str]) -> dict[str, dict[str, Any]]:
    """``-o METHOD.KEY=VALUE`` (for one method) or ``-o KEY=VALUE`` (for every method that takes KEY)."""
    from .methods.base import method_info

    out: dict[str, dict[str, Any]] = {m: {} for m in names}
    for k, v in parse_options(items).items():
        if "." in k:
            m, key = k.split(".", 1)
            if m not in out:
                raise click.UsageError(f"--option {k}: {m!r} is not among the evaluated methods {names}")
            out[m][key] = v
        else:
            takers = [m for m in names if k in method_info(m).options]
            if not takers:
                raise click.UsageError(f"--option {k}: none of the methods {names} takes {k}=")
            for m in takers:
                out[m][k] = v
    from .methods.base import _get, _resolve_options

    for m, o in out.items():
        try:
            _resolve_options(_get(m), o)  # an option the method refuses is a usage error, before any work
        except ValueError as e:
            raise click.UsageError(f"--option: {e}") from None
    return {m: o for m, o in out.items() if o}


def load_image_model(spec: str | None) -> LoadedModel:
    """A model spec of ``audit``: "shapes" (default), "shapes-marker" (the spurious-cue copy), or a local
    transformers image-model folder."""
    lm = load_eval_model(spec)
    if lm.kind != "image":
        raise Failure(f"{spec}: a text model; 'attnroll audit' compares image classifiers")
    return lm


def load_eval_model(spec: str | None) -> LoadedModel:
    """A model spec of ``evaluate``: "shapes" (default), "shapes-marker" (the spurious-cue copy), or a local
    transformers folder (an image classifier, or a text classifier with its tokenizer)."""
    if spec == "shapes-marker":
        from .cli import load_shapes
        from .models import spurious

        lm = load_shapes()
        try:
            lm.model = spurious.load_marker_model()
        except FileNotFoundError as e:
            raise Failure(str(e)) from None
        lm.name = "shapes-marker (embedded, spurious corner cue)"
        return lm
    return load_model(spec or "shapes", None, "image")


def load_texts(data: str, n: int) -> list[str]:
    """``--data`` for a text classifier: a UTF-8 text file, one example per line (blank lines skipped)."""
    path = Path(data)
    if data in DATASETS or not path.is_file():
        raise click.UsageError(f"--data {data}: a text classifier needs a text file, one example per line")
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise Failure(f"cannot read {path}: {_one_line_err(e)}") from None
    texts = [ln for ln in lines if ln][:n]
    if not texts:
        raise Failure(f"{path}: no text in this file (one example per line)")
    return texts


def _one_line_err(e: Exception) -> str:
    return " ".join(str(getattr(e, "strerror", None) or e).split())


def load_data(data: str, lm: LoadedModel, n: int, seed: int) -> dict[str, Any]:
    """``--data``: a generated dataset name or a folder of images. Returns pixel_values, and for generated
    data the raw images, labels, object masks (pixels) and marker masks."""
    import torch

    from .models import shapes

    if data in DATASETS:
        images, labels, masks = shapes.make_dataset(n, seed)
        marker = None
        if data == "shapes-marker":
            from .models import spurious

            images, marker = spurious.add_marker(images, labels, seed=seed)
        size = tuple(getattr(getattr(lm.model, "config", None), "image_size", shapes.IMAGE_SIZE) for _ in range(2))
        if size != (shapes.IMAGE_SIZE,) * 2:
            raise click.UsageError(f"--data {data}: generated {shapes.IMAGE_SIZE}x{shapes.IMAGE_SIZE} images do not "
                                   f"fit a model that takes {size[0]}x{size[1]}; give a folder of images instead")
        return {"x": shapes.preprocess(images), "images": images, "labels": labels, "masks": masks, "marker": marker}
    path = Path(data)
    if not path.exists():
        raise click.UsageError(f"--data {data}: neither a folder of images nor one of {', '.join(DATASETS)}")
    import numpy as np

    files = expand_images((path,))[:n]
    xs, raw = [], []
    for f in files:
        img = read_image(f)
        x1 = lm.prepare_image(img)
        xs.append(x1)
        # the picture as the model sees it (same size), for the report's overlays
        small = img.resize((x1.shape[-1], x1.shape[-2]))
        raw.append(torch.from_numpy(np.asarray(small, dtype=np.float32) / 255.0).permute(2, 0, 1))
    x, images = torch.cat(xs), torch.stack(raw)
    return {"x": x, "images": images, "labels": None, "masks": None, "marker": None, "files": files}


def fill_tensor(fill: str, lm: LoadedModel, x: Any) -> Any:
    """``--fill``: "black" = a black picture through the model's own preprocessing ((C, H, W), per channel),
    "mean" = 0.0, or a float in model-input space."""
    if fill == "mean":
        return 0.0
    if fill == "black":
        from PIL import Image

        return lm.prepare_image(Image.new("RGB", (int(x.shape[-1]), int(x.shape[-2])), (0, 0, 0)))[0]
    try:
        return float(fill)
    except ValueError:
        raise click.UsageError(f"--fill must be black, mean or a number, got {fill!r}") from None


def _rich_table(result: Any) -> None:
    """Print the evaluation table with rich when it is installed, else as plain text."""
    from .evaluate.suite import METRICS

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
        table.add_column(f"{k} {'↑' if METRICS[k][1] else '↓'}", justify="right")
    table.add_column("seconds", justify="right")
    best = {k: result.best(k) for k in result.metrics}
    for m in result.methods:
        cells = []
        for k in result.metrics:
            v, se = result.values[m][k], result.stderr[m][k]
            s = f"{v:.1f}±{se:.1f}" if k in ("positive", "negative") else f"{v:.3f}±{se:.3f}"
            cells.append(f"[bold]{s}[/bold]" if best[k] == m else s)
        table.add_row(m, *cells, f"{result.seconds[m]:.2f}")
    if result.chance:
        table.add_row("[dim](chance)[/dim]", *[f"[dim]{result.chance[k]:.3f}[/dim]" if k in result.chance else ""
                                               for k in result.metrics], "")
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 160))
    console.print(table)


# -------------------------------------------------------------------------------------------- evaluate
@cli.command("evaluate", short_help="Score methods with perturbation and localisation metrics.")
@click.option("--model", "model_spec", metavar="MODEL", default="shapes", show_default=True,
              help="shapes | shapes-marker (embedded) | a local transformers image or text classifier folder.")
@click.option("--methods", "method_list", default="rollout,flow,gae,grad_rollout,raw,integrated_gradients,random",
              show_default=True, help="Comma-separated methods to compare.")
@click.option("--data", default="shapes", show_default=True,
              help="shapes | shapes-marker (generated, with object masks) | a folder of images (no masks: "
                   "perturbation metrics only) | for a text classifier, a text file with one example per line.")
@click.option("--n", "n", default=200, show_default=True, type=click.IntRange(1), help="How many images.")
@click.option("--seed", default=12345, show_default=True, type=click.IntRange(0),
              help="Seed of the generated images (12345 = the shapes model's held-out test seed).")
@click.option("--metrics", "metric_list", help="Comma-separated subset of deletion, insertion, positive, negative, "
              "pointing, mass, iou (images) or comprehensiveness, sufficiency (text) [default: all that apply].")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE",
              help="A method option, e.g. -o flow.n_jobs=2 or -o alpha=0.6 (every method that takes it).")
@click.option("--fill", default="black", show_default=True, metavar="black|mean|FLOAT",
              help="What replaces removed patches: black pixels (Chefer et al.: zero before normalisation), "
                   "mean (0 in model-input space) or a value in model-input space.")
@click.option("--steps", type=click.IntRange(1), help="Deletion / insertion steps [default: one per patch].")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1), help="Images per forward pass.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-eval"), show_default=True,
              help="Output folder (created): evaluation.csv, evaluation.json, curves.png (perturbation curves).")
def evaluate_cmd(model_spec, method_list, data, n, seed, metric_list, options, fill, steps, batch_size, out) -> None:
    """Compare methods on one classifier. Images: deletion / insertion AUC, positive / negative perturbation AUC
    and, on generated data with object masks, the pointing game, the relevance mass in the object and the top-k
    IoU. Text classifiers (--data FILE, one example per line): AOPC comprehensiveness and sufficiency. Prints a
    table (mean ± standard error, best in bold) and writes a CSV, a JSON and a figure of the curves."""
    from .evaluate.suite import LOCALISATION, METRICS

    names = _methods_list(method_list)
    opts = _method_options(options, names)
    metrics = None
    if metric_list:
        metrics = [m.strip() for m in metric_list.split(",") if m.strip()]
        bad = [m for m in metrics if m not in METRICS]
        if bad or not metrics:
            raise click.UsageError(f"--metrics: unknown {bad or '(none given)'}; choose from {', '.join(METRICS)}")
    out = prepare_out(out)
    lm = load_eval_model(model_spec)
    if lm.kind == "text":
        result = _evaluate_text(lm, data, n, names, metrics, opts, batch_size)
        meta = {"model": lm.name, "data": data, "n": n, "options": opts}
        _write_results(out, result, meta)
        return
    d = load_data(data, lm, n, seed)
    masks = None
    if d["masks"] is not None:
        from .models.shapes import patch_masks

        masks = patch_masks(d["masks"])
    elif metrics and any(k in LOCALISATION for k in metrics):
        raise click.UsageError("--metrics pointing/mass/iou need object masks: use --data shapes or shapes-marker")
    fill_value = fill_tensor(fill, lm, d["x"])
    result = _run_suite(lm.model, d["x"], names, labels=d["labels"], masks=masks, metrics=metrics,
                        method_options=opts, fill=fill_value, steps=steps, batch_size=batch_size)
    meta = {"model": lm.name, "data": data, "n": n, "seed": seed, "fill": fill, "steps": steps,
            "options": opts}
    _write_results(out, result, meta)


def _evaluate_text(lm: LoadedModel, data: str, n: int, names: list[str], metrics: Any, opts: dict,
                   batch_size: int) -> Any:
    from .evaluate.suite import LOCALISATION

    if metrics and any(k in LOCALISATION for k in metrics):
        raise click.UsageError("--metrics pointing/mass/iou need masks, which text files do not carry")
    texts = load_texts(data, n)
    enc = lm.tokenizer(texts, padding=True, truncation=True, return_tensors="pt", return_special_tokens_mask=True)
    return _run_suite(lm.model, enc, names, metrics=metrics, method_options=opts, batch_size=batch_size)


def _run_suite(model: Any, inputs: Any, names: list[str], **kwargs: Any) -> Any:
    """evaluate_methods with progress on stderr; metrics that do not fit the model's kind are a usage error."""
    from .evaluate.suite import evaluate_methods

    try:
        return evaluate_methods(model, inputs, names, progress=lambda msg: click.echo(msg, err=True), **kwargs)
    except ValueError as e:
        if "do not apply" in str(e):
            raise click.UsageError(f"--metrics: {e}") from None
        raise


def _write_results(out: Path, result: Any, meta: dict) -> None:
    """The table on the terminal; evaluation.csv, evaluation.json and (when there are curves) curves.png."""
    import io

    from .evaluate.suite import CURVES
    from .viz import _deps

    _rich_table(result)
    written = [_write(out / "evaluation.csv", result.to_csv()),
               _write(out / "evaluation.json", json.dumps({**meta, **result.as_dict()}, indent=1, default=float))]
    if any(k in result.curves.get(result.methods[0], {}) for k in CURVES):
        plt = _deps.pyplot("attnroll evaluate")
        fig = result.plot()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        written.append(_write(out / "curves.png", buf.getvalue()))
    for p in written:
        click.echo(f"wrote {p}")


# ----------------------------------------------------------------------------------------------- audit
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
              help="Output folder (created): audit.html or audit.png, and audit.json.")
@click.option("--js-threshold", default=0.05, show_default=True, type=click.FloatRange(0, 1),
              help="Flag when the mean Jensen-Shannon divergence exceeds this (raise it for noisy gradient maps).")
@click.option("--shift-threshold", default=0.05, show_default=True, type=click.FloatRange(0, 1),
              help="Flag when a region's mean mass shift exceeds this and its 95% CI excludes 0.")
@click.option("--fail-if-flagged", is_flag=True, help="Exit with code 3 when the audit flags a shift (for CI).")
def audit_cmd(model_a, model_b, data, n, seed, method, options, examples, fmt, out, js_threshold, shift_threshold,
              fail_if_flagged) -> int:
    """Explain the same inputs with MODEL_A and MODEL_B (shapes | shapes-marker | a transformers image-model
    folder) and report how the maps differ: per example Jensen-Shannon divergence, rank correlation and top-k
    overlap; the mass moving between regions with bootstrap confidence intervals; a verdict; and a picture of the
    examples that changed most. Exit code 3 with --fail-if-flagged when a shift is flagged."""
    from . import methods
    from .evaluate.audit import audit, grid_regions, shapes_regions

    if method not in methods():
        raise click.UsageError(f"--method {method!r} is unknown; see 'attnroll methods'")
    opts = parse_options(options)
    out = prepare_out(out)
    la, lb = load_image_model(model_a), load_image_model(model_b)
    d = load_data(data, la, n, seed)
    if d["masks"] is not None:
        regions = shapes_regions(d["masks"], d["marker"])
    else:
        regions = None  # audit() falls back to grid_regions (centre / border / corners)
    report = audit(la.model, lb.model, d["x"], method=method, regions=regions, js_threshold=js_threshold,
                   shift_threshold=shift_threshold, **opts)
    click.echo(f"A = {la.name}\nB = {lb.name}\ndata = {data} ({d['x'].shape[0]} images), method = {method}")
    click.echo(report.summary())
    names = [la.labels.get(i, str(i)) for i in range(max(la.labels or {0: 0}) + 1)] if la.labels else None
    target = out / f"audit.{fmt}"
    try:
        report.save(target, images=d["images"], n=examples, class_names=names)
    except OSError as e:
        raise Failure(f"cannot write {target}: {e.strerror or e}") from None
    meta = {"model_a": la.name, "model_b": lb.name, "data": data, "n": n, "seed": seed, "method": method,
            "options": opts}
    _write(out / "audit.json", json.dumps({**meta, **report.as_dict()}, indent=1, default=float))
    click.echo(f"wrote {target}\nwrote {out / 'audit.json'}")
    return 3 if (fail_if_flagged and report.flagged) else 0


# ---------------------------------------------------------------------------------------------- sanity
@cli.command("sanity", short_help="Cascading randomisation: do the maps depend on the weights?")
@click.option("--model", "model_spec", metavar="MODEL", default="shapes", show_default=True,
              help="shapes | shapes-marker (embedded) | a local transformers image-classifier folder.")
@click.option("--methods", "method_list", default="rollout,flow,gae,grad_rollout,raw", show_default=True,
              help="Comma-separated methods.")
@click.option("--components", default="all,qk,value,mlp", show_default=True,
              help="Which weights of each block are re-drawn: all, qk (queries and keys), value (value and "
                   "attention output), mlp; comma-separated, one table each.")
@click.option("--data", default="shapes", show_default=True, help="shapes | shapes-marker | a folder of images.")
@click.option("--n", "n", default=64, show_default=True, type=click.IntRange(1), help="How many images.")
@click.option("--seed", default=12345, show_default=True, type=click.IntRange(0), help="Seed of generated images.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds of the re-drawn weights.")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE", help="A method option.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-sanity"), show_default=True,
              help="Output folder (created): sanity.csv, sanity.json, sanity.png.")
def sanity_cmd(model_spec, method_list, components, data, n, seed, seeds, options, out) -> None:
    """Re-draw the model's weights cumulatively from the top (classifier head, then the last block down to the
    first) and print, for each method, the mean Spearman rank correlation of its maps with the trained model's
    (Adebayo et al. 2018). A map that stays at 1.0 does not depend on the weights re-drawn so far."""
    import io

    import numpy as np

    from ._checks import SANITY_COMPONENTS
    from .evaluate.sanity import cascading_randomization
    from .viz import _deps

    names = _methods_list(method_list)
    opts = _method_options(options, names)
    comps = [c.strip() for c in components.split(",") if c.strip()]
    bad = [c for c in comps if c not in SANITY_COMPONENTS]
    if bad or not comps:
        raise click.UsageError(f"--components: unknown {bad or '(none given)'}; choose from "
                               f"{', '.join(SANITY_COMPONENTS)}")
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise click.UsageError(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    if not seed_list or min(seed_list) < 0:
        raise click.UsageError(f"--seeds must be non-negative integers, got {seeds!r}")
    out = prepare_out(out)
    lm = load_image_model(model_spec)
    x = load_data(data, lm, n, seed)["x"]
    rows, records = [], []
    plt = _deps.pyplot("attnroll sanity")
    fig, axes = plt.subplots(1, len(comps), figsize=(4.6 * len(comps), 3.6), squeeze=False)
    for ax, comp in zip(axes[0], comps):
        runs = [cascading_randomization(lm.model, x, names, component=comp, seed=s, method_options=opts)
                for s in seed_list]
        mean = {m: np.mean([r.correlations[m] for r in runs], axis=0) for m in names}
        lo = {m: np.min([r.correlations[m] for r in runs], axis=0) for m in names}
        hi = {m: np.max([r.correlations[m] for r in runs], axis=0) for m in names}
        click.echo(f"\ncomponent {comp!r}: mean Spearman correlation with the trained model's maps "
                   f"({x.shape[0]} images, seeds {', '.join(map(str, seed_list))})")
        width = max(len(s) for s in runs[0].steps)
        click.echo("  ".join(["step".ljust(width)] + [m.rjust(max(7, len(m))) for m in names]))
        for i, step in enumerate(runs[0].steps):
            click.echo("  ".join([step.ljust(width)] + [f"{mean[m][i]:.3f}".rjust(max(7, len(m))) for m in names]))
            for m in names:
                rows.append(f"{comp},{step},{m},{mean[m][i]:.6g},{lo[m][i]:.6g},{hi[m][i]:.6g}")
        records.append({"component": comp, "runs": [r.as_dict() for r in runs]})
        for m in names:
            ax.plot(range(len(runs[0].steps)), mean[m], marker="o", label=m)
        ax.axhline(0.0, color="0.6", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(runs[0].steps)))
        ax.set_xticklabels(runs[0].steps, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(-1.05, 1.05)
        ax.set_title(f"re-drawn: {comp}", fontsize=10)
        ax.set_ylabel("Spearman ρ with the trained model's map", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    meta = {"model": lm.name, "data": data, "n": n, "seed": seed, "seeds": seed_list, "options": opts}
    written = [_write(out / "sanity.csv", "component,step,method,mean,min_over_seeds,max_over_seeds\n"
                      + "\n".join(rows) + "\n"),
               _write(out / "sanity.json", json.dumps({**meta, "components": records}, indent=1)),
               _write(out / "sanity.png", buf.getvalue())]
    for p in written:
        click.echo(f"wrote {p}")
