"""``-o jsonpath=TEMPLATE``: the subset of kubectl's JSONPath templates people type.

A template is text with actions in braces, evaluated against the document kubectl would
print as JSON (the object for one object, the ``List`` for a listing):

* fields ``{.metadata.name}``, escaped dots ``{.metadata.labels.app\\.kubernetes\\.io/name}``,
  bracketed names ``{.metadata.labels['a.b/c']}``; ``{@}`` or ``{$}`` is the document;
* ``[*]`` / ``.*`` (every element or value), ``[n]``, ``[-1]``, slices ``[a:b]``,
  unions ``[0,2]`` / ``['a','b']``, recursive descent ``{..name}``;
* filters ``[?(@.status.phase=="Running")]`` (``==``, ``!=``, ``<``, ``<=``, ``>``,
  ``>=`` against a quoted string or a number; ``[?(@.x)]`` tests presence);
* ``{range .items[*]}...{end}`` (nestable) and string literals ``{"\\n"}``, ``{"\\t"}``.

As kubectl (its ``--allow-missing-template-keys`` default): a missing field prints
nothing; several results of one action are joined by a space; strings print bare, maps
and lists as compact JSON. What is not supported is refused with a usage error
(kubectl's full grammar: docs/cli.md, "jsonpath").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_MISSING = object()


class JsonPathError(ValueError):
    """The template cannot be parsed."""


# ---- the path inside one action ----------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    names: tuple[str, ...]  # one name, or a union of names


@dataclass(frozen=True)
class _Wildcard:
    pass


@dataclass(frozen=True)
class _Index:
    indices: tuple[int, ...]


@dataclass(frozen=True)
class _Slice:
    start: int | None
    stop: int | None
    step: int | None


@dataclass(frozen=True)
class _Recursive:
    step: _Field | _Wildcard


@dataclass(frozen=True)
class _Filter:
    path: tuple[Any, ...]
    op: str | None
    value: Any


_Step = _Field | _Wildcard | _Index | _Slice | _Recursive | _Filter
_NAME = re.compile(r"(?:\\.|[^.\[\]\s,(){}=!<>])+")
_OPS = ("==", "!=", "<=", ">=", "<", ">")


def _unescape(name: str) -> str:
    return re.sub(r"\\(.)", r"\1", name)


def _parse_path(text: str) -> tuple[_Step, ...]:
    """``.a.b[0]..c`` (a leading ``@`` or ``$`` is the document itself)."""
    steps: list[_Step] = []
    i = 0
    if text[:1] in ("@", "$"):
        i = 1
    while i < len(text):
        if text.startswith("..", i):
            i += 2
            if text.startswith("*", i):
                steps.append(_Recursive(_Wildcard()))
                i += 1
                continue
            m = _NAME.match(text, i)
            if not m:
                raise JsonPathError(f"a name must follow '..' at {text[i:]!r}")
            steps.append(_Recursive(_Field((_unescape(m.group()),))))
            i = m.end()
        elif text[i] == ".":
            i += 1
            if i == len(text):
                break  # "{.}": the document
            if text[i] == "*":
                steps.append(_Wildcard())
                i += 1
                continue
            if text[i] == "[":
                continue
            m = _NAME.match(text, i)
            if not m:
                raise JsonPathError(f"a field name must follow '.' at {text[i - 1:]!r}")
            steps.append(_Field((_unescape(m.group()),)))
            i = m.end()
        elif text[i] == "[":
            end = _closing_bracket(text, i)
            steps.append(_parse_bracket(text[i + 1:end].strip()))
            i = end + 1
        else:
            raise JsonPathError(f"unexpected {text[i:]!r} (a path starts with '.' or '[')")
    return tuple(steps)


def _closing_bracket(text: str, start: int) -> int:
    depth, quote = 0, ""
    for j in range(start, len(text)):
        c = text[j]
        if quote:
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return j
    raise JsonPathError(f"unclosed '[' in {text[start:]!r}")


def _parse_bracket(inner: str) -> _Step:
    if inner == "*":
        return _Wildcard()
    if inner.startswith("?(") and inner.endswith(")"):
        return _parse_filter(inner[2:-1].strip())
    if inner[:1] in "'\"":
        names = [p.strip() for p in _split_union(inner)]
        if not all(len(n) >= 2 and n[0] == n[-1] and n[0] in "'\"" for n in names):
            raise JsonPathError(f"bad quoted name in [{inner}]")
        return _Field(tuple(n[1:-1] for n in names))
    if ":" in inner:
        parts = inner.split(":")
        if len(parts) > 3:
            raise JsonPathError(f"bad slice [{inner}]")
        try:
            nums = [int(p) if p.strip() else None for p in parts] + [None] * (3 - len(parts))
        except ValueError:
            raise JsonPathError(f"bad slice [{inner}]") from None
        return _Slice(nums[0], nums[1], nums[2])
    try:
        return _Index(tuple(int(p) for p in inner.split(",")))
    except ValueError:
        raise JsonPathError(f"unsupported subscript [{inner}]") from None


def _split_union(inner: str) -> list[str]:
    parts, current, quote = [], "", ""
    for c in inner:
        if quote:
            current += c
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
            current += c
        elif c == ",":
            parts.append(current)
            current = ""
        else:
            current += c
    parts.append(current)
    return parts


def _parse_filter(expr: str) -> _Filter:
    for op in _OPS:
        left, sep, right = expr.partition(op)
        if sep:
            return _Filter(_parse_path(left.strip()), op, _literal(right.strip()))
    return _Filter(_parse_path(expr), None, None)


def _literal(text: str) -> Any:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    try:
        return json.loads(text)  # numbers, true, false, null
    except json.JSONDecodeError:
        raise JsonPathError(f"a filter compares with a quoted string or a number, not "
                            f"{text!r}") from None


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node.values())
    if isinstance(node, list):
        return list(node)
    return []


def _descendants(node: Any) -> Iterator[Any]:
    yield node
    for child in _children(node):
        yield from _descendants(child)


def _apply(step: _Step, nodes: list[Any]) -> list[Any]:
    out: list[Any] = []
    for node in nodes:
        match step:
            case _Field(names):
                if isinstance(node, dict):
                    out.extend(node[n] for n in names if n in node)
            case _Wildcard():
                out.extend(_children(node))
            case _Index(indices):
                if isinstance(node, list):
                    out.extend(node[i] for i in indices if -len(node) <= i < len(node))
            case _Slice(start, stop, stride):
                if isinstance(node, list):
                    out.extend(node[start:stop:stride])
            case _Recursive(inner):
                for d in _descendants(node):
                    out.extend(_apply(inner, [d]))
            case _Filter():
                out.extend(item for item in _children(node) if _matches(step, item))
    return out


def _matches(f: _Filter, item: Any) -> bool:
    found = _evaluate(f.path, item)
    if f.op is None:
        return bool(found)
    for value in found:
        try:
            if ((f.op == "==" and value == f.value) or (f.op == "!=" and value != f.value)
                    or (f.op == "<" and value < f.value) or (f.op == "<=" and value <= f.value)
                    or (f.op == ">" and value > f.value)
                    or (f.op == ">=" and value >= f.value)):
                return True
        except TypeError:
            continue
    return False


def _evaluate(path: tuple[_Step, ...], doc: Any) -> list[Any]:
    nodes = [doc]
    for step in path:
        nodes = _apply(step, nodes)
    return nodes


# ---- the template ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Text:
    text: str


@dataclass(frozen=True)
class _Action:
    path: tuple[_Step, ...]


@dataclass(frozen=True)
class _Range:
    path: tuple[_Step, ...]
    body: tuple[_Text | _Action | _Range, ...]


_Node = _Text | _Action | _Range


@dataclass(frozen=True)
class Template:
    """A parsed template; :meth:`render` evaluates it against a JSON-like document."""

    source: str
    nodes: tuple[_Node, ...]

    def render(self, doc: Any) -> str:
        # Round-trip through JSON first: the template sees what `-o json` would print.
        return _render(self.nodes, json.loads(json.dumps(doc, default=str)))


def parse(template: str) -> Template:
    """Parse a kubectl-style template; raises :class:`JsonPathError` on what it cannot."""
    body, rest = _parse_nodes(_tokens(template), template, in_range=False)
    if rest:
        raise JsonPathError(f"{{end}} without {{range}} in {template!r}")
    return Template(template, body)


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", inside-the-braces) in order."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(template):
        start = template.find("{", i)
        if start < 0:
            out.append(("text", template[i:]))
            break
        if start > i:
            out.append(("text", template[i:start]))
        end, quote = start + 1, ""
        while end < len(template):
            c = template[end]
            if quote:
                if c == "\\":
                    end += 1
                elif c == quote:
                    quote = ""
            elif c in "'\"":
                quote = c
            elif c == "}":
                break
            end += 1
        if end >= len(template):
            raise JsonPathError(f"unclosed action in {template!r}")
        out.append(("action", template[start + 1:end].strip()))
        i = end + 1
    return out


def _parse_nodes(tokens: list[tuple[str, str]], source: str, *, in_range: bool
                 ) -> tuple[tuple[_Node, ...], list[tuple[str, str]]]:
    nodes: list[_Node] = []
    while tokens:
        kind, text = tokens.pop(0)
        if kind == "text":
            nodes.append(_Text(text))
        elif text == "end":
            if not in_range:
                return tuple(nodes), [(kind, text), *tokens]
            return tuple(nodes), tokens
        elif text.startswith("range "):
            body, tokens = _parse_nodes(tokens, source, in_range=True)
            nodes.append(_Range(_parse_path(text[len("range "):].strip()), body))
        elif text[:1] in "'\"":
            if len(text) < 2 or text[-1] != text[0]:
                raise JsonPathError(f"unclosed string {text!r}")
            nodes.append(_Text(_string(text[1:-1])))
        elif text[:1] in (".", "[", "@", "$"):
            nodes.append(_Action(_parse_path(text)))
        else:
            raise JsonPathError(f"unsupported action {{{text}}} in {source!r} (supported: "
                                "paths, range/end, string literals)")
    if in_range:
        raise JsonPathError(f"{{range}} without {{end}} in {source!r}")
    return tuple(nodes), []


def _string(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t", "r": "\r"}.get(m.group(1),
                                                                          m.group(1)), text)


def _render(nodes: tuple[_Node, ...], doc: Any) -> str:
    out: list[str] = []
    for node in nodes:
        match node:
            case _Text(text):
                out.append(text)
            case _Action(path):
                out.append(" ".join(_format(v) for v in _evaluate(path, doc)))
            case _Range(path, body):
                found = _evaluate(path, doc)
                items = found[0] if len(found) == 1 and isinstance(found[0], list) else found
                out.extend(_render(body, item) for item in items)
    return "".join(out)


def _format(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
