"""Sanity checks for saliency maps: cascading model-parameter randomisation (Adebayo et al. 2018).

A map that explains *the model* should change when the model's parameters are destroyed. The check
re-initialises the parameters of a copy of the model step by step from the top -- first the classification
head, then the transformer blocks from the last to the first, cumulatively -- and after every step measures
the Spearman rank correlation between each method's map on the randomised copy and its map on the original
model. High correlation after the weights that produce the prediction were randomised means the map does not
depend on them.

What to expect from attention rollout (and raw attention): it reads the attention weights only. The head, and
a block's value / attention-output / MLP weights, do not enter that block's own attention (block l's
attention depends on blocks 0 .. l-1 and on its own query / key projections), so rollout's correlation stays
exactly 1.0 after the head step and after randomising only the value or MLP weights of the top block.
Gradient-weighted methods use the head's gradient and drop at the first step.

Re-initialisation: every chosen tensor (or, for a fused qkv projection, the rows of the chosen thirds) is
replaced by draws from a normal distribution with mean 0 and the standard deviation of the values it replaces
(population std; 0 for a single value), from one ``torch.Generator`` seeded with ``seed`` and used in a fixed
order (steps top-down, parameters in registration order), so a seed gives identical results. Components:

* ``"all"``: every parameter of the block. Normalisation layers (LayerNorm, RMSNorm, ...) are reset to their
  default initialisation (weight 1, bias 0) rather than drawn: a draw with the trained weights' small spread
  (about 0.06 around a mean near 1) would shrink the block's input about 15-fold and make its attention nearly
  uniform, an artefact of the rule rather than of the model (Adebayo et al. re-initialise each layer with its
  own default initialiser).
* ``"qk"``: the query and key projections (weights and biases).
* ``"value"``: the value projection and the attention output projection.
* ``"mlp"``: the feed-forward layers.

The head step re-initialises every parameter of the head, whatever the component. Embeddings, the final
LayerNorm and a pooler (BERT) are never touched. Which tensors make up each component comes only from the
model's layer anatomy (``attnroll.capture.model_facts(model).anatomy``: the q / k / v / o projections, the
MLP, the norms of each block; a fused q/k/v tensor contributes the rows of the chosen thirds), never from
parameter names; a model whose anatomy is unknown is refused with the reason.

Text: the correlation of each example is taken over its *units* only, the tokens the other text metrics
count (:func:`attnroll.evaluate.text.text_units`): real tokens (attention mask 1) that are not special
(the config's CLS / SEP / BOS / EOS / PAD ids, or ``special_tokens_mask`` when the tokenizer was asked for
it; ``keep=`` overrides). Padding scores 0 in both maps; counted, it would tie a block of ranks in both and
pull the correlation of a short sentence in a long batch towards 1. So a padded batch gives each sentence the
same correlation as that sentence alone. Images (and other tensor inputs) use every unit of the map.

The model is copied with ``copy.deepcopy`` (the caller's model is never changed; memory for a second copy is
needed) and the copy is put in eval mode.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import _checks
from ..capture import model_facts
from ..capture.anatomy import component_parameters, find_blocks, find_head
from ..capture.layers import Target
from ..methods import Explainer, batch_size_of, explain_batches
from ._common import nanmean, spearman_rows

__all__ = ["SanityResult", "cascading_randomization", "find_blocks", "find_head", "component_parameters"]

DEFAULT_METHODS = ("rollout", "gae", "grad_rollout", "raw")

# ----------------------------------------------------------------------------------------------- result
@dataclass
class SanityResult:
    """Correlation of each method's map with its original map after each cumulative randomisation step.

    Attributes:
        methods: method names, in the order run.
        steps: step names, top-down and cumulative: "classifier", then "layer L-1" ... "layer 0".
        component: which block parameters were re-initialised ("all", "qk", "value", "mlp").
        correlations: method -> (S,) mean over examples of the Spearman rank correlation between the map of
            the original model and the map after step s (examples whose correlation is undefined, a constant
            map, are skipped; NaN if all are).
        per_example: method -> (S, B) the per-example correlations (NaN where undefined).
        seed: the generator seed; head / blocks: the module paths that were randomised.
    """

    methods: list[str]
    steps: list[str]
    component: str
    correlations: dict[str, np.ndarray]
    per_example: dict[str, np.ndarray]
    seed: int = 0
    head: str = ""
    blocks: str = ""

    def summary(self) -> str:
        """A small table: one row per step, one column per method (mean Spearman correlation)."""
        w0 = max(len("step"), *(len(s) for s in self.steps))
        widths = [max(7, len(m)) for m in self.methods]
        lines = [
            f"cascading randomisation (component {self.component!r}, seed {self.seed}): mean Spearman "
            "correlation with the original map",
            "  ".join(["step".ljust(w0)] + [m.rjust(w) for m, w in zip(self.methods, widths)]),
        ]
        for i, s in enumerate(self.steps):
            cells = [f"{self.correlations[m][i]:.3f}".rjust(w) for m, w in zip(self.methods, widths)]
            lines.append("  ".join([s.ljust(w0)] + cells))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-able: methods, steps, component, seed, head, blocks, correlations and per_example as lists of
        floats (NaN -> None)."""

        def fl(a: np.ndarray) -> Any:
            return [fl(v) for v in a] if np.ndim(a) else (None if not np.isfinite(a) else float(a))

        return {
            "methods": list(self.methods),
            "steps": list(self.steps),
            "component": self.component,
            "seed": self.seed,
            "head": self.head,
            "blocks": self.blocks,
            "correlations": {m: fl(v) for m, v in self.correlations.items()},
            "per_example": {m: fl(v) for m, v in self.per_example.items()},
        }

    def plot(self, ax: Any = None) -> Any:
        """Correlation against step, one line per method (needs matplotlib, the ``viz`` extra). Returns the
        matplotlib Axes."""
        if ax is None:
            try:
                import matplotlib.pyplot as plt
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError("SanityResult.plot needs matplotlib: pip install 'attnroll[viz]'") from e
            _, ax = plt.subplots(figsize=(1.0 + 0.8 * len(self.steps), 3.2))
        x = np.arange(len(self.steps))
        for m in self.methods:
            ax.plot(x, self.correlations[m], marker="o", label=m)
        ax.axhline(0.0, color="0.6", linewidth=0.8, linestyle="--")
        ax.set_xticks(x)
        ax.set_xticklabels(self.steps, rotation=30, ha="right")
        ax.set_ylim(-1.05, 1.05)
        ax.set_xlabel(f"randomised (cumulative, top-down; component {self.component!r})")
        ax.set_ylabel("Spearman ρ with original map")
        ax.legend(fontsize="small")
        return ax


@torch.no_grad()
def _reinitialise(targets: list[Target], gen: torch.Generator) -> None:
    """Replace each target by N(0, std of the values it replaces) draws from ``gen``, in place (normalisation
    parameters marked ``layers.RESET``: back to weight 1 / bias 0)."""
    for name, p, rows in targets:
        if isinstance(rows, str):  # layers.RESET: a normalisation layer's default (weight 1, bias 0)
            p.fill_(0.0 if name.rsplit(".", 1)[-1] == "bias" else 1.0)
            continue
        view = p if rows is None else p[rows]
        old = view.detach().to("cpu", torch.float64)
        std = float(old.std(correction=0)) if old.numel() else 0.0
        new = torch.randn(tuple(view.shape), generator=gen, dtype=torch.float64) * std
        if rows is None:
            p.copy_(new.to(device=p.device, dtype=p.dtype))
        else:  # assigned through the index: a tensor index (rows of every head) reads a copy, never a view
            p[rows] = new.to(device=p.device, dtype=p.dtype)


# ----------------------------------------------------------------------------------------------- inputs
def _maps(
    model: nn.Module, inputs: Any, method: str, target: Any, options: dict, batch_size: int
) -> tuple[np.ndarray, list | None]:
    """The method's scores (B, units) float64 over all inputs in chunks, and the resolved per-example target."""
    r = explain_batches(model, inputs, method, target=target, batch_size=batch_size, **options)
    return r.scores.to(torch.float64).numpy(), r.targets


# ----------------------------------------------------------------------------------------------- entry point
def cascading_randomization(
    model: nn.Module,
    inputs: Any,
    methods: Any = DEFAULT_METHODS,
    *,
    target: Any = None,
    component: str = "all",
    seed: int = 0,
    method_options: dict[str, dict] | None = None,
    batch_size: int = 64,
    keep: Any = None,
) -> SanityResult:
    """Cascading model-parameter randomisation (Adebayo et al. 2018) of a copy of ``model``.

    Args:
        model: an nn.Module that ``attnroll.explain`` supports (never modified: a deep copy is randomised).
        inputs: pixel tensor (B, 3, H, W) or the processor / tokenizer's dict, batch-first.
        methods: registered method names (a single name is accepted).
        target: None = the class the original model predicts, per example; an int, a list of B ints or a
            callable target as for ``explain``. Kept fixed through all steps.
        component: "all" | "qk" | "value" | "mlp" -- which parameters of each block are re-initialised.
        seed: seed of the generator drawing the new parameters (same seed, same result).
        method_options: {method: {option: value}} passed to ``explain`` for that method.
        batch_size: examples per ``explain`` call.
        keep: text only: a (B, n) bool mask of real tokens left out of the correlation (default: the special
            tokens, as the text metrics; an all-False mask counts every real token). Padding is always left
            out.

    Returns:
        a :class:`SanityResult` with steps ["classifier", "layer L-1", ..., "layer 0"].

    Raises:
        ValueError: unknown component or method, empty methods, method options a method does not take, a
            model whose layer anatomy or head is unknown (the reason named), ``keep`` with inputs that are not
            tokenised text, a text example with fewer than 2 units.
        TypeError: a model that is not an nn.Module, inputs that are neither a tensor nor a dict.
    """
    _checks.check_module("model", model)
    methods = _checks.check_method_names("methods", methods)
    component = _checks.check_choice("component", component, _checks.SANITY_COMPONENTS)
    seed = _checks.check_int("seed", seed, low=0)
    batch_size = _checks.check_int("batch_size", batch_size, low=1)
    options = _checks.check_method_options("method_options", method_options, methods)
    for m in methods:
        Explainer(model, m, **options.get(m, {}))  # validates the name (lists the methods) and the options
    batch = batch_size_of(inputs)
    if batch == 0:
        raise ValueError("inputs hold no examples (B=0)")

    work = copy.deepcopy(model).eval()
    anat, plan = _plan(work, component)
    units = _units(model, inputs, keep)  # after the anatomy, whose refusal names the model's problem first

    original: dict[str, np.ndarray] = {}
    fixed = target
    for m in methods:
        original[m], resolved = _maps(work, inputs, m, fixed, options.get(m, {}), batch_size)
        if units is not None and original[m].shape != tuple(units.shape):
            raise ValueError(f"method {m!r} scored {original[m].shape[1]} units per example, not the inputs' "
                             f"{units.shape[1]} tokens; cascading randomisation on text needs maps over tokens")
        if fixed is None and resolved is not None:
            fixed = resolved  # the original model's predicted classes, for every later map

    gen = torch.Generator().manual_seed(seed)
    per_example = {m: np.empty((len(plan), batch)) for m in methods}
    for s, (_, targets) in enumerate(plan):
        _reinitialise(targets, gen)
        for m in methods:
            maps, _ = _maps(work, inputs, m, fixed, options.get(m, {}), batch_size)
            per_example[m][s] = spearman_rows(original[m], maps, units)
    return SanityResult(
        methods=methods,
        steps=[name for name, _ in plan],
        component=component,
        correlations={m: np.array([nanmean(r) for r in per_example[m]]) for m in methods},
        per_example=per_example,
        seed=seed,
        head=anat.head_path,
        blocks=anat.path,
    )


def _units(model: nn.Module, inputs: Any, keep: Any) -> np.ndarray | None:
    """(B, n) bool: the tokens each text example is correlated over (see the module docs); None for inputs
    that are not tokenised text (a tensor, a dict without ``input_ids``), whose maps count every unit."""
    from .text import text_units

    if not (hasattr(inputs, "keys") and "input_ids" in inputs.keys()):
        if keep is not None:
            raise ValueError(f"keep applies to tokenised text (a dict with input_ids), but inputs are "
                             f"{_checks.describe(inputs)}")
        return None
    units = text_units(model, _checks.check_text_inputs(inputs), keep).numpy()
    few = (units.sum(axis=1) < 2).nonzero()[0].tolist()
    if few:
        raise ValueError(f"examples {few[:10]} have fewer than 2 tokens that count (real, not special or kept); "
                         "a rank correlation needs at least 2")
    return units


def _plan(work: nn.Module, component: str) -> tuple[Any, list[tuple[str, list[Target]]]]:
    """The anatomy of ``work`` and the steps: ("classifier", the head's parameters), then ("layer i", the
    component's tensors of block i) from the last block to the first. Resolved before any work, so a model
    whose anatomy or head is unknown fails first (ValueError with the anatomy's reason)."""
    facts = model_facts(work)
    anat = facts.anatomy
    if anat is None:
        raise ValueError(facts.anatomy_reason)
    if anat.head_module is None:
        find_head(work, anat.path)  # raises naming what was looked for
    plan: list[tuple[str, list[Target]]] = [("classifier", anat.head_targets())]
    for layer in reversed(anat.layers):
        plan.append((f"layer {layer.index}", layer.targets(component)))
    return anat, plan
