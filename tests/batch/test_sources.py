"""Listing a source: ids, order, pairs and the errors for what cannot be a source."""

from __future__ import annotations

import json

import pytest

from attnroll.batch import list_items


def test_an_image_folder_is_searched_recursively_in_a_stable_order(tmp_path):
    for rel in ("b.png", "a/z.JPG", "a/b/c.webp", ".hidden/x.png", "notes.txt", "a/.x.png"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    items = list_items(tmp_path)
    assert [it.id for it in items] == ["a/b/c.webp", "a/z.JPG", "b.png"]
    assert [it.index for it in items] == [0, 1, 2] and all(it.kind == "image" for it in items)
    assert items[2].path == str(tmp_path / "b.png")


def test_folder_order_is_pathlib_s_and_links_to_files_count_but_links_to_folders_are_not_followed(tmp_path):
    root = tmp_path / "src"
    for rel in ("a-b.png", "a/b.png", "a b/c.png", "A.png", "a.b/x.PNG", "z/deep/er/1.png", "z/deep/er/10.png",
                "z/deep/er/2.png", "outside/o.png"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"")
    (root / "link.png").symlink_to(root / "A.png")
    (root / "linked").symlink_to(root / "z", target_is_directory=True)
    (root / "broken.png").symlink_to(root / "nowhere.png")
    # The reference: pathlib's own order of every image file below, not descending into linked folders.
    expect = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() == ".png"
                    and "linked" not in p.relative_to(root).parts)
    items = list_items(root)
    assert [it.path for it in items] == [str(p) for p in expect]
    assert [it.id for it in items] == [p.relative_to(root).as_posix() for p in expect]
    assert "link.png" in [it.id for it in items] and not any(it.id.startswith("linked/") for it in items)
    assert [it.id for it in items].index("a/b.png") < [it.id for it in items].index("a-b.png")  # parts, not strings


def test_text_lines_with_tab_pairs_and_jsonl(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("one\ntwo\tpair two\n\nfour\n")
    items = list_items(t)
    assert [(it.id, it.text, it.pair) for it in items] == [
        ("line:1", "one", None), ("line:2", "two", "pair two"), ("line:3", "", None), ("line:4", "four", None)]
    assert items[1].source == "two\tpair two"
    j = tmp_path / "t.jsonl"
    j.write_text(json.dumps({"text": "a", "pair": "b", "id": "x"}) + "\n\n" + json.dumps({"text": "c"}) + "\n")
    assert [(it.id, it.text, it.pair) for it in list_items(j)] == [("x", "a", "b"), ("line:3", "c", None)]


def test_tables_need_a_column_and_read_paths_relative_to_the_table(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    pd.DataFrame({"id": ["p", "q"], "path": ["img/1.png", "img/2.png"], "text": ["x", None]}).to_parquet(
        tmp_path / "t.parquet")
    items = list_items(tmp_path / "t.parquet", column="path")
    assert [(it.id, it.kind, it.path) for it in items] == [("p", "image", str(tmp_path / "img/1.png")),
                                                            ("q", "image", str(tmp_path / "img/2.png"))]
    texts = list_items(tmp_path / "t.parquet", column="text")
    assert [(it.kind, it.text) for it in texts] == [("text", "x"), ("text", "")]  # a missing text fails later
    with pytest.raises(ValueError, match="name the column of paths or texts.*its columns: id, path, text"):
        list_items(tmp_path / "t.parquet")


def test_what_cannot_be_a_source(tmp_path):
    with pytest.raises(ValueError, match="no images in this folder"):
        list_items(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n')
    with pytest.raises(ValueError, match="ids must be unique.*'a'"):
        list_items(tmp_path / "d.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n')
    with pytest.raises(ValueError, match="line 1: expected an object with a 'text' field"):
        list_items(tmp_path / "bad.jsonl")
    (tmp_path / "t.txt").write_text("x\n")
    with pytest.raises(ValueError, match="column='c' applies to a Parquet / CSV table"):
        list_items(tmp_path / "t.txt", column="c")
