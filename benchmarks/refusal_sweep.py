"""Which transformers families attnroll explains, and how it refuses the others: a report, not a test.

For each ``model_type`` below, a tiny random-weight model is built offline from its config
(``AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, ...)`` + ``AutoModel.from_config``),
run once on a dummy input of its main input, then explained with ``attnroll.explain(model, inputs, "rollout")``.
Each row says one of:

- ``explained``: rollout (``encdec_rollout`` for an encoder-decoder) returned an Explanation;
- ``refused (attnroll)``: attnroll raised, from its own code, with the message shown (read it: does it name
  this model's own obstacle?);
- ``LEAK``: an exception raised inside torch / transformers reached the caller (attnroll should refuse or
  explain instead);
- ``skipped``: the tiny model could not be built or did not run on its own (the sweep's config, not attnroll).

Run: ``PYTHONPATH=src python benchmarks/refusal_sweep.py [model_type ...] [--out benchmarks/refusal_sweep.md]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path

#: Popular model types (text encoders, decoders, encoder-decoders, vision, audio, and known obstacles).
MODEL_TYPES = (
    "bert", "roberta", "distilbert", "electra", "albert", "deberta", "deberta-v2", "mpnet", "xlm-roberta",
    "camembert", "roformer", "longformer", "big_bird", "funnel", "squeezebert", "canine", "layoutlm", "xlnet",
    "nystromformer", "yoso", "reformer", "perceiver",
    "gpt2", "gpt_neo", "gptj", "gpt_bigcode", "codegen", "ctrl", "llama", "mistral", "qwen2", "gemma", "phi",
    "falcon", "bloom", "opt", "mpt", "rwkv", "mamba", "mamba2", "falcon_mamba",
    "t5", "bart", "marian", "pegasus", "led", "m2m_100", "bigbird_pegasus", "seamless_m4t",
    "vit", "deit", "beit", "dinov2", "vit_mae", "vit_msn", "yolos", "swin", "convnext", "segformer", "levit",
    "mobilevit", "vitdet", "deformable_detr", "detr", "conditional_detr", "rt_detr", "sam_vision_model",
    "wav2vec2", "hubert", "whisper",
)

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, vocab_size=100,
            max_position_embeddings=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, num_key_value_heads=2,
            image_size=32, patch_size=8, embedding_size=32, num_layers=2, num_heads=2, d_ff=37, d_kv=16)

_DETR = dict(use_timm_backbone=False, use_pretrained_backbone=False, num_queries=5, backbone=None,
             backbone_config={"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16, 16, 32],
                              "depths": [1, 1, 1, 1], "out_features": ["stage2", "stage3", "stage4"]})
_SEQ2SEQ_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)

#: Per model type: config entries replacing / adding to TINY (its own names, lists where it wants lists).
OVERRIDES = {
    "funnel": dict(block_sizes=[1, 1], num_hidden_layers=None),
    "squeezebert": dict(q_groups=1, k_groups=1, v_groups=1, post_attention_groups=1, intermediate_groups=1,
                        output_groups=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "gptj": dict(rotary_dim=8), "codegen": dict(rotary_dim=8),
    "xlnet": dict(max_position_embeddings=None, n_layer=2, n_head=2),
    "convnext": dict(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], image_size=64, patch_size=4),
    "marian": dict(_SEQ2SEQ_IDS, decoder_vocab_size=100),
    "whisper": dict(_SEQ2SEQ_IDS, max_source_positions=16, max_target_positions=16, num_mel_bins=8),
    "bigbird_pegasus": dict(attention_type="original_full"),
    "yolos": dict(image_size=[32, 32]),
    "swin": dict(embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4, num_layers=None,
                 num_hidden_layers=None, hidden_size=None),
    "segformer": dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                      patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    "levit": dict(hidden_sizes=[16, 32, 48], num_attention_heads=[1, 2, 3], depths=[1, 1, 1], key_dim=[8, 8, 8],
                  patch_size=16, image_size=64),
    "mobilevit": dict(hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], image_size=64),
    "deformable_detr": _DETR, "detr": _DETR, "conditional_detr": _DETR,
    "rt_detr": dict(backbone_config={"model_type": "rt_detr_resnet", "embedding_size": 8,
                                     "hidden_sizes": [8, 16, 16, 32], "depths": [1, 1, 1, 1],
                                     "out_features": ["stage2", "stage3", "stage4"]},
                    encoder_in_channels=[16, 16, 32], encoder_hidden_dim=32, decoder_in_channels=[32, 32, 32],
                    num_queries=5, hidden_size=32),
    "sam_vision_model": dict(image_size=64, patch_size=16, window_size=2, global_attn_indexes=[1],
                             output_channels=16, mlp_dim=37),
    "vitdet": dict(window_block_indices=[0], window_size=2, residual_block_indices=[]),
    "reformer": dict(attn_layers=["local", "lsh"], axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 16],
                     local_attn_chunk_length=4, lsh_attn_chunk_length=4),
    "mamba": dict(state_size=4), "mamba2": dict(state_size=4, head_dim=16, n_groups=1, expand=1),
    "falcon_mamba": dict(state_size=4),
}


def tiny_model(model_type: str):
    """A tiny random-weight model of ``model_type`` and its dummy inputs."""
    import torch
    from transformers import AutoConfig, AutoModel

    extra = OVERRIDES.get(model_type, {})
    tiny = {k: v for k, v in {**TINY, **extra}.items() if v is not None}  # None: leave the config's default
    config = AutoConfig.for_model(model_type, **tiny)
    torch.manual_seed(0)
    model = AutoModel.from_config(config).eval()
    return model, dummy_inputs(model, config)


def dummy_inputs(model, config) -> dict:
    """The model's main input (and decoder ids for an encoder-decoder), small."""
    import torch

    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        side = getattr(config, "image_size", 32)
        side = side if isinstance(side, int) and side >= 32 else 64
        if getattr(config, "model_type", "") in ("deformable_detr", "detr", "conditional_detr", "rt_detr"):
            side = 256
        inputs = {name: torch.randn(1, getattr(config, "num_channels", 3), side, side)}
    elif name == "input_values":
        inputs = {name: torch.randn(1, 4000)}
    elif name == "input_features":
        inputs = {name: torch.randn(1, getattr(config, "num_mel_bins", 80), 2 * config.max_source_positions)}
    else:
        inputs = {name: torch.randint(3, 90, (1, 8))}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, 90, (1, 5))
    return inputs


def raised_in_attnroll(exc: BaseException) -> bool:
    """Whether the innermost frame that raised ``exc`` is attnroll's own code."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and f"{os.sep}attnroll{os.sep}" in frames[-1].filename


def sweep_one(model_type: str, method: str | None = None) -> tuple[str, str]:
    """(outcome, message) for one model type (see the module docstring); ``method``: instead of rollout /
    encdec_rollout."""
    import torch

    import attnroll

    try:
        model, inputs = tiny_model(model_type)
        with torch.no_grad():
            model(**inputs)
    except Exception as e:  # noqa: BLE001  (the sweep's tiny config, not attnroll)
        return "skipped", f"{type(e).__name__}: {e}"
    if method is None:
        method = "encdec_rollout" if getattr(model.config, "is_encoder_decoder", False) else "rollout"
    try:
        attnroll.explain(model, inputs, method)
    except Exception as e:  # noqa: BLE001
        outcome = "refused (attnroll)" if raised_in_attnroll(e) else "LEAK"
        return outcome, f"{type(e).__name__}: {e}"
    return "explained", ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", default=list(MODEL_TYPES))
    parser.add_argument("--method", default=None, help="explain with this method instead of rollout")
    parser.add_argument("--out", default=None, help="write the markdown report here (default: print it)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    rows = ["| model_type | outcome | message |", "|---|---|---|"]
    for model_type in args.model_types:
        outcome, message = sweep_one(model_type, args.method)
        message = " ".join(message.split()).replace("|", "/")[:400]
        rows.append(f"| {model_type} | {outcome} | {message} |")
        print(rows[-1], file=sys.stderr, flush=True)
    what = (f'"{args.method}")`' if args.method else '"rollout")` (encoder-decoders: `"encdec_rollout"`)')
    text = "\n".join([f"# Refusal sweep: `attnroll.explain(model, x, {what} over tiny transformers models",
                      "", "Made by `benchmarks/refusal_sweep.py` (see its docstring for the outcomes).", "", *rows, ""])
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        print(text)


if __name__ == "__main__":
    main()
