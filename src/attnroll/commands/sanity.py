"""``attnroll sanity``: cascading randomisation (Adebayo et al. 2018) — do the maps depend on the weights?"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ._args import load_safety_options, method_options, methods_list
from ._data import check_data, data_for, load_data, load_eval_model, load_text_data
from ._group import cli
from ._output import echo_written, figure_png, prepare_out, write


def _components(value: str) -> list[str]:
    from .._checks import SANITY_COMPONENTS

    comps = [c.strip() for c in value.split(",") if c.strip()]
    bad = [c for c in comps if c not in SANITY_COMPONENTS]
    if bad or not comps:
        raise click.UsageError(f"--components: unknown {bad or '(none given)'}; choose from "
                               f"{', '.join(SANITY_COMPONENTS)}")
    return comps


def _seeds(value: str) -> list[int]:
    try:
        seed_list = [int(s) for s in value.split(",") if s.strip()]
    except ValueError:
        raise click.UsageError(f"--seeds must be comma-separated integers, got {value!r}") from None
    if not seed_list or min(seed_list) < 0:
        raise click.UsageError(f"--seeds must be non-negative integers, got {value!r}")
    return seed_list


def _table(comp: str, runs: list, names: list[str], n: str, seed_list: list[int]) -> list[str]:
    """Print one component's table (mean over seeds); return its CSV rows (mean, min and max over seeds)."""
    import numpy as np

    mean = {m: np.mean([r.correlations[m] for r in runs], axis=0) for m in names}
    lo = {m: np.min([r.correlations[m] for r in runs], axis=0) for m in names}
    hi = {m: np.max([r.correlations[m] for r in runs], axis=0) for m in names}
    click.echo(f"\ncomponent {comp!r}: mean Spearman correlation with the trained model's maps "
               f"({n}, seeds {', '.join(map(str, seed_list))})")
    width = max(len(s) for s in runs[0].steps)
    click.echo("  ".join(["step".ljust(width)] + [m.rjust(max(7, len(m))) for m in names]))
    rows = []
    for i, step in enumerate(runs[0].steps):
        click.echo("  ".join([step.ljust(width)] + [f"{mean[m][i]:.3f}".rjust(max(7, len(m))) for m in names]))
        for m in names:
            rows.append(f"{comp},{step},{m},{mean[m][i]:.6g},{lo[m][i]:.6g},{hi[m][i]:.6g}")
    return rows


def _plot(ax: Any, comp: str, runs: list, names: list[str]) -> None:
    import numpy as np

    steps = runs[0].steps
    for m in names:
        ax.plot(range(len(steps)), np.mean([r.correlations[m] for r in runs], axis=0), marker="o", label=m)
    ax.axhline(0.0, color="0.6", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(steps)))
    ax.set_xticklabels(steps, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(-1.05, 1.05)
    ax.set_title(f"re-drawn: {comp}", fontsize=10)
    ax.set_ylabel("Spearman ρ with the trained model's map", fontsize=8)
    ax.legend(fontsize=7)


@cli.command("sanity", short_help="Cascading randomisation: do the maps depend on the weights?")
@click.option("--model", "model_spec", metavar="MODEL", default="shapes", show_default=True,
              help="shapes | shapes-marker | minilm-evidence (embedded; the last a text classifier) | a local "
                   "transformers image or text classifier folder.")
@click.option("--methods", "-m", "method_list", default="rollout,flow,gae,grad_rollout,raw", show_default=True,
              help="Comma-separated methods.")
@click.option("--components", default="all,qk,value,mlp", show_default=True,
              help="Which weights of each block are re-drawn: all, qk (queries and keys), value (value and "
                   "attention output), mlp; comma-separated, one table each.")
@click.option("--data", default="shapes", show_default=True,
              help="shapes | shapes-marker | a folder of images | for a text classifier: evidence (generated "
                   "sentences; the default with --model minilm-evidence), a text file (one example per line) or "
                   "a JSONL file ('text' per line).")
@click.option("--n", "n", default=64, show_default=True, type=click.IntRange(1), help="How many images (sentences).")
@click.option("--seed", default=12345, show_default=True, type=click.IntRange(0),
              help="Seed of the generated images or sentences.")
@click.option("--seeds", default="0", show_default=True, help="Comma-separated seeds of the re-drawn weights.")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE", help="A method option.")
@click.option("--with-special-tokens", "with_special", is_flag=True,
              help="Text: correlate over the special tokens too (CLS, SEP), not only the others as the text "
                   "metrics count them (padding is left out either way).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-sanity"), show_default=True,
              help="Output folder (created): sanity.csv, sanity.json, sanity.png.")
@load_safety_options
def sanity_cmd(model_spec, method_list, components, data, n, seed, seeds, options, with_special, out) -> None:
    """Re-draw the model's weights cumulatively from the top (classifier head, then the last block down to the
    first) and print, for each method, the mean Spearman rank correlation of its maps with the trained model's
    (Adebayo et al. 2018). A map that stays at 1.0 does not depend on the weights re-drawn so far. On text, each
    sentence is correlated over its real tokens that are not special (padding left out)."""
    from ..evaluate.sanity import cascading_randomization
    from ..viz import deps

    names = methods_list(method_list)
    opts = method_options(options, names)
    comps = _components(components)
    seed_list = _seeds(seeds)
    check_data(data)
    data = data_for(model_spec, data)
    lm = load_eval_model(model_spec)
    keep = None
    if lm.kind == "text":
        x = load_text_data(lm, data, n, seed)["inputs"]
        count = f"{x['input_ids'].shape[0]} sentences"
        if with_special:  # nothing kept out: every real token counts
            keep = x["input_ids"].new_zeros(x["input_ids"].shape, dtype=bool)
    else:
        if with_special:
            raise click.UsageError(f"--with-special-tokens applies to text classifiers; {lm.name} takes images")
        x = load_data(data, lm, n, seed)["x"]
        count = f"{x.shape[0]} images"
    out = prepare_out(out)  # after the model and data, so that a wrong combination leaves no folder behind
    rows, records = [], []
    plt = deps.pyplot("attnroll sanity")
    fig, axes = plt.subplots(1, len(comps), figsize=(4.6 * len(comps), 3.6), squeeze=False)
    for ax, comp in zip(axes[0], comps):
        runs = [cascading_randomization(lm.model, x, names, component=comp, seed=s, method_options=opts,
                                        keep=keep)
                for s in seed_list]
        rows += _table(comp, runs, names, count, seed_list)
        records.append({"component": comp, "runs": [r.as_dict() for r in runs]})
        _plot(ax, comp, runs, names)
    fig.tight_layout()
    png = figure_png(fig, plt)
    meta = {"model": lm.name, "data": data, "n": n, "seed": seed, "seeds": seed_list, "options": opts,
            **({"with_special_tokens": with_special} if lm.kind == "text" else {})}
    echo_written([write(out / "sanity.csv", "component,step,method,mean,min_over_seeds,max_over_seeds\n"
                        + "\n".join(rows) + "\n"),
                  write(out / "sanity.json", json.dumps({**meta, "components": records}, indent=1)),
                  write(out / "sanity.png", png)])
