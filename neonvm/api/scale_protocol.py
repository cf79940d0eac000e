"""The ``/scale`` protocol between the controller and a runner: token, fence, JSON shapes.

``PUT /scale`` on the runner port, ``Authorization: Bearer <token>``::

    {"cpus": 2, "memorySlots": 3, "fence": {"epoch": 7, "token": 42, "seq": 3}}

The token is :func:`pod_token`; the fence ``(epoch, token, seq)`` is compared in that
order by :func:`fence_decision`; bounds by :func:`check_bounds`. Both sides import this
module (the runner applies, the controller asks); the QMP machinery stays in
:mod:`neonvm.runner.scaling`. The rules in full: docs/runner.md, "Live scaling".
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

NO_TOKEN = "NoToken"
"""The reason of a 401 that no token can change: the runner was started without a token
file, so it never takes a ``PUT /scale`` (every other 401 may pass once a rotated token
file reaches the pod)."""


class ScaleError(Exception):
    """A request that cannot be applied; ``status`` is the HTTP code to answer."""

    def __init__(self, status: int, message: str, refused: tuple[str, ...] = (),
                 reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.refused = refused
        """Devices whose eject the guest refused during this request (504 at once)."""
        self.reason = reason
        """A machine-readable word for the answer's body (:data:`NO_TOKEN`), or ""."""


@dataclass(frozen=True, order=True)
class ScaleFence:
    """The controller's (leader epoch, lock token, scale seq); compared in that order."""

    epoch: int
    token: int
    seq: int = 0

    def __str__(self) -> str:
        return f"epoch {self.epoch} token {self.token} seq {self.seq}"


def parse_fence_floor(text: str) -> ScaleFence:
    """``"epoch,token,seq"`` (the form of ``--scaling-fence-floor``)."""
    parts = text.split(",")
    if len(parts) != 3:
        raise ValueError(f"fence floor {text!r}: expected epoch,token,seq")
    try:
        epoch, token, seq = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"fence floor {text!r}: expected three integers") from None
    return ScaleFence(epoch=epoch, token=token, seq=seq)


@dataclass(frozen=True)
class ScaleTarget:
    vcpus: int
    memory_slots: int


@dataclass(frozen=True)
class ScaleLimits:
    """What the spec the VM booted with allows (``ceil`` of the CPU bounds, slots)."""

    min_vcpus: int
    max_vcpus: int
    min_slots: int
    max_slots: int
    slot_bytes: int


@dataclass(frozen=True)
class AppliedFence:
    """The last fence applied and its target, as persisted in the work dir."""

    fence: ScaleFence
    target: ScaleTarget
    recorded_at: float
    removals: tuple[str, ...] = ()
    """Devices (vCPU qom-paths, DIMM ids) this runner sent ``device_del`` for whose
    removal it has not yet seen finish: QEMU cannot cancel one, and the guest may eject
    the device at any later time, so such a device is neither plugged nor free."""

    def as_json(self) -> dict[str, Any]:
        return {"fence": asdict(self.fence), "cpus": self.target.vcpus,
                "memorySlots": self.target.memory_slots, "recordedAt": self.recorded_at,
                "pendingRemovals": list(self.removals)}



def parse_vcpus(value: object) -> int:
    """A vCPU count from an int, a float or a CPU quantity (``"1500m"``, ``"2"``): ceil."""
    if isinstance(value, bool):
        raise ScaleError(400, f"cpus: {value!r} is not a CPU quantity")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ScaleError(400, f"cpus: {value!r} is not a CPU quantity")
        number = Decimal(str(value))
    elif isinstance(value, str):
        text = value.strip()
        try:
            number = (Decimal(text[:-1]) / 1000) if text.endswith("m") else Decimal(text)
        except InvalidOperation:
            raise ScaleError(400, f"cpus: {value!r} is not a CPU quantity (2, 1.5, "
                                  "1500m)") from None
        if not number.is_finite():
            raise ScaleError(400, f"cpus: {value!r} is not a CPU quantity")
    else:
        raise ScaleError(400, f"cpus: {value!r} is not a CPU quantity")
    if number <= 0:
        raise ScaleError(400, f"cpus: {value!r} must be positive")
    return int(number.to_integral_value(rounding="ROUND_CEILING"))


def _int_field(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScaleError(400, f"{where}{key}: expected an integer, got {value!r}")
    return value


def parse_request(body: bytes, current: ScaleTarget) -> tuple[ScaleFence, ScaleTarget]:
    """The fence and the full target of a ``PUT /scale`` body (absent fields: ``current``)."""
    try:
        doc = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ScaleError(400, "body is not JSON") from None
    if not isinstance(doc, dict):
        raise ScaleError(400, "body must be a JSON object")
    unknown = set(doc) - {"cpus", "memorySlots", "fence"}
    if unknown:
        raise ScaleError(400, f"unknown fields: {', '.join(sorted(unknown))}")
    fence_doc = doc.get("fence")
    if not isinstance(fence_doc, dict):
        raise ScaleError(400, "fence: required, {\"epoch\": int, \"token\": int}")
    seq = 0 if fence_doc.get("seq") is None else _int_field(fence_doc, "seq", "fence.")
    fence = ScaleFence(epoch=_int_field(fence_doc, "epoch", "fence."),
                       token=_int_field(fence_doc, "token", "fence."), seq=seq)
    vcpus = current.vcpus if doc.get("cpus") is None else parse_vcpus(doc["cpus"])
    slots = (current.memory_slots if doc.get("memorySlots") is None
             else _int_field(doc, "memorySlots", ""))
    return fence, ScaleTarget(vcpus=vcpus, memory_slots=slots)


def check_bounds(target: ScaleTarget, limits: ScaleLimits) -> None:
    if not limits.min_vcpus <= target.vcpus <= limits.max_vcpus:
        raise ScaleError(400, f"cpus: {target.vcpus} vCPUs is outside "
                              f"[{limits.min_vcpus}, {limits.max_vcpus}]")
    if not limits.min_slots <= target.memory_slots <= limits.max_slots:
        raise ScaleError(400, f"memorySlots: {target.memory_slots} is outside "
                              f"[{limits.min_slots}, {limits.max_slots}]")


def pod_token(secret: bytes, pod_uid: str) -> str:
    """The bearer token of one pod: HMAC-SHA256 of its uid under the VM's secret (hex).

    The controller sends the token of the pod it means (the plan's pod uid); the runner
    expects the token of its own pod (its uid from the downward API). A request that
    reaches another pod (the old pod's IP reused) carries a token no live pod accepts."""
    return hmac.new(secret, pod_uid.encode(), hashlib.sha256).hexdigest()


def fence_decision(last: AppliedFence | None, fence: ScaleFence, target: ScaleTarget) -> str:
    """``"newer"`` (record and apply), ``"retry"`` (same fence and target: converge again);
    raises 409 for an older fence, or the same fence with another target."""
    if last is None or fence > last.fence:
        return "newer"
    if fence == last.fence:
        if target == last.target:
            return "retry"
        raise ScaleError(409, f"fence {fence} was already applied with cpus="
                              f"{last.target.vcpus} memorySlots={last.target.memory_slots}; "
                              "a fence carries one target")
    raise ScaleError(409, f"stale fence: {fence} is older than the last applied {last.fence}")


def request_body(cpus: int, memory_slots: int, fence: ScaleFence) -> dict[str, Any]:
    """The JSON body of a ``PUT /scale`` (what :func:`parse_request` reads)."""
    return {"cpus": cpus, "memorySlots": memory_slots,
            "fence": {"epoch": fence.epoch, "token": fence.token, "seq": fence.seq}}
