"""Kubernetes resource quantities ("1Gi", "512Mi", "2G", 1073741824) as whole bytes.

Only the forms that describe sizes are accepted: a non-negative number with an optional
binary (Ki..Ei) or decimal (k..E) suffix, or an exponent (``1e9``). Fractions that do not
come to a whole number of bytes (``"0.5"``, ``"100m"``) are refused, because a disk or a
memory slot of a fractional byte has no meaning. Shared by the api, the controller and
the runner, and free of the Kubernetes client.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, int] = {
    "": 1,
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}
_QUANTITY = re.compile(
    r"^\+?(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[kMGTPE]|[eE][+-]?[0-9]+)?$"
)


class QuantityError(ValueError):
    """The value is not a size quantity."""


def parse_bytes(value: object) -> int:
    """``value`` (str or int) as a whole number of bytes; raises :class:`QuantityError`."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"{value!r} is negative")
        return value
    if not isinstance(value, str):
        raise QuantityError(f"{value!r} is not a size")
    m = _QUANTITY.match(value.strip())
    if m is None:
        raise QuantityError(f"{value!r} is not a size quantity (e.g. 512Mi, 1Gi)")
    try:
        number = Decimal(m["number"])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise QuantityError(f"{value!r} is not a size quantity") from None
    suffix = m["suffix"] or ""
    if suffix in _SUFFIXES:
        total = number * _SUFFIXES[suffix]
    else:  # an exponent: e3, E+6
        total = number * Decimal(10) ** int(suffix[1:])
    if total != total.to_integral_value():
        raise QuantityError(f"{value!r} is not a whole number of bytes")
    return int(total)


def format_bytes(n: int) -> str:
    """``n`` in the largest binary unit that divides it exactly ("1536Mi", "2Gi")."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _SUFFIXES[suffix]
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)
