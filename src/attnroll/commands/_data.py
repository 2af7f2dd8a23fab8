"""Reading what the commands take: image files and folders, text files, the generated datasets, and the
``--model`` spec (through :func:`attnroll.models.load_model`), each failure as one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from ._output import Failure, one_line

__all__ = ["IMAGE_SUFFIXES", "DATASETS", "TEXT_DATASETS", "TOY_MODEL_NOTE", "expand_images", "read_image", "load",
           "echo_notes",
           "text_or_file", "input_options", "check_inputs",
           "load_for", "load_eval_model", "load_image_model", "load_texts", "load_text_data", "data_for", "load_data",
           "load_files", "fill_tensor", "check_data", "check_fill", "check_cmap"]

#: Image file suffixes the commands read (what pillow decodes).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
#: ``--data`` names of the generated datasets.
DATASETS = ("shapes", "shapes-marker")
#: ``--data`` names of the generated text datasets (``attnroll.models.evidence``: sentences with evidence tokens).
TEXT_DATASETS = ("evidence",)


def expand_images(paths: tuple[Path, ...]) -> list[Path]:
    """Files as given; folders replaced by their image files (sorted, not recursive)."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise Failure(f"{p}: no images in this folder (looked for {', '.join(IMAGE_SUFFIXES)})")
            files.extend(found)
        elif p.suffix.lower() not in IMAGE_SUFFIXES:
            raise Failure(f"{p}: unsupported image format {p.suffix or '(no suffix)'!r}; supported: "
                          f"{', '.join(IMAGE_SUFFIXES)}")
        else:
            files.append(p)
    return files


def read_image(path: Path) -> Any:
    """A PIL RGB image, fully decoded; an unreadable or corrupt file is a one-line failure."""
    from ..viz.pixels import read_image as decode

    try:
        return decode(path, "attnroll explain")
    except ValueError as e:
        raise Failure(str(e)) from None
    except OSError as e:  # a missing or unopenable file
        raise Failure(f"cannot read image {path}: {one_line(str(e))}") from None


def _as_option(msg: str) -> str:
    """The library names its arguments ``model`` / ``weights`` / ``trust_remote_code=True``...; on the command
    line they are options."""
    msg = re.sub(r"\b\w+=True \((--[\w-]+) on the command line\)", r"\1", msg)
    for word in ("model", "weights"):
        if msg.startswith(word + " "):
            return "--" + msg.replace(" weights FILE", " --weights FILE")
    return msg


#: What ``load`` says on stderr when an image command falls back to the embedded model (no ``--model``).
TOY_MODEL_NOTE = (
    "note: no --model given: using the embedded shapes ViT ({name}), a toy trained on synthetic shapes "
    "(circles, squares, triangles...), not on photos; pass --model FOLDER (a local transformers image "
    "classifier) or --model TIMM_NAME --weights FILE"
)


def load(spec: str | None, weights: Path | None, want: str) -> Any:
    """``--model`` [``--weights``] as a :class:`attnroll.models.LoadedModel`; a failure is one line (a timm
    name without ``--weights`` is a usage error). ``--trust-remote-code`` / ``--allow-partial-weights`` come
    from the command's options (``_args.load_safety_options``)."""
    from ..models import MissingWeightsError, load_model
    from ._args import load_flags

    try:
        lm = load_model(spec, weights, want=want, **load_flags())
    except MissingWeightsError:
        raise click.UsageError(f"--model {spec} (a timm architecture) needs --weights FILE: attnroll never "
                               "downloads") from None
    except (ValueError, ImportError, FileNotFoundError) as e:
        raise Failure(_as_option(one_line(str(e)))) from None
    return lm


#: Where the notes of a command wait for :func:`echo_notes` (on the click context).
_NOTES = "attnroll.notes"


def echo_notes(spec: str | None, lm: Any) -> None:
    """The command's notes on stderr, one line each, after the work (a failure stays one ``error:`` line):
    which file ``--text`` / ``--pair`` read, and, when an image command fell back to the embedded shapes model
    (no ``--model``), that it is a toy."""
    ctx = click.get_current_context(silent=True)
    for note in (ctx.meta.get(_NOTES, []) if ctx is not None else []):
        click.echo(note, err=True)
    if lm.kind == "image" and spec in (None, "", "embedded"):
        click.echo(TOY_MODEL_NOTE.format(name=lm.name), err=True)


#: Suffixes that make a one-word ``--text`` / ``--pair`` value a file name: a missing file is then an error,
#: not a text of one word.
TEXT_FILE_SUFFIXES = (".txt", ".text", ".md", ".prompt")


def text_or_file(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--text`` / ``--pair``: the contents (UTF-8) of the file the value names, when it names one (a note
    on stderr says so), else the value itself. A one-word value ending in a text-file suffix that names no
    file is a usage error (a mistyped file name would otherwise be explained as a word)."""
    if value is None:
        return None
    path, flag = Path(value), "--" + param.name
    try:
        is_file = "\n" not in value and "\0" not in value and path.is_file()
    except (OSError, ValueError):  # a text too long to be a file name
        is_file = False
    if is_file:
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.BadParameter(f"cannot read {path}: {one_line(getattr(e, 'strerror', None) or e)}") from None
        ctx.meta.setdefault(_NOTES, []).append(f"note: {flag}: the text of the file {path} "
                                               f"({len(content):,} characters)")
        return content
    if not any(c.isspace() for c in value) and path.suffix.lower() in TEXT_FILE_SUFFIXES:
        raise click.BadParameter(f"{value}: no such file (a value that names a file is read; this one looks like "
                                 "a file name)")
    return value


def input_options(fn: Any) -> Any:
    """The input and model options of ``explain`` and ``view``: IMAGE..., --text, --pair, --model, --weights,
    --trust-remote-code, --allow-partial-weights."""
    from ._args import load_safety_options

    decorators = [load_safety_options,
        click.argument("images", nargs=-1, type=click.Path(exists=True, path_type=Path)),
        click.option("--text", callback=text_or_file, metavar="TEXT|FILE",
                     help="Explain this text instead of images; a value that names a file is read (UTF-8). "
                          "--text prompt.txt explains the file's text."),
        click.option("--pair", callback=text_or_file, metavar="TEXT|FILE",
                     help="A second text (or a file, read the same way): a sentence pair (similarity for "
                          "sentence-embedding models)."),
        click.option("--model", "model_spec", metavar="MODEL",
                     help="'shapes' / 'minilm' (embedded, the default for images / text), a local transformers "
                          "model folder, or a timm architecture name with --weights."),
        click.option("--weights", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Weights file for a timm architecture (.safetensors or a torch state dict)."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return fn


def check_inputs(images: tuple, text: str | None, pair: str | None) -> str:
    """The kind of input ("image" / "text") of :func:`input_options`, or a usage error for a wrong combination."""
    if pair is not None and text is None:
        raise click.UsageError("--pair needs --text")
    if images and text is not None:
        raise click.UsageError("give either IMAGE... or --text, not both")
    if not images and text is None:
        raise click.UsageError("nothing to explain: give IMAGE... (files or folders) or --text TEXT")
    for name, t in (("--text", text), ("--pair", pair)):
        if t is not None and not t.strip():
            raise click.UsageError(f"{name} is empty")
    return "text" if text is not None else "image"


def load_for(spec: str | None, weights: Path | None, kind: str) -> Any:
    """:func:`load` for inputs of ``kind``; a model of the other kind is a usage error."""
    lm = load(spec, weights, kind)
    if lm.kind != kind:
        raise click.UsageError(f"model {lm.name} is a{'n image' if lm.kind == 'image' else ' text'} model; "
                               f"give {'IMAGE...' if lm.kind == 'image' else '--text'}")
    return lm


def load_eval_model(spec: str | None) -> Any:
    """A model spec of ``evaluate``: "shapes" (default), "shapes-marker" (the spurious-cue copy), or a local
    transformers folder (an image classifier, or a text classifier with its tokenizer)."""
    return load(spec or "shapes", None, "image")


def load_image_model(spec: str | None) -> Any:
    """A model spec of ``audit`` / ``sanity``: like :func:`load_eval_model`, but an image classifier."""
    lm = load_eval_model(spec)
    if lm.kind != "image":
        raise Failure(f"{spec}: a text model; 'attnroll audit' compares image classifiers")
    return lm


#: Suffixes of JSON-lines files (one object with a "text" field per line), as ``attnroll batch`` reads them.
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def load_texts(data: str, n: int) -> list[str]:
    """``--data`` for a text classifier: a UTF-8 text file, one example per line (blank lines skipped), or a
    JSONL file (its "text" fields, read as ``attnroll batch`` reads them; pairs are refused)."""
    path = Path(data)
    if data in DATASETS + TEXT_DATASETS or not path.is_file():
        raise click.UsageError(f"--data {data}: a text classifier needs evidence (generated sentences), a text "
                               "file (one example per line) or a JSONL file with a 'text' field per line")
    if path.suffix.lower() in JSONL_SUFFIXES:
        texts = _jsonl_texts(path)[:n]
    else:
        try:
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as e:
            raise Failure(f"cannot read {path}: {one_line(getattr(e, 'strerror', None) or e)}") from None
        texts = [ln for ln in lines if ln][:n]
    if not texts:
        raise Failure(f"{path}: no text in this file (one example per line)")
    return texts


def _jsonl_texts(path: Path) -> list[str]:
    """The non-blank "text" fields of a JSONL file (:func:`attnroll.batch.sources.list_items`); a pair is a
    usage error (a classifier's evaluation here reads single texts)."""
    from ..batch.sources import list_items

    try:
        items = list_items(path)
    except ValueError as e:
        raise Failure(one_line(str(e))) from None
    paired = [it.id for it in items if it.pair is not None]
    if paired:
        raise click.UsageError(f"--data {path}: {paired[0]} has a 'pair'; give single texts here")
    return [it.text.strip() for it in items if it.text.strip()]


def data_for(model_spec: str | None, data: str) -> str:
    """``--data`` after ``--model``: the embedded text classifier (minilm-evidence) reads its generated
    sentences ("evidence") when ``--data`` was left at its default; generated sentences for an embedded image
    model are a usage error."""
    src = click.get_current_context().get_parameter_source("data")
    trained_on_evidence = ("minilm-evidence", "bamba-evidence", "mamba2-evidence")
    if model_spec in trained_on_evidence and src is click.core.ParameterSource.DEFAULT:
        return "evidence"
    if data in TEXT_DATASETS and model_spec in DATASETS:  # the embedded image models share the data's names
        raise click.UsageError(f"--data {data}: generated sentences, for a text classifier (--model minilm-evidence)")
    return data


def load_text_data(lm: Any, data: str, n: int, seed: int) -> dict[str, Any]:
    """``--data`` for a text classifier ``lm``: "evidence" (``n`` generated sentences of ``seed`` with their
    labels and evidence-token masks) or a text / JSONL file (:func:`load_texts`; no labels, no masks).
    Returns {"inputs": the tokenizer's dict, padded, with ``special_tokens_mask``; "labels"; "masks"}."""
    if data in TEXT_DATASETS:
        from ..models import evidence

        ex = evidence.make_examples(n, seed)
        enc, masks = evidence.encode(lm.tokenizer, ex)
        return {"inputs": enc, "labels": ex.labels, "masks": masks}
    texts = load_texts(data, n)
    enc = lm.tokenizer(texts, padding=True, truncation=True, return_tensors="pt", return_special_tokens_mask=True)
    return {"inputs": enc, "labels": None, "masks": None}


def _generated(data: str, lm: Any, n: int, seed: int) -> dict[str, Any]:
    from ..models import shapes

    images, labels, masks = shapes.make_dataset(n, seed)
    marker = None
    if data == "shapes-marker":
        from ..models import spurious

        images, marker = spurious.add_marker(images, labels, seed=seed)
    size = tuple(getattr(getattr(lm.model, "config", None), "image_size", shapes.IMAGE_SIZE) for _ in range(2))
    if size != (shapes.IMAGE_SIZE,) * 2:
        raise click.UsageError(f"--data {data}: generated {shapes.IMAGE_SIZE}x{shapes.IMAGE_SIZE} images do not "
                               f"fit a model that takes {size[0]}x{size[1]}; give a folder of images instead")
    return {"x": shapes.preprocess(images), "images": images, "labels": labels, "masks": masks, "marker": marker}


def load_data(data: str, lm: Any, n: int, seed: int) -> dict[str, Any]:
    """``--data``: a generated dataset name or a folder of images. Returns pixel_values, and for generated
    data the raw images, labels, object masks (pixels) and marker masks."""
    if data in TEXT_DATASETS:
        raise click.UsageError(f"--data {data}: generated sentences, for a text classifier (--model minilm-evidence)")
    if data in DATASETS:
        return _generated(data, lm, n, seed)
    path = Path(data)
    if not path.exists():
        raise click.UsageError(f"--data {data}: neither a folder of images nor one of {', '.join(DATASETS)}")
    if path.is_file() and path.suffix.lower() in (".txt", ".text") + JSONL_SUFFIXES:
        raise click.UsageError(f"--data {data}: a text file, for a text classifier; {lm.name} takes images "
                               "(a folder of images or one of " + ", ".join(DATASETS) + ")")
    return load_files(expand_images((path,))[:n], lm)


def load_files(files: list[Path], lm: Any) -> dict[str, Any]:
    """Image files as the model's pixel values ``x`` and the pictures at the model's input size (for reports)."""
    import numpy as np
    import torch

    xs, raw = [], []
    for f in files:
        img = read_image(f)
        x1 = lm.prepare_image(img)
        xs.append(x1)
        # the picture as the model sees it (same size), for the report's overlays
        small = img.resize((x1.shape[-1], x1.shape[-2]))
        raw.append(torch.from_numpy(np.asarray(small, dtype=np.float32) / 255.0).permute(2, 0, 1))
    x, images = torch.cat(xs), torch.stack(raw)
    return {"x": x, "images": images, "labels": None, "masks": None, "marker": None, "files": files}


def check_data(data: str) -> None:
    """``--data`` before any model is loaded: a generated dataset name or an existing file / folder."""
    if data not in DATASETS + TEXT_DATASETS and not Path(data).exists():
        raise click.UsageError(f"--data {data}: neither a folder of images, a text file, nor one of "
                               f"{', '.join(DATASETS + TEXT_DATASETS)}")


def check_fill(fill: str) -> None:
    """``--fill`` before any model is loaded: black, mean or a finite number."""
    if fill in ("black", "mean"):
        return
    try:
        value = float(fill)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise click.UsageError(f"--fill must be black, mean or a finite number, got {fill!r}")


def check_cmap(cmap: str) -> None:
    """``--cmap`` before any model is loaded: a matplotlib colormap name."""
    from ..viz import deps

    try:
        deps.colormap(cmap, "attnroll explain")
    except ValueError as e:
        raise click.UsageError(f"--{one_line(str(e))}") from None


def fill_tensor(fill: str, lm: Any, x: Any) -> Any:
    """``--fill``: "black" = a black picture through the model's own preprocessing ((C, H, W), per channel),
    "mean" = 0.0, or a float in model-input space."""
    if fill == "mean":
        return 0.0
    if fill == "black":
        from PIL import Image

        return lm.prepare_image(Image.new("RGB", (int(x.shape[-1]), int(x.shape[-2])), (0, 0, 0)))[0]
    try:
        return float(fill)
    except ValueError:
        raise click.UsageError(f"--fill must be black, mean or a number, got {fill!r}") from None
