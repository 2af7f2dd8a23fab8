"""The commands' default method comes from the one table (attnroll.explain.defaults.DEFAULTS): changing an
entry changes what ``explain`` / ``view`` / ``batch`` run, and the printed choice is the table's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("click")
pytest.importorskip("matplotlib")
T = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from PIL import Image  # noqa: E402

from attnroll.commands import cli  # noqa: E402
from attnroll.explain import defaults  # noqa: E402


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=3, initializer_range=0.3)
    d = tmp_path_factory.mktemp("vit")
    T.ViTForImageClassification(cfg).eval().save_pretrained(d)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / "im.png")
    return d


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_explain_prints_and_uses_the_tables_choice(vit_dir, tmp_path):
    res = run("explain", vit_dir / "im.png", "--model", vit_dir, "--out", tmp_path, "--format", "json")
    assert res.exit_code == 0, res.output
    model = T.ViTForImageClassification.from_pretrained(vit_dir).eval()
    want = defaults.choose(model, "image classifier")
    assert want.method == defaults.DEFAULTS["image classifier"].methods[0]
    assert f"note: {want.note}" in res.stderr and "see EVALUATION.md" in want.note
    assert [p.name for p in tmp_path.iterdir()] == [f"im.{want.method}.json"]


@pytest.mark.parametrize("command", ["explain", "view", "batch"])
def test_changing_the_table_changes_the_commands_method(vit_dir, tmp_path, monkeypatch, command):
    monkeypatch.setitem(defaults.DEFAULTS, "image classifier", defaults.Default(("grad_rollout",), "a test entry"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "im.png").write_bytes((vit_dir / "im.png").read_bytes())
    out = tmp_path / "out"
    res = run(command, src if command == "batch" else src / "im.png", "--model", vit_dir, "--out", out)
    assert res.exit_code == 0, res.output
    assert "note: method grad_rollout: the default for image classifiers (a test entry" in res.stderr
    if command == "explain":
        assert [p.name for p in out.iterdir()] == ["im.grad_rollout.png"]
    elif command == "view":
        assert "methods grad_rollout, rollout, gae, per_head_rollout" in res.output
    else:
        from attnroll import read_batch

        assert set(read_batch(out)["method"]) == {"grad_rollout"}


def test_an_entry_that_does_not_apply_falls_through_and_says_why(vit_dir, monkeypatch):
    model = T.ViTModel(T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=37))  # no classifier: no logit layer
    entry = defaults.Default(("decompx", "rollout"), "a test entry")
    got = defaults.choose(model, "image classifier", table={"image classifier": entry})
    assert got.method == "rollout" and "decompx skipped" in got.note
    got = defaults.choose(model, "sentence encoder", scalar=False,
                          table={"sentence encoder": defaults.Default(("gae", "raw"), "t")})
    assert got.method == "raw" and "gae skipped: it needs a scalar" in got.note
    with pytest.raises(ValueError, match="no default method of the decoder entry applies"):
        defaults.choose(model, "decoder", scalar=False, table={"decoder": defaults.Default(("gae",), "t")})


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 whose word-level tokenizer, like GPT-2's own, has no padding token."""
    tokenizers = pytest.importorskip("tokenizers")
    words = "<unk> <s> the cat sat on mat . a dog".split()
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<s>")
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=len(words), n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1,
                       eos_token_id=1)
    d = tmp_path_factory.mktemp("gpt2")
    T.GPT2LMHeadModel(cfg).eval().save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_a_decoder_gets_the_decoder_entry_though_its_tokenizer_has_no_padding_token(gpt2_dir, tmp_path):
    """The decoder entry's first method (a gradient method: the predicted token's logit is the scalar to explain)
    runs, though the tokenizer came without a padding token (before: transformers' "Asking to pad" error)."""
    res = run("explain", "--model", gpt2_dir, "--text", "the cat sat on the mat", "--out", tmp_path,
              "--format", "json")
    assert res.exit_code == 0, res.output
    first = defaults.DEFAULTS["decoder"].methods[0]
    assert f"note: method {first}: the default for decoders" in res.stderr
    assert res.stdout.startswith(f"text: {first} ")
    from attnroll.models import load_model

    tok = load_model(str(gpt2_dir)).tokenizer
    enc = tok(["the cat sat on the mat", "a dog"], padding=True, return_tensors="pt")
    assert enc["attention_mask"].sum(dim=1).tolist() == [6, 2] and tok.pad_token == tok.eos_token
