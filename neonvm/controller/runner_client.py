"""The controller's HTTP client for a runner, and what it takes from a runner's answer.

The runner is the VM owner's choice (``spec.runnerImage``), so it is asked through a
client written for a hostile peer: one deadline per exchange, bounded answers, no
redirects, strict parsing (docs/security.md, "The runner as seen by the controller").
Used by live scaling (:mod:`neonvm.controller.scaling`) and the acceleration report
(:mod:`neonvm.controller.acceleration`).
"""

from __future__ import annotations

import re
import socket
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from neonvm.controller import actions as act

RUNNER_BODY_LIMIT = 64 * 1024
"""Largest answer body (bytes) taken from a runner; a longer one is not read further."""
RUNNER_HEAD_LIMIT = 16 * 1024
"""Largest status line and headers (bytes) taken from a runner."""
MAX_LENGTH_DIGITS = 18
"""The most digits a runner's ``Content-Length`` may have (any body limit is far below);
a longer one is malformed, not parsed."""


class ScalingError(Exception):
    """The runner could not be asked (no token, unreachable, refused)."""

    def __init__(self, message: str, permanent: bool = False,
                 misbehaving: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent
        """Asking again cannot help (the token Secret is forbidden, missing or not ours)."""
        self.misbehaving = misbehaving
        """The runner answered, but not as a runner answers (see
        :data:`neonvm.controller.scaling.RUNNER_MISBEHAVING`)."""


MAX_RUNNER_COUNT = 1 << 20
"""Largest vCPU or memory slot count taken from a runner's report (far above any VM)."""
MAX_RUNNER_BYTES = 1 << 60
"""Largest memory size (bytes) taken from a runner's report."""
MAX_FENCE_VALUE = (1 << 63) - 1


def bounded_count(value: object, limit: int) -> int:
    """A non-negative integer of the runner's report, at most ``limit`` (a bool, a float,
    a string or anything else is malformed)."""
    if type(value) is not int or not 0 <= value <= limit:
        raise ValueError(f"{value!r:.40} is not an integer in 0..{limit}")
    return value


def runner_view(doc: dict[str, Any], pod_uid: str) -> act.RunnerView:
    """A ``GET /scale`` report as :class:`~neonvm.controller.actions.RunnerView`; raises
    KeyError, TypeError or ValueError on anything malformed (the fields, their types,
    their ranges)."""
    last = doc.get("lastApplied") or None
    fence = None
    if last is not None:
        f = last["fence"]
        fence = (bounded_count(f["epoch"], MAX_FENCE_VALUE),
                 bounded_count(f["token"], MAX_FENCE_VALUE),
                 bounded_count(f.get("seq", 0), MAX_FENCE_VALUE))
    qemu = doc["qemu"]
    vcpus = bounded_count(qemu["vcpus"], MAX_RUNNER_COUNT)
    if doc.get("mode") == "SysfsScaling":
        online = (doc.get("guest") or {}).get("cpusOnline")
        vcpus = bounded_count(online, MAX_RUNNER_COUNT) if online is not None else 0
    removals = doc.get("pendingRemovals") or []
    if not isinstance(removals, list) or not all(isinstance(r, str) for r in removals):
        raise TypeError("pendingRemovals is not a list of names")
    answered = doc.get("podUid")
    if answered is not None and not isinstance(answered, str):
        raise TypeError("podUid is not a string")
    return act.RunnerView(pod_uid=pod_uid, fence=fence, vcpus=vcpus,
                        memory_slots=bounded_count(qemu["memorySlots"], MAX_RUNNER_COUNT),
                        memory_bytes=bounded_count(qemu["memoryBytes"], MAX_RUNNER_BYTES),
                        pending_removals=tuple(removals),
                        answered_uid=answered or None)


def short(text: str, limit: int = 200) -> str:
    """A runner's text as quoted in logs and conditions: one line, at most ``limit``."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "\u2026"


def error_text(doc: dict[str, Any]) -> str:
    """The ``error`` of a runner's answer, as quoted (a runner's text is not trusted)."""
    return short(str(doc.get("error", "")))


_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?")


class _Deadline(Exception):
    """The exchange's overall deadline passed."""


def runner_exchange(method: str, url: str, body: bytes | None, headers: dict[str, str],
                    deadline: float, *, clock: Callable[[], float] = time.monotonic,
                    body_limit: int = RUNNER_BODY_LIMIT,
                    head_limit: int = RUNNER_HEAD_LIMIT) -> tuple[int, bytes]:
    """One HTTP/1.1 request to a runner, and its answer: (status, body).

    Written for a peer that may be hostile (docs/security.md, "The runner as seen by
    the controller"): the whole exchange (connect, send, every read) ends by
    ``deadline`` seconds, however the answer trickles in; at most ``head_limit`` bytes
    of status line and headers and ``body_limit`` of body are read (nothing is read
    past them); a redirect (3xx) is an error and is never followed (``Location`` is not
    read); the answer must be framed by ``Content-Length`` or by the connection's end
    (no ``Transfer-Encoding``). Raises :class:`ScalingError`: ``misbehaving`` when the
    runner answered in a way no runner does, else (no connection, nothing back by the
    deadline) plain."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ScalingError(f"{method} {url}: not an http:// address")
    try:
        port = parts.port or 80
    except ValueError:
        raise ScalingError(f"{method} {url}: not a valid port") from None
    end = clock() + deadline

    def left() -> float:
        remaining = end - clock()
        if remaining <= 0:
            raise _Deadline
        return remaining

    payload = body or b""
    request = "".join([
        f"{method} {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\n",
        f"Host: {parts.netloc}\r\n", "Connection: close\r\n",
        f"Content-Length: {len(payload)}\r\n",
        *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"]).encode() + payload
    received = bytearray()
    try:
        with socket.create_connection((parts.hostname, port), timeout=left()) as sock:
            sock.settimeout(left())
            sock.sendall(request)
            return _read_answer(sock, received, left, body_limit, head_limit)
    except (_Deadline, TimeoutError):
        if received:
            raise ScalingError(f"{method} {url}: the answer was not complete after "
                               f"{deadline:g} s ({len(received)} bytes so far)",
                               misbehaving=True) from None
        raise ScalingError(f"{method} {url}: no answer within {deadline:g} s") from None
    except OSError as exc:
        raise ScalingError(f"{method} {url}: {exc}") from None


def _read_answer(sock: socket.socket, received: bytearray, left: Callable[[], float],
                 body_limit: int, head_limit: int) -> tuple[int, bytes]:
    """Read one answer from ``sock`` into ``received`` (see :func:`runner_exchange`)."""
    head_end = -1
    status = 0
    length: int | None = None
    while True:
        sock.settimeout(left())
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
        if head_end < 0:
            head_end = received.find(b"\r\n\r\n")
            if head_end < 0:
                if len(received) > head_limit:
                    raise ScalingError(f"the runner's headers are over {head_limit} bytes",
                                       misbehaving=True)
                continue
            if head_end > head_limit:
                raise ScalingError(f"the runner's headers are over {head_limit} bytes",
                                   misbehaving=True)
            status, length = _parse_head(bytes(received[:head_end]), body_limit)
        if len(received) - head_end - 4 > body_limit:
            raise ScalingError(f"the runner's answer is over {body_limit} bytes: not read "
                               f"further", misbehaving=True)
        if length is not None and len(received) - head_end - 4 >= length:
            break
    if head_end < 0:
        raise ScalingError("the runner closed the connection before a whole answer "
                           f"({len(received)} bytes)", misbehaving=bool(received))
    content = bytes(received[head_end + 4:])
    if length is not None:
        if len(content) < length:
            raise ScalingError(f"the runner's answer ended after {len(content)} of the "
                               f"{length} bytes it announced", misbehaving=True)
        content = content[:length]
    return status, content


def _parse_head(head: bytes, body_limit: int) -> tuple[int, int | None]:
    """(status, Content-Length or None) from an answer's head; a redirect, an
    interim (1xx) or unframed answer, or a length over ``body_limit`` is misbehaving."""
    lines = head.split(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise ScalingError("the runner's answer does not start with an HTTP/1.x status "
                           "line", misbehaving=True)
    status = int(match.group(1))
    if 300 <= status < 400:
        raise ScalingError(f"the runner answered a redirect ({status}): not followed",
                           misbehaving=True)
    if status < 200:
        raise ScalingError(f"the runner answered an interim status ({status})",
                           misbehaving=True)
    lengths = set()
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ScalingError("the runner's answer has a malformed header line",
                               misbehaving=True)
        name = name.strip().lower()
        if name == b"transfer-encoding":
            raise ScalingError("the runner's answer uses Transfer-Encoding (only a "
                               "Content-Length or the connection's end is taken)",
                               misbehaving=True)
        if name == b"content-length":
            lengths.add(value.strip())
    if not lengths:
        return status, None
    text = lengths.pop()
    # bytes.isdigit takes ASCII digits only; int() refuses more than 4,300 of them.
    if lengths or not text.isdigit() or len(text) > MAX_LENGTH_DIGITS:
        raise ScalingError("the runner's answer has a malformed Content-Length",
                           misbehaving=True)
    length = int(text)
    if length > body_limit:
        raise ScalingError(f"the runner announced an answer of {length} bytes, over "
                           f"{body_limit}: not read", misbehaving=True)
    return status, length
