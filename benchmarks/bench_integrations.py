"""The integrations side by side with ``attnroll.explain``: what each facade or adapter adds.

    captum      AttnrollAttribution(model, m).attribute(pixels)  vs  explain(model, {"pixel_values": ...}, m)
    inseq       inseq.attribute(prompt, k new tokens) with "attnroll_<m>"  vs  generate + explain per step
    lens        explain(bridge, ids, m)  vs  TransformerLens' own run_with_cache(hook_pattern) + rollout by hand
                (rollout) and  vs  explain(the same weights as a plain transformers model, m)
    open_clip   explain(clip.visual, pixels, m)  vs  the open_clip forward + rollout of its attention, recomputed
                by hand (rollout) and vs explain(the transformers CLIP vision tower of the same size, m)

Median of ``--repeats`` interleaved runs (each pair timed back to back), CPU, float32, tiny-to-small random-weight
models. Prints a markdown table with the machine load.

    PYTHONPATH=src python benchmarks/bench_integrations.py [--repeats 7] [--only captum,lens]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
import transformers as T

import attnroll

Pair = tuple[str, Callable[[], object], Callable[[], object]]


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def side_by_side(a: Callable, b: Callable, repeats: int) -> tuple[float, float]:
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        ta.append(timed(a))
        tb.append(timed(b))
    return statistics.median(ta), statistics.median(tb)


def word_tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tempfile.mkdtemp()
    T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", pad_token="w0").save_pretrained(d)
    return T.AutoTokenizer.from_pretrained(d)


def gpt2(vocab: int = 512) -> T.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=6, n_embd=256, n_head=8, vocab_size=vocab, n_positions=256, bos_token_id=0,
                       eos_token_id=0)
    return T.GPT2LMHeadModel(cfg).eval()


def captum_pairs() -> list[Pair]:
    from attnroll.integrations.captum import AttnrollAttribution

    torch.manual_seed(0)
    vit = T.ViTForImageClassification(T.ViTConfig(image_size=224, patch_size=16, hidden_size=192, num_hidden_layers=6,
                                                  num_attention_heads=3, intermediate_size=768, num_labels=10)).eval()
    px = torch.randn(4, 3, 224, 224)
    out = []
    for m in ("rollout", "gae"):
        attr = AttnrollAttribution(vit, m)
        out.append((f"captum `{m}`, ViT 6x192, 4 images 224²", lambda a=attr: a.attribute(px, target=0),
                    lambda m=m: attnroll.explain(vit, {"pixel_values": px}, m, target=0)))
    return out


def inseq_pairs() -> list[Pair]:
    import inseq

    import attnroll.integrations.inseq  # noqa: F401  (registers the methods)

    lm, tok = gpt2(), word_tokenizer(512)
    prompt = " ".join(f"w{i % 500 + 1}" for i in range(48))
    k = 4

    def by_hand(m: str) -> None:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = lm.generate(ids, max_new_tokens=k, do_sample=False, pad_token_id=0)
        for s in range(k):
            pre = gen[:, :ids.shape[1] + s]
            attnroll.explain(lm, {"input_ids": pre, "attention_mask": torch.ones_like(pre)}, m,
                             target=[int(gen[0, ids.shape[1] + s])])

    out = []
    for m in ("rollout", "gae"):
        model = inseq.load_model(lm, f"attnroll_{m}", tokenizer=tok)
        out.append((f"inseq `attnroll_{m}`, GPT-2 6x256, 48-token prompt, {k} new tokens",
                    lambda model=model: model.attribute(prompt, generation_args={"max_new_tokens": k},
                                                        show_progress=False),
                    lambda m=m: by_hand(m)))
    return out


def lens_pairs() -> list[Pair]:
    from transformer_lens.model_bridge import TransformerBridge

    hf, plain, tok = gpt2(), gpt2(), word_tokenizer(512)
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=hf, tokenizer=tok).eval()
    ids = torch.randint(1, 500, (4, 128), generator=torch.Generator().manual_seed(0))
    names = [f"blocks.{i}.attn.hook_pattern" for i in range(len(bridge.blocks))]

    def own() -> torch.Tensor:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids, names_filter=lambda n: n in names)
        n = ids.shape[1]
        R = torch.eye(n)
        for name in names:
            R = (0.5 * cache[name].mean(1) + 0.5 * torch.eye(n)) @ R
        return R[:, -1]

    return [
        ("lens `rollout`: explain(bridge) vs TransformerLens run_with_cache + rollout, 4x128 tokens",
         lambda: attnroll.explain(bridge, ids, "rollout"), own),
        ("lens `rollout`: explain(bridge) vs explain(plain transformers GPT-2, same sizes)",
         lambda: attnroll.explain(bridge, ids, "rollout"),
         lambda: attnroll.explain(plain, {"input_ids": ids}, "rollout")),
        ("lens `gae`: explain(bridge) vs explain(plain transformers GPT-2, same sizes)",
         lambda: attnroll.explain(bridge, ids, "gae"), lambda: attnroll.explain(plain, {"input_ids": ids}, "gae")),
    ]


def open_clip_pairs() -> list[Pair]:
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(0)
    clip = CLIP(256, CLIPVisionCfg(layers=6, width=192, head_width=64, image_size=224, patch_size=16),
                CLIPTextCfg(context_length=32, vocab_size=512, width=192, heads=3, layers=6)).eval()
    hf = T.CLIPVisionModel(T.CLIPVisionConfig(hidden_size=192, intermediate_size=768, num_hidden_layers=6,
                                              num_attention_heads=3, image_size=224, patch_size=16)).eval()
    px = torch.randn(4, 3, 224, 224)
    blocks = clip.visual.transformer.resblocks

    def own() -> torch.Tensor:
        seen = []
        hooks = [b.attn.register_forward_pre_hook(lambda m, a: seen.append((m, a[0]))) for b in blocks]
        with torch.no_grad():
            clip.visual(px)
            for h in hooks:
                h.remove()
            R = None
            for m, x in seen:
                B, n, E = x.shape
                q, k, _ = torch.nn.functional.linear(x, m.in_proj_weight, m.in_proj_bias).chunk(3, -1)
                q, k = (t.reshape(B, n, m.num_heads, -1).transpose(1, 2) for t in (q, k))
                a = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1).mean(1)
                step = 0.5 * a + 0.5 * torch.eye(n)
                R = step if R is None else step @ R
        return R[:, 0]

    return [
        ("open_clip `rollout`: explain(visual) vs open_clip forward + rollout recomputed by hand, 4 images 224²",
         lambda: attnroll.explain(clip.visual, px, "rollout"), own),
        ("open_clip `rollout`: explain(visual) vs explain(transformers CLIPVisionModel, same sizes)",
         lambda: attnroll.explain(clip.visual, px, "rollout"), lambda: attnroll.explain(hf, {"pixel_values": px},
                                                                                        "rollout")),
        ("open_clip `gae`: explain(visual) vs explain(transformers CLIPVisionModel, same sizes)",
         lambda: attnroll.explain(clip.visual, px, "gae", target=0),
         lambda: attnroll.explain(hf, {"pixel_values": px}, "gae", target=lambda o: o.pooler_output[:, 0])),
    ]


SUITES = {"captum": captum_pairs, "inseq": inseq_pairs, "lens": lens_pairs, "open_clip": open_clip_pairs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--only", default=",".join(SUITES))
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load before: {os.getloadavg()}")
    print("| comparison | integration (s) | reference (s) | ratio |")
    print("|---|---|---|---|")
    for name in args.only.split(","):
        for label, a, b in SUITES[name]():
            ta, tb = side_by_side(a, b, args.repeats)
            print(f"| {label} | {ta:.4f} | {tb:.4f} | {ta / tb:.3f} |", flush=True)
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
