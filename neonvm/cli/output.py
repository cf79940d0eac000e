"""``-o/--output`` for every inspection command, and how each format prints.

Two kinds of command (docs/cli.md, "Output"):

* commands about Kubernetes objects (``vm list``, ``vm get``) print the API objects, as
  kubectl does: one object, or a ``kind: List`` (``apiVersion: v1``, ``items``,
  ``metadata.resourceVersion: ""``) for a listing, JSON with 4-space indent and sorted
  keys, YAML with sorted keys; plus ``name``, ``wide`` and ``jsonpath=TEMPLATE``;
* every other command (``status``, ``leader show``, ``locks list``, ``check``...)
  prints its own document for ``json``/``yaml`` (not a Kubernetes object), which its
  ``--help`` says; ``jsonpath=`` applies to that document.

Tables print ``<none>`` for an absent value, and an empty listing prints kubectl's "No
resources found in NS namespace." on stderr (exit 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import click
import yaml

from neonvm.cli import jsonpath

NONE = "<none>"
JSONPATH = "jsonpath="

OBJECTS_HELP = ("Output format: table (default){extra}, json|yaml (the API objects as "
                "kubectl prints them: one object, or a List), jsonpath=TEMPLATE.")
DOCUMENT_HELP = ("Output format: table (default){extra}, json|yaml (this command's own "
                 "document, not a Kubernetes object), jsonpath=TEMPLATE (applied to that "
                 "document).")


class OutputFormat(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.3
    """A choice of formats, or ``jsonpath=TEMPLATE`` (parsed here, so a bad template is a
    usage error, exit 2)."""

    name = "format"

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join([*self.choices, JSONPATH + "..."]) + "]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        text = str(value)
        if text in self.choices:
            return text
        if text.startswith(JSONPATH):
            template = _strip_quotes(text[len(JSONPATH):])
            try:
                jsonpath.parse(template)
            except jsonpath.JsonPathError as exc:
                self.fail(f"error parsing jsonpath {template!r}: {exc}", param, ctx)
            return JSONPATH + template
        self.fail(f"unable to match a printer suitable for the output format {text!r}, "
                  f"allowed formats are: {', '.join([*self.choices, 'jsonpath'])}",
                  param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter,
                       incomplete: str) -> list[click.shell_completion.CompletionItem]:
        from click.shell_completion import CompletionItem

        return [CompletionItem(c) for c in [*self.choices, JSONPATH]
                if c.startswith(incomplete)]


def _strip_quotes(template: str) -> str:
    # kubectl accepts jsonpath='{...}' with the quotes inside the value too.
    if len(template) >= 2 and template[0] == template[-1] and template[0] in "'\"":
        return template[1:-1]
    return template


def output_option(*extra: str, objects: bool = False) -> Any:
    """``-o/--output``: table, json, yaml, ``jsonpath=`` and the ``extra`` formats
    (``wide``, ``name``). ``objects``: json/yaml print API objects (else the command's
    own document); only the help differs."""
    shown = "".join(f", {e}" for e in extra)
    return click.option(
        "-o", "--output", type=OutputFormat(["table", "json", "yaml", *extra]),
        default="table", metavar="FORMAT",
        help=(OBJECTS_HELP if objects else DOCUMENT_HELP).format(extra=shown),
    )


OUTPUT_OPTION = output_option()

NO_HEADERS_OPTION = click.option("--no-headers", is_flag=True,
                                 help="Tables: print no header row.")


def object_name(kind: str, group: str, name: str) -> str:
    """What ``kubectl get -o name`` prints: ``<kind>.<group>/<name>`` (``<kind>/<name>``
    for the core group), the kind in lower case."""
    return f"{kind.lower()}.{group}/{name}" if group else f"{kind.lower()}/{name}"


def as_list(objects: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The ``kind: List`` kubectl prints for a listing with ``-o json|yaml``."""
    return {"apiVersion": "v1", "items": list(objects), "kind": "List",
            "metadata": {"resourceVersion": ""}}


def kube_json(doc: Any) -> str:
    """JSON as kubectl prints it: 4-space indent, sorted keys, and Go's escaping of
    ``<``, ``>``, ``&`` and the line/paragraph separators."""
    text = json.dumps(doc, indent=4, sort_keys=True, ensure_ascii=False, default=str)
    # Outside strings JSON has none of these characters, so this only touches strings.
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


class _KubeDumper(yaml.SafeDumper):
    """go-yaml's string styles (what kubectl's YAML printer uses): a string that would
    read back as another type (``"True"``, a timestamp, ``"1"``) in double quotes, a
    multi-line string as a literal block, else plain (single quotes when plain cannot
    hold it)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    tag = "tag:yaml.org,2002:str"
    if dumper.resolve(yaml.ScalarNode, value, (True, False)) != tag:  # type: ignore[no-untyped-call]
        return dumper.represent_scalar(tag, value, style='"')
    if "\n" in value:
        return dumper.represent_scalar(tag, value, style="|")
    return dumper.represent_scalar(tag, value)


_KubeDumper.add_representer(str, _represent_str)


def kube_yaml(doc: Any) -> str:
    """YAML as kubectl prints it: sorted keys, block style, go-yaml's string styles, long
    strings folded at 80 columns (both emitters are libyaml's); ends with a newline."""
    return yaml.dump(doc, Dumper=_KubeDumper, sort_keys=True, default_flow_style=False,
                     allow_unicode=True)


def without_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without ``metadata.managedFields``, as kubectl prints objects unless
    ``--show-managed-fields``."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or "managedFields" not in meta:
        return obj
    return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


SHOW_MANAGED_FIELDS_OPTION = click.option(
    "--show-managed-fields", is_flag=True,
    help="Keep metadata.managedFields when printing objects (json, yaml, jsonpath).")


def render_jsonpath(fmt: str, doc: Any) -> str:
    """The text of ``-o jsonpath=TEMPLATE`` for ``doc`` (no newline added, as kubectl)."""
    return jsonpath.parse(fmt[len(JSONPATH):]).render(doc)


def emit_objects(doc: dict[str, Any], fmt: str) -> None:
    """Print one API object or a ``List`` in ``fmt`` (json, yaml or jsonpath=)."""
    if fmt == "json":
        click.echo(kube_json(doc))
    elif fmt == "yaml":
        click.echo(kube_yaml(doc), nl=False)
    elif fmt.startswith(JSONPATH):
        click.echo(render_jsonpath(fmt, doc), nl=False)
    else:  # pragma: no cover - callers handle the table formats
        raise ValueError(f"not an object format: {fmt}")


def no_resources(namespace: str | None) -> None:
    """kubectl's message for an empty table, on stderr: the command still succeeds."""
    if namespace:
        click.echo(f"No resources found in {namespace} namespace.", err=True)
    else:
        click.echo("No resources found", err=True)


def emit(rows: Sequence[dict[str, Any]] | dict[str, Any], fmt: str,
         columns: Sequence[str] | None = None, *, no_headers: bool = False,
         namespace: str | None = None) -> None:
    """Print a command's own document: ``rows`` (or one object) as a table, JSON, YAML or
    ``jsonpath=`` (``wide`` is a table too: the caller passes the wide columns). An empty
    table prints kubectl's "No resources found" (in ``namespace``) on stderr."""
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    if fmt == "yaml":
        click.echo(yaml.safe_dump(rows, sort_keys=False, default_flow_style=False).rstrip())
        return
    if fmt.startswith(JSONPATH):
        click.echo(render_jsonpath(fmt, rows), nl=False)
        return
    items = [rows] if isinstance(rows, dict) else list(rows)
    if not items:
        no_resources(namespace)
        return
    for line in table_lines(items, columns or list(items[0].keys()), no_headers=no_headers):
        click.echo(line)


def table_lines(items: Sequence[dict[str, Any]], columns: Sequence[str], *,
                no_headers: bool = False, widths: Sequence[int] | None = None) -> list[str]:
    """The lines of a table (header unless ``no_headers``), columns at least ``widths``
    wide (a watch keeps the widths of its first table)."""
    cols = list(columns)
    cells = [[cell(item.get(c)) for c in cols] for item in items]
    least = list(widths) if widths is not None else [0] * len(cols)
    found = [max(least[i], len(c) if not no_headers else 0, *(len(r[i]) for r in cells))
             for i, c in enumerate(cols)]
    lines = [] if no_headers else [
        "   ".join(c.upper().ljust(w) for c, w in zip(cols, found, strict=True)).rstrip()]
    lines += ["   ".join(v.ljust(w) for v, w in zip(r, found, strict=True)).rstrip()
              for r in cells]
    return lines


def column_widths(items: Sequence[dict[str, Any]], columns: Sequence[str]) -> list[int]:
    """The widths :func:`table_lines` gives ``columns`` for ``items``, header included."""
    return [max(len(c), *(len(cell(i.get(c))) for i in items)) for c in columns]


def cell(v: Any) -> str:
    """One table cell: ``<none>`` for an absent value, as kubectl prints it."""
    if v is None or v == "":
        return NONE
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)
