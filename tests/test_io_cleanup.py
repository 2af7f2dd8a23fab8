"""The clean-up of an interrupted atomic write is itself safe from interrupts: a Ctrl-C that lands while the
temporary file is being created, opened or removed, or while the signal handlers are being put back, leaves
no temporary file, no open descriptor and no replaced handler. Each interrupt is simulated at that exact
point (a real SIGINT sent to this process, or a patched call raising KeyboardInterrupt)."""

from __future__ import annotations

import os
import signal
import sys
import tempfile

import pytest

from attnroll import _io
from attnroll._io import atomic_write, held_signals

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.fixture(autouse=True)
def python_sigint():
    """Python's own SIGINT handler whatever the runner inherited (a background run starts with it ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def tmp_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def opened(monkeypatch):
    """Records the descriptor of each temporary file; ``opened.then`` runs right after it is created."""
    real = tempfile.mkstemp
    fds: list[int] = []

    def mkstemp(*a, **k):
        fd, name = real(*a, **k)
        fds.append(fd)
        if mkstemp.then is not None:
            mkstemp.then()
        return fd, name

    mkstemp.then = None
    mkstemp.fds = fds
    monkeypatch.setattr(_io.tempfile, "mkstemp", mkstemp)
    return mkstemp


def test_ctrl_c_while_the_temporary_file_is_created_closes_its_descriptor(tmp_path, opened):
    opened.then = lambda: os.kill(os.getpid(), signal.SIGINT)  # held, delivered as the creation ends
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.bin", b"data")
    assert tmp_files(tmp_path) == [] and not (tmp_path / "a.bin").exists()
    assert not is_open(opened.fds[0])


def test_an_interrupt_while_the_descriptor_is_opened_as_a_file_closes_it(tmp_path, opened, monkeypatch):
    def fdopen(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(_io.os, "fdopen", fdopen)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.bin", b"data")
    monkeypatch.undo()
    assert tmp_files(tmp_path) == [] and not is_open(opened.fds[0])


@pytest.mark.parametrize("first", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_second_ctrl_c_while_the_temporary_file_is_removed_does_not_leave_it(tmp_path, monkeypatch, first):
    real, calls = os.unlink, []

    def unlink(path, *a, **k):
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt  # the second Ctrl-C, landing on the removal
        return real(path, *a, **k)

    def writer(f):
        f.write(b"partial")
        monkeypatch.setattr(_io.os, "unlink", unlink)
        raise first

    with pytest.raises((KeyboardInterrupt, RuntimeError)) as got:
        atomic_write(tmp_path / "a.bin", writer)
    monkeypatch.undo()
    assert tmp_files(tmp_path) == [] and not (tmp_path / "a.bin").exists()
    assert isinstance(got.value, KeyboardInterrupt)  # the interrupt is not lost: the program still stops
    assert len(calls) == 2


def test_a_ctrl_c_before_the_clean_up_holds_the_signals_does_not_leave_the_file(tmp_path, monkeypatch):
    real, entered = _io.held_signals, []

    def held():
        entered.append(1)
        if len(entered) == 2:  # the clean-up's: the interrupt lands before the signals are held
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(_io, "held_signals", held)

    def writer(f):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.bin", writer)
    monkeypatch.undo()
    assert tmp_files(tmp_path) == [] and len(entered) == 3


def test_a_ctrl_c_while_the_handlers_are_put_back_restores_every_handler(monkeypatch):
    def mine(signum, frame):
        pass

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, mine)
    real, fired = signal.signal, []

    def patched(signum, handler):
        old = real(signum, handler)
        if signum == signal.SIGINT and handler is signal.default_int_handler and not fired:
            fired.append(1)
            raise KeyboardInterrupt  # acted on as soon as SIGINT's own handler is back
        return old

    try:
        monkeypatch.setattr(_io.signal, "signal", patched)
        with pytest.raises(KeyboardInterrupt):
            with held_signals():
                pass
        monkeypatch.undo()
        assert fired and signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        monkeypatch.undo()
        for s, h in before.items():
            signal.signal(s, h)
