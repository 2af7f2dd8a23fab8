"""Atomic file writes and readers' errors. A leaf module: used by ``Explanation.save`` / ``load``, ``viz``,
the model loaders and the command line alike.

Writes go to a temporary file in the destination folder, then a rename, so that a failure never leaves a
half-written file under the final name. Interrupts included: SIGINT and SIGTERM are held from before the
temporary file exists until the clean-up that removes it is armed, and while a write runs SIGTERM raises
:class:`Terminated` (instead of killing the process on the spot) so that the clean-up runs; a process that
had SIGTERM's default action is then terminated by the signal as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator

#: The signals that interrupt a write: Ctrl-C and a polite kill.
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM while a handler from :func:`terminate_raises` (or an atomic
    write in a process that kept SIGTERM's default action) is installed. A BaseException, like
    KeyboardInterrupt, so that ``except Exception`` does not swallow it; the command line exits 143."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"terminated by signal {signum}")


def terminate_raises() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread for the rest of the process (the command
    line installs this once at start, before any file is written). No-op outside the main thread."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[bool]:
    """For one write in the main thread: if SIGTERM has its default action (kill at once), make it raise
    :class:`Terminated` instead, so that clean-up code runs. Yields whether it did; restores the action."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield False
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def held_signals() -> Iterator[None]:
    """In the main thread: SIGINT and SIGTERM arriving during the block are held (recorded, not acted on)
    and delivered when it ends, through the handlers they had. Python runs signal handlers in the main
    thread whichever thread the OS picked, so this, unlike a thread's signal mask, holds them in a process
    with other threads (torch's, a progress bar's). Elsewhere: a no-op (signals interrupt the main thread,
    not this one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old: dict[int, Any] = {}
    try:
        for s in _SIGNALS:
            old[s] = signal.getsignal(s)
            signal.signal(s, lambda signum, frame: pending.append(signum))
        yield
    finally:
        _restore(list(old.items()))
        if pending:
            _deliver(pending[0], old[pending[0]])


def _restore(handlers: list[tuple[int, Any]]) -> None:
    """Put each (signal, handler) back; a signal acted on as soon as its own handler is back (an interrupt
    raised) does not leave the others' handlers replaced."""
    if handlers:
        try:
            signal.signal(*handlers[0])
        finally:
            _restore(handlers[1:])


def _deliver(signum: int, handler: Any) -> None:
    """Act on a held signal as its handler would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)  # the default action (terminate)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None] | bytes | str, *, mode: str = "wb") -> str:
    """Write ``path`` atomically.

    ``write`` is the content (bytes or str) or a function ``write(fileobj)`` filling an open binary file.
    The data go to ``.<name>.<random>.tmp`` in the same folder, which is renamed over ``path`` only when
    everything was written; on any error or interrupt (KeyboardInterrupt, SIGTERM) the temporary file is
    closed and removed and the exception re-raised — at no instant is an interrupt able to leave it (or its
    descriptor) behind: signals are held from before the temporary file is created until it is open as a
    file object that the clean-up knows, and a second interrupt arriving while the clean-up runs does not
    stop it (:func:`_discard`). Returns the path written.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp, f = None, None
    with _sigterm_raises() as temporary:
        try:
            with held_signals():  # a signal held here is delivered at the end of the block, with `tmp` known
                fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
                try:
                    f = os.fdopen(fd, "wb")
                except BaseException:
                    os.close(fd)
                    raise
            with f:
                if callable(write):
                    write(f)
                elif isinstance(write, str):
                    f.write(write.encode("utf-8"))
                else:
                    f.write(write)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException as exc:
            _discard(f, tmp, exc)
            if temporary and isinstance(exc, Terminated):
                # The process had SIGTERM's default action: die by the signal, as it would have.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            raise
    return path


#: How many interrupts :func:`_discard` outlasts before it gives up on the temporary file.
_DISCARD_TRIES = 20


def _discard(f: Any, tmp: str | None, exc: BaseException) -> None:
    """Close ``f`` and remove ``tmp`` after ``exc`` stopped a write. An interrupt (KeyboardInterrupt,
    :class:`Terminated`) arriving meanwhile — before the signals are held, or delivered as they are released
    — does not stop the clean-up: it is retried, and the interrupt re-raised once the file is gone (from
    ``exc``, which it supersedes unless ``exc`` was itself an interrupt)."""
    late: BaseException | None = None
    for _ in range(_DISCARD_TRIES):
        try:
            with held_signals():  # no second interrupt while cleaning up
                if f is not None and not f.closed:
                    with contextlib.suppress(OSError):
                        f.close()
                if tmp is not None and os.path.lexists(tmp):
                    os.unlink(tmp)
            break
        except (KeyboardInterrupt, Terminated) as e:
            late = late or e
        except OSError:
            break  # the folder went away or became read-only: nothing more to do; `exc` says what happened
    if late is not None and not isinstance(exc, (KeyboardInterrupt, Terminated)):
        raise late from exc


# ------------------------------------------------------------------------------------------- readers
@contextlib.contextmanager
def reading(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Context manager around one file's reader: a file that exists but holds the wrong thing (zero
    bytes, truncated, another format, entries missing) raises ``ValueError("<path> is not a valid <what>:
    <why>")`` instead of whatever the parser raised (EOFError, BadZipFile, KeyError, a library's own
    error...). Missing files and permissions (FileNotFoundError, IsADirectoryError, PermissionError)
    pass unchanged: they already say so. Keep the block to the reading and parsing of that one file."""
    path = os.fspath(path)
    try:
        yield
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as e:  # noqa: BLE001 - any parser error here means a malformed file
        if isinstance(e, ValueError) and path in str(e):
            raise  # already names the file and what is wrong
        size = os.path.getsize(path) if os.path.isfile(path) else None
        why = "the file is empty (0 bytes)" if size == 0 else f"{type(e).__name__}: {e}"
        raise ValueError(f"{path} is not a valid {what}: {why}") from None
