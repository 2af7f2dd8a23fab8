"""Parsing the arguments several commands share: ``-o KEY=VALUE`` options, ``--target``, ``--methods``, and
the model-loading safety options (``--trust-remote-code``, ``--allow-partial-weights``)."""

from __future__ import annotations

import json
import re
from typing import Any

import click

from ._output import one_line

__all__ = ["parse_options", "parse_target", "method_and_options", "methods_list", "method_options",
           "load_safety_options", "load_flags"]

#: Where :func:`load_safety_options` keeps the flags on the click context, for :func:`load_flags`.
_LOAD_FLAGS = "attnroll.load_flags"


def _keep_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    ctx.meta.setdefault(_LOAD_FLAGS, {})[param.name] = bool(value)
    return value


def load_safety_options(fn: Any) -> Any:
    """``--trust-remote-code`` and ``--allow-partial-weights`` for a command that loads a model. They are
    not passed to the command function: :func:`load_flags` (used by ``_data.load``) reads them."""
    decorators = [
        click.option("--trust-remote-code", "trust_remote_code", is_flag=True, expose_value=False,
                     callback=_keep_flag,
                     help="Run the Python files of a model folder whose config names its own classes (auto_map). "
                          "That code runs on this machine with your rights: only for a folder you trust. "
                          "Without it such a folder is refused."),
        click.option("--allow-partial-weights", "allow_partial_weights", is_flag=True, expose_value=False,
                     callback=_keep_flag,
                     help="Explain a model whose weights files lack some of its tensors, hold extra ones or "
                          "wrongly shaped ones: those weights stay random (a warning names them), so its "
                          "output is partly random. Without it such a model is refused."),
    ]
    for deco in reversed(decorators):
        fn = deco(fn)
    return fn


def load_flags() -> dict[str, bool]:
    """{trust_remote_code, allow_partial_weights} as the running command was given them (False when it
    has no such options, or outside a command)."""
    ctx = click.get_current_context(silent=True)
    flags = {"trust_remote_code": False, "allow_partial_weights": False}
    if ctx is not None:  # ctx.meta is one dict for a context and its parents
        flags.update(ctx.meta.get(_LOAD_FLAGS, {}))
    return flags


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``-o KEY=VALUE`` pairs; values are JSON when they parse (numbers, true/false, null, lists), else str."""
    out: dict[str, Any] = {}
    for it in items:
        if "=" not in it or not it.split("=", 1)[0].strip():
            raise click.UsageError(f"--option must be KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = {"none": None, "None": None, "True": True, "False": False}.get(v, v)
    return out


def parse_target(target: str | None, lm: Any) -> Any:
    """``--target``: None, a class index, or a class name of the loaded model (case-insensitive)."""
    if target is None:
        return None
    if re.fullmatch(r"-?\d+", target.strip()):
        return int(target)
    by_name = {v.lower(): k for k, v in lm.labels.items()}
    if target.lower() in by_name:
        return by_name[target.lower()]
    known = f"; class names: {', '.join(lm.labels.values())}" if lm.labels else ""
    raise click.UsageError(f"--target must be a class index or a class name, got {target!r}{known}")


def method_and_options(method: str, items: tuple[str, ...]) -> dict[str, Any]:
    """``--method`` and its ``-o KEY=VALUE`` options, parsed: a usage error for an unknown method, a malformed
    option or an option the method does not take."""
    from ..methods import check_options, methods

    if method not in methods():
        raise click.UsageError(f"unknown method {method!r}; 'attnroll methods' lists them ({', '.join(methods())})")
    opts = parse_options(items)
    try:
        check_options(method, opts)
    except (TypeError, ValueError) as e:
        raise click.UsageError(one_line(str(e))) from None
    return opts


def methods_list(value: str) -> list[str]:
    """``--methods a,b,c``: distinct registered names, in the order given."""
    from ..methods import methods

    names = list(dict.fromkeys(m.strip() for m in value.split(",") if m.strip()))
    unknown = [m for m in names if m not in methods()]
    if not names or unknown:
        raise click.UsageError(f"--methods: unknown {unknown or '(none given)'}; see 'attnroll methods'")
    return names


def method_options(items: tuple[str, ...], names: list[str]) -> dict[str, dict[str, Any]]:
    """``-o METHOD.KEY=VALUE`` (for one method) or ``-o KEY=VALUE`` (for every method that takes KEY)."""
    from ..methods import check_options, method_info

    out: dict[str, dict[str, Any]] = {m: {} for m in names}
    for k, v in parse_options(items).items():
        if "." in k:
            m, key = k.split(".", 1)
            if m not in out:
                raise click.UsageError(f"--option {k}: {m!r} is not among the evaluated methods {names}")
            out[m][key] = v
        else:
            takers = [m for m in names if k in method_info(m).options]
            if not takers:
                raise click.UsageError(f"--option {k}: none of the methods {names} takes {k}=")
            for m in takers:
                out[m][k] = v
    for m, o in out.items():
        try:
            check_options(m, o)  # an option the method refuses, or a bad value, is a usage error, before any work
        except (TypeError, ValueError) as e:
            raise click.UsageError(f"--option: {e}") from None
    return {m: o for m, o in out.items() if o}
