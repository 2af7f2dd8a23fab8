"""The ``attnroll`` command line: one module per command, registered on one click group.

Layout:

- :mod:`._group`: the group :data:`cli` (one-line errors, exit codes, ``--debug``) and :func:`main`;
- :mod:`._output`: :class:`~._output.Failure` (exit 1, one line), the output folder, atomic writes, progress;
- :mod:`._args`: parsing ``-o KEY=VALUE``, ``--target``, ``--methods`` and per-method options;
- :mod:`._data`: reading images, text files and the generated datasets; loading ``--model`` (through
  :func:`attnroll.models.load_model`) with one-line errors;
- one public module per command: ``explain``, ``view``, ``context``, ``demo``, ``methods``, ``evaluate``, ``audit``,
  ``sanity``, ``batch``.

**Adding a command** is writing one file, ``commands/<name>.py``::

    import click
    from ._group import cli
    from ._output import Failure, prepare_out, write

    @cli.command("name", short_help="One line for 'attnroll --help'.")
    @click.option(...)
    def name_cmd(...) -> None | int:
        ...                              # return an int to set the exit code (default 0)

Every module of this package whose name does not start with ``_`` is imported when the package is (in
alphabetical order; click lists commands by name anyway), and its ``@cli.command`` decorators register it.
Nothing else is edited. Conventions: usage errors raise ``click.UsageError`` (exit 2), other failures
:class:`~._output.Failure` or any exception (exit 1, one line); every file is written with
:func:`~._output.write` (atomic) after all inputs were checked. A command module's top level imports only
click and this package's helpers; torch, the models, methods and pictures are imported inside the command
function, so that ``--help`` and usage errors need no torch (``tests/test_imports.py`` checks).

Exit codes: 0 success, 2 usage error, 1 failure, 3 ``attnroll audit --fail-if-flagged`` flagged a shift,
3 ``attnroll batch`` completed with some inputs in its failures table, 130 interrupted (Ctrl-C), 143 terminated
(SIGTERM).
"""

import importlib as _importlib
import pkgutil as _pkgutil

from ._group import cli, main

__all__ = ["cli", "main"]


def _register_commands() -> None:
    for m in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not m.name.startswith("_"):
            _importlib.import_module(f"{__name__}.{m.name}")


_register_commands()
