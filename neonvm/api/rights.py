"""The right to run: the wire contract between a self-fencing runner and the leader.

A runner asks ``POST <rights-url>/v1/rights`` with :class:`RightRequest` as JSON and
``Authorization: Bearer`` :func:`right_bearer` (the VM's scaling token, domain-separated
from the ``/scale`` bearer of :mod:`neonvm.api.scale_protocol`). The leader answers 200
:class:`RightGrant` or an error status with :class:`RightRefusal`. The runner reads its
boot-time clock (``CLOCK_BOOTTIME``: monotonic, and it counts a suspend) before sending
and, on a valid grant, keeps its guest until that time plus
the granted seconds; the leader treats the pod as dead only after
:func:`dead_for_sure_after`. Both sides import this module. The argument in full:
docs/protocol.md ("Self-fencing") and docs/runner.md ("Self-fencing").
"""

from __future__ import annotations

import hashlib
import hmac
import math
import urllib.parse
from dataclasses import dataclass
from typing import Any

RIGHTS_PATH = "/v1/rights"
"""The path a runner POSTs to, under its ``--rights-url``."""

GUEST_STARTED_QUERY = "guest=started"
"""The query a runner adds to :data:`RIGHTS_PATH` in every ask sent after it started its
guest (QEMU), and never before: the leader then grants without the term's write to the
pod (docs/protocol.md, "A term's first grants"). Not in the body, whose unknown keys a
leader of an earlier release refuses; such a leader ignores the query (it compares the
path without it) and writes the pod as before. Absent, or anything else: not started."""

RIGHT_SECONDS_ANNOTATION = "vm.neon.tech/right-seconds"
"""Pod annotation: the runner of this pod self-fences with a right of this many seconds
(absent: it does not, and only ``node.kubernetes.io/out-of-service`` frees the pod)."""

DEFAULT_RIGHT_SECONDS = 30.0
"""D: how long one grant keeps a guest alive, counted from the runner's send time."""

RIGHTS_URL_ENV = "NEONVM_RIGHTS_URL"
"""The runner's environment variable for ``--rights-url``: set in a pod's (immutable)
spec, it says the runner self-fences (the controller writes it, and reads it back
before it condemns a pod)."""
RIGHTS_TOKEN_FILE_ENV = "NEONVM_RIGHTS_TOKEN_FILE"
"""The runner's environment variable for ``--rights-token-file``: the projected
ServiceAccount token it presents as its bearer (docs/security.md, "Rights endpoint")."""
RIGHT_SECONDS_ENV = "NEONVM_RIGHT_SECONDS"
"""The runner's environment variable for ``--right-seconds`` (D)."""
RIGHTS_CLOSED_ENV = "NEONVM_RIGHTS_CLOSED_URL"
"""The runner's environment variable for ``--rights-closed-url``: the rights URL whose
port the guest filter closes although the runner does not self-fence (the controller
sets it on every pod it builds while it has a rights URL: the leader's listener is
reachable from any pod, docs/security.md, "Rights endpoint")."""

DEFAULT_RHO = 0.05
"""rho: the bound on how much faster the leader's clock runs than any runner's: over any
interval the leader's clock advances at most ``1 + rho`` times what the runner's does
(docs/protocol.md, "Why the margin is enough"), which makes ``D * (1 + rho)`` exact."""

DEFAULT_EPSILON = 2.0
"""epsilon: seconds of slack for scheduling (the watchdog's wake-up, the kill itself)."""

RETRY_TIMEOUT = 2.0
"""The longest a runner waits for the answer to a quick ask (after a granted runner's ask
got no answer or a 5xx; ``D/6`` if shorter), from before it connects
(:mod:`neonvm.runner.right`). The leader's rights server closes unanswered an ask that has
waited half this long since its connection was accepted, before any work for it
(``neonvm.controller.rights.STALE_AFTER``; docs/protocol.md, "Stale asks dropped, oldest
first")."""

NOT_LEADER = "NotLeader"
"""Refusal reason (503): this replica holds no active term; ask again (another replica)."""
UNAUTHORIZED = "Unauthorized"
"""Refusal reason (401): the bearer does not match the VM's token and the pod uid."""
NOT_CURRENT_POD = "NotCurrentPod"
"""Refusal reason (403): the pod uid is not the VM's current pod (or the VM is unknown)."""
CONDEMNED = "Condemned"
"""Refusal reason (403): the pod was condemned; it is never granted again."""
BAD_REQUEST = "BadRequest"
"""Refusal reason (400): the body is not a :class:`RightRequest`."""

_DOMAIN = b"right:"
"""Prefix of the HMAC message of a right's bearer. The ``/scale`` bearer is the HMAC of
the bare pod uid, and a pod uid never contains ``:`` (:class:`RightRequest` refuses one),
so neither bearer is ever the other's."""


class RightsContractError(ValueError):
    """A document that does not follow this contract (the text says which field)."""


def right_bearer(token: bytes, pod_uid: str) -> str:
    """The bearer a runner presents for a right: HMAC-SHA256 of ``"right:" + pod_uid``
    under the VM's scaling token (hex). Distinct from :func:`~neonvm.api.scale_protocol.
    pod_token` of the same token and uid, so neither can be replayed as the other."""
    _check_pod_uid(pod_uid)
    return hmac.new(token, _DOMAIN + pod_uid.encode(), hashlib.sha256).hexdigest()


def authorization_header(token: bytes, pod_uid: str) -> str:
    """The ``Authorization`` header's value for :func:`right_bearer`."""
    return f"Bearer {right_bearer(token, pod_uid)}"


def bearer_matches(authorization: str | None, token: bytes, pod_uid: str) -> bool:
    """Whether an ``Authorization`` header carries :func:`right_bearer` (constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    try:
        expected = right_bearer(token, pod_uid)
    except RightsContractError:
        return False
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def dead_for_sure_after(issued: float, term_start: float, seconds: float,
                        rho: float = DEFAULT_RHO, epsilon: float = DEFAULT_EPSILON) -> float:
    """The leader's monotonic time after which a pod's guest is surely dead.

    Every grant to the pod was issued by ``max(issued, term_start)`` (``issued``: this
    leader's last grant to it; ``term_start``: earlier leaders' grants all precede it),
    and a runner's deadline falls at most ``seconds * (1 + rho)`` of real time after the
    send that preceded the grant; ``epsilon`` covers the watchdog's wake-up and the kill."""
    for name, value in (("seconds", seconds), ("rho", rho), ("epsilon", epsilon)):
        if not math.isfinite(value) or value < 0:
            raise RightsContractError(f"{name}: {value!r} must be finite and >= 0")
    return max(issued, term_start) + seconds * (1.0 + rho) + epsilon


def ask_target(guest_started: bool) -> str:
    """The request target of an ask: :data:`RIGHTS_PATH`, with :data:`GUEST_STARTED_QUERY`
    once the asking runner has started its guest."""
    return RIGHTS_PATH + ("?" + GUEST_STARTED_QUERY if guest_started else "")


_STARTED_TARGET = ask_target(True)


def says_guest_started(target: str) -> bool:
    """Whether a request target says the asking runner has started its guest: its query
    holds ``guest=started`` and no other ``guest`` value. Anything else (no query, another
    value, a malformed one) says not started: the leader then writes the pod first, the
    safe side (docs/protocol.md, "A term's first grants")."""
    if target == _STARTED_TARGET:  # every ask of a runner whose guest runs: no parse
        return True
    _, sep, query = target.partition("?")
    if not sep:
        return False
    values = urllib.parse.parse_qs(query.partition("#")[0], keep_blank_values=True)
    return values.get("guest") == ["started"]


def renew_interval(seconds: float) -> float:
    """How often a runner asks: a third of the right, so two asks may fail in a row."""
    return seconds / 3.0


def request_deadline(seconds: float) -> float:
    """The overall deadline of one ask (connect, send, answer): a sixth of the right."""
    return seconds / 6.0


def annotation_value(seconds: float) -> str:
    """The text of :data:`RIGHT_SECONDS_ANNOTATION` for a right of ``seconds``."""
    return format(_positive_seconds(seconds, "seconds"), "g")


def parse_annotation(text: str | None) -> float | None:
    """The seconds of :data:`RIGHT_SECONDS_ANNOTATION`, or None when absent or not a
    positive finite number (such a pod is treated as not self-fencing)."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _positive_seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RightsContractError(f"{where}: expected a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise RightsContractError(f"{where}: {value!r} must be a positive finite number")
    return number


def _check_pod_uid(pod_uid: object) -> str:
    if not isinstance(pod_uid, str) or not pod_uid:
        raise RightsContractError(f"podUID: expected a non-empty string, got {pod_uid!r}")
    if ":" in pod_uid:
        raise RightsContractError(f"podUID: {pod_uid!r} must not contain ':'")
    return pod_uid


def _object(doc: object, fields: set[str], where: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise RightsContractError(f"{where}: expected a JSON object, got {doc!r}")
    unknown = set(doc) - fields
    if unknown:
        raise RightsContractError(f"{where}: unknown fields: {', '.join(sorted(unknown))}")
    return doc


def _name(doc: dict[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value:
        raise RightsContractError(f"{key}: expected a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class RightRequest:
    """The body of ``POST /v1/rights``: which pod of which VM asks."""

    namespace: str
    vm: str
    pod_uid: str

    def __post_init__(self) -> None:
        _name({"namespace": self.namespace}, "namespace")
        _name({"vm": self.vm}, "vm")
        _check_pod_uid(self.pod_uid)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "vm": self.vm, "podUID": self.pod_uid}

    @classmethod
    def from_dict(cls, doc: object) -> RightRequest:
        obj = _object(doc, {"namespace", "vm", "podUID"}, "request")
        return cls(namespace=_name(obj, "namespace"), vm=_name(obj, "vm"),
                   pod_uid=_check_pod_uid(obj.get("podUID")))


@dataclass(frozen=True)
class RightGrant:
    """The body of a 200: the guest may run ``seconds`` past the runner's send time."""

    seconds: float

    def __post_init__(self) -> None:
        _positive_seconds(self.seconds, "seconds")

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds}

    @classmethod
    def from_dict(cls, doc: object) -> RightGrant:
        obj = _object(doc, {"seconds"}, "grant")
        return cls(seconds=_positive_seconds(obj.get("seconds"), "seconds"))


@dataclass(frozen=True)
class RightRefusal:
    """The body of any other answer: a machine-readable ``reason`` (:data:`NOT_LEADER`,
    ...) and a human ``message``."""

    reason: str
    message: str = ""

    def __post_init__(self) -> None:
        _name({"reason": self.reason}, "reason")
        if not isinstance(self.message, str):
            raise RightsContractError(f"message: expected a string, got {self.message!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_dict(cls, doc: object) -> RightRefusal:
        obj = _object(doc, {"reason", "message"}, "refusal")
        message = obj.get("message", "")
        if not isinstance(message, str):
            raise RightsContractError(f"message: expected a string, got {message!r}")
        return cls(reason=_name(obj, "reason"), message=message)
