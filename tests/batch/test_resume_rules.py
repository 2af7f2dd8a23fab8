"""What a rerun trusts: each shard records what made it (the run's key and the source's fingerprint), and a
rerun does exactly the missing work or refuses with the reason — also without a manifest, with the output
inside the source folder, or when the source changed. Plus the clear errors of empty sources and damaged
shards, and summary counts that equal the rows and failures written."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from attnroll.batch import BatchMismatchError, read_batch, read_failures, read_manifest, run_batch  # noqa: E402
from attnroll.batch import store  # noqa: E402
from attnroll.batch.engines import ModelSpec  # noqa: E402

from .helpers import write_shapes  # noqa: E402


@pytest.fixture(scope="module")
def lm():
    return ModelSpec().load()  # the embedded shapes model


def shards(out):
    return sorted((out / "rows").glob("part-*.parquet"))


def independent_counts(out, ids):
    """explained / failed / rows of ``out`` read here from the Parquet files, over the source's ``ids``."""
    rows = [i for f in shards(out) for i in pq.read_table(f).column("id").to_pylist()]
    failed = {i for f in sorted((out / "failures").glob("part-*.parquet"))
              for i in pq.read_table(f).column("id").to_pylist()}
    return {"explained": len((set(rows) - failed) & set(ids)), "failed": len(failed & set(ids)), "rows": len(rows)}


def test_without_its_manifest_another_method_is_refused_and_the_same_one_does_exactly_the_missing_work(lm, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_shapes(src, 9)
    run_batch(src, out, methods=["rollout"], batch_size=3, shard_size=3, loaded=lm)
    before = read_batch(out)
    (out / "manifest.json").unlink()
    with pytest.raises(BatchMismatchError, match=r"part-.*different run \(methods: \[\"rollout\"\] before, \[\"gae\"\]"):
        run_batch(src, out, methods=["gae"], batch_size=3, loaded=lm)
    assert not (out / "manifest.json").exists()  # the refusal leaves the folder as it was
    lost = shards(out)[1]
    lost_ids = pq.read_table(lost).column("id").to_pylist()
    lost.unlink()
    again = run_batch(src, out, methods=["rollout"], batch_size=3, loaded=lm)
    assert (again.done_before, again.explained) == (6, len(lost_ids)) == (6, 3)
    assert sorted(read_batch(out)["id"]) == sorted(before["id"])
    res = run_batch(src, out, methods=["gae"], batch_size=3, loaded=lm, overwrite=True)
    assert res.explained == 9 and set(read_batch(out)["method"]) == {"gae"}


def test_an_output_inside_its_source_folder_never_explains_its_own_overlays(lm, tmp_path):
    src = tmp_path / "src"
    write_shapes(src, 5)
    out = src / "maps"
    first = run_batch(src, out, png=True, loaded=lm)
    again = run_batch(src, out, png=True, loaded=lm)
    assert (first.inputs, first.explained) == (5, 5) and (again.inputs, again.done_before, again.explained) == (5, 5, 0)
    assert not any(i.startswith("maps/") for i in read_batch(out)["id"]) and len(read_batch(out)) == 5
    # another batch output below the source is skipped too
    other = run_batch(src, tmp_path / "elsewhere", loaded=lm)
    assert other.inputs == 5


@pytest.mark.parametrize("change", ["added", "removed", "renamed"])
def test_a_source_that_changed_is_refused_with_the_reason(lm, tmp_path, change):
    src, out = tmp_path / "src", tmp_path / "out"
    paths = write_shapes(src, 6)
    run_batch(src, out, loaded=lm)
    manifest = (out / "manifest.json").read_text()
    if change == "added":
        shutil.copy(paths[0], src / "a-new.png")  # sorts first: every index would move
    elif change == "removed":
        paths[0].unlink()
    else:
        paths[-1].rename(paths[-1].with_name("zz.png"))
    with pytest.raises(BatchMismatchError, match="the source changed since"):
        run_batch(src, out, loaded=lm)
    assert (out / "manifest.json").read_text() == manifest  # put back as it was
    run_batch(src, out, loaded=lm, overwrite=True)
    df = read_batch(out)
    assert df["index"].is_unique and sorted(df["index"]) == list(range(len(df)))


def test_a_text_source_edited_in_place_is_refused(lm, tmp_path):
    from attnroll.batch.sources import list_items, source_fingerprint

    t = tmp_path / "t.txt"
    t.write_text("one\ntwo\n")
    fp = source_fingerprint(t, list_items(t))
    t.write_text("one\nTWO\n")
    assert source_fingerprint(t, list_items(t)) != fp
    # named from another working folder, the same source has the same fingerprint
    import os

    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert source_fingerprint("t.txt", list_items("t.txt")) == source_fingerprint(t, list_items(t))
    finally:
        os.chdir(here)


def test_a_shard_of_another_run_is_refused_naming_it(lm, tmp_path):
    src = tmp_path / "src"
    write_shapes(src, 6)
    a, b = tmp_path / "a", tmp_path / "b"
    run_batch(src, a, batch_size=3, shard_size=3, loaded=lm)
    run_batch(src, b, batch_size=3, shard_size=3, options={"rollout": {"alpha": 0.9}}, loaded=lm)
    intruder = shards(b)[1]
    shards(a)[1].unlink()
    shutil.copy(intruder, a / "rows" / intruder.name)
    with pytest.raises(BatchMismatchError, match=rf"{intruder.name} holds results of a different run \(options"):
        run_batch(src, a, batch_size=3, loaded=lm)


def strip_metadata(folder):
    """Make every shard look like one of an earlier version: no record of what made it."""
    for f in sorted(folder.glob("*/part-*.parquet")):
        t = pq.read_table(f)
        pq.write_table(t.replace_schema_metadata(None), f)


def test_shards_of_an_earlier_version_resume_under_their_manifest_only(lm, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_shapes(src, 6)
    run_batch(src, out, batch_size=3, shard_size=3, loaded=lm)
    strip_metadata(out)
    shards(out)[0].unlink()
    again = run_batch(src, out, batch_size=3, loaded=lm)  # the manifest vouches for them
    assert (again.done_before, again.explained) == (3, 3)
    (out / "manifest.json").unlink()
    strip_metadata(out)
    with pytest.raises(BatchMismatchError, match="has no manifest.json and its shard part-.* does not record"):
        run_batch(src, out, loaded=lm)
    assert run_batch(src, out, loaded=lm, overwrite=True).explained == 6


def test_overwrite_leaves_a_folder_that_is_no_batch_output_alone(lm, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_shapes(src, 2)
    (out / "png").mkdir(parents=True)
    (out / "png" / "mine.txt").write_text("keep")
    run_batch(src, out, loaded=lm, overwrite=True)
    assert (out / "png" / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("name,content", [("t.csv", "id,path\n"), ("t.csv", ""), ("t.jsonl", ""),
                                          ("t.jsonl", "\n\n"), ("t.parquet", None), ("t.txt", "")])
def test_an_empty_source_says_so(tmp_path, name, content):
    from attnroll.batch import list_items

    path = tmp_path / name
    if content is None:
        import pyarrow as pa

        pq.write_table(pa.table({"id": pa.array([], pa.string()), "path": pa.array([], pa.string())}), path)
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"source {path}: .*(no inputs|empty|no JSON lines|cannot read this table)"):
        list_items(path, column="path" if path.suffix != ".jsonl" and path.suffix != ".txt" else None)


def test_an_empty_table_is_a_one_line_usage_error(tmp_path):
    from ..commands.test_cli import one_line_error, run

    (tmp_path / "t.csv").write_text("id,path\n")
    msg = one_line_error(run("batch", tmp_path / "t.csv", "--column", "path", "--out", tmp_path / "o", "--png"), 2)
    assert "holds no inputs" in msg


def test_a_damaged_shard_is_named_with_what_to_do(lm, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_shapes(src, 4)
    run_batch(src, out, loaded=lm)
    bad = out / "rows" / "part-000000000-0badf00d.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    for call in (lambda: run_batch(src, out, loaded=lm), lambda: read_batch(out)):
        with pytest.raises(ValueError, match=rf"{bad} is not a readable batch shard .*delete it .*--overwrite"):
            call()
    from ..commands.test_cli import one_line_error, run

    msg = one_line_error(run("batch", src, "--out", out, "-m", "rollout"), 1)  # run_batch's default method
    assert str(bad) in msg and "delete it" in msg


def test_the_summary_counts_what_was_written(lm, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_shapes(src, 8)
    (src / "broken.png").write_bytes(b"not a png")
    ids = [p.relative_to(src).as_posix() for p in sorted(src.rglob("*.png"))]
    first = run_batch(src, out, methods=["rollout", "raw"], batch_size=3, shard_size=3, png=True, loaded=lm)
    want = independent_counts(out, ids)
    assert (first.explained + first.failed_now, first.done_before) == (9, 0)  # every input once
    assert (first.explained, first.failed, first.rows) == (want["explained"], want["failed"], want["rows"]) == (8, 1, 16)
    assert first.summary().startswith("9 inputs: 8 explained now, 1 failed in ") and "; 16 rows in" in first.summary()
    lost = shards(out)[1]
    n_lost = len(set(pq.read_table(lost).column("id").to_pylist()))
    lost.unlink()
    again = run_batch(src, out, methods=["rollout", "raw"], batch_size=3, loaded=lm)
    want = independent_counts(out, ids)
    assert (again.explained, again.failed_now, again.done_before) == (n_lost, 0, 9 - n_lost)
    assert (again.failed, again.rows, again.missing) == (want["failed"], want["rows"], 0) == (1, 16, 0)
    assert f"({9 - n_lost} done before): {n_lost} explained now, 0 failed in " in again.summary()
    assert "; 1 failed in all; 16 rows" in again.summary()
    counts = read_manifest(out)["counts"]
    assert {k: counts[k] for k in want} == want and read_manifest(out)["last_run"]["explained"] == n_lost
    assert len(read_failures(out)) == 1
    assert json.loads((out / "manifest.json").read_text())["source_fingerprint"].startswith("sha256:")
