"""Atomic writes under interrupts: at no instant can KeyboardInterrupt or SIGTERM leave a
temporary file behind or a half-written file under the final name. The interrupt is raised at chosen points
of the write (inside the writer, in the window right after the temporary file is created, at the rename),
in this process and in a child process that keeps SIGTERM's default action."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from attnroll import _io
from attnroll._io import Terminated, atomic_write

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

OLD, NEW = b"old complete content\n", b"x" * 10_000


@pytest.fixture(autouse=True, scope="module")
def python_sigint():
    """Python's own SIGINT handler for these tests, whatever the runner inherited: a test suite started in the
    background by a non-interactive shell (``nohup … &``) begins with SIGINT ignored, so no KeyboardInterrupt
    would ever arrive."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # in the child, before exec: Python then installs its handler


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture
def sigterm_raises():
    before = signal.getsignal(signal.SIGTERM)
    _io.terminate_raises()
    yield
    signal.signal(signal.SIGTERM, before)


class Chunked:
    """A writer that writes NEW in chunks and is interrupted (by ``fire()``) before chunk ``at``."""

    def __init__(self, at: int, fire):
        self.at, self.fire = at, fire

    def __call__(self, f):
        for i in range(10):
            if i == self.at:
                self.fire()
            f.write(NEW[i * 1000:(i + 1) * 1000])


def _sigint():
    os.kill(os.getpid(), signal.SIGINT)


def _sigterm():
    os.kill(os.getpid(), signal.SIGTERM)


@settings(max_examples=15)
@given(at=st.integers(0, 9), kind=st.sampled_from(["KeyboardInterrupt", "SIGINT", "SIGTERM"]), existing=st.booleans())
def test_interrupt_anywhere_inside_the_writer_leaves_only_complete_files(at, kind, existing):
    before = signal.getsignal(signal.SIGTERM)
    _io.terminate_raises()
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "out.bin"
            if existing:
                path.write_bytes(OLD)

            def raise_kbd():
                raise KeyboardInterrupt

            fire = {"KeyboardInterrupt": raise_kbd, "SIGINT": _sigint, "SIGTERM": _sigterm}[kind]
            with pytest.raises(Terminated if kind == "SIGTERM" else KeyboardInterrupt):
                atomic_write(path, Chunked(at, fire))
            assert leftovers(Path(d)) == []
            assert (path.read_bytes() == OLD) if existing else not path.exists()
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("fire, exc", [(_sigint, KeyboardInterrupt), (_sigterm, Terminated)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_right_after_the_temporary_file_is_created_is_cleaned_up(tmp_path, monkeypatch, sigterm_raises,
                                                                          fire, exc):
    real = tempfile.mkstemp
    created = []

    def mkstemp_then_signal(*a, **k):
        fd, name = real(*a, **k)
        created.append(name)
        fire()  # arrives before atomic_write has even seen the name: held until it has
        return fd, name

    monkeypatch.setattr(_io.tempfile, "mkstemp", mkstemp_then_signal)
    with pytest.raises(exc):
        atomic_write(tmp_path / "a.bin", NEW)
    assert created and not os.path.exists(created[0])
    assert leftovers(tmp_path) == [] and not (tmp_path / "a.bin").exists()
    # The handlers are back as they were: a later signal acts at once.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is _io._raise_terminated


def test_an_interrupt_at_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(OLD)

    def replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(_io.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "a.bin", NEW)
    assert leftovers(tmp_path) == [] and (tmp_path / "a.bin").read_bytes() == OLD


def test_errors_still_clean_up_and_success_writes_everything(tmp_path):
    with pytest.raises(ZeroDivisionError):
        atomic_write(tmp_path / "b.bin", lambda f: (f.write(b"half"), 1 / 0))
    assert leftovers(tmp_path) == [] and not (tmp_path / "b.bin").exists()
    atomic_write(tmp_path / "b.bin", NEW)
    assert (tmp_path / "b.bin").read_bytes() == NEW and leftovers(tmp_path) == []


def test_the_sigterm_action_is_restored_after_a_write(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    atomic_write(tmp_path / "d.bin", NEW)
    assert signal.getsignal(signal.SIGTERM) == before


CHILD = textwrap.dedent("""
    import sys, time
    from attnroll._io import atomic_write

    def slow(f):
        f.write(b"a" * 1000)
        print("HALF", flush=True)
        time.sleep(30)
        f.write(b"b" * 1000)

    atomic_write(sys.argv[1], slow)
""")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_library_process_killed_mid_write_leaves_nothing(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "c.bin")], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env,
                             preexec_fn=_default_sigint)
    assert child.stdout.readline().strip() == b"HALF"
    assert len(leftovers(tmp_path)) == 1  # the write is under way
    child.send_signal(sig)
    child.communicate(timeout=60)
    # The signal keeps its meaning for a library user: the process dies by it (Python re-raises an uncaught
    # KeyboardInterrupt as SIGINT; atomic_write re-sends SIGTERM), after the clean-up.
    assert child.returncode == -sig
    assert leftovers(tmp_path) == [] and not (tmp_path / "c.bin").exists()
