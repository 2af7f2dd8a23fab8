"""``attnroll methods``: the registered methods, one line each."""

from __future__ import annotations

import click

from ._group import cli


@cli.command("methods", short_help="List the registered methods with references.")
def methods_cmd() -> None:
    """List the registered methods, one line each: name, what it computes, [grad / class-specific], reference."""
    from ..methods import method_info, methods

    names = list(methods())
    width = max(len(n) for n in names)
    for name in names:
        m = method_info(name)
        cs = m.class_specific and "class-specific" not in m.description
        tags = ", ".join(t for t, on in (("needs gradients", m.needs_grad), ("class-specific", cs)) if on)
        tag = f" [{tags}]" if tags else ""
        ref = f" — {m.reference}" if m.reference else ""
        click.echo(f"{name:<{width}}  {m.description}{tag}{ref}")
