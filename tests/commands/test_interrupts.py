"""Ctrl-C and SIGTERM sent to a real ``attnroll`` process at several points of its work: it exits
130 / 143 with one ``error:`` line, and the output folder holds only complete files (no temporary files, no
half-written ones).

The points are made exact by a ``sitecustomize`` module that this test puts on the child's path: it pauses
the child at the chosen point of the chosen write (right after a temporary file is created, or half-way
through writing one) and says so on stderr; the test then sends the signal. Nothing in attnroll knows."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("click")
pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

import attnroll  # noqa: E402
from attnroll.explain.explanation import Explanation  # noqa: E402

# slow: real attnroll processes signalled mid-write.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")]

SITE = textwrap.dedent('''
    import os, sys, tempfile, time

    POINT = os.environ.get("ATTNROLL_TEST_PAUSE")  # "tmp:K" or "half:K": the K-th output file (1-based)
    if POINT:
        kind, k = POINT.split(":")
        k = int(k)
        count = [0]
        real_mkstemp, real_fdopen = tempfile.mkstemp, os.fdopen

        def mkstemp(*a, **kw):
            fd, name = real_mkstemp(*a, **kw)
            if kw.get("suffix") == ".tmp":
                count[0] += 1
                if kind == "tmp" and count[0] == k:
                    print("PAUSED", name, file=sys.stderr, flush=True)
                    time.sleep(3)  # signals are held back here; they arrive when the write starts
            return fd, name

        class Half:
            def __init__(self, f):
                self.f, self.first = f, True

            def write(self, data):
                if self.first and kind == "half" and count[0] == k and len(data) > 1:
                    self.first = False
                    self.f.write(data[: len(data) // 2])
                    self.f.flush()
                    print("PAUSED half", file=sys.stderr, flush=True)
                    time.sleep(60)  # interrupted by the signal
                return self.f.write(data)

            def __getattr__(self, name):
                return getattr(self.f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

        def fdopen(fd, *a, **kw):
            return Half(real_fdopen(fd, *a, **kw))

        tempfile.mkstemp = mkstemp
        os.fdopen = fdopen
''')


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("interrupt")
    (d / "site").mkdir()
    (d / "site" / "sitecustomize.py").write_text(SITE)
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(d / f"im{i}.png")
    exe = shutil.which("attnroll", path=os.path.dirname(sys.executable)) or shutil.which("attnroll")
    if exe is None:
        pytest.skip("the attnroll console script is not installed")
    return d, exe


def start(setup, out: Path, pause: str | None):
    d, exe = setup
    src = str(Path(attnroll.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d / "site"), src]), "OMP_NUM_THREADS": "1"}
    if pause:
        env["ATTNROLL_TEST_PAUSE"] = pause
    cmd = [exe, "explain", str(d / "im0.png"), str(d / "im1.png"), "--model", "shapes", "--format",
           "png,json,npz,html", "--out", str(out)]
    # A child of a shell that ignores SIGINT would inherit that; give it the default, as a terminal does.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def complete(path: Path) -> bool:
    """Whether a file the command writes is whole: it parses as what its suffix says."""
    try:
        if path.suffix == ".npz":
            Explanation.load(path)
        elif path.suffix == ".png":
            with Image.open(path) as im:
                im.load()
        elif path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".html":
            return path.read_text().rstrip().endswith("</html>")
        else:
            return False
    except Exception:  # noqa: BLE001 - anything unreadable is incomplete
        return False
    return True


def check_folder(out: Path) -> list[str]:
    names = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [n for n in names if n.endswith(".tmp") or n.startswith(".")], names
    assert all(complete(out / n) for n in names), names
    return names


def wait_for(proc, marker: str) -> None:
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith(marker):
            return
    raise AssertionError(f"the child never reached {marker!r}; rc={proc.wait()}, stderr: {''.join(lines)}")


EXIT = {signal.SIGINT: (130, "error: interrupted"), signal.SIGTERM: (143, "error: terminated")}


# Each signal at each kind of point (just after a temporary file is created / half-way through writing
# one), on the first file and on a later one (earlier files complete). One child process per case.
@pytest.mark.parametrize("sig, pause, done_before", [
    (signal.SIGINT, "tmp:1", 0), (signal.SIGTERM, "half:1", 0), (signal.SIGTERM, "tmp:3", 2),
    (signal.SIGINT, "half:6", 5),
], ids=["SIGINT-tmp1", "SIGTERM-half1", "SIGTERM-tmp3", "SIGINT-half6"])
def test_a_signal_during_a_write_leaves_only_complete_files(setup, tmp_path, sig, pause, done_before):
    out = tmp_path / "out"
    proc = start(setup, out, pause)
    wait_for(proc, "PAUSED")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    code, line = EXIT[sig]
    assert proc.returncode == code, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith(line) and "Traceback" not in err, err
    assert len(check_folder(out)) == done_before  # the interrupted file is not there, the earlier ones are whole


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_the_model_works_writes_nothing(setup, tmp_path, sig):
    # The output folder is prepared (checked writable) before the model loads; the first output file is
    # written only after the work. A signal as soon as the folder exists lands in between.
    out = tmp_path / "out"
    proc = start(setup, out, None)
    while not out.exists() and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    code, line = EXIT[sig]
    assert proc.returncode == code and err.strip().splitlines()[-1].startswith(line), err
    assert check_folder(out) == []
