"""The documents and code speak to users: no development-process references ("issue 15", "session 4") in the
product's folders and top-level documents, and the two result documents stay short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "docs", "benchmarks", "examples", "tools")
DOCUMENTS = ("README.md", "EVALUATION.md", "BENCHMARKS.md")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".json", ".js", ".css", ".html", ".yaml", ".yml"}
MAX_LINES = {"EVALUATION.md": 400, "BENCHMARKS.md": 400}

PROCESS_WORD = re.compile(r"\b(?:issue|session)s?[ _-]?\d+", re.IGNORECASE)


def _product_files() -> list[Path]:
    files = [ROOT / d for d in DOCUMENTS]
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return files


def process_words(text: str) -> list[tuple[int, str]]:
    """(line number, matched text) of every development-process reference in ``text``."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in PROCESS_WORD.finditer(line)]


@pytest.mark.parametrize("text, found", [
    ("as issue 15 asked", ["issue 15"]),
    ("Session 4: measuring", ["Session 4"]),
    ("benchmarks/issue15_validation/x.py", ["issue15"]),
    ("both session-9 scripts", ["session-9"]),
    ("issues 14, 16", ["issues 14"]),
    ("the capture session waits; a session's hooks; 2 sessions", []),
    ("tissue 3 and reissue 4", []),
])
def test_the_pattern_finds_process_words_and_nothing_else(text, found):
    assert [w for _, w in process_words(text)] == found


def test_no_process_words_in_the_product():
    files = _product_files()
    assert len(files) > 50, "the scan found too few files: is the repository layout what this test expects?"
    hits = []
    for path in files:
        for n, word in process_words(path.read_text(encoding="utf-8", errors="replace")):
            hits.append(f"{path.relative_to(ROOT)}:{n}: {word!r}")
    assert not hits, ("development-process references (say what the thing is instead):\n" + "\n".join(hits))


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_the_result_documents_stay_short(name):
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES[name], (
        f"{name} has {lines} lines, more than {MAX_LINES[name]}: keep the latest figure of each measurement "
        "with its command there, and move how it was reached to docs/research/")


def test_the_research_notes_and_tools_are_linked_from_the_documents():
    evaluation, benchmarks = (ROOT / "EVALUATION.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()
    for target in re.findall(r"\]\(((?:docs|tools)/[^)#]+)", evaluation + benchmarks):
        assert (ROOT / target).exists(), f"a link to {target}, which does not exist"
    assert "docs/research/value-aware-shapes.md" in evaluation
    assert "docs/research/batch-engine.md" in benchmarks
