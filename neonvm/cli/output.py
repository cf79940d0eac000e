"""``--output json|yaml|table`` for every inspection command."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
import yaml

OUTPUT_OPTION = click.option(
    "-o", "--output", type=click.Choice(["table", "json", "yaml"]), default="table",
    show_default=True, help="Output format.",
)


def emit(rows: Sequence[dict[str, Any]] | dict[str, Any], fmt: str,
         columns: Sequence[str] | None = None) -> None:
    """Print ``rows`` (or one object) as a table, JSON or YAML."""
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if fmt == "yaml":
        click.echo(yaml.safe_dump(rows, sort_keys=False, default_flow_style=False).rstrip())
        return
    items = [rows] if isinstance(rows, dict) else list(rows)
    if not items:
        click.echo("No resources found.")
        return
    cols = list(columns or items[0].keys())
    cells = [[_cell(item.get(c)) for c in cols] for item in items]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    click.echo("   ".join(c.upper().ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
    for r in cells:
        click.echo("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _cell(v: Any) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)
