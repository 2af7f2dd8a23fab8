"""The ``attnroll`` click group and the console entry point. Commands register on :data:`cli` with
``@cli.command(...)`` from their own module (see :mod:`attnroll.commands`)."""

from __future__ import annotations

import os
import sys

import click

from ._output import one_line

__all__ = ["Group", "cli", "main"]


class Group(click.Group):
    """A click group whose errors are one line (usage errors exit 2, failures 1); ``--debug`` re-raises."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        argv = list(sys.argv[1:] if args is None else args)
        head = argv[: argv.index("--")] if "--" in argv else argv
        debug = "--debug" in head
        try:
            rv = super().main(argv, "attnroll", complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            code = 0
        except click.UsageError as e:
            if debug:
                raise
            where = e.ctx.command_path if e.ctx is not None else "attnroll"
            click.echo(f"error: {one_line(e.format_message())} (see '{where} --help')", err=True)
            code = 2
        except click.ClickException as e:
            if debug:
                raise
            click.echo(f"error: {one_line(e.format_message())}", err=True)
            code = e.exit_code
        except click.Abort:
            click.echo("error: aborted", err=True)
            code = 1
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            code = 130
        except Exception as e:  # noqa: BLE001 - the command line reports every failure as one line
            if debug:
                raise
            click.echo(f"error: {one_line(str(e)) or type(e).__name__}", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
@click.version_option(package_name="attnroll", prog_name="attnroll")
def cli(debug: bool) -> None:
    """attnroll: explain what a transformer looked at (attention rollout, flow and their variants).

    \b
    attnroll demo                         pictures from the embedded models into ./attnroll-demo/
    attnroll explain cat.png --model DIR  explain an image with a local transformers model
    attnroll explain --text "..." --pair "..."   which words make two sentences similar
    attnroll view cat.png --model DIR     one interactive HTML page: layers, methods, heads, values
    attnroll methods                      the registered methods, with references
    attnroll evaluate                     score methods: deletion/insertion, perturbation AUC, localisation
    attnroll audit shapes shapes-marker   how reliance shifts between two checkpoints
    attnroll sanity                       cascading randomisation: do the maps depend on the weights?
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnroll`` console script; returns the exit code (0, 1, 2, 3 or 130)."""
    return cli.main(argv, prog_name="attnroll", standalone_mode=False)
