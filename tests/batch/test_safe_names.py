"""File names made from data (``attnroll._names.safe_name``) and the write-time guard (``inside``): any
string becomes one plain file name inside the output folder, the same on every run, never the name of
another string (also without case), and short. Checked for generated strings and for the known hostile
ones, by writing the files and looking at the whole folder tree."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from attnroll._names import MAX_NAME_BYTES, UnsafePathError, inside, safe_name
from attnroll.batch import overlay_name

HOSTILE = ["..", ".", "", "/", "/etc/passwd", "../../x", "a/../../b", "..\\..\\x", "C:\\Windows\\x", "a\0b",
           "line\nbreak", "tab\there", "\x1b[31mred", "CON", "con", "Con.png", "nul.txt", "COM1", "lpt9.x", "AUX.",
           "trailing.", "trailing ", " lead", ".hidden", ".lock", "manifest.json", "x" * 1000, "é" * 300, "日本語",
           "e\u0301", "\u00e9", "\ud800", "A", "a", "~", "a~b", "png", "rows", "-rf", "*?<>|\"':"]

# Surrogates included: a file name decoded by os.fsdecode can hold them.
any_text = st.text(st.characters(codec=None), max_size=300) | st.sampled_from(HOSTILE)


def plain_component(name: str) -> bool:
    """What every file system takes as one ordinary file name, also Windows and macOS."""
    reserved = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}
    return (0 < len(name.encode("utf-8")) <= MAX_NAME_BYTES and name not in (".", "..")
            and not any(c in name for c in '/\\\0:*?"<>|') and all(32 < ord(c) < 127 for c in name)
            and not name.startswith(".") and not name.endswith((".", " "))
            and name.split(".")[0].lower() not in reserved)


@pytest.mark.slow  # over a second
@settings(max_examples=400, deadline=None)
@given(any_text)
def test_any_string_is_one_plain_file_name_the_same_every_time(s):
    name = safe_name(s)
    assert plain_component(name), repr(name)
    assert safe_name(s) == name  # stable: nothing random, no state
    assert os.path.basename(name) == name and os.path.normpath(name) == name


@settings(max_examples=200, deadline=None)
@given(st.lists(any_text, min_size=2, max_size=30, unique=True))
def test_different_strings_get_names_that_differ_also_without_case(strings):
    names = [safe_name(s).casefold() for s in strings]
    assert len(set(names)) == len(strings)


def test_the_known_hostile_names_and_their_case_variants_are_distinct():
    strings = sorted(set(HOSTILE + [s.upper() for s in HOSTILE] + [s.lower() for s in HOSTILE]))
    names = [safe_name(s).casefold() for s in strings]
    assert len(set(names)) == len(strings)
    # names that become equal once sanitised (a/b, a\b, a:b, a b) and differ only in case stay apart
    assert len({safe_name(s).lower() for s in ("a/b", "a\\b", "a:b", "a b", "a_b", "A_b", "a_B")}) == 7


def test_a_plain_lower_case_name_is_kept_and_others_keep_their_readable_part():
    for s in ("img001.png", "cat", "row-3_a.b", "x+y=z,w@v"):
        assert safe_name(s) == s
    assert safe_name("deeper/Img001.png").startswith("deeper_Img001.png~")
    assert safe_name("CON").startswith("_CON~") and safe_name("..").startswith("_..~")


@pytest.mark.slow  # over a second
@settings(max_examples=200, deadline=None)
@given(any_text, st.sampled_from(["rollout", "gae", "per_head_rollout"]))
def test_writing_any_id_as_an_overlay_creates_one_file_in_the_folder_and_nothing_else(tmp_path_factory, s, method):
    root = tmp_path_factory.mktemp("t")
    out = root / "out" / "png"
    out.mkdir(parents=True)
    path = inside(out, overlay_name(s, method))
    path.write_bytes(b"x")
    tree = sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))
    assert tree == ["out", "out/png", f"out/png/{path.name}"]
    assert len(path.name.encode()) <= MAX_NAME_BYTES + len(f".{method}.png")


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/etc/passwd", "a\\b", "a\0b"])
def test_the_write_guard_refuses_anything_but_one_plain_component(tmp_path, name):
    with pytest.raises(UnsafePathError, match="refusing to write"):
        inside(tmp_path, name)


def test_the_write_guard_refuses_a_link_that_leads_outside(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x.png").symlink_to(tmp_path / "elsewhere.png")
    with pytest.raises(UnsafePathError, match="outside the output folder"):
        inside(tmp_path / "out", "x.png")
    assert inside(tmp_path / "out", "y.png") == tmp_path / "out" / "y.png"


def test_only_strings_have_names():
    with pytest.raises(TypeError, match="takes a str, got bytes"):
        safe_name(b"x")
