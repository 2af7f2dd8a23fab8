"""Methods register themselves when attnroll.methods is imported: every method file is found, a name cannot
be registered twice."""

from pathlib import Path

import pytest

import attnroll
from attnroll.methods import method_info, methods, register

METHOD_DIR = Path(attnroll.__file__).parent / "methods"


def test_every_method_file_registers_a_method():
    files = {p.stem for p in METHOD_DIR.glob("*.py") if not p.stem.startswith("_")} - {"base", "explanation", "batches", "context"}
    modules = {method_info(n).fn.__module__.rsplit(".", 1)[1] for n in methods()}
    assert modules == files


def test_a_duplicate_name_raises_and_keeps_the_first():
    before = method_info("rollout").fn
    with pytest.raises(ValueError, match="'rollout' is already registered"):
        register("rollout", description="an impostor")
    assert method_info("rollout").fn is before


def test_command_modules_each_register_a_command():
    click = pytest.importorskip("click")  # noqa: F841
    from attnroll.commands import cli

    folder = Path(attnroll.__file__).parent / "commands"
    files = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    owners = {c.callback.__module__.rsplit(".", 1)[1] for c in cli.commands.values()}
    assert owners == files
    assert {"explain", "demo", "methods", "evaluate", "audit", "sanity"} <= set(cli.commands)
