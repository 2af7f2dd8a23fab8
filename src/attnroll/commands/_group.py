"""The ``attnroll`` click group and the console entry point. Commands register on :data:`cli` with
``@cli.command(...)`` from their own module (see :mod:`attnroll.commands`)."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import click

from .._io import Terminated, terminate_raises
from ._output import one_line

__all__ = ["Group", "cli", "main"]


class Group(click.Group):
    """A click group whose errors are one line (usage errors exit 2, failures 1, Ctrl-C 130, SIGTERM 143);
    ``--debug`` re-raises. Warnings raised while a command runs are not printed as Python prints them (two
    lines each, before the error): each distinct one becomes one ``warning: ...`` line, or, when the command
    fails, part of its one error line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        argv = list(sys.argv[1:] if args is None else args)
        head = argv[: argv.index("--")] if "--" in argv else argv
        debug = "--debug" in head
        terminate_raises()  # SIGTERM unwinds like Ctrl-C (clean-up runs, exit 143); before any file exists
        with warnings.catch_warnings(record=True) as caught:
            code, message = self._run(argv, complete_var, debug, extra)
        notes = _warning_lines(caught)
        if message is not None:
            click.echo(message + (f" (warnings: {'; '.join(notes)})" if notes else ""), err=True)
        else:
            for note in notes:
                click.echo(f"warning: {note}", err=True)
        if standalone_mode:
            sys.exit(code)
        return code

    def _run(self, argv: list[str], complete_var: Any, debug: bool, extra: dict) -> tuple[int, str | None]:
        """Run the command: (exit code, the one error line or None)."""
        try:
            rv = super().main(argv, "attnroll", complete_var, standalone_mode=False, **extra)
            return (rv if isinstance(rv, int) else 0), None
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            return 0, None
        except click.UsageError as e:
            if debug:
                raise
            where = e.ctx.command_path if e.ctx is not None else "attnroll"
            return 2, f"error: {one_line(e.format_message())} (see '{where} --help')"
        except click.ClickException as e:
            if debug:
                raise
            return e.exit_code, f"error: {one_line(e.format_message())}"
        except click.Abort as e:
            # click turns Ctrl-C into Abort; EOF on a prompt too (that one is a failure).
            if isinstance(e.__cause__ or e.__context__, KeyboardInterrupt):
                return 130, "error: interrupted"
            return 1, "error: aborted"
        except KeyboardInterrupt:
            return 130, "error: interrupted"
        except Terminated:
            return 143, "error: terminated (SIGTERM)"
        except Exception as e:  # noqa: BLE001 - the command line reports every failure as one line
            if debug:
                raise
            return 1, f"error: {one_line(str(e)) or type(e).__name__}"


def _warning_lines(caught: list) -> list[str]:
    """The distinct messages of the recorded warnings, one line each, in order."""
    out: list[str] = []
    for w in caught:
        msg = one_line(str(w.message))
        if msg and msg not in out:
            out.append(msg)
    return out


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
    attnroll context --model DIR --prompt q.txt --passages docs.txt --generate 20   which passages an answer used
    attnroll methods                      the registered methods, with references
    attnroll evaluate                     score methods: deletion/insertion, perturbation AUC, localisation
    attnroll audit shapes shapes-marker   how reliance shifts between two checkpoints
    attnroll sanity                       cascading randomisation: do the maps depend on the weights?
    attnroll batch photos/ --out maps/    a whole dataset into resumable Parquet (local or Ray)
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnroll`` console script; returns the exit code (0, 1, 2, 3, 130 on Ctrl-C or 143
    on SIGTERM)."""
    return cli.main(argv, prog_name="attnroll", standalone_mode=False)
