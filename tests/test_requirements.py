"""The declared requirements are true: the installed transformers is inside the range the adapter works
with (this test fails when it is not), pyproject declares that same range, and the Python floor is one the
code runs on (syntax checked at the floor's grammar; the running interpreter is at or above it)."""

import ast
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _floor() -> tuple[int, int]:
    spec = PYPROJECT["project"]["requires-python"]
    assert spec.startswith(">="), spec
    major, minor = spec[2:].split(".")[:2]
    return int(major), int(minor)


def test_the_installed_transformers_is_in_the_adapters_range():
    T = pytest.importorskip("transformers")
    from packaging.version import Version

    from attnroll.capture.hf import TRANSFORMERS_RANGE

    (lo_major, lo_minor), (hi_major, hi_minor) = TRANSFORMERS_RANGE
    v = Version(T.__version__)
    assert Version(f"{lo_major}.{lo_minor}") <= v < Version(f"{hi_major}.{hi_minor}"), T.__version__


def test_pyproject_declares_the_adapters_range():
    from attnroll.capture.hf import TRANSFORMERS_RANGE

    (lo_major, lo_minor), (hi_major, _) = TRANSFORMERS_RANGE
    want = f"transformers>={lo_major}.{lo_minor},<{hi_major}"
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("hf", "text"):
        assert want in extras[extra], (extra, extras[extra])


def test_versions_outside_the_range_are_refused_or_warned():
    from attnroll import UnsupportedModelError
    from attnroll.capture.hf import check_transformers_version

    with pytest.raises(UnsupportedModelError, match=r"needs transformers>=5.0,<6; transformers 4.46.3 is installed"):
        check_transformers_version("4.46.3")
    with pytest.warns(RuntimeWarning, match="6.1.0 is newer"):
        check_transformers_version("6.1.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_transformers_version("5.0.0rc1")
        check_transformers_version("5.24.0")


def test_the_python_floor_is_true():
    floor = _floor()
    assert sys.version_info[:2] >= floor
    for f in (ROOT / "src").rglob("*.py"):  # every file parses with the floor's grammar
        ast.parse(f.read_text(encoding="utf-8"), filename=str(f), feature_version=floor)
    # the code needs what the floor has: BaseException.add_note is 3.11 (capture's helpful-error path)
    uses_add_note = any("add_note(" in f.read_text(encoding="utf-8") for f in (ROOT / "src").rglob("*.py"))
    assert not uses_add_note or floor >= (3, 11)
