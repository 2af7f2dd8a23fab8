"""Start-up cost: ``import attnroll`` and the ``attnroll`` command's ``--help`` and usage errors import no heavy
library (torch and the optional dependencies load with the first function that needs them), and every public
name still resolves. Each check runs in a fresh interpreter, whose ``sys.modules`` is the evidence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Libraries that must not load before a function needs them.
HEAVY = ("torch", "transformers", "timm", "matplotlib", "ray", "pandas", "pyarrow", "numba",
         "sentence_transformers", "captum", "PIL")


def fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter that imports this checkout's attnroll."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300)


def loaded(code: str) -> dict:
    """Run ``code`` in a new interpreter; its last stdout line is JSON."""
    out = fresh(code)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_check_sees_an_import():
    # the same measure as below, on a module the child does import (json) next to one it does not
    got = loaded("import sys, json; print(json.dumps(sorted(m for m in ('json', 'no_such_module') if m in sys.modules)))")
    assert got == ["json"]


def test_import_attnroll_loads_no_heavy_library():
    # torch too: the command line lives inside the package, so its --help pays for whatever this import loads
    got = loaded(f"""
        import sys, json, attnroll
        print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))""")
    assert got == []


# Every command's help, then usage errors that click finds (unknown command or option, a value of the wrong
# type or outside its range or choices, a missing argument): (arguments, exit code). The commands are read
# from the group itself, so that a new command is covered as soon as it exists.
CLI_SCRIPT = """
    import sys, json
    from attnroll._entry import main

    HEAVY = {heavy!r}

    def run(args):
        sys.argv = ["attnroll", *args]
        try:
            main()
        except SystemExit as e:
            return e.code

    from attnroll.commands import cli
    commands = sorted(cli.commands)
    calls = [["--help"], ["--version"], ["no-such-command"], ["--no-such-option"]]
    calls += [[c, "--help"] for c in commands] + [[c, "--no-such-option"] for c in commands]
    calls += [["explain", "--top", "many"], ["explain", "--unit", "page"], ["audit", "--format", "gif"],
              ["evaluate", "--n", "0"], ["batch"], ["demo", "--images", "99"]]
    report = []
    for args in calls:
        code = run(args)
        report.append([args, code, sorted(m for m in HEAVY if m in sys.modules)])
    print(json.dumps({{"commands": commands, "calls": report}}))
"""


def test_help_and_usage_errors_import_no_torch():
    got = loaded(CLI_SCRIPT.format(heavy=HEAVY))
    assert {"audit", "batch", "demo", "evaluate", "explain", "methods", "sanity", "view"} <= set(got["commands"])
    for args, code, heavy in got["calls"]:  # the modules accumulate: the first call that loads one is named
        assert heavy == [], f"'attnroll {' '.join(args)}' imported {heavy}"
        expected = 0 if args[-1] in ("--help", "--version") else 2
        assert code == expected, f"'attnroll {' '.join(args)}' exited {code}, expected {expected}"


def test_python_m_attnroll_is_the_command():
    out = fresh("import runpy, sys; sys.argv = ['attnroll', 'no-such-command']; "
                "runpy.run_module('attnroll', run_name='__main__')")
    assert out.returncode == 2 and "No such command 'no-such-command'" in out.stderr, out.stderr


@pytest.mark.slow
def test_every_public_name_resolves_on_first_use():
    got = loaded("""
        import sys, json, attnroll
        listed = sorted(set(attnroll.__all__) - set(dir(attnroll)))
        missing = [n for n in attnroll.__all__ if getattr(attnroll, n, None) is None]
        import attnroll.core.rollout, attnroll.explain.context_attribution, attnroll.batch.read, attnroll._system
        same = {
            "rollout": attnroll.rollout is attnroll.core.rollout.rollout,
            "context_attribution": attnroll.context_attribution
                                   is sys.modules["attnroll.explain.context_attribution"].context_attribution,
            "explain": attnroll.explain is sys.modules["attnroll.explain"],
            "read_batch": attnroll.read_batch is attnroll.batch.read.read_batch,
            "attention_flow": attnroll.attention_flow is attnroll._system.attention_flow,
            "capture": attnroll.capture is sys.modules["attnroll.capture"],
        }
        ns = {}
        exec("from attnroll import *", ns)
        try:
            attnroll.no_such_name
            unknown = "no error"
        except AttributeError as e:
            unknown = str(e)
        print(json.dumps({"listed": listed, "missing": missing, "same": same, "star": sorted(set(ns) - {"__builtins__"}),
                          "all": sorted(attnroll.__all__), "unknown": unknown, "core": attnroll.core.__name__}))""")
    assert got["listed"] == [], "names of __all__ missing from dir(attnroll)"
    assert got["missing"] == []
    assert all(got["same"].values()), got["same"]
    assert got["star"] == got["all"]
    assert got["unknown"] == "module 'attnroll' has no attribute 'no_such_name'"
    assert got["core"] == "attnroll.core"  # subpackages are reachable as attributes too


def test_the_metrics_help_lists_the_registered_metrics():
    pytest.importorskip("click")
    from attnroll.commands.evaluate import HELP_METRICS
    from attnroll.evaluate import metric_names

    assert set(HELP_METRICS) == {"image", "text"}
    for kind, (plain, masked) in HELP_METRICS.items():
        assert list(plain) == metric_names(kind, masks=False), kind
        assert list(masked) == metric_names(kind, masks=True), kind
    written = [m for plain, masked in HELP_METRICS.values() for m in (*plain, *masked)]
    assert sorted(written) == sorted(metric_names())
