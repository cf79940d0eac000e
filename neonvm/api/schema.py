"""Dataclasses as the single source of the VirtualMachine API: schema and codec.

An API type is a dataclass whose fields carry :func:`api_field` metadata (JSON name,
description, bounds). From that one description this module derives

* the OpenAPI v3 schema the CRD ships (:func:`openapi_schema`), and
* the codec between Kubernetes JSON and the dataclasses (:func:`decode`, :func:`encode`).

So the schema the API server enforces and the shape the controller reads cannot drift.
Cross-field rules (``min <= max``) are CEL expressions declared on the class in
``__validations__`` and end up as ``x-kubernetes-validations``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from neonvm.api.millicpu import MilliCPU, MilliCPUError, millicpu_schema

T = TypeVar("T")

FREE_FORM = "free_form"
"""Metadata flag: the field is an arbitrary JSON object kept as a dict (e.g. affinity)."""

QUANTITY = "quantity"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""Metadata flag: the field is a Kubernetes resource quantity ("1Gi", 512, "250m")."""
QUANTITY_MAX_LENGTH = 32
"""Every quantity string is bounded: no real quantity is longer."""
SHAPE = "shape"
"""Metadata: a dataclass whose schema the field has, while the codec keeps a plain dict."""
NO_DEFAULT: Any = object()
"""``schema_default`` when the CRD stores no default for the field."""


def api_field(
    description: str,
    *,
    json: str | None = None,
    default: Any = None,
    default_factory: Any = dataclasses.MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    pattern: str | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
    max_items: int | None = None,
    max_properties: int | None = None,
    item_max_length: int | None = None,
    int32: bool = False,
    free_form: bool = False,
    quantity: bool = False,
    shape: type | None = None,
    required: bool = False,
    schema_default: Any = NO_DEFAULT,
) -> Any:
    """A dataclass field with the metadata the schema and codec need.

    Bounds: ``max_length`` for a string, ``max_items`` for a list, ``max_properties`` for
    a map or free-form object, ``item_max_length`` for the strings inside a list or map.
    ``shape`` gives a ``dict`` field (or a list of them) the schema of a dataclass while
    the codec keeps plain dicts, for fields that code reads as mappings.
    ``schema_default`` is the CRD's ``default:``, which the API server stores when the
    field is absent (NeonVM's defaults; docs/neonvm-compat.md, "Defaults"); ``default``
    is only the dataclass's, for objects built in Python.
    """
    meta = {
        "description": description,
        "json": json,
        "minimum": minimum,
        "maximum": maximum,
        "exclusive_minimum": exclusive_minimum,
        "pattern": pattern,
        "min_length": min_length,
        "max_length": max_length,
        "max_items": max_items,
        "max_properties": max_properties,
        "item_max_length": item_max_length,
        "int32": int32,
        SHAPE: shape,
        FREE_FORM: free_form,
        QUANTITY: quantity,
        "required": required,
        "schema_default": schema_default,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def json_name(f: dataclasses.Field[Any]) -> str:
    name: str | None = f.metadata.get("json")
    if name:
        return name
    head, *rest = f.name.split("_")
    return head + "".join(p.title() for p in rest)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


# ---- schema ------------------------------------------------------------------------------


def openapi_schema(cls: type) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of dataclass ``cls``."""
    hints = get_type_hints(cls)
    props: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        name = json_name(f)
        props[name] = _field_schema(hints[f.name], f.metadata)
        if f.metadata.get("required"):
            required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    if required:
        schema["required"] = required
    rules = getattr(cls, "__validations__", ())
    if rules:
        schema["x-kubernetes-validations"] = [_rule(*r) for r in rules]
    return schema


def _rule(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """One ``x-kubernetes-validations`` entry; ``field_path`` (".cpus.min") is the field the
    API server's error names, when the rule sits on a parent so that it also sees the
    field removed."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


def _field_schema(tp: Any, meta: typing.Mapping[str, Any]) -> dict[str, Any]:
    tp, _ = _unwrap_optional(tp)
    is_list = get_origin(tp) is list
    if meta.get(FREE_FORM):
        s: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if meta.get("max_properties") is not None:
            s["maxProperties"] = meta["max_properties"]
        if is_list:
            s = {"type": "array", "items": s}
    elif meta.get(SHAPE) is not None:
        s = openapi_schema(meta[SHAPE])
        if is_list:
            s = {"type": "array", "items": s}
    elif meta.get(QUANTITY) and get_origin(tp) is dict:
        s = {"type": "object", "additionalProperties": quantity_schema()}
    elif meta.get(QUANTITY):
        s = quantity_schema()
    else:
        s = _type_schema(tp)
    if meta.get("int32") and s.get("type") == "integer":
        s["format"] = "int32"
    if meta.get("item_max_length") is not None:
        inner = s.get("items") if is_list else s.get("additionalProperties")
        assert inner is not None and inner.get("type") == "string", "item_max_length: strings"
        inner["maxLength"] = meta["item_max_length"]
    if meta.get("max_items") is not None:
        s["maxItems"] = meta["max_items"]
    if meta.get("max_properties") is not None and not meta.get(FREE_FORM):
        s["maxProperties"] = meta["max_properties"]
    if meta.get("max_length") is not None:
        s["maxLength"] = meta["max_length"]
    if meta.get("description"):
        s["description"] = meta["description"]
    if meta.get("minimum") is not None:
        s["minimum"] = meta["minimum"]
        if meta.get("exclusive_minimum"):
            s["exclusiveMinimum"] = True
    if meta.get("maximum") is not None:
        s["maximum"] = meta["maximum"]
    if meta.get("pattern"):
        s["pattern"] = meta["pattern"]
    if meta.get("min_length") is not None:
        s["minLength"] = meta["min_length"]
    if meta.get("schema_default", NO_DEFAULT) is not NO_DEFAULT:
        s["default"] = meta["schema_default"]
    return s


def quantity_schema() -> dict[str, Any]:
    """A Kubernetes resource quantity: int-or-string with the quantity pattern, bounded."""
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        "maxLength": QUANTITY_MAX_LENGTH,
    }


def _type_schema(tp: Any) -> dict[str, Any]:
    tp, _ = _unwrap_optional(tp)
    origin = get_origin(tp)
    if tp is MilliCPU:
        return millicpu_schema()
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer", "format": "int64"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is Literal:
        return {"type": "string", "enum": list(get_args(tp))}
    if origin is list:
        return {"type": "array", "items": _type_schema(get_args(tp)[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(tp)[1])}
    if dataclasses.is_dataclass(tp):
        return openapi_schema(typing.cast(type, tp))
    raise TypeError(f"no schema for {tp!r}")


# ---- codec -------------------------------------------------------------------------------


class DecodeError(ValueError):
    """The object does not have the shape of the API type; the message names the field."""


def decode(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from Kubernetes JSON (unknown keys are ignored)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise DecodeError(f"{path or '.'}: expected an object, got {type(data).__name__}")
    kwargs = {}
    for attr, name, hint, meta in _decoding_plan(typing.cast(type, cls)):
        value = data.get(name)
        if value is not None:
            kwargs[attr] = _decode_value(hint, meta, value, f"{path}.{name}")
    return cls(**kwargs)


@functools.cache
def _decoding_plan(cls: type) -> tuple[tuple[str, str, Any, typing.Mapping[str, Any]], ...]:
    """Per field of ``cls``: attribute name, JSON name, resolved type, metadata.

    Cached per class because ``get_type_hints`` re-evaluates every annotation string on
    each call (about ten times the cost of the decode itself); a class's fields never change.
    """
    hints = get_type_hints(cls)
    return tuple((f.name, json_name(f), hints[f.name], f.metadata)
                 for f in dataclasses.fields(cls))


def _decode_value(tp: Any, meta: typing.Mapping[str, Any], value: Any, path: str) -> Any:
    tp, _ = _unwrap_optional(tp)
    if meta.get(FREE_FORM) or meta.get(QUANTITY) or meta.get(SHAPE) is not None:
        return value
    if tp is MilliCPU:
        try:
            return MilliCPU.parse(value)
        except MilliCPUError as exc:
            raise DecodeError(f"{path}: {exc}") from None
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return decode(typing.cast(type, tp), value, path)
    if origin is list:
        if not isinstance(value, list):
            raise DecodeError(f"{path}: expected a list")
        (item,) = get_args(tp)
        return [_decode_value(item, {}, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise DecodeError(f"{path}: expected an object")
        return {k: _decode_value(get_args(tp)[1], {}, v, f"{path}.{k}") for k, v in value.items()}
    if origin is Literal:
        if value not in get_args(tp):
            raise DecodeError(f"{path}: {value!r} is not one of {', '.join(get_args(tp))}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DecodeError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp in (int, str, bool) and not isinstance(value, tp):
        raise DecodeError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


WIRE_HOOK = "wire_form"
"""A dataclass may define ``wire_form(self, out) -> dict``: :func:`encode` hands it the
JSON built from the fields and writes what it returns (see
:meth:`neonvm.api.types.VirtualMachineStatus.wire_form`)."""


def encode(obj: Any) -> Any:
    """Dataclass to Kubernetes JSON; None fields are omitted."""
    if isinstance(obj, MilliCPU):
        return obj.to_json()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            out[json_name(f)] = encode(value)
        hook = getattr(obj, WIRE_HOOK, None)
        return hook(out) if hook is not None else out
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        return {k: encode(v) for k, v in obj.items()}
    return obj
