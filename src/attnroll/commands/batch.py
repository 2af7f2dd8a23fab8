"""``attnroll batch``: explain a whole dataset into a resumable Parquet dataset, in this process or on Ray Data.

Exit codes: 0 every input explained; 3 the run completed but some inputs failed (they are rows of
``DIR/failures/``, with the reason); 2 usage error (a bad argument, or ``DIR`` holds a different run and
``--overwrite`` was not given); 1 failure (the model cannot be loaded, ``DIR`` cannot be written, Ray is
missing or fails); 130 interrupted (rerun the same command to complete the output).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from ._args import load_flags, load_safety_options, method_options, methods_list
from ._data import echo_notes, load
from ._default import announce, check_early, chosen_options, default_choice
from ._group import cli
from ._output import Failure, one_line, prepare_out

#: Exit code of a completed run in which some inputs failed.
SOME_FAILED = 3


def _progress_bar() -> Any:
    """A rich progress bar with rate and ETA on a terminal (stderr); None elsewhere (logs, pipes, CI)."""
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        return None
    console = Console(stderr=True)
    if not console.is_terminal:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                    TimeRemainingColumn(), console=console, transient=True)


class _Bar:
    """run_batch's progress callback driving a rich bar: done/total, inputs per second, time left."""

    def __init__(self, bar: Any, label: str):
        self.bar, self.label, self.task, self.t0 = bar, label, None, None

    def __call__(self, done: int, total: int) -> None:
        import time

        if self.task is None:
            self.task = self.bar.add_task(self.label, total=total, rate="")
            self.t0 = time.perf_counter()
        dt = time.perf_counter() - self.t0
        rate = f"{done / dt:.1f} inputs/s" if done and dt > 0 else ""
        self.bar.update(self.task, completed=done, rate=rate)


@cli.command("batch", short_help="Explain a whole dataset into resumable Parquet (local or Ray).")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--out", type=click.Path(path_type=Path), required=True, help="Output folder (created; reruns resume it)."
)
@click.option("--method", "-m", "method_list",
              help="Method(s), comma-separated: -m rollout,gae [default: the measured default of the model's "
                   "kind, attnroll.explain.defaults, see EVALUATION.md; printed].")
@click.option("--option", "-o", "options", multiple=True, metavar="[METHOD.]KEY=VALUE",
              help="A method option, repeatable: -o alpha=0.9 (every method that takes it) or -o gae.position=0.")
@click.option("--model", "model_spec", metavar="MODEL",
              help="As for 'attnroll explain': embedded by default, a transformers folder, or a timm name with "
                   "--weights.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Weights file for a timm architecture.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="local: this process. ray: Ray Data actors (pip install 'attnroll[ray]').")
@click.option("--num-workers", default=1, show_default=True, type=click.IntRange(1),
              help="Ray actors, each holding one copy of the model.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(1),
              help="Inputs per forward pass (and per shard with --engine ray).")
@click.option("--shard-size", type=click.IntRange(1), metavar="N",
              help="Inputs per committed shard at most, whole batches [default: 256; a shard is also committed "
              "once its batches took a second]; --engine local.")
@click.option("--address", metavar="ADDR", help="Join this Ray cluster (e.g. auto, or ray://head:10001).")
@click.option("--png", is_flag=True, help="Also write overlays to DIR/png/<id>.<method>.png (images).")
@click.option("--column", metavar="C[,PAIR]", help="The column of paths or texts of a Parquet / CSV source "
              "(two columns: a sentence pair).")
@click.option("--target", type=click.IntRange(0), metavar="CLASS",
              help="Explain this class index for every input [default: each input's predicted class].")
@click.option("--target-column", metavar="C", help="A column of the Parquet / CSV source (or a field of the JSONL "
              "lines) with the class index to explain per input (empty: the predicted class).")
@click.option("--num-gpus", default=0.0, show_default=True, type=click.FloatRange(0),
              help="GPUs per Ray actor (0.25: four actors share one GPU); --engine ray.")
@click.option("--cpus-per-worker", type=click.IntRange(1), metavar="N",
              help="CPUs (torch threads) per Ray actor [default: 1 with --address, else this machine's CPUs "
              "shared between the actors]; --engine ray.")
@click.option("--overwrite", is_flag=True, help="Discard DIR's results when they come from different settings.")
@load_safety_options
def batch_cmd(source, out, method_list, options, model_spec, weights, engine, num_workers, batch_size, shard_size,
              address, png, column, target, target_column, num_gpus, cpus_per_worker, overwrite) -> int:
    """Explain every input of SOURCE with each method and write a Parquet dataset to --out: one row per
    (input, method) under DIR/rows/, unreadable inputs with the reason under DIR/failures/, and
    DIR/manifest.json. Rerunning the same command after a crash completes only what is missing.

    \b
    SOURCE: an image folder (recursive), a .txt file (one text per line; TEXT<TAB>PAIR for a pair), a .jsonl
    file ({"text": ..., "pair": ..., "id": ...} per line), or a .parquet / .csv table with --column.
    Examples:
      attnroll batch photos/ --out maps/ -m rollout,gae --model ./my-vit
      attnroll batch pairs.jsonl --out sims/ -m gae            # MiniLM: which words make each pair similar
      attnroll batch photos/ --out maps/ --engine ray --num-workers 4 --address auto
      attnroll batch photos/ --out maps/ --engine ray --num-workers 8 --num-gpus 0.25   # 4 actors per GPU
      attnroll batch val.csv --column path --target-column label --out maps/   # explain the true class
    Read it back with attnroll.read_batch(DIR) (pandas) and attnroll.batch.row_explanation(row).
    Exit codes: 0 all explained, 3 some inputs failed (see DIR/failures/), 2 usage, 1 failure, 130 interrupted.
    """
    from ..batch import BatchMismatchError, list_items, run_batch
    from ..batch.engines import begin_ray, check_ray
    from ..batch.run import check_cpus_per_worker, check_num_gpus, check_shard_size

    names = methods_list(method_list) if method_list is not None else None
    opts = method_options(options, names) if names is not None else None
    choice = None
    if names is None:
        check_early(options)
    if target is not None and target_column is not None:
        raise click.UsageError("--target and --target-column: give one (a class for every input, or one per input)")
    try:
        check_num_gpus(num_gpus, engine)
        check_shard_size(shard_size, engine)
        check_cpus_per_worker(cpus_per_worker, engine)
        items = list_items(source, column, target_column, exclude=[out])
    except ValueError as e:
        raise click.UsageError(one_line(e)) from None
    if png and items[0].kind != "image":
        raise click.UsageError("--png writes overlays of images; this source holds texts")
    if engine == "local" and (address or num_workers > 1):
        raise click.UsageError("--address and --num-workers are for --engine ray")
    ray_start = None
    if engine == "ray":
        try:
            check_ray()
        except ImportError as e:
            raise Failure(one_line(e)) from None
        # the runtime starts in the background while this process loads the model (seconds each)
        ray_start = begin_ray(address, num_workers, cpus_per_worker)
    try:
        out = prepare_out(out)
        lm = load(model_spec, weights, items[0].kind)
        if names is None:  # no -m: the kind's measured default, said on stderr once done
            choice = default_choice(lm, text=items[0].text, pairs=any(i.pair is not None for i in items))
            chosen = chosen_options(choice, options)
            names, opts = [choice.method], ({choice.method: chosen} if chosen else {})
        bar = _progress_bar()
        argv = sys.argv[1:]
        command = shlex.join(["attnroll", *argv[argv.index("batch"):]]) if "batch" in argv else None
        with bar if bar is not None else _null():
            result = run_batch(source, out, methods=names, options=opts, model=model_spec, weights=weights,
                               loaded=lm, engine=engine, batch_size=batch_size, shard_size=shard_size,
                               num_workers=num_workers, address=address, png=png, column=column, target=target,
                               target_column=target_column, num_gpus=num_gpus,
                               cpus_per_worker=cpus_per_worker, overwrite=overwrite,
                               progress=_Bar(bar, f"{','.join(names)}") if bar is not None else None,
                               command=command, ray_start=ray_start, **load_flags())
    except BatchMismatchError as e:
        raise click.UsageError(one_line(e)) from None
    except ImportError as e:  # Ray installed without what Ray Data needs (found when it is imported)
        raise Failure(one_line(e)) from None
    finally:
        if ray_start is not None:  # the model did not load, say: the runtime started for nothing stops
            ray_start.stop()
    echo_notes(model_spec, lm)
    announce(choice)
    click.echo(result.summary())
    return SOME_FAILED if result.failed else 0


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()
