"""The readout: which output rows a prediction reads, with what weights, and how an explanation picks them.

One module for the whole policy. :class:`Readout` is the weights (B, n); :func:`resolve_readout` turns a
spec ("cls", "mean", "last", "eot", positions, a weight vector, an attention-pool head's weights) into one,
as adapters do when they declare a stream's readout and as the ``readout=`` option does. The explained
rows of a record's stream (:func:`explained_readout`) and the output position of a token-level target
(:func:`explained_positions`) follow from the options, the stream's :class:`StreamInfo` (mask, prefix,
suffix, causal, the adapter's readout) and the model's outputs (:func:`token_level`: logits per token or
pooled); :func:`readout_size` gives the (B, n) the rows are picked from.

Pure functions: they read a record (an :class:`~attnroll.capture.record.AttentionRecord`: its
``stream_info``, ``stream_shape``, ``streams`` / ``operators`` and ``outputs``) and never change it. This
module imports nothing of ``record.py`` (which imports it), so the record is read by its attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .. import _checks
from .outputs import main_logits

__all__ = ["READOUT_KINDS", "Readout", "resolve_readout", "last_real", "is_causal", "token_level", "readout_size",
           "explained_positions", "explained_readout"]


#: Readout kinds an adapter may declare or ``readout=`` may ask for (besides an int position or weights).
READOUT_KINDS = ("cls", "mean", "last", "eot", "position", "weights", "attention_pool")


@dataclass
class Readout:
    """The output rows a prediction reads: ``weights`` (B, n), one non-negative row per example summing to 1.

    The explained map is ``weights[b] @ R[b]`` for a rollout matrix R (B, n, n) — a single row for a
    one-hot readout (CLS, last token, end-of-text), the mean of the real tokens' rows for mean pooling.

    Attributes:
        kind: "cls" (the first token), "mean" (mean over the real tokens after the prefix and before the
            suffix), "last" (last real token), "eot" (the end-of-text token a text tower pools),
            "position" (explicit indices), "weights" (a given vector), "attention_pool" (the weights of an
            attention-pooling head's own attention).
        weights: (B, n) float32.
        source: where the adapter learned it ("default", "sentence-transformers 1_Pooling/config.json",
            "config.use_mean_pooling", "timm global_pool='avg'", "readout= option", ...).
    """

    kind: str
    weights: torch.Tensor
    source: str = "default"

    def positions(self) -> list[int] | None:
        """The one row per example when every example's weights are one-hot, else None. Remembered for the
        weights as they are (the same tensor at the same version: an in-place change or a new tensor
        recomputes it), since an explanation asks several times; an inference tensor, which has no version,
        is never remembered."""
        w = self.weights
        version = None if w.is_inference() else w._version
        memo = getattr(self, "_positions", None)
        if memo is None or memo[0] is not w or version is None or memo[1] != version:
            nz = (w != 0).sum(dim=-1)
            one = [int(i) for i in w.argmax(dim=-1).tolist()] if bool((nz == 1).all()) else None
            memo = self._positions = (w, version, one)
        return None if memo[2] is None else list(memo[2])

    def rows(self) -> list[int]:
        """Sorted union over the batch of the rows with non-zero weight."""
        return sorted({int(i) for i in (self.weights != 0).any(dim=0).nonzero().flatten().tolist()})

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (kind, source, positions when one-hot)."""
        return {"kind": self.kind, "source": self.source, "positions": self.positions()}


def resolve_readout(
    spec: Any,
    *,
    batch: int,
    n: int,
    mask: torch.Tensor | None,
    prefix: int = 0,
    suffix: int = 0,
    source: str = "default",
    eot: Sequence[int] | None = None,
) -> Readout:
    """Turn a readout spec into :class:`Readout` weights (B, n).

    ``spec``: "cls" | "mean" | "last" | "eot" (needs ``eot`` positions) | an int position | a list of one
    position per example | a weight vector (n,) or (B, n) (non-negative, normalised to sum 1 per row) |
    a :class:`Readout` (returned as is) | ("attention_pool", weights) for an attention-pooling head's own
    attention weights. Padded tokens (``mask`` 0) never get weight."""
    if isinstance(spec, Readout):
        return spec

    def real() -> torch.Tensor:  # (B, n) 1 = real token; built only for the readouts that weight by it
        return torch.ones(batch, n) if mask is None else mask.detach().to("cpu", torch.float32).reshape(batch, n)

    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "attention_pool":
        return Readout("attention_pool", _check_weights(spec[1], batch, n, real()), source)
    if isinstance(spec, str):
        _checks.check_choice("readout", spec, ("cls", "mean", "last", "eot"))
        if spec == "mean":
            w = real().clone()
            w[:, :prefix] = 0
            if suffix:
                w[:, n - suffix:] = 0
            empty = (w.sum(dim=-1) == 0).nonzero().flatten().tolist()
            if empty:
                raise ValueError(f"readout='mean': examples {empty} have no real token after the prefix")
            return Readout("mean", w / w.sum(dim=-1, keepdim=True), source)
        if spec == "cls":
            return Readout("cls", _one_hot([0] * batch, n), source)
        if spec == "last":
            return Readout("last", _one_hot(last_real(mask, batch, n), n), source)
        if eot is None:
            raise ValueError("readout='eot' is for text towers that pool an end-of-text token (CLIP); this stream has "
                             "none")
        return Readout("eot", _one_hot(list(eot), n), source)
    if isinstance(spec, (torch.Tensor,)) or type(spec).__module__ == "numpy" or (
        isinstance(spec, (list, tuple)) and spec and isinstance(spec[0], float)
    ):
        return Readout("weights", _check_weights(spec, batch, n, real()), source)
    pos = _checks.check_positions(spec, batch, n)
    return Readout("position", _one_hot(pos, n), source)


def _one_hot(positions: Sequence[int], n: int) -> torch.Tensor:
    w = torch.zeros(len(positions), n)
    w[torch.arange(len(positions)), torch.tensor(list(positions), dtype=torch.long)] = 1.0
    return w


def _check_weights(spec: Any, batch: int, n: int, real: torch.Tensor) -> torch.Tensor:
    w = torch.as_tensor(spec).detach().to("cpu", torch.float32)
    if w.ndim == 1:
        w = w.expand(batch, -1)
    if w.shape != (batch, n):
        raise ValueError(
            f"readout weights must have shape ({n},) or ({batch}, {n}) (one weight per token), got {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("readout weights must be finite and non-negative")
    w = w * real
    sums = w.sum(dim=-1, keepdim=True)
    if bool((sums == 0).any()):
        raise ValueError("readout weights must put some weight on a real (unpadded) token of every example")
    return w / sums


def last_real(mask: torch.Tensor | None, B: int, n: int) -> list[int]:
    """Index of the last real token per example (n − 1 without a mask)."""
    if mask is None:
        return [n - 1] * B
    idx = torch.arange(n, device=mask.device).expand(B, n)
    last = torch.where(mask.bool(), idx, torch.full_like(idx, -1)).amax(dim=-1)
    return [int(v) if v >= 0 else n - 1 for v in last.tolist()]


def is_causal(layer: torch.Tensor) -> bool:
    """Whether attention (B, [H,] n, n) never looks ahead (every entry above the diagonal is exactly 0)."""
    n = layer.shape[-1]
    if n < 2 or layer.shape[-2] != n or layer.is_meta:  # meta: the shape-only stand-in of a matrix-free record
        return False
    return bool(torch.triu(layer.detach(), diagonal=1).abs().amax() == 0)


# ------------------------------------------------------------------------ the rows an explanation reads
def token_level(outputs: Any, n: int | None = None) -> bool:
    """Whether the model's main logits are per token (B, n, V) — not pooled (B, C), nor per query (detection
    heads, other lengths)."""
    logits = main_logits(outputs)
    return logits is not None and logits.ndim == 3 and (n is None or logits.shape[1] == n)


def readout_size(rec: Any, stream: str) -> tuple[int, int]:
    """(B, n) of the rows a readout picks in ``stream`` of the record ``rec``: the last layer's tokens for a
    stage chain (``StreamInfo.merges``: Swin), else the stream's."""
    info = rec.stream_info(stream)
    shape = rec.stream_shape(stream)
    if info.merges and rec.streams.get(stream):
        return shape[0], rec.streams[stream][-1].shape[-1]
    return shape[0], shape[-1]


def explained_positions(rec: Any, stream: str, position: Any = None) -> list[int]:
    """The output position of a token-level target (and the row of one-hot readouts), one per example:
    ``position`` (the option: an int or one per example), else the last real token for causal attention or
    token-level outputs (decoder-only LMs), else the row of the stream's readout when it is one row, else 0."""
    info = rec.stream_info(stream)
    B, n = readout_size(rec, stream)
    if position is not None:
        return _checks.check_positions(position, B, n)
    causal = is_causal(rec.streams[stream][0]) if rec.streams else rec.operators[stream][0].is_causal_model
    if info.causal or causal or (stream in ("self", "decoder") and token_level(rec.outputs, n)):
        return last_real(info.mask, B, n)
    one = info.readout.positions() if info.readout is not None else None
    return one if one is not None else [0] * B


def explained_readout(rec: Any, stream: str, *, spec: Any = None, position: Any = None,
                      model: str = "the model") -> Readout:
    """The rows explained in ``stream``: ``spec`` (the ``readout`` option: a position, "cls", "mean", "last",
    "eot", a weight vector), else ``position`` (the option), else the adapter's declared readout of the stream
    (the rows the model's prediction reads) when the outputs are pooled, else the explained token's row (the
    last real one for causal streams). ``model`` names the model in the error of a stream without a default."""
    info = rec.stream_info(stream)
    B, n = readout_size(rec, stream)
    common = dict(batch=B, n=n, mask=info.mask, prefix=info.prefix, suffix=info.suffix)
    if spec is not None:
        eot = info.readout.positions() if info.readout is not None and info.readout.kind == "eot" else None
        return resolve_readout(spec, source="readout= option", eot=eot, **common)
    if position is not None:
        return resolve_readout(explained_positions(rec, stream, position), source="position= option", **common)
    pooled = not token_level(rec.outputs, n)
    if info.readout is not None and pooled:
        return info.readout
    if info.readout is None and info.readout_reason and pooled:
        raise ValueError(f"readout: {model} has no default readout: {info.readout_reason}")
    # Token-level outputs (a language model's next-token logits): the rows of the explained position.
    return resolve_readout(explained_positions(rec, stream), source="the explained token's position", **common)
