"""Entry point of the ``attnroll`` command: a clear message when the ``cli`` extra is missing, instead of a
traceback from an import (the core library needs only numpy, scipy and torch)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        import click  # noqa: F401
    except ImportError:
        print("error: the attnroll command needs the cli extra: pip install 'attnroll[cli]'", file=sys.stderr)
        sys.exit(1)
    from .commands import main as cli_main

    sys.exit(cli_main())  # the exit code (0, 1, 2 or 3) must reach the shell


if __name__ == "__main__":
    main()
