"""``--output json|yaml|table`` for every inspection command (plus ``wide`` and ``name``
where kubectl has them: listings of Kubernetes objects)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
import yaml


def output_option(*extra: str) -> Any:
    """``-o/--output``: table, json, yaml and the ``extra`` formats (``wide``, ``name``)."""
    return click.option(
        "-o", "--output", type=click.Choice(["table", "json", "yaml", *extra]),
        default="table", show_default=True, help="Output format.",
    )


OUTPUT_OPTION = output_option()


def object_name(kind: str, group: str, name: str) -> str:
    """What ``kubectl get -o name`` prints: ``<kind>.<group>/<name>`` (``<kind>/<name>``
    for the core group), the kind in lower case."""
    return f"{kind.lower()}.{group}/{name}" if group else f"{kind.lower()}/{name}"


def emit(rows: Sequence[dict[str, Any]] | dict[str, Any], fmt: str,
         columns: Sequence[str] | None = None) -> None:
    """Print ``rows`` (or one object) as a table, JSON or YAML (``wide`` is a table too:
    the caller passes the wide columns)."""
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
