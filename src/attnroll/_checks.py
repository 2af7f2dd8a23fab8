"""The one place for input validation and its error messages.

Every public function validates through these helpers so that a user sees the same kind of message
everywhere: the argument's name, what was received, and what was expected. This module imports nothing
from the rest of the package but the dependency-free :mod:`._messages` (``core/`` may import it).
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import numpy as np
import torch

from ._messages import one_line  # noqa: F401 - re-exported: the package imports it from here

#: Tolerance on row sums for inputs that must be row-stochastic (float32 / float64 input); lower-precision
#: input gets a wider one, see ``stochastic_atol``.
STOCHASTIC_ATOL = 1e-3
#: Row-sum tolerance in units of the input dtype's machine epsilon: a softmax computed and stored in that
#: dtype rounds each entry (relative error eps/2, so the row sum by at most eps/2 in total) and divides by a
#: sum rounded the same way; 4 eps covers both with margin (bfloat16: 0.031, float16: 0.0039).
STOCHASTIC_EPS = 4


def stochastic_atol(dtype: torch.dtype) -> float:
    """The row-sum tolerance for row-stochastic input of ``dtype``: the larger of ``STOCHASTIC_ATOL`` and
    ``STOCHASTIC_EPS`` machine epsilons of that dtype (integer / bool input: ``STOCHASTIC_ATOL``)."""
    if not dtype.is_floating_point:
        return STOCHASTIC_ATOL
    return max(STOCHASTIC_ATOL, STOCHASTIC_EPS * float(torch.finfo(dtype).eps))


class UnsupportedModelError(TypeError):
    """Raised when no capture adapter knows the model; the message lists the supported families."""


def describe(x: Any) -> str:
    """A short human description of a value for error messages: type, shape and dtype."""
    if isinstance(x, torch.Tensor):
        where = "" if x.device.type == "cpu" else f" on {x.device}"
        return f"torch.Tensor of shape {tuple(x.shape)} and dtype {x.dtype}{where}"
    if isinstance(x, np.ndarray):
        return f"numpy.ndarray of shape {x.shape} and dtype {x.dtype}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of length {len(x)}"
    return f"{type(x).__name__} {x!r}"


# ----------------------------------------------------------------------------------------------- scalars
def _integer_scalar(value: Any) -> Any:
    """A 0-d integer torch tensor or numpy array as a Python int; anything else unchanged."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        kind_ok = (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool) \
            if isinstance(value, torch.Tensor) else value.dtype.kind in "iu"
        if kind_ok:
            return int(value.item())
    return value


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """An integer (Python, numpy or a 0-d integer tensor; bools and floats such as 1.0 refused) within
    [low, high]; returns it as ``int``."""
    value = _integer_scalar(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {describe(value)}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    high_open: bool = False,
) -> float:
    """A finite real number in [low, high] (or [low, high) with ``high_open``); returns it as float."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0 and (
        value.is_floating_point() if isinstance(value, torch.Tensor) else value.dtype.kind in "iuf"
    ):
        value = float(value.item())
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    value = float(value)
    bad = not np.isfinite(value)
    bad = bad or (low is not None and value < low)
    bad = bad or (high is not None and (value >= high if high_open else value > high))
    if bad:
        if high is None:
            expected = "finite" if low is None else f">= {low}"
        else:
            expected = f"in [{low}, {high})" if high_open else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """A real boolean: ``True`` / ``False`` (or a numpy bool); not 0/1, not None, not the string "False"."""
    if not isinstance(value, (bool, np.bool_)):
        hint = " (a string is not a boolean: pass False, not 'False')" if isinstance(value, str) else ""
        raise TypeError(f"{name} must be True or False, got {describe(value)}{hint}")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """One of a fixed set of strings."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_index(name: str, value: Any, size: int, what: str = "tokens") -> int:
    """An index into an axis of ``size`` entries; negative indices count from the end. Returns it >= 0."""
    value = check_int(name, value)
    if not -size <= value < size:
        raise ValueError(
            f"{name}={value} is out of range for {size} {what}: expected an index in [{-size}, {size - 1}]"
        )
    return value % size


def check_indices(name: str, value: Any, size: int, what: str = "tokens") -> list[int]:
    """One index or a non-empty sequence of indices into an axis of ``size`` entries: ints, a list / tuple /
    range of ints, or a 1-D integer tensor / array (floats such as 1.7 or 1.0 are refused, never truncated).
    Negative indices count from the end. Returns a list of indices >= 0."""
    value = _integer_scalar(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return [check_index(name, value, size, what)]
    if isinstance(value, (torch.Tensor, np.ndarray)):
        t, _ = as_tensor(name, value)
        if t.is_floating_point() or t.dtype == torch.bool or t.ndim != 1:
            raise TypeError(f"{name} must be an int or a 1-D sequence of integer {what[:-1]} indices, got "
                            f"{describe(value)}")
        value = t.tolist()
    if not isinstance(value, (list, tuple, range)):
        raise TypeError(f"{name} must be an int or a sequence of {what[:-1]} indices, got {describe(value)}")
    if len(value) == 0:
        raise ValueError(f"{name} is empty: give at least one index")
    return [check_index(f"{name}[{i}]", v, size, what) for i, v in enumerate(value)]


def check_dtype(dtype: Any) -> torch.dtype | None:
    """``None``, or a float32/float64 request given as a torch dtype, numpy dtype or string."""
    if dtype is None:
        return None
    table = {"float32": torch.float32, "float64": torch.float64}
    if isinstance(dtype, torch.dtype):
        key = str(dtype).replace("torch.", "")
    else:
        try:
            key = np.dtype(dtype).name
        except TypeError:
            key = None
    if key not in table:
        raise ValueError(f"dtype must be float32 or float64 (torch, numpy or string), got {dtype!r}")
    return table[key]


# ----------------------------------------------------------------------------------------------- arrays
def as_tensor(name: str, x: Any) -> tuple[torch.Tensor, bool]:
    """Wrap a numpy array or torch tensor as a tensor without copying; also says whether it was numpy.

    Only real floating point (or integer/bool, converted later) arrays are accepted.
    """
    if isinstance(x, torch.Tensor):
        t, was_numpy = x, False
    elif isinstance(x, np.ndarray):
        if x.dtype == object or x.dtype.kind not in "biuf":
            raise TypeError(f"{name} must hold real numbers, got {describe(x)}")
        t, was_numpy = torch.from_numpy(np.ascontiguousarray(x)), True
    else:
        raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {describe(x)}")
    if t.is_complex():
        raise TypeError(f"{name} must hold real numbers, got {describe(x)}")
    check_device(name, t)
    return t, was_numpy


def check_device(name: str, t: torch.Tensor) -> None:
    """Refuse tensors without data: the ``meta`` device holds shapes only (a model or tensor built with
    ``device="meta"`` or loaded lazily), so nothing can be computed from it."""
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the 'meta' device ({describe(t)}): it has a shape but no data. Materialise it first "
            "(load the weights / move it to 'cpu' or 'cuda' with real values)"
        )


def check_square(name: str, t: torch.Tensor) -> None:
    """The last two axes must be equal (query x key attention)."""
    if t.ndim < 2 or t.shape[-1] != t.shape[-2]:
        raise ValueError(
            f"{name} must be square in its last two axes (queries x keys, n x n), got shape {tuple(t.shape)}"
        )


def check_values(
    name: str,
    minimum: float,
    sums: torch.Tensor,
    *,
    stochastic: bool = False,
    how_to_accept: str = "",
    atol: float = STOCHASTIC_ATOL,
    source: torch.Tensor | None = None,
) -> None:
    """Judge an attention tensor from two cheap statistics: its minimum entry and its row sums (only the
    rows that matter, e.g. real tokens). NaN propagates into both and infinities into the sums, so these
    catch every NaN, infinite or negative entry without another pass over the data.

    Raises ValueError for NaN / infinite / negative entries and, with ``stochastic``, rows whose sum is
    not 1 within ``atol`` (see ``stochastic_atol``; the message then ends with ``how_to_accept``).
    ``source``, the tensor itself, is read only on failure, to tell infinite entries from finite entries
    so large that their row sums overflow."""
    finite = bool(torch.isfinite(sums).all()) if sums.numel() else True
    if minimum != minimum or minimum == float("-inf") or not finite:
        # amin propagates NaN, so a non-NaN minimum means the bad sums come from infinities.
        bad = "NaN" if minimum != minimum else "infinite"
        if bad == "infinite" and source is not None and bool(torch.isfinite(source).all()):
            top = float(source.abs().amax())
            raise ValueError(
                f"{name} has entries so large (max {top:.3g}) that its row sums overflow {source.dtype}; "
                "rescale the matrices (attention is scale-free for flow; rollout needs row sums that fit)"
            )
        raise ValueError(f"{name} contains {bad} values; attention probabilities must be finite")
    if minimum < 0:
        raise ValueError(
            f"{name} contains negative entries (min {minimum:.3g}); attention must be non-negative. "
            "Clamp signed relevance (e.g. gradient x attention) to its positive part first."
        )
    if stochastic and sums.numel() and float((sums - 1).abs().max()) > atol:
        lo, hi = float(sums.min()), float(sums.max())
        raise ValueError(
            f"{name}: rows must sum to 1 within {atol:.3g} (softmax attention probabilities), but row sums "
            f"range from {lo:.4g} to {hi:.4g}. {how_to_accept}"
        )


def check_finite_nonnegative(name: str, t: torch.Tensor) -> None:
    """No NaN, no infinity, no negative entry."""
    if t.numel() == 0:
        return
    check_values(name, float(t.amin()), t.sum(dim=-1), source=t)


def check_finite(name: str, t: torch.Tensor) -> None:
    """No NaN and no infinity (signed values allowed)."""
    if t.numel() and t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "infinite"
        raise ValueError(f"{name} contains {bad} values; attention must be finite")


def check_binary(name: str, t: torch.Tensor, meaning: str = "bool or 0/1 values") -> torch.Tensor:
    """A mask: every entry 0 or 1 (bool, integer or float); returns it as a bool tensor. ``meaning`` says
    what the values stand for in the message."""
    if t.numel() and t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
        vals = torch.unique(t.detach().cpu())[:6].tolist()
        raise ValueError(f"{name} must hold only {meaning}, got values {vals}")
    return t.to(torch.bool)


def check_mask(name: str, mask: Any, batch: int | None, n: int) -> torch.Tensor:
    """An attention mask of 0/1 values, shape (B, n) — or (n,) for unbatched input. Returns a bool tensor
    of shape (B, n) (B = 1 for unbatched)."""
    m, _ = as_tensor(name, mask)
    expected = (n,) if batch is None else (batch, n)
    if tuple(m.shape) != expected:
        raise ValueError(
            f"{name} must have shape {expected} (batch, tokens) matching the attention, got {tuple(m.shape)}"
        )
    m = check_binary(name, m, "0 and 1 (1 = real token, 0 = padding)")
    return m.reshape(1, n) if batch is None else m


def check_head_weights(name: str, value: Any, num_heads: int | None = None) -> torch.Tensor:
    """Per-head fusion weights: a non-empty 1-D list / tuple / tensor / array of finite, non-negative
    numbers, not all zero, of length ``num_heads`` when given. Returns them as a float64 CPU tensor
    normalised to sum 1."""
    if isinstance(value, (list, tuple)):
        try:
            # float64 first, so that weights given as Python floats lose no precision.
            value = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{name} weights must be numbers (one per head), got {describe(value)}") from None
    w, _ = as_tensor(name, value)
    w = w.detach().to("cpu", torch.float64)
    if w.ndim != 1 or w.numel() == 0:
        raise ValueError(f"{name} weights must be a non-empty 1-D vector (one per head), got {describe(value)}")
    if num_heads is not None and w.shape[0] != num_heads:
        raise ValueError(
            f"{name} weights must be a vector of length H={num_heads} (one per head), got shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"{name} weights must be finite, non-negative and not all zero, got {w.tolist()}")
    return w / w.sum()


def check_head_fusion(name: str, value: Any, *, allow_none: bool = True, num_heads: int | None = None) -> Any:
    """A head fusion rule: "mean" | "max" | "min", a per-head weight vector (``check_head_weights``), or
    None (heads kept / already fused) when ``allow_none``. Returns the string, None or the weights."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return check_choice(name, value, ("mean", "max", "min"))
    if isinstance(value, (list, tuple, np.ndarray, torch.Tensor)):
        return check_head_weights(name, value, num_heads)
    none = "None, " if allow_none else ""
    raise TypeError(f"{name} must be {none}'mean', 'max', 'min' or a length-H weight vector, got {describe(value)}")


# ---- capture checks ----
class CaptureError(RuntimeError):
    """Raised when a forward pass did not yield exactly one attention tensor per layer (a layer missing, a
    module firing twice, a module returning no weights)."""


def check_fuse_heads(value: Any) -> Any:
    """``fuse_heads`` for capture: None (keep every head), "mean" | "max" | "min", or a non-negative weight
    vector (one entry per head; its length is checked against H when the first layer is seen).

    Returns None, the string, or the weights as a 1-D float64 tensor normalised to sum 1."""
    return check_head_fusion("fuse_heads", value)


def check_model_inputs(
    inputs: Any,
    *,
    model: str,
    params: Sequence[str],
    required: Sequence[str] = (),
    required_any: Sequence[str] = (),
    open_keywords: bool = False,
    hint: str = "",
) -> None:
    """What ``capture`` / ``explain`` pass to a model's forward, checked before the forward runs.

    ``inputs`` must be a mapping of keyword arguments, a tensor (the one positional argument) or a tuple /
    list of tensors (positional arguments; None, after the first, for an argument left out). For a mapping: keys are
    strings; with ``open_keywords`` False
    (the forward has no ``**kwargs``) every key must be one of ``params``; every name in ``required`` must
    be present, and at least one of ``required_any`` when given. No tensor may be on the meta device.
    Errors name ``inputs``, what was received and the keys expected (``model`` is the model's class name,
    ``hint`` an example of valid inputs)."""
    from collections.abc import Mapping

    expect = ", ".join(repr(k) for k in (required_any or required or params)) or "none"
    tail = f" {hint}" if hint else ""
    if isinstance(inputs, torch.Tensor):
        check_device("inputs", inputs)
        return
    if isinstance(inputs, (tuple, list)):
        # None leaves out an argument between two others, as the forward itself takes it: enc(src, None, mask)
        bad = [i for i, v in enumerate(inputs) if not isinstance(v, torch.Tensor) and (v is not None or i == 0)]
        if not inputs or bad:
            what = "empty" if not inputs else f"item {bad[0]} is {describe(inputs[bad[0]])}"
            raise TypeError(
                f"inputs must be a dict of keyword arguments for {model} (keys {expect}), a tensor, or a tuple "
                "of tensors (positional arguments, the first a tensor, None for an argument left out); got a "
                f"{type(inputs).__name__} of length {len(inputs)} whose {what}.{tail}"
            )
        for i, v in enumerate(inputs):
            if v is not None:
                check_device(f"inputs[{i}]", v)
        return
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a dict of keyword arguments for {model} (keys {expect}; what a processor / "
            f"tokenizer returns), a tensor, or a tuple of tensors; got {describe(inputs)}.{tail}"
        )
    keys = list(inputs.keys())
    non_str = [k for k in keys if not isinstance(k, str)]
    if non_str:
        raise TypeError(f"inputs for {model}: keys must be argument names (strings), got {non_str[0]!r}.{tail}")
    unknown = [k for k in keys if k not in params]
    missing = [k for k in required if k not in keys]
    none_of = bool(required_any) and not any(k in keys for k in required_any)
    if (unknown and not open_keywords) or missing or none_of:
        parts = []
        if unknown and (not open_keywords or none_of):
            parts.append(f"{', '.join(map(repr, unknown))} {'is' if len(unknown) == 1 else 'are'} not an argument of "
                         f"its forward")
        if missing:
            parts.append(f"{', '.join(map(repr, missing))} missing")
        if none_of:
            parts.append(f"none of {', '.join(map(repr, required_any))} given")
        raise ValueError(
            f"inputs for {model} have keys {keys}: {'; '.join(parts)}. Expected keys: {expect} (its forward takes "
            f"{', '.join(params) or 'no named arguments'}).{tail}"
        )
    for k in required_any:
        if k in inputs and inputs[k] is not None and not isinstance(inputs[k], torch.Tensor):
            raise TypeError(
                f"inputs[{k!r}] for {model} must be a torch.Tensor (batch first), got {describe(inputs[k])}; "
                "call the processor / tokenizer with return_tensors='pt'"
            )
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            check_device(f"inputs[{k!r}]", v)


def check_model_device(model: Any, modules: Sequence[Any] | None = None) -> None:
    """Refuse a model whose parameters or buffers are on the meta device (built without weights);
    ``modules``: the model's modules when the caller has walked them already."""
    # The common case without building every tensor's qualified name (nn.Module's own dicts: a third of the
    # time of parameters() + buffers()).
    if not any(t is not None and t.is_meta for m in (model.modules() if modules is None else modules)
               for d in (m._parameters, m._buffers) for t in d.values()):
        return
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type == "meta":
            raise ValueError(
                f"model {type(model).__name__} has {name} on the 'meta' device: it was built without its weights "
                "(device='meta' or a lazy loader). Load the weights (or model.to_empty(device='cpu') and "
                "initialise) before explaining it"
            )


def check_figure(*, cell: Any, dpi: Any, max_cols: Any = 1, alpha: Any = 0.0) -> tuple[int, int, int, float]:
    """The layout options of the figure functions: ``cell`` (pixels per map), ``dpi`` and ``max_cols``
    positive integers, ``alpha`` (the map's weight) in [0, 1]."""
    return (check_int("cell", cell, low=1), check_int("dpi", dpi, low=1), check_int("max_cols", max_cols, low=1),
            check_real("alpha", alpha, low=0.0, high=1.0))


# ---- explain checks ----
def check_positions(value: Any, batch: int, n: int) -> list[int]:
    """``position`` for explain: one output token index for every example, or one per example (a list /
    1-D integer array of length B); negative indices count from the end. Returns a list of B indices >= 0."""
    value = _integer_scalar(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_)):
        return [check_index("position", value, n)] * batch
    if isinstance(value, (list, tuple, range, torch.Tensor, np.ndarray)) and len(value) != batch:
        raise ValueError(
            f"position must be an int or a list with one index per example (B={batch}), got "
            f"{describe(value)}"
        )
    if not isinstance(value, (list, tuple, range, torch.Tensor, np.ndarray)):
        raise TypeError(f"position must be an int or a list of B ints (one per example), got {describe(value)}")
    return check_indices("position", value, n)


def check_target(target: Any, batch: int, num_classes: int, *, default: list[int]) -> list[int]:
    """A class / token target: None (``default``, the argmax per example), an int for every example or a
    list of B ints; each in [-C, C). Returns B indices >= 0."""
    if target is None:
        return [int(v) for v in default]
    what = "classes" if num_classes < 1000 else "output indices (vocabulary)"
    if isinstance(target, torch.Tensor) and target.ndim <= 1 and not target.is_floating_point():
        target = target.tolist()
    if isinstance(target, np.ndarray) and target.ndim <= 1 and target.dtype.kind in "iu":
        target = target.tolist()
    if isinstance(target, (list, tuple)):
        if len(target) != batch:
            raise ValueError(
                f"target must have one entry per example: the batch has B={batch} examples, the list has "
                f"{len(target)}. Pass an int to use the same target for every example."
            )
        return [check_index(f"target[{i}]", t, num_classes, what) for i, t in enumerate(target)]
    if isinstance(target, bool) or not isinstance(target, numbers.Integral):
        raise TypeError(
            "target must be None (the predicted class), an int, a list of ints (one per example) or a callable "
            f"f(outputs) -> (B,) scores; got {describe(target)}"
        )
    return [check_index("target", target, num_classes, what)] * batch


def check_target_output(y: Any, batch: int | None, fn: Any) -> torch.Tensor:
    """What a callable target returned: a floating tensor of shape (B,), one scalar per example."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"target callable {name} must return a torch.Tensor of shape (B,), got {describe(y)}")
    want = "(B,)" if batch is None else f"({batch},)"
    if y.ndim != 1 or (batch is not None and y.shape[0] != batch):
        raise ValueError(
            f"target callable {name} must return one scalar per example, shape {want}, got shape "
            f"{tuple(y.shape)}. For example lambda out: out.logits[:, 3] (not out.logits, not .sum())."
        )
    if not y.is_floating_point():
        raise TypeError(f"target callable {name} must return floating scores, got dtype {y.dtype}")
    return y


# ---- evaluate checks ----
def check_scores(name: str, scores: Any, batch: int | None = None, units: int | None = None) -> torch.Tensor:
    """Saliency scores for evaluation: an ``Explanation`` (its ``.scores``), a torch tensor or numpy array of
    shape (B, units) or (B, h, w) (flattened row-major). Returns a float64 CPU tensor (B, units); rejects
    NaN / infinite values and a batch or unit count that does not match the inputs."""
    if hasattr(scores, "scores") and hasattr(scores, "full_row"):
        scores = scores.scores
    t, _ = as_tensor(name, scores)
    if t.ndim == 3:
        t = t.reshape(t.shape[0], -1)
    if t.ndim != 2:
        raise ValueError(
            f"{name} must be (B, units) or (B, h, w) saliency over input units (an Explanation's .scores), "
            f"got shape {tuple(t.shape)}"
        )
    t = t.detach().to("cpu", torch.float64)
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"{name} has {t.shape[0]} rows but the inputs hold B={batch} examples")
    if units is not None and t.shape[1] != units:
        raise ValueError(
            f"{name} has {t.shape[1]} units per example but the inputs have {units} "
            "(patches of the model's grid, or tokens)"
        )
    return t


def check_unit_masks(name: str, masks: Any, batch: int, units: int) -> torch.Tensor:
    """Ground-truth masks over input units: bool/0-1 (B, units) or (B, h, w) with h·w = units. Returns a bool
    CPU tensor (B, units); every example must have at least one unit inside its mask."""
    t, _ = as_tensor(name, masks)
    if t.ndim == 3:
        t = t.reshape(t.shape[0], -1)
    if t.ndim != 2 or tuple(t.shape) != (batch, units):
        raise ValueError(
            f"{name} must be (B, units) = ({batch}, {units}) or (B, h, w) patch masks matching the scores, got "
            f"shape {tuple(t.shape)}. Pool pixel masks to the patch grid first (attnroll.models.shapes.patch_masks)."
        )
    t = check_binary(name, t, "0/1 or bool values").to("cpu")
    empty = (~t.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{name}: examples {empty[:10]} have an empty mask; each needs at least one unit inside")
    return t


def check_fractions(name: str, values: Any, *, include_zero: bool = False) -> np.ndarray:
    """An increasing sequence of fractions in [0, 1] (e.g. the share of units removed at each step)."""
    try:
        f = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a sequence of fractions in [0, 1], got {describe(values)}") from None
    if f.size == 0 or not np.all(np.isfinite(f)) or f.min() < 0 or f.max() > 1 or np.any(np.diff(f) <= 0):
        raise ValueError(f"{name} must be strictly increasing fractions in [0, 1], got {f.tolist()[:12]}")
    if include_zero and f[0] != 0:
        raise ValueError(f"{name} must start at 0 (the unperturbed input), got {f.tolist()[:12]}")
    return f


# ---- evaluate: perturbation checks ----
def check_pixel_values(pixel_values: Any) -> torch.Tensor:
    """Image-model inputs for perturbation metrics: a floating (B, C, H, W) tensor or array (any channel
    count), as the model takes them (already preprocessed). Returns a tensor (numpy arrays are wrapped)."""
    x, _ = as_tensor("pixel_values", pixel_values)
    if x.ndim != 4:
        raise ValueError(
            f"pixel_values must be (B, C, H, W) model inputs (a batch of preprocessed images), got shape "
            f"{tuple(x.shape)}; add a batch axis for one image"
        )
    if not x.is_floating_point():
        raise TypeError(
            f"pixel_values must be floating point model inputs (after preprocessing), got dtype {x.dtype}"
        )
    if x.shape[0] == 0:
        raise ValueError("pixel_values holds no images (B=0)")
    return x


def check_grid(grid: Any, units: int, height: int, width: int, *, from_scores: Any = None) -> tuple[int, int]:
    """The patch grid (h, w) of an image metric: ``grid`` if given, else the grid the scores carry
    (``from_scores``), else a square grid inferred from ``units``. h·w must equal ``units`` and h, w must
    divide the image height and width."""
    if grid is not None and from_scores is not None and tuple(grid) != tuple(from_scores):
        raise ValueError(f"grid={tuple(grid)} disagrees with the scores' own grid {tuple(from_scores)}")
    if grid is None:
        grid = from_scores
    if grid is None:
        side = int(round(units**0.5))
        if side * side != units:
            raise ValueError(
                f"cannot infer the patch grid: the scores have {units} units, not a perfect square; "
                "pass grid=(h, w)"
            )
        grid = (side, side)
    if not isinstance(grid, (tuple, list)) or len(grid) != 2:
        raise TypeError(f"grid must be a pair (h, w) of patch rows and columns, got {describe(grid)}")
    h, w = (check_int("grid", g, low=1) for g in grid)
    if h * w != units:
        raise ValueError(f"grid={(h, w)} has {h * w} patches but the scores have {units} units per example")
    if height % h or width % w:
        raise ValueError(
            f"grid={(h, w)} must divide the image size {height}x{width} (pixel_values H, W) into whole patches"
        )
    return h, w


def check_image_fill(name: str, value: Any, batch: int, image_shape: Sequence[int]) -> float | torch.Tensor:
    """A replacement value for image pixels: a real number (in model-input space), or a tensor/array that
    broadcasts to one image (C, H, W) — e.g. (C, 1, 1) per channel — or holds one image per example
    (B, C, H, W). Returns the float, or a floating tensor of one of those two shapes."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return check_real(name, value)
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        raise TypeError(
            f"{name} must be a real number or a tensor broadcastable to one image {tuple(image_shape)}, "
            f"got {describe(value)}"
        )
    t, _ = as_tensor(name, value)
    one = tuple(int(s) for s in image_shape)
    per_example = (int(batch),) + one
    ok = tuple(t.shape) == per_example
    if not ok and t.ndim <= 3:
        try:
            ok = tuple(torch.broadcast_shapes(tuple(t.shape), one)) == one
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected a shape that broadcasts to one image {one} (e.g. "
            f"{(one[0], 1, 1)} for one value per channel) or one image per example {per_example}"
        )
    if not t.is_floating_point():
        t = t.to(torch.float32)
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values")
    return t


def check_labels(labels: Any, batch: int, num_classes: int) -> list[int]:
    """Ground-truth class labels: B ints in [0, C) (list, tuple, 1-D integer tensor or array)."""
    if isinstance(labels, (torch.Tensor, np.ndarray)):
        t, _ = as_tensor("labels", labels)
        if t.ndim != 1 or t.is_floating_point():
            raise TypeError(f"labels must be a 1-D sequence of class indices (ints), got {describe(labels)}")
        labels = t.tolist()
    if not isinstance(labels, (list, tuple)):
        raise TypeError(f"labels must be a sequence of B class indices (ints), got {describe(labels)}")
    if len(labels) != batch:
        raise ValueError(f"labels must have one class index per example (B={batch}), got {len(labels)}")
    out = [check_int(f"labels[{i}]", v) for i, v in enumerate(labels)]
    bad = [(i, v) for i, v in enumerate(out) if not 0 <= v < num_classes]
    if bad:
        i, v = bad[0]
        raise ValueError(
            f"labels[{i}]={v} is not a class index: the model has {num_classes} classes [0, {num_classes - 1}]"
        )
    return out


def check_text_inputs(inputs: Any) -> dict[str, torch.Tensor]:
    """Tokenised text for text metrics: a dict / BatchEncoding with ``input_ids`` (B, n) and optionally
    ``attention_mask``, ``token_type_ids`` and ``special_tokens_mask`` of the same shape. Returns a dict of
    int64 tensors holding the keys present; ``attention_mask`` defaults to all ones."""
    if not hasattr(inputs, "keys") or not hasattr(inputs, "__getitem__"):
        raise TypeError(
            f"inputs must be a dict / BatchEncoding from the tokenizer (input_ids, attention_mask, ...), got "
            f"{describe(inputs)}"
        )
    if "input_ids" not in inputs.keys():
        raise ValueError(f"inputs must hold 'input_ids' (B, n); got keys {sorted(inputs.keys())}")
    ids, _ = as_tensor("inputs['input_ids']", inputs["input_ids"])
    if ids.ndim != 2 or ids.is_floating_point():
        raise ValueError(f"inputs['input_ids'] must be (B, n) integer token ids, got {describe(inputs['input_ids'])}")
    out = {"input_ids": ids.long()}
    for key in ("attention_mask", "token_type_ids", "special_tokens_mask"):
        if key not in inputs.keys() or inputs[key] is None:
            continue
        t, _ = as_tensor(f"inputs[{key!r}]", inputs[key])
        if tuple(t.shape) != tuple(ids.shape) or t.is_floating_point():
            raise ValueError(
                f"inputs[{key!r}] must be integers of the shape of input_ids {tuple(ids.shape)}, got "
                f"{describe(inputs[key])}"
            )
        out[key] = t.long().to(ids.device)
    if "attention_mask" in out:
        check_binary("inputs['attention_mask']", out["attention_mask"], "0 (padding) and 1 (real token)")
    out.setdefault("attention_mask", torch.ones_like(out["input_ids"]))
    return out


def check_keep(keep: Any, batch: int, n: int) -> torch.Tensor:
    """Tokens never removed by text metrics: a bool / 0-1 (B, n) mask over input_ids. Returns a bool tensor."""
    t, _ = as_tensor("keep", keep)
    if tuple(t.shape) != (batch, n):
        raise ValueError(
            f"keep must be a (B, n) = ({batch}, {n}) mask over input_ids (True = never removed), got shape "
            f"{tuple(t.shape)}"
        )
    return check_binary("keep", t, "0/1 or bool values")


# ---- evaluate: localisation/sanity checks ----
#: Parameter groups of a transformer block that ``cascading_randomization`` can re-initialise.
SANITY_COMPONENTS = ("all", "qk", "value", "mlp")


def check_topk(name: str, k: Any, units: int) -> int:
    """A top-k size: an int in [1, units]."""
    return check_int(name, k, low=1, high=units)


def check_method_names(name: str, methods: Any) -> list[str]:
    """A non-empty sequence of distinct method names (a single string is one method). Whether each name is
    registered is checked by the method registry, whose message lists the methods."""
    if isinstance(methods, str):
        methods = [methods]
    if not isinstance(methods, (list, tuple)):
        raise TypeError(f"{name} must be a list of method names (e.g. ['rollout', 'gae']), got {describe(methods)}")
    if not methods:
        raise ValueError(
            f"{name} must name at least one method (e.g. ['rollout', 'gae']), got an empty {type(methods).__name__}"
        )
    bad = [m for m in methods if not isinstance(m, str)]
    if bad:
        raise TypeError(f"{name} must hold method names (strings), got {describe(bad[0])}")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise ValueError(f"{name} names {dup} more than once; list each method once")
    return list(methods)


def check_method_options(name: str, options: Any, methods: Sequence[str]) -> dict[str, dict]:
    """Per-method options: None or a dict {method name: {option: value}} whose keys are among ``methods``."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"{name} must be a dict {{method: {{option: value}}}}, got {describe(options)}")
    unknown = [k for k in options if k not in methods]
    if unknown:
        raise ValueError(f"{name} has entries for {unknown}, which are not among the methods run ({list(methods)})")
    for k, v in options.items():
        if not isinstance(v, dict):
            raise TypeError(f"{name}[{k!r}] must be a dict of that method's options, got {describe(v)}")
    return dict(options)


def check_module(name: str, model: Any) -> Any:
    """A torch ``nn.Module`` (something with parameters to change), not a bare callable."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{name} must be a torch.nn.Module whose parameters can be re-initialised, got {describe(model)}"
        )
    return model


def check_found(what: str, found: Any, model: Any, looked_for: str) -> Any:
    """Raise a ValueError naming what was looked for in ``model`` when ``found`` is None."""
    if found is None:
        raise ValueError(f"cannot find the {what} of {type(model).__name__}: looked for {looked_for}")
    return found


# ---- evaluate: audit checks ----
def check_audit_inputs(pixel_values: Any) -> torch.Tensor:
    """Inputs of a checkpoint audit: a floating (B, C, H, W) tensor or array with B >= 1."""
    x, _ = as_tensor("pixel_values", pixel_values)
    if x.ndim != 4 or not x.is_floating_point():
        raise ValueError(
            f"pixel_values must be floating (B, C, H, W) model inputs (preprocessed images), got {describe(x)}"
        )
    if x.shape[0] == 0:
        raise ValueError("pixel_values is empty (B = 0): an audit needs at least one example")
    return x


def check_audit_target(target: Any, batch: int) -> Any:
    """None, an int, a callable, or one class index per example (list / tensor / array of ``batch`` ints,
    returned as a list)."""
    if target is None or callable(target):
        return target
    if isinstance(target, numbers.Integral) and not isinstance(target, bool):
        return int(target)
    if isinstance(target, (list, tuple, torch.Tensor, np.ndarray)):
        t = np.asarray(target.detach().cpu() if isinstance(target, torch.Tensor) else target)
        if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
            raise ValueError(f"target must be one class index per example, got {describe(target)}")
        if t.shape[0] != batch:
            raise ValueError(f"target has {t.shape[0]} entries but pixel_values holds B={batch} examples")
        return [int(v) for v in t]
    raise TypeError(f"target must be None, an int, a list of B ints or a callable, got {describe(target)}")


def check_audit_maps(grid_a: Any, grid_b: Any, units_a: int, units_b: int) -> None:
    """The two audited models must explain the same input units."""
    if grid_a != grid_b or units_a != units_b:
        what = (
            f"patch grid {grid_a} vs {grid_b}"
            if grid_a is not None and grid_b is not None
            else f"{units_a} vs {units_b} units (grid {grid_a} vs {grid_b})"
        )
        raise ValueError(
            f"models A and B explain different input units: {what}. An audit compares maps over the same "
            "units: use two checkpoints of one architecture (same image size and patch size)"
        )


def check_audit_regions(regions: Any, batch: int, units: int) -> dict[str, np.ndarray]:
    """Regions of an audit: a dict name -> bool/0-1 masks (B, units) or (B, h, w) with h·w = units. Returns
    name -> bool numpy (B, units). Empty regions are allowed (their mass is 0)."""
    if not isinstance(regions, dict):
        raise TypeError(f"regions must be a dict name -> (B, units) bool masks, got {describe(regions)}")
    out = {}
    for name, mask in regions.items():
        if not isinstance(name, str):
            raise TypeError(f"regions: names must be strings, got {name!r}")
        t, _ = as_tensor(f"regions[{name!r}]", mask)
        if t.ndim == 3:
            t = t.reshape(t.shape[0], -1)
        if tuple(t.shape) != (batch, units):
            raise ValueError(
                f"regions[{name!r}] must be (B, units) = ({batch}, {units}) or (B, h, w) masks over the maps' "
                f"units, got shape {tuple(mask.shape)}"
            )
        out[name] = check_binary(f"regions[{name!r}]", t).detach().cpu().numpy()
    return out


def check_pixel_masks(name: str, masks: Any) -> torch.Tensor:
    """Pixel masks (B, H, W) of bool or 0/1 values; returns a bool tensor."""
    t, _ = as_tensor(name, masks)
    if t.ndim != 3:
        raise ValueError(f"{name} must be (B, H, W) pixel masks, got shape {tuple(t.shape)}")
    return check_binary(name, t).detach().cpu()
