"""The method a command uses when ``-m`` is not given: the kind's entry of
:data:`attnroll.explain.defaults.DEFAULTS`, chosen once the model is loaded, and the line that says so."""

from __future__ import annotations

from typing import Any

import click

__all__ = ["has_class_scores", "default_choice", "announce", "check_early", "chosen_options"]


def has_class_scores(lm: Any, text: str = "a") -> bool:
    """Whether a text model gives class scores (B, C) for ``text`` (else it is a bare encoder: sentence
    embeddings, or a decoder's per-token logits)."""
    import torch

    from ..capture.outputs import main_logits

    with torch.no_grad():
        lg = main_logits(lm.model(**lm.tokenizer([text], return_tensors="pt")))
    return lg is not None and lg.ndim == 2


def default_choice(lm: Any, *, text: str | None = None, pairs: bool = False) -> Any:
    """The :class:`~attnroll.explain.defaults.Choice` for a loaded model: for text, whether it has class
    scores is probed on ``text`` (default "a"); ``pairs``: the inputs come with a pair (a sentence encoder then
    has a similarity to explain). A usage error when no entry of the table applies."""
    from ..explain.defaults import default_for

    has = has_class_scores(lm, text or "a") if lm.kind == "text" else None
    try:
        return default_for(lm, has_scores=has, scalar=None if lm.kind != "text" else bool(has or pairs))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def announce(choice: Any) -> None:
    """Print which method was chosen and why (stderr, as the commands' other notes; after the work, so that
    a failure stays one error line). Nothing when ``choice`` is None (``-m`` was given)."""
    if choice is not None:
        click.echo(f"note: {choice.note}", err=True)


def chosen_options(choice: Any, items: tuple[str, ...]) -> dict[str, Any]:
    """The ``-o`` options for the chosen default method: a usage error naming the default when it does not
    take one of them."""
    from ._args import method_and_options

    try:
        return method_and_options(choice.method, items)
    except click.UsageError as e:
        raise click.UsageError(f"{e.message} (no -m: {choice.method} is the default for {choice.kind}s, see "
                               "EVALUATION.md; give -m METHOD for another)") from None


def check_early(items: tuple[str, ...]) -> None:
    """``-o`` options given without ``-m``, checked before the model is loaded (the method is known only
    then): well formed, each key an option of some method, each value within its rule. Whether the chosen
    default takes them is checked once it is chosen."""
    from ..explain.options import COMMON_OPTIONS, RULES
    from ..methods import method_info, methods
    from ._args import parse_options

    for k, v in parse_options(items).items():
        key = k.split(".", 1)[-1]
        if key not in COMMON_OPTIONS and not any(key in method_info(m).options for m in methods()):
            raise click.UsageError(f"--option {k}: no method takes {key}=; 'attnroll methods' lists them")
        rule = RULES.get(key)
        if rule is not None:
            try:
                rule(key, v)
            except (TypeError, ValueError) as e:
                raise click.UsageError(f"--option: {e}") from None
