"""MilliCPU: NeonVM's CPU amount, thousandths of a vCPU, written as an int or a string.

NeonVM's ``guest.cpus.{min,max,use}`` and ``status.cpus`` take a JSON integer (whole
vCPUs: ``2``) or a string (``"0.5"``, ``"250m"``, ``"2"``). The schema's pattern is
NeonVM's ``^[0-9]+((\\.[0-9]*)?|m)`` anchored at the end, so the API server refuses the
strings NeonVM's own parser would refuse too (``"two"``) and a few odd ones it takes
(``"1k"``, ``"1e3"``). A decimal with more than three places rounds *up* to the next
millicpu, as NeonVM's ``MilliValue`` does.

A manifest may also write a float (``0.25``, as NeonVM's samples do): the
MutatingAdmissionPolicy of :mod:`neonvm.api.admission` stores it in this encoding.

Encoding follows NeonVM's ``MarshalJSON``: a whole number of vCPUs is written as an
integer, anything else as a millicpu string (``"500m"``, ``"1500m"``).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

PATTERN = r"^[0-9]+((\.[0-9]*)?|m)$"
_RE = re.compile(PATTERN)


class MilliCPUError(ValueError):
    """Not a CPU amount NeonVM would accept."""


class MilliCPU(int):
    """A CPU amount in millicpu (1000 = one vCPU); an ``int``, so it compares and sorts."""

    @classmethod
    def parse(cls, value: object) -> MilliCPU:
        """The millicpu of a JSON value: an int is whole vCPUs, a string NeonVM's quantity.

        A float is vCPUs too (NeonVM's manifests write ``0.25``): rounded to a micro-vCPU,
        then up to the next millicpu, as :mod:`neonvm.api.admission` stores it. The API
        server itself never hands the controller one: that policy rewrites numbers into
        NeonVM's encoding and the schema takes only integers and strings.
        """
        if isinstance(value, MilliCPU):
            return value
        if isinstance(value, bool):
            raise MilliCPUError(f"expected a number, got {value!r}")
        if isinstance(value, int):
            if value < 0:
                raise MilliCPUError(f"expected a non-negative number, got {value!r}")
            return cls(value * 1000)
        if isinstance(value, float):
            if not math.isfinite(value) or value < 0:
                raise MilliCPUError(f"expected a non-negative number, got {value!r}")
            return cls(math.ceil(round(value * 1000, 6)))
        if isinstance(value, str):
            if not _RE.match(value):
                raise MilliCPUError(f"expected a number, got {value!r} (whole vCPUs such as 2, "
                                    "or a string such as \"0.5\" or \"250m\")")
            if value.endswith("m"):
                return cls(int(value[:-1]))
            try:
                milli = Decimal(value) * 1000
            except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
                raise MilliCPUError(f"expected a number, got {value!r}") from None
            return cls(math.ceil(milli))
        raise MilliCPUError(f"expected a number, got {value!r}")

    @property
    def cores(self) -> float:
        """vCPUs as a float (0.25 for 250m)."""
        return int(self) / 1000

    def rounded_up(self) -> int:
        """The smallest whole number of vCPUs that holds this amount (NeonVM's RoundedUp)."""
        return -(-int(self) // 1000)

    def to_json(self) -> int | str:
        """NeonVM's encoding: whole vCPUs as an integer, otherwise ``"<n>m"``."""
        if int(self) % 1000 == 0:
            return int(self) // 1000
        return f"{int(self)}m"

    def __str__(self) -> str:
        return str(self.to_json())

    def __repr__(self) -> str:
        return f"MilliCPU({int(self)})"

    def __format__(self, spec: str) -> str:
        # "{cpus:g}" reads as vCPUs (2, 0.5), as in NeonVM's %v; other specs are int's.
        if spec in ("", "g"):
            return f"{self.cores:g}"
        return int.__format__(int(self), spec)


def millicpu_schema() -> dict[str, Any]:
    """The OpenAPI schema of a MilliCPU field (NeonVM's int-or-string with its pattern)."""
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": PATTERN,
    }
