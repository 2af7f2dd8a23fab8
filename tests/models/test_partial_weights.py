"""Weights that do not cover the model are an error naming the tensors (missing, left over, wrongly shaped),
for a transformers folder and for a timm architecture with a weights file; ``allow_partial_weights=True``
(``--allow-partial-weights``) loads them with a warning naming them. transformers' own logging is left as the
user set it."""

import shutil

import pytest
import torch
from click.testing import CliRunner

T = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from attnroll.commands import cli  # noqa: E402
from attnroll.models import PartialWeightsError, load_model  # noqa: E402


def rewrite(folder, edit):
    """``edit(state)`` applied to the folder's model.safetensors."""
    f = folder / "model.safetensors"
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


@pytest.fixture
def copy(bert_dir, tmp_path):
    d = tmp_path / "bert"
    shutil.copytree(bert_dir, d)
    return d


def _same_as_files(model, folder):
    state = load_file(str(folder / "model.safetensors"))
    own = model.state_dict()
    return all(torch.equal(own[k], v) for k, v in state.items() if k in own)


def test_complete_folder_loads(bert_dir):
    lm = load_model(bert_dir)
    assert _same_as_files(lm.model, bert_dir)


def _drop(key):
    return lambda s: s.pop(key)


def _extra(s):
    s["bert.encoder.layer.9.attention.self.query.weight"] = torch.zeros(32, 32)


def _reshape(s):
    s["bert.pooler.dense.weight"] = s["bert.pooler.dense.weight"][:16].clone()


@pytest.mark.parametrize("edit, key, what", [
    (_drop("bert.encoder.layer.0.attention.self.query.weight"), "bert.encoder.layer.0.attention.self.query.weight",
     "missing"),
    (_drop("classifier.weight"), "classifier.weight", "missing"),  # the task head, left at random
    (_extra, "bert.encoder.layer.9.attention.self.query.weight", "does not have"),
    (_reshape, "bert.pooler.dense.weight (16, 32) in the files, (32, 32) in the model", "wrong shape"),
])
def test_partial_folder_is_an_error_naming_the_key(copy, edit, key, what):
    rewrite(copy, edit)
    with pytest.raises(PartialWeightsError) as e:
        load_model(copy)
    msg = str(e.value)
    assert key in msg and what in msg and str(copy) in msg and "allow_partial_weights=True" in msg
    with pytest.warns(UserWarning, match="loaded anyway") as w:
        lm = load_model(copy, allow_partial_weights=True)
    assert key in str(w[0].message) and lm.kind == "text"


def test_three_of_many_tensors_names_a_few_and_counts(copy):
    keep = ("bert.embeddings.word_embeddings.weight", "classifier.weight", "classifier.bias")
    rewrite(copy, lambda s: [s.pop(k) for k in list(s) if k not in keep])
    cfg = T.AutoConfig.from_pretrained(copy, local_files_only=True, trust_remote_code=False)
    n = len(set(T.BertForSequenceClassification(cfg).state_dict()) - set(keep))
    assert n > 30
    with pytest.raises(PartialWeightsError) as e:
        load_model(copy)
    msg = str(e.value)
    assert f"{n} of the model's tensors missing" in msg and f"and {n - 5} more" in msg
    assert "bert.embeddings.LayerNorm.bias" in msg  # the first few, in order


def test_loading_leaves_transformers_logging_alone(bert_dir):
    T.logging.set_verbosity_warning()
    try:
        load_model(bert_dir)
        assert T.logging.get_verbosity() == T.logging.WARNING
    finally:
        T.logging.set_verbosity_warning()


def test_cli_refuses_partial_weights_and_the_option_accepts(copy, tmp_path):
    rewrite(copy, _drop("classifier.weight"))
    res = CliRunner().invoke(cli, ["explain", "--text", "the cat sat", "--model", str(copy), "--format", "json",
                                   "--out", str(tmp_path / "o")])
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert "classifier.weight" in lines[0] and "--allow-partial-weights" in lines[0]
    res = CliRunner().invoke(cli, ["explain", "--text", "the cat sat", "--model", str(copy), "--format", "json",
                                   "--allow-partial-weights", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "classifier.weight" in res.stderr


def test_every_model_command_has_the_options():
    for cmd in ("explain", "view", "evaluate", "sanity", "audit", "batch"):
        res = CliRunner().invoke(cli, [cmd, "--help"])
        assert "--trust-remote-code" in res.output and "--allow-partial-weights" in res.output, cmd


# ----------------------------------------------------------------------------------------------------- timm
@pytest.fixture(scope="module")
def timm_state():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3).eval().state_dict()


@pytest.mark.parametrize("edit, key", [
    (lambda s: s.pop("blocks.3.attn.qkv.weight"), "blocks.3.attn.qkv.weight"),
    (lambda s: s.update({"blocks.99.norm.weight": torch.ones(4)}), "blocks.99.norm.weight"),
    (lambda s: s.update({"pos_embed": s["pos_embed"][:, :50].clone()}), "pos_embed (1, 50, 192) in the files"),
])
def test_timm_weights_that_do_not_fit_are_an_error(timm_state, tmp_path, edit, key):
    state = dict(timm_state)
    edit(state)
    w = tmp_path / "w.safetensors"
    save_file(state, str(w))
    with pytest.raises(PartialWeightsError, match="allow_partial_weights") as e:
        load_model("vit_tiny_patch16_224", w)
    assert key in str(e.value)
    with pytest.warns(UserWarning, match="loaded anyway"):
        lm = load_model("vit_tiny_patch16_224", w, allow_partial_weights=True)
    own = lm.model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in state.items() if k in own and own[k].shape == v.shape)


def test_run_batch_passes_the_option_on(copy, tmp_path):
    from attnroll.batch import run_batch
    from attnroll.batch.engines import ModelSpec

    rewrite(copy, _drop("classifier.weight"))
    (tmp_path / "t.txt").write_text("the cat sat\na dog ran\n")
    with pytest.raises(PartialWeightsError, match="classifier.weight"):
        run_batch(tmp_path / "t.txt", tmp_path / "o", model=str(copy))
    with pytest.warns(UserWarning, match="classifier.weight"):
        res = run_batch(tmp_path / "t.txt", tmp_path / "o", model=str(copy), allow_partial_weights=True)
    assert res.failed == 0
    spec = ModelSpec(str(copy), None, "text", allow_partial_weights=True)  # what a Ray actor loads
    with pytest.warns(UserWarning, match="classifier.weight"):
        assert spec.load().kind == "text"
