"""Load a script of the repository's ``tools/`` folder by its path (``tools/`` is not part of the package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(relative: str) -> ModuleType:
    """The module of ``tools/<relative>`` (e.g. ``"train/train_shapes.py"``), imported once per process."""
    path = TOOLS / relative
    name = "attnroll_tools_" + path.with_suffix("").relative_to(TOOLS).as_posix().replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"load_tool: no script at {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
