"""TransformerLens 4: a TransformerBridge built offline around a tiny random-weight transformers GPT-2, read at
its own ``blocks.{i}.attn.hook_pattern``; the rollout equals the rollout of the patterns TransformerLens caches,
and the bridge is left as it was."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformer_lens")
T = pytest.importorskip("transformers")

import attnroll  # noqa: E402
from attnroll.capture.registry import family_of  # noqa: E402

pytestmark = pytest.mark.slow  # importing TransformerLens takes several seconds

VOCAB = 64


@functools.lru_cache(maxsize=1)
def tokenizer_dir(tmp: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<unk>": VOCAB - 2, "<bos>": VOCAB - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<bos>", eos_token="<bos>",
                              pad_token="<unk>").save_pretrained(tmp)
    return tmp


@pytest.fixture
def bridge(tmp_path_factory):
    """TransformerBridge.boot_transformers with hf_model= and tokenizer=: no download (the model name only
    picks the architecture adapter)."""
    from transformer_lens.model_bridge import TransformerBridge

    tok = T.AutoTokenizer.from_pretrained(tokenizer_dir(str(tmp_path_factory.mktemp("tok"))))
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=VOCAB - 1,
                       eos_token_id=VOCAB - 1, initializer_range=0.3)
    hf = T.GPT2LMHeadModel(cfg).eval()
    return TransformerBridge.boot_transformers("gpt2", hf_model=hf, tokenizer=tok).eval()


def tokens(batch: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB - 2, (batch, n), generator=torch.Generator().manual_seed(3))


def own_patterns(bridge, ids):
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    return [cache[f"blocks.{i}.attn.hook_pattern"] for i in range(len(bridge.blocks))]


def test_detected_and_rollout_equals_its_own_hook_pattern(bridge):
    assert family_of(bridge).name == "transformer_lens"
    ids = tokens()
    A = own_patterns(bridge, ids)
    n = ids.shape[1]
    R = torch.eye(n)
    for a in A:
        R = (0.5 * a.mean(1) + 0.5 * torch.eye(n)) @ R
    e = attnroll.explain(bridge, ids, "rollout")
    torch.testing.assert_close(e.full_row, R[:, -1], atol=1e-5, rtol=0)  # causal: the last token's row
    assert e.positions == [6, 6]
    with torch.no_grad():
        pred = bridge(ids)[:, -1].argmax(-1).tolist()
    assert e.target == pred
    raw = attnroll.explain(bridge, ids, "raw", layer=-1)
    torch.testing.assert_close(raw.full_row, A[-1].mean(1)[:, -1], atol=1e-5, rtol=0)


def test_gradient_rollout_equals_its_own_hooks(bridge):
    ids = tokens()
    kept = []

    def keep(t, hook):
        t.retain_grad()
        kept.append(t)
        return t

    names = [(f"blocks.{i}.attn.hook_pattern", keep) for i in range(len(bridge.blocks))]
    with bridge.hooks(fwd_hooks=names):
        logits = bridge(ids)
    logits[:, -1, 5].sum().backward()
    n = ids.shape[1]
    R = torch.eye(n)
    for a in kept:  # grad_rollout's defaults: mean_h((dy/dA ⊙ A)^+), then (W + I) with rows renormalised
        W = (a.grad * a.detach()).clamp(min=0).mean(1) + torch.eye(n)
        R = (W / W.sum(-1, keepdim=True)) @ R
    want = R[:, -1]
    bridge.zero_grad(set_to_none=True)
    e = attnroll.explain(bridge, ids, "grad_rollout", target=5)
    torch.testing.assert_close(e.full_row, want.float(), atol=1e-5, rtol=0)


def test_padding_mask_and_the_bridge_left_as_it_was(bridge):
    ids = tokens()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with torch.no_grad():  # TransformerLens installs some hooks of its own on a first forward pass
        bridge(ids, attention_mask=mask)
    hooks_before = {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
                    for n, m in bridge.named_modules()}
    training = {n: m.training for n, m in bridge.named_modules()}
    bridge.train()  # a bridge in training mode is explained in eval mode and handed back in training mode
    e = attnroll.explain(bridge, {"input": ids, "attention_mask": mask}, "rollout")
    assert e.positions == [6, 4]  # the last real token of each example
    assert float(e.scores[1, 5:].abs().sum()) == 0
    assert all(m.training for m in bridge.modules())
    bridge.train(False)
    for n, m in bridge.named_modules():
        m.training = training[n]
    assert {n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for n, m in bridge.named_modules()} == hooks_before
    assert not any(p.grad is not None for p in bridge.parameters())

