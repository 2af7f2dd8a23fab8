"""Every family of the test zoos (tests/capture/models.py and tests/methods/models.py) read the way the model
itself reads its tokens: the batch axis (each example of a batch of different inputs explained as when it is
explained alone), the token layout (prefix + grid + suffix = the sequence length), the readout (the last real
token for causal streams, the token the text tower pools for CLIP) and both routes (matrix-free and dense)
giving the same map."""

from __future__ import annotations

import pytest
import torch

import attnroll

from ..zoo import plain as capture_zoo
from ..zoo import sharp as methods_zoo

# Left out of `make test-fast` (its 90 s budget on 2 cores); `make test` and CI run it.
pytestmark = pytest.mark.slow

ZOOS = {"plain": capture_zoo, "sharp": methods_zoo}
CASES = [(z, name) for z, zoo in ZOOS.items() for name in zoo.BUILDERS
         if name not in zoo.SIGNED]  # DiffLlama's signed matrices: tests/capture/test_diffllama.py


def _streams(zoo, name: str) -> list[str | None]:
    if name in zoo.SEQ2SEQ_MODELS:
        return ["encoder", "decoder"]
    if name == "clip":
        return ["vision", "text"]
    return [None]


def _inputs(zoo, name: str, model) -> dict:
    """Two different examples; text: the last one padded (2 tokens) with the model's pad id, as a tokenizer
    pads (CLIP pools the largest id, RoBERTa counts positions from the non-pad ids)."""
    x = zoo.inputs_for(name, batch=2, seed=3)
    if name == "clip" and "pixel_values" not in x:
        x["pixel_values"] = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    if "attention_mask" in x:
        x["attention_mask"][-1, -2:] = 0
        text = getattr(model.config, "text_config", None) or model.config
        pad = getattr(text, "pad_token_id", None)
        x["input_ids"][-1, -2:] = 0 if pad is None else pad
    return x


def _alone(x: dict, b: int) -> dict:
    """Example b alone, its padding cropped away (a decoder's inputs are never padded here)."""
    out = {k: v[b:b + 1] for k, v in x.items()}
    if "attention_mask" in out:
        keep = int(out["attention_mask"].sum())
        for k in ("input_ids", "attention_mask"):
            out[k] = out[k][:, :keep]
    return out


def _explain(model, x, stream, **kw):
    return attnroll.explain(model, x, "rollout", **({} if stream is None else {"stream": stream}), **kw)


def _real(x: dict, stream: str | None, b: int, n: int) -> int:
    """Real tokens of example b in a stream of n tokens."""
    mask = x.get("attention_mask")
    if stream in ("vision", "decoder") or mask is None or mask.shape[-1] != n:
        return n
    return int(mask[b].sum())


@pytest.mark.parametrize("zoo_name,name", CASES)
def test_each_example_of_a_batch_reads_as_when_alone_and_routes_agree(zoo_name, name):
    zoo = ZOOS[zoo_name]
    model = zoo.model(name).eval()
    x = _inputs(zoo, name, model)
    for stream in _streams(zoo, name):
        batch = _explain(model, x, stream)
        dense = _explain(model, x, stream, attention="dense")
        torch.testing.assert_close(batch.scores, dense.scores, atol=1e-5, rtol=1e-4)
        assert batch.readout_weights is not None
        torch.testing.assert_close(batch.readout_weights.float(), dense.readout_weights.float())
        n = batch.full_row.shape[-1]
        for b in range(2):
            alone = _explain(model, _alone(x, b), stream)
            keep = _real(x, stream, b, n)
            assert alone.full_row.shape[-1] == keep, (name, stream)
            torch.testing.assert_close(batch.full_row[b, :keep], alone.full_row[0], atol=1e-5, rtol=1e-4)
            if keep < n:  # padding gets no relevance
                assert batch.full_row[b, keep:].abs().max().item() < 1e-6, (name, stream)


@pytest.mark.parametrize("zoo_name,name", CASES)
def test_token_layout_accounts_for_every_token_and_the_readout_is_the_models_own(zoo_name, name):
    zoo = ZOOS[zoo_name]
    model = zoo.model(name).eval()
    x = _inputs(zoo, name, model)
    rec = attnroll.capture(model, x)
    with torch.no_grad():
        out = zoo.eager(model)(**x, output_attentions=True) if zoo is methods_zoo else \
            zoo.eager_reference(model)(**x, output_attentions=True)
    for s, info in rec.info.items():
        B, _, nq, n = rec.stream_shape(s)
        assert B == 2, (name, s)  # the batch axis is the examples'
        if s == "cross":
            continue
        if info.grid is not None:
            assert info.prefix + info.grid[0] * info.grid[1] + info.suffix == n, (name, s)
            px = x["pixel_values"]
            patch = model.config.vision_config.patch_size if hasattr(model.config, "vision_config") else \
                model.config.patch_size
            assert info.grid == (px.shape[-2] // patch, px.shape[-1] // patch)
        causal = info.causal
        own = _causal_by_model(out, s)
        assert causal == own, (name, s, causal, own)
        w = info.readout.weights
        if causal and info.readout.kind != "eot":  # (an end-of-text pooling tower: checked below)
            last = [_real(x, s, b, n) - 1 for b in range(B)]
            assert w.argmax(dim=-1).tolist() == last and torch.allclose(w.sum(-1), torch.ones(B)), (name, s)
        if name == "clip" and s == "text":
            # CLIP's text tower pools the (final-normed) hidden state of one token: the readout's.
            with torch.no_grad():
                t = model.text_model(input_ids=x["input_ids"], attention_mask=x["attention_mask"])
            pos = w.argmax(dim=-1)
            torch.testing.assert_close(t.pooler_output, t.last_hidden_state[torch.arange(B), pos])


def _causal_by_model(out, stream: str) -> bool:
    """Causality from the model's own eager attention: nothing above the diagonal in the first layer of the
    stream (padded query rows aside: the first real row ahead would show it)."""
    ref = {"self": getattr(out, "attentions", None), "encoder": getattr(out, "encoder_attentions", None),
           "decoder": getattr(out, "decoder_attentions", None)}
    if stream in ("vision", "text"):
        ref[stream] = getattr(out, f"{stream}_model_output").attentions
    a = ref[stream][0][0]  # example 0 is never padded
    return bool(torch.triu(a, diagonal=1).abs().amax() == 0)
