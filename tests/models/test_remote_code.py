"""No code from a model folder runs unless asked: a folder whose configuration names its own classes
(``auto_map``) is refused, without a prompt, even when stdin would answer "y"; with ``trust_remote_code=True``
(``--trust-remote-code``) its code runs. Every transformers loading call in the package says
``trust_remote_code`` explicitly (so transformers never asks on the terminal)."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

T = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from attnroll.models import RemoteCodeError, load_model  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"

CODE = '''
import pathlib
pathlib.Path({marker!r}).write_text("the folder's code ran")
from transformers import ViTConfig, ViTForImageClassification


class ProbeConfig(ViTConfig):
    model_type = "attnroll-probe"


class ProbeForImageClassification(ViTForImageClassification):
    config_class = ProbeConfig
'''


def custom_folder(root: Path) -> tuple[Path, Path]:
    """(folder, marker): a tiny ViT classifier whose config names a class in the folder's probe_code.py,
    which writes ``marker`` when it is imported."""
    d, marker = root / "custom-model", root / "MARKER"
    torch.manual_seed(0)
    cfg = T.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, num_labels=2)
    T.ViTForImageClassification(cfg).eval().save_pretrained(d)
    conf = json.loads((d / "config.json").read_text())
    conf.update(model_type="attnroll-probe", architectures=["ProbeForImageClassification"],
                auto_map={"AutoConfig": "probe_code.ProbeConfig",
                          "AutoModelForImageClassification": "probe_code.ProbeForImageClassification"})
    (d / "config.json").write_text(json.dumps(conf))
    (d / "probe_code.py").write_text(CODE.format(marker=str(marker)))
    return d, marker


def _run(args: list[str], root: Path, stdin: str = "y\n") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HOME": str(root / "hf"),
           "HF_MODULES_CACHE": str(root / "hf-modules"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True, env=env,
                          timeout=300, cwd=root)


@pytest.fixture
def image(tmp_path):
    f = tmp_path / "im.png"
    PIL.new("RGB", (32, 32), (200, 30, 30)).save(f)
    return f


@pytest.mark.slow  # a subprocess or a whole held-out set
def test_cli_refuses_folder_code_even_when_stdin_says_yes(tmp_path, image):
    d, marker = custom_folder(tmp_path)
    res = _run(["-m", "attnroll.commands", "explain", str(image), "--model", str(d), "--out", str(tmp_path / "o")],
               tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert not marker.exists(), "the folder's code ran"
    assert "[y/N]" not in out and "custom code" not in out.lower(), out
    assert "--trust-remote-code" in res.stderr and str(d) in res.stderr and "probe_code" in res.stderr


def test_library_refuses_folder_code_without_the_option(tmp_path):
    d, marker = custom_folder(tmp_path)
    with pytest.raises(RemoteCodeError, match="trust_remote_code=True") as e:
        load_model(d)
    assert str(d) in str(e.value) and not marker.exists()


@pytest.mark.slow  # a subprocess or a whole held-out set
def test_the_option_runs_the_folders_code(tmp_path, image):
    d, marker = custom_folder(tmp_path)
    code = (f"from attnroll.models import load_model; lm = load_model({str(d)!r}, trust_remote_code=True); "
            "print(type(lm.model).__name__, lm.kind)")
    res = _run(["-c", code], tmp_path, stdin="")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ProbeForImageClassification", "image"] and marker.exists()
    marker.unlink()
    res = _run(["-m", "attnroll.commands", "explain", str(image), "--model", str(d), "--trust-remote-code",
                "--format", "json", "--out", str(tmp_path / "o")], tmp_path, stdin="")
    assert res.returncode == 0, res.stderr
    assert marker.exists() and list((tmp_path / "o").glob("*.json"))


def test_custom_tokenizer_class_is_refused_too(bert_dir, tmp_path):
    d = tmp_path / "bert"
    shutil.copytree(bert_dir, d)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["auto_map"] = {"AutoTokenizer": ["tok_code.MyTokenizer", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(RemoteCodeError, match="tokenizer_config.json"):
        load_model(d, want="text")


def test_trust_remote_code_must_be_a_boolean(bert_dir):
    with pytest.raises(TypeError, match="trust_remote_code must be True or False"):
        load_model(bert_dir, trust_remote_code="yes")


LOADERS = {"from_pretrained", "pipeline", "SentenceTransformer", "CrossEncoder"}


def test_every_loading_call_says_trust_remote_code():
    """transformers asks on the terminal (and runs the code on "y") when ``trust_remote_code`` is left out."""
    unsaid = []
    for f in (SRC / "attnroll").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in LOADERS and not any(k.arg == "trust_remote_code" for k in node.keywords):
                    unsaid.append(f"{f.relative_to(SRC)}:{node.lineno}")
    assert not unsaid, unsaid
