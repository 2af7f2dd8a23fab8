"""Entry point of the ``attnroll`` command: a clear message when the ``cli`` extra is missing, instead of a
traceback from an import (the core library needs only numpy, scipy and torch)."""

from __future__ import annotations

import sys


def main() -> None:
    # Signals first: an interrupt during the imports below (click and the commands' declarations; torch loads
    # later, inside the command that needs it) is still one line and the conventional exit code (130 for
    # Ctrl-C, 143 for SIGTERM), not a traceback.
    from ._io import Terminated, terminate_raises

    terminate_raises()
    try:
        try:
            import click  # noqa: F401
        except ImportError:
            print("error: the attnroll command needs the cli extra: pip install 'attnroll[cli]'", file=sys.stderr)
            sys.exit(1)
        from .commands import main as cli_main
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except Terminated:
        print("error: terminated (SIGTERM)", file=sys.stderr)
        sys.exit(143)
    sys.exit(cli_main())  # the exit code (0, 1, 2, 3, 130 or 143) must reach the shell


if __name__ == "__main__":
    main()
