"""Family matrix: build tiny random-weight configs of popular transformers / timm architectures and classify
what attnroll does with each.

    correct   captured attention equals the model's own eager attention (1e-5) on every stream (timm: the
              captured A reproduces each block's own fused output, A @ v), and the
              token layout is consistent: an image stream has a grid with prefix + rows·cols + suffix = n
              (and rows·cols = the config's (image_size / patch_size)²), every non-cross stream has a
              readout (the last token for causal streams), a padded text batch equals its cropped examples
    refused   attnroll raised UnsupportedModelError / CaptureError (the reason is printed)
    wrong     any check above failed (or attnroll crashed with another exception)
    skipped   the tiny config could not be built or run by transformers / timm itself (not counted)

    PYTHONPATH=src python benchmarks/family_matrix.py [--only bert,vit] [--markdown out.md]

The tiny sizes (``shrink``, the timm and Swin sizes) come from the test suite's zoo, ``tests/zoo.py``.
"""

from __future__ import annotations

import argparse
import copy
import signal
import sys
import time
import warnings
from pathlib import Path

import torch

import attnroll
from attnroll.capture import CaptureError, swin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's tiny-model zoo, tests/zoo.py
from tests.zoo import SWIN_HF, SWIN_TIMM, TIMM_SMALL, shrink  # noqa: E402

HF_TYPES = """
bert roberta distilbert electra albert deberta deberta-v2 mpnet xlm-roberta camembert roformer squeezebert xlm
funnel longformer big_bird convbert ernie layoutlm mobilebert nystromformer megatron-bert rembert esm ibert
data2vec-text xmod modernbert canine splinter yoso mra xlm-roberta-xl
gpt2 gpt_neo gpt_neox gptj llama mistral mixtral qwen2 qwen2_moe qwen3 phi phi3 gemma gemma2 falcon bloom mpt
opt codegen starcoder2 stablelm olmo olmo2 cohere gpt_bigcode biogpt xglm persimmon granite nemotron glm
helium smollm3 ctrl
t5 mt5 umt5 bart mbart marian pegasus blenderbot blenderbot-small m2m_100 prophetnet led longt5 plbart fsmt
bigbird_pegasus switch_transformers
vit deit beit dinov2 dinov2_with_registers data2vec-vision vit_msn vit_mae yolos ijepa swin swinv2 segformer
levit dpt pvt_v2 hiera vitdet clip_vision_model siglip_vision_model
wav2vec2 hubert wavlm audio-spectrogram-transformer whisper speech_to_text sew unispeech data2vec-audio
clip siglip siglip2 blip owlvit chinese_clip altclip vilt flava llava paligemma git timesformer videomae vivit
qwen2_vl qwen2_5_vl llava_next
""".split()

#: Swin takes per-stage depths and heads (not depth / num_heads): two stages of two blocks, 4x4 windows.
TINY_SWIN = SWIN_TIMM

#: transformers types whose tiny config is built from these arguments instead of shrinking the defaults.
TINY_HF = {t: SWIN_HF for t in ("swin", "swinv2")}

TIMM_MODELS = [
    ("vit_tiny_patch16_224", {}), ("deit_tiny_distilled_patch16_224", {}),
    ("vit_tiny_patch16_224", {"reg_tokens": 4, "no_embed_class": True}), ("vit_tiny_patch16_224", {"global_pool": "avg"}),
    ("vit_so150m_patch16_reg4_map_256", {}), ("vit_small_patch16_18x2_224", {}), ("vit_dwee_patch16_reg1_gap_256", {}),
    ("eva02_tiny_patch14_224", {"patch_size": 8}), ("beit_base_patch16_224", {}), ("cait_xxs24_224", {}),
    ("vit_relpos_small_patch16_224", {}), ("naflexvit_base_patch16_gap", {}), ("samvit_base_patch16", {}),
    ("swin_tiny_patch4_window7_224", TINY_SWIN), ("vit_medium_patch16_rope_reg1_gap_256", {}),
    ("swinv2_tiny_window8_256", TINY_SWIN),
]

class Timeout(Exception):
    pass


def _alarm(*_):
    raise Timeout("took more than 150 s")


def hf_inputs(model, cfg):
    g = torch.Generator().manual_seed(0)
    key = getattr(model, "main_input_name", "input_ids")
    inp = {}
    if key == "input_ids" or hasattr(model, "get_text_features"):
        ids = torch.randint(3, 99, (2, 8), generator=g)
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 6:] = 0
        inp.update(input_ids=ids, attention_mask=mask)
    if key == "pixel_values" or hasattr(model, "get_image_features"):
        size = getattr(getattr(cfg, "vision_config", None) or cfg, "image_size", 32)
        size = size if isinstance(size, int) else size[0]
        frames = getattr(cfg, "num_frames", None)
        shape = (2, frames, 3, size, size) if frames else (2, 3, size, size)
        inp["pixel_values"] = torch.randn(*shape, generator=g)
    if key in ("input_values", "input_features"):
        if key == "input_features" and cfg.model_type == "whisper":
            inp[key] = torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        elif key == "input_features":
            inp[key] = torch.randn(2, 64, getattr(cfg, "input_feat_per_channel", 80), generator=g)
        elif cfg.model_type == "audio-spectrogram-transformer":
            inp[key] = torch.randn(2, cfg.max_length, cfg.num_mel_bins, generator=g)
        else:
            inp[key] = torch.randn(2, 1600, generator=g)
    if cfg.model_type == "vit_mae":  # one fixed shuffle for attnroll and the reference alike
        inp["noise"] = torch.rand(2, (cfg.image_size // cfg.patch_size) ** 2, generator=g)
    if getattr(cfg, "is_encoder_decoder", False):
        inp["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=g)
    return inp


def is_vlm_config(cfg):
    """A vision-language model: an image token id and a vision sub-config."""
    return getattr(cfg, "image_token_id", None) is not None and getattr(cfg, "vision_config", None) is not None


def vlm_inputs(model, cfg, inp):
    """VLMs: one run of image placeholder tokens per image, as many as the model's own image features have
    tokens, inside the tiny vocabulary."""
    if not is_vlm_config(cfg):
        return inp
    try:
        with torch.no_grad():
            feats = model.get_image_features(pixel_values=inp["pixel_values"]).pooler_output
    except Exception:  # noqa: BLE001 - other image inputs (Qwen2-VL patches, LLaVA-NeXT image_sizes): the
        return inp     # capture refuses these before running, or the reference run says the config won't run
    cfg.image_token_id = 98  # the configs' ids (32000, 256000) lie outside the tiny vocabulary
    per_image = int(feats[0].shape[0])
    ids = torch.randint(3, 98, (2, per_image + 8), generator=torch.Generator().manual_seed(0))
    ids[:, 2:2 + per_image] = 98
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": inp["pixel_values"]}


def vlm_reference(ref, inp, out):
    """A VLM's own eager attentions: the language model's from its output, the vision tower's from the tower."""
    tower = getattr(ref, "vision_tower", None) or ref.model.vision_tower
    return {"language": list(out.attentions),
            "vision": list(tower(inp["pixel_values"], output_attentions=True).attentions)}


def reference_streams(out):
    """transformers' own attentions by attnroll stream name."""
    found = {}
    for field, stream in (("attentions", "self"), ("encoder_attentions", "encoder"),
                          ("decoder_attentions", "decoder"), ("cross_attentions", "cross")):
        v = getattr(out, field, None)
        if v:
            found[stream] = list(v)
    for field, stream in (("vision_model_output", "vision"), ("text_model_output", "text")):
        sub = getattr(out, field, None)
        if sub is not None and getattr(sub, "attentions", None):
            found[stream] = list(sub.attentions)
    return found


def layout_problems(rec, cfg, inp):
    problems = []
    for s, info in rec.info.items():
        n = rec.streams[s][0].shape[-1]
        if s != "cross" and info.readout is None and not info.readout_reason:
            problems.append(f"{s}: no readout")
        if info.causal and info.readout is not None and info.readout.kind not in ("last", "position", "eot"):
            problems.append(f"{s}: causal stream read at {info.readout.kind}")
        if info.kind == "image":
            if info.grid is None:
                if not info.grid_reason:
                    problems.append(f"{s}: image stream without grid or reason")
                continue
            h, w = info.grid
            if info.prefix + h * w + info.suffix != n:
                problems.append(f"{s}: prefix {info.prefix} + {h}x{w} + suffix {info.suffix} != {n}")
            vc = getattr(cfg, "vision_config", None) if s == "vision" else cfg
            img, p = getattr(vc, "image_size", None), getattr(vc, "patch_size", None)
            if isinstance(img, int) and isinstance(p, int) and "pixel_values" in inp and h * w != (img // p) ** 2:
                problems.append(f"{s}: grid {h}x{w} but image {img} / patch {p}")
    return problems


def padding_problem(model, inp):
    if "input_ids" not in inp or "pixel_values" in inp or "decoder_input_ids" in inp:
        return None
    e = attnroll.explain(model, inp, "rollout")
    keep = int(inp["attention_mask"][1].sum())
    one = {k: v[1:2, :keep] for k, v in inp.items()}
    alone = attnroll.explain(model, one, "rollout")
    if not torch.allclose(alone.scores[0], e.scores[1, :keep], atol=1e-4, rtol=1e-3):
        return "padded batch != cropped example"
    return None


def check_hf(model_type):
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    if name is None:
        return "skipped", "no base model class"
    try:
        torch.manual_seed(0)
        if model_type in TINY_HF:  # derived sizes (Swin's hidden_size = embed_dim·2^stages) need the constructor
            cfg = T.AutoConfig.for_model(model_type, **TINY_HF[model_type])
        else:
            cfg = shrink(T.AutoConfig.for_model(model_type))
        model = getattr(T, name if isinstance(name, str) else name[0])(cfg).eval()
        if hasattr(model, "set_default_language"):  # X-MOD
            model.set_default_language(next(iter(cfg.languages)))
        inp = hf_inputs(model, cfg)
        inp = vlm_inputs(model, cfg, inp)
    except Exception as e:  # noqa: BLE001 - the tiny config itself does not build
        return "skipped", f"tiny config: {type(e).__name__}: {str(e)[:90]}"
    try:
        attnroll.capture(model)  # the adapter and its sites, without running the model
    except (attnroll.UnsupportedModelError, CaptureError) as e:
        return "refused", str(e).split(". ")[0][:160]
    try:
        ref_cfg = copy.deepcopy(cfg)
        ref_cfg._attn_implementation = "eager"
        for k in getattr(ref_cfg, "sub_configs", {}) or {}:
            if getattr(ref_cfg, k, None) is not None:
                getattr(ref_cfg, k)._attn_implementation = "eager"
        ref = type(model)(ref_cfg).eval()
        ref.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            ref(**inp)  # a warm-up call: some models switch attention modules on their first call (BigBird)
            out = ref(**inp, output_attentions=True)
            expect = vlm_reference(ref, inp, out) if is_vlm_config(cfg) else reference_streams(out)
    except Timeout:
        raise
    except Exception as e:  # noqa: BLE001 - the tiny config itself does not build / run
        return "skipped", f"tiny config: {type(e).__name__}: {str(e)[:90]}"
    native = None
    if swin.is_swin(model):  # windows scattered into stage matrices; the reference has each stage's last block
        native = lambda rec: last_of_stage(model, native_layers(model, rec))  # noqa: E731
    return classify(lambda: attnroll.capture(model, inp), expect, lambda rec: layout_problems(rec, cfg, inp),
                    lambda: padding_problem(model, inp), native)


def native_layers(model, rec):
    """The record's layers in each attention module's own layout, to compare with the model's tensors:
    Swin stage matrices read back at their window positions, CaiT's [CLS + patches] rows cropped to the
    block's own queries and keys; other models' layers as they are."""
    from attnroll.capture import cait, swin

    layers = rec.attentions
    if swin.is_swin(model):
        timm_model = type(model).__module__.startswith("timm.")
        blocks = [m for _, m in (swin._timm_blocks(model) if timm_model else swin._hf_layers(model))]
        ids_of = swin.timm_window_ids if timm_model else swin.hf_window_ids
        out = []
        for A, blk, (h, w) in zip(layers, blocks, rec.extra["stage_grids"]):
            ids = ids_of(blk, h, w)
            B, H = A.shape[:2]
            win = A[:, :, ids[:, :, None], ids[:, None, :]].permute(0, 2, 1, 3, 4)
            out.append(win.reshape(B * ids.shape[0], H, ids.shape[1], ids.shape[1]))
        return out
    if cait.is_cait(model):
        kinds = [type(m).__name__ for m in model.modules() if type(m).__name__ in (cait.TALKING, cait.CLASS)]
        return [A[:, :, :1] if k == cait.CLASS else A[:, :, 1:, 1:] for A, k in zip(layers, kinds)]
    return layers


def last_of_stage(model, layers):
    """transformers Swin returns the attention of each stage's last block only."""
    stages = [m for m in model.modules() if type(m).__name__.endswith("Stage") and hasattr(m, "blocks")]
    ends = list(__import__("itertools").accumulate(len(st.blocks) for st in stages))
    return [layers[e - 1] for e in ends]


def classify(run, expect, layout, padding, native=None):
    try:
        rec = run()
    except (attnroll.UnsupportedModelError, CaptureError) as e:
        return "refused", str(e).split(". ")[0][:160]
    except Timeout:
        raise
    except Exception as e:  # noqa: BLE001
        return "wrong", f"crash {type(e).__name__}: {str(e)[:120]}"
    if not expect:
        return "wrong", "no reference attentions to compare with (unverified)"
    for s, layers in expect.items():
        got = rec.streams.get(s) if native is None else native(rec)
        if got is None or len(got) != len(layers):
            return "wrong", f"stream {s}: {0 if got is None else len(got)} layers, reference {len(layers)}"
        mask = rec.info[s].mask
        for i, (a, b) in enumerate(zip(got, layers)):
            if a.shape != b.shape:
                return "wrong", f"{s} layer {i}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
            real = torch.ones_like(a) if mask is None or a.shape[-2] != mask.shape[-1] else mask.bool()[:, None, :, None]
            if not torch.allclose(a * real, b * real, atol=1e-5, rtol=1e-5):
                return "wrong", f"{s} layer {i}: differs from eager by {float((a * real - b * real).abs().max()):.2g}"
    problems = layout(rec)
    if problems:
        return "wrong", "; ".join(problems)
    try:
        p = padding()
    except attnroll.UnsupportedModelError as e:  # attnroll's own refusal, with its reason (e.g. a token mixer)
        return "refused", f"explain: {str(e)[:200]}"
    except (CaptureError, ValueError) as e:
        p = f"explain failed: {str(e)[:100]}"
    if p:
        return "wrong", p
    streams = ", ".join(f"{s}({rec.info[s].readout.kind if rec.info[s].readout else '-'})" for s in rec.streams)
    return "correct", f"{rec.family}: {streams}"


def timm_reference(model, x):
    """Per attention module, (v, out): v (B, H, n, d) from the block's own projection and the tensor its output
    projection (or the norm before it) receives on the model's default fused path. Captured probabilities A
    are right when (A @ v) reproduces ``out`` (RoPE, relative-position biases and all)."""
    mods = [m for m in model.modules() if hasattr(m, "attn_drop") and hasattr(m, "num_heads") and hasattr(m, "proj")
            and (getattr(m, "qkv", None) is not None or hasattr(m, "v_proj") or isinstance(getattr(m, "v", None), torch.nn.Linear))]
    if not mods:
        return None
    seen, hooks = {}, []
    for i, m in enumerate(mods):
        hooks.append(m.register_forward_pre_hook(lambda mod, a, i=i: seen.setdefault(i, {}).update(x=a[0])))
        after = m.norm if isinstance(getattr(m, "norm", None), torch.nn.LayerNorm) else m.proj
        hooks.append(after.register_forward_pre_hook(lambda mod, a, i=i: seen[i].update(out=a[0])))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, m in enumerate(mods):
        inp = seen[i]["x"]
        B, N, _ = inp.shape
        if getattr(m, "qkv", None) is not None:
            qkv = m.qkv(inp)
            if getattr(m, "v_bias", None) is not None and m.qkv.bias is None:  # SwinV2 keeps the biases apart
                qkv = qkv + torch.cat((torch.zeros_like(m.v_bias), torch.zeros_like(m.v_bias), m.v_bias))
            v = qkv.reshape(B, N, 3, m.num_heads, -1)[:, :, 2]
        elif isinstance(getattr(m, "v", None), torch.nn.Linear):  # CaiT class attention
            v = m.v(inp).reshape(B, N, m.num_heads, -1)
        else:
            v = m.v_proj(inp).reshape(B, N, m.num_heads, -1)
        out.append((v.transpose(1, 2), seen[i]["out"]))
    return out


def reproduces(rec, pairs, layers=None):
    """'' when every captured layer reproduces its block's output, else the first problem."""
    layers = rec.attentions if layers is None else layers
    if len(pairs) % len(layers):
        return f"{len(layers)} layers for {len(pairs)} attention modules"
    k = len(pairs) // len(layers)  # parallel branches: heads concatenated per layer
    for li, A in enumerate(layers):
        for j in range(k):
            v, out = pairs[li * k + j]
            H = v.shape[1]
            a = A[:, j * H : (j + 1) * H]
            B, _, _, d = v.shape
            mixed = (a @ v).transpose(1, 2).reshape(B, a.shape[-2], H * d)
            if not torch.allclose(mixed, out, atol=1e-5, rtol=1e-4):
                return f"layer {li}: A @ v differs from the block's output by {float((mixed - out).abs().max()):.2g}"
    return ""


def check_timm(name, kw):
    import timm

    base = TIMM_SMALL
    try:
        torch.manual_seed(0)
        try:
            model = timm.create_model(name, **{**base, **kw}).eval()
        except TypeError:
            model = timm.create_model(name, pretrained=False, num_classes=3, **kw).eval()
        size = model.pretrained_cfg.get("input_size", (3, 32, 32)) if "img_size" not in str(model) else (3, 32, 32)
        x = torch.randn(2, 3, 32, 32)
        try:
            model(x)
        except Exception:  # noqa: BLE001 - the model insists on its own input size
            x = torch.randn(2, *size)
            model(x)
        expect = timm_reference(model, x)
    except Timeout:
        raise
    except Exception as e:  # noqa: BLE001
        return "skipped", f"tiny model: {type(e).__name__}: {str(e)[:90]}"

    def layout(rec):
        info = rec.info["self"]
        problems = []
        if info.grid is None or info.prefix + info.grid[0] * info.grid[1] != rec.streams["self"][0].shape[-1]:
            problems.append(f"layout prefix {info.prefix} grid {info.grid}")
        if info.readout is None and not info.readout_reason:
            problems.append("no readout")
        return problems

    try:
        rec = attnroll.capture(model, x)
    except (attnroll.UnsupportedModelError, CaptureError) as e:
        return "refused", str(e).split(". ")[0][:160]
    except Exception as e:  # noqa: BLE001
        return "wrong", f"crash {type(e).__name__}: {str(e)[:120]}"
    if expect is None:
        return "wrong", "no reference (unverified)"
    problem = reproduces(rec, expect, native_layers(model, rec)) or "; ".join(layout(rec))
    if problem:
        return "wrong", problem
    return "correct", f"{rec.family}: self({rec.info['self'].readout.kind if rec.info['self'].readout else '-'})"


def parse_matrix_args(doc, argv=None):
    """The matrix scripts' shared command line (``--only``, ``--markdown``); quiets warnings and transformers'
    logging. Returns (args, the set of names given to ``--only``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated model types / timm names")
    ap.add_argument("--markdown", default="", help="write the matrix as a Markdown table to this file")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return args, set(filter(None, args.only.split(",")))


def main(argv=None):
    args, only = parse_matrix_args(__doc__, argv)
    signal.signal(signal.SIGALRM, _alarm)
    rows = []
    jobs = [("transformers", t, lambda t=t: check_hf(t)) for t in HF_TYPES]
    jobs += [("timm", f"{n}{kw if kw else ''}", lambda n=n, kw=kw: check_timm(n, kw)) for n, kw in TIMM_MODELS]
    t0 = time.time()
    for lib, name, job in jobs:
        if only and name.split("{")[0] not in only:
            continue
        signal.alarm(150)
        try:
            verdict, why = job()
        except Timeout as e:
            verdict, why = "skipped", str(e)
        finally:
            signal.alarm(0)
        rows.append((lib, name, verdict, why))
        print(f"{verdict:8s} {lib:12s} {name:40s} {why}", flush=True)
    return report(rows, ("correct", "refused", "wrong", "skipped"), t0, args.markdown)


def report(rows: list[tuple], verdicts: tuple[str, ...], t0: float, markdown: str | None) -> int:
    """Print the verdict counts, write the rows as a markdown table when asked; exit code 1 if any is wrong."""
    counts = {v: sum(r[2] == v for r in rows) for v in verdicts}
    print(f"\n{counts} of {len(rows)} in {time.time() - t0:.0f} s", flush=True)
    if markdown:
        with open(markdown, "w", encoding="utf-8") as f:
            f.write("| library | architecture | verdict | detail |\n|---|---|---|---|\n")
            for r in rows:
                f.write("| " + " | ".join(str(c).replace("|", "/") for c in r) + " |\n")
            f.write(f"\n{counts}\n")
    return 0 if counts["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
