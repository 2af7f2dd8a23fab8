"""``attnroll explain IMAGE... --text PROMPT --generate N`` and ``attnroll view ... --generate N`` with a tiny
random-weight LLaVA folder (model + processor): the page and the JSON against the Python API on the same inputs,
loading a vision-language model folder (and a hub id from the local cache), one-line refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import attnroll
from attnroll.viz.viewer import decode_rows, read_payload

T = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
click_testing = pytest.importorskip("click.testing")

from ..capture.test_vlm import IMG, llava  # noqa: E402

WORDS = "the a cat dog is on mat what in picture ? . this shows red blue".split()
#: The processor's chat template: the images' placeholders, then the prompt, then "the" opening the answer.
TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}"
            "{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}the {% endif %}")


def processor():
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}, "<image>": IMG}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ip = T.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return T.LlavaProcessor(image_processor=ip, tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                            num_additional_image_tokens=1, chat_template=TEMPLATE, image_token="<image>")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llava")
    llava().save_pretrained(d)
    processor().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    from PIL import Image

    p = tmp_path_factory.mktemp("img") / "photo.png"
    Image.fromarray((np.random.default_rng(0).random((40, 50, 3)) * 255).astype("uint8")).save(p)
    return p


def run(*args):
    from attnroll.commands import cli

    return click_testing.CliRunner().invoke(cli, list(map(str, args)))


def test_a_vlm_folder_loads_with_its_processor(vlm_dir, picture):
    from PIL import Image

    lm = attnroll.models.load_model(vlm_dir)
    assert lm.kind == "vlm" and type(lm.processor).__name__ == "LlavaProcessor"
    inp = lm.prompt_inputs([Image.open(picture).convert("RGB")], "what is in the picture ?")
    ids = inp["input_ids"][0].tolist()
    assert ids.count(IMG) == 16 and ids[16:] == [WORDS.index(w) + 3 for w in "what is in the picture ? the".split()]


def test_explain_generate_with_an_image_writes_the_page_and_the_json(vlm_dir, picture, tmp_path):
    from PIL import Image

    out = tmp_path / "out"
    res = run("explain", picture, "--model", vlm_dir, "--text", "what is in the picture ?", "--generate", 3,
              "--format", "html,json", "--out", out)
    assert res.exit_code == 0, res.output
    assert "answer (3 tokens)" in res.output and "images" in res.output
    files = sorted(p.name for p in out.iterdir())
    stem = "photo.what-is-in-the-picture.answer.rollout"
    assert files == [f"{stem}.html", f"{stem}.json"]
    rec = json.loads((out / files[1]).read_text())
    lm = attnroll.models.load_model(vlm_dir)
    inp = lm.prompt_inputs([Image.open(picture).convert("RGB")], "what is in the picture ?")
    ga = attnroll.vlm_generation_attribution(lm.model, inp, generate=3, tokenizer=lm.processor)
    assert rec["answer_ids"] == ga.answer_ids and rec["images"] == [str(picture)]
    np.testing.assert_allclose(np.asarray(rec["image_maps"][2][0]), ga.image_maps[2][0].numpy(), atol=1e-6)
    ex = read_payload((out / files[0]).read_text())["examples"][0]
    assert ex["images"][0]["image"].startswith("data:image/png;base64,") and ex["images"][0]["size"] == [50, 40]
    rows = decode_rows(ex["images"][0]["rows"])
    want = torch.stack([m[0].reshape(-1) for m in ga.image_maps]).numpy()
    assert np.abs(rows - want).max() <= 2e-4 * want.max()


def test_view_generate_writes_one_page(vlm_dir, picture, tmp_path):
    res = run("view", picture, "--model", vlm_dir, "--text", "what is in the picture ?", "--generate", 2,
              "-m", "gae", "--out", tmp_path, "--name", "answer")
    assert res.exit_code == 0, res.output
    payload = read_payload((tmp_path / "answer.html").read_text())
    assert payload["methods"] == ["gae"] and len(payload["examples"][0]["target_tokens"]) == 2


@pytest.mark.parametrize("args,message", [
    (["--format", "png"], "writes html (the viewer page) and json"),
    (["-m", "alti"], "takes one method, -m rollout, gae, grad_rollout"),
    (["--target", "3"], "without --pair or --target"),
])
def test_refusals_are_one_line(vlm_dir, picture, tmp_path, args, message):
    res = run("explain", picture, "--model", vlm_dir, "--text", "what ?", "--generate", 2, "--out", tmp_path, *args)
    assert res.exit_code == 2 and message in res.output


def test_a_text_model_with_an_image_is_refused(picture, tmp_path):
    res = run("explain", picture, "--model", "minilm", "--text", "what ?", "--generate", 2, "--out", tmp_path)
    assert res.exit_code == 2 and "not a vision-language model" in res.output


def test_a_hub_id_loads_from_the_local_cache_and_is_never_fetched(vlm_dir, tmp_path, monkeypatch):
    """A hub id (Qwen/Qwen2-VL-2B-Instruct) is read from the Hugging Face cache when it is there (a snapshot
    folder laid out as the hub client leaves it; here the tiny LLaVA's files), else a clear error."""
    import shutil

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError, match="no copy of the hub model Qwen/Qwen2-VL-2B-Instruct in the local"):
        attnroll.models.load_model("Qwen/Qwen2-VL-2B-Instruct")
    repo = cache / "models--Qwen--Qwen2-VL-2B-Instruct"
    snap = repo / "snapshots" / ("0" * 40)
    shutil.copytree(vlm_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    lm = attnroll.models.load_model("Qwen/Qwen2-VL-2B-Instruct")
    assert lm.kind == "vlm" and lm.name == str(snap)
    res = run("explain", "--model", "Qwen/Qwen2.5-VL-3B-Instruct", "--text", "hi", "--out", tmp_path / "o")
    assert res.exit_code == 1 and "attnroll never downloads" in res.output
