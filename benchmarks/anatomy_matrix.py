"""Anatomy matrix: what the layer anatomy says about each architecture of the family matrix, and whether it is
right where it describes the value path.

For each tiny random-weight model of ``family_matrix.py`` (same configs, float64):

    exact      the anatomy describes every block for the value-aware methods, and on one forward pass every
               layer's attention shares plus b_O equal the actual pre-norm vector and the DecompX shares of
               every layer add up to the layer's actual output (1e-6)
    described  the anatomy describes the blocks (the sanity check can use it) but the value-aware methods
               refuse them, with the reason (windowed attention, several stacks, ...)
    refused    the anatomy refuses the model, with the reason (an unknown block, an unplaced parameter, ...)
    wrong      a described value path whose shares do not add up (a silent misdescription)
    skipped    the tiny config does not build / run, or the capture refuses the model (not counted)

    PYTHONPATH=src python benchmarks/anatomy_matrix.py [--only bert,vit] [--markdown out.md]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_matrix as fm  # noqa: E402  (the same architectures and tiny configs)

from attnroll import UnsupportedModelError  # noqa: E402
from attnroll.capture import CaptureError, model_facts  # noqa: E402
from attnroll.capture.value_path import record_states  # noqa: E402
from attnroll.core.decompx import block_shares, initial_shares  # noqa: E402
from attnroll.core.value_aware import apply_norm, head_mix, value_outputs  # noqa: E402


def exactness(model, inputs) -> str:
    """"" when every layer's shares add up (see the module docstring), else what failed."""
    rec, st, anat = record_states(model, inputs)
    S = initial_shares(st.inputs[0])
    for i, blk in enumerate(anat.blocks(torch.float64)):
        x = st.inputs[i]
        z = head_mix(rec.attentions[i].double(), value_outputs(apply_norm(x, blk.norm1) if blk.pre_norm else x, blk), x)
        actual = st.norm2_in[i] if blk.pre_norm else st.norm1_in[i]
        err = float((z.sum(2) + (0 if blk.bo is None else blk.bo) - actual).abs().max())
        if err > 1e-6:
            return f"layer {i}: attention shares off by {err:.2e}"
        S = block_shares(S, rec.attentions[i].double(), blk)
        err = float((S.sum(2) - st.outputs[i]).abs().max())
        if err > 1e-6:
            return f"layer {i}: DecompX shares off the output by {err:.2e}"
    return ""


def verdict(model, inputs) -> tuple[str, str]:
    facts = model_facts(model)
    anat = facts.anatomy
    if anat is None:
        return "refused", facts.anatomy_reason.split(". Known")[0][:150]
    if anat.value_aware:
        return "described", f"{anat.family}, {len(anat.layers)} blocks; value-aware: {anat.value_aware[:110]}"
    try:
        problem = exactness(model, inputs)
    except (UnsupportedModelError, CaptureError) as e:
        return "skipped", f"capture: {str(e)[:120]}"
    return ("wrong", problem) if problem else ("exact", f"{anat.family}, {len(anat.layers)} blocks")


def build_hf(model_type):
    import transformers as T
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    if name is None:
        raise ValueError("no base model class")
    torch.manual_seed(0)
    cfg = fm.shrink(T.AutoConfig.for_model(model_type))
    cfg._attn_implementation = "eager"
    model = getattr(T, name if isinstance(name, str) else name[0])(cfg).eval().double()
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in fm.hf_inputs(model, cfg).items()}
    with torch.no_grad():
        model(**inputs)
    return model, inputs


def build_timm(name, kw):
    import timm

    base = dict(pretrained=False, depth=2, embed_dim=32, num_heads=4, num_classes=3, img_size=32, patch_size=8)
    torch.manual_seed(0)
    model = timm.create_model(name, **{**base, **kw}).eval().double()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        model(x)
    return model, x


def main(argv=None):
    args, only = fm.parse_matrix_args(__doc__, argv)
    jobs = [("transformers", t, lambda t=t: build_hf(t)) for t in fm.HF_TYPES]
    jobs += [("timm", f"{n}{kw if kw else ''}", lambda n=n, kw=kw: build_timm(n, kw)) for n, kw in fm.TIMM_MODELS]
    rows, t0 = [], time.time()
    for lib, name, build in jobs:
        if only and name.split("{")[0] not in only:
            continue
        try:
            model, inputs = build()
        except Exception as e:  # noqa: BLE001 - the tiny config itself does not build / run in float64
            row = (lib, name, "skipped", f"tiny config: {type(e).__name__}: {str(e)[:90]}")
        else:
            try:
                row = (lib, name, *verdict(model, inputs))
            except Exception as e:  # noqa: BLE001 - a crash is a wrong answer of attnroll
                row = (lib, name, "wrong", f"crash {type(e).__name__}: {str(e)[:120]}")
        rows.append(row)
        print(f"{row[2]:9s} {lib:12s} {name:40s} {row[3]}", flush=True)
    return fm.report(rows, ("exact", "described", "refused", "wrong", "skipped"), t0, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
