"""Self-fencing: the runner keeps its guest only while it holds a right to run.

Two loops share one deadline on the runner's boot-time clock (:func:`boottime`, which
also counts a suspend) (:class:`RightKeeper`):

* the renewer asks the leader (``POST <rights-url>/v1/rights``, :mod:`neonvm.api.rights`)
  every ``D/3`` (after two refusals in a row, once more ``D/6`` before the deadline), each
  ask bounded by ``D/6`` overall (a ``503 NotLeader`` is sent again at once, a few times,
  within it). Once granted, an ask that got no answer or a 5xx (a leader dead or not yet
  serving) is followed by quick ones (:data:`RETRY_SOON`, each bounded by
  :data:`RETRY_TIMEOUT`) until one is granted. It reads the clock *before* sending
  (``t0``) and, only on a 200 whose body is a valid grant, sets
  ``deadline = max(deadline, t0 + min(granted, D))``; any other answer, or none, changes
  nothing. Every ask sent after QEMU was started (:meth:`SelfFence.arm`), and none
  before, says so in its target (:data:`~neonvm.api.rights.GUEST_STARTED_QUERY`): the
  leader then grants without writing the pod (docs/protocol.md, "A deposed leader's
  delete still in flight");
* the watchdog (:class:`Watchdog`) SIGKILLs QEMU (never ACPI) once
  ``boottime() >= deadline`` and logs one line; the supervisor then ends the runner
  non-zero and does not start QEMU again. QEMU is not started before the first grant;
  a runner refused as ``Condemned`` before it, or not granted within
  :data:`FIRST_GRANT_RIGHTS` D of its first ask (:meth:`SelfFence.gave_up`), exits
  non-zero without starting QEMU.

Clock, HTTP and the kill are passed in, so the logic runs over a fake clock in tests;
:class:`SelfFence` wires the real ones and the two threads. docs/runner.md
("Self-fencing") has the rules and what is not covered (a frozen node).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import math
import os
import random
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loguru import logger

from neonvm.api.rights import (
    CONDEMNED,
    NOT_LEADER,
    RETRY_TIMEOUT,
    RIGHTS_PATH,
    RightGrant,
    RightRefusal,
    RightRequest,
    RightsContractError,
    ask_target,
    authorization_header,
    renew_interval,
    request_deadline,
)
from neonvm.runner.errors import SpecError
from neonvm.runner.guestnet import Blocked

MAX_ANSWER = 64 * 1024
"""The longest answer body read; a longer one is not a grant."""
FIRST_RETRY = 0.5
"""Before the first grant, asks are retried after 0.5 s, doubling up to ``D/3``."""
FIRST_GRANT_RIGHTS = 4
"""A runner with no right this many D after its first ask gives up without starting QEMU
(a leader that refuses its credential for good, or none that answers): it exits
non-zero, so its pod fails and the VM's restart replaces it, instead of a VM shown
Running with no guest for ever (docs/runner.md, "Self-fencing")."""
NOT_LEADER_TRIES = 3
"""An ask answered ``503 NotLeader`` (the Service may point at a deposed leader for a
moment) is sent again at once, on a new connection, up to this many sends in all, while
the ask's overall deadline (``D/6``) lasts."""
RETRY_SOON = (0.5, 1.0)
"""Once granted, after an ask that got no answer or a 5xx, the next one goes a random
0.5-1 s after it was sent (or when it ended, if later) instead of at the next ``D/3``,
until one is granted: a new leader that starts granting late in the right still reaches
the runner (docs/protocol.md, "Defaults and the trade-off"). A 4xx refusal keeps the
schedule. Each is bounded by :data:`~neonvm.api.rights.RETRY_TIMEOUT` (or ``D/6`` if
shorter) overall."""
WATCHDOG_MAX_SLEEP = 1.0
"""The watchdog re-reads the clock at least this often."""


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Clock(Protocol):
    def __call__(self) -> float:
        """Seconds on a monotonic clock (in production :func:`boottime`, which also
        counts a suspend)."""
        ...


Post = Callable[[str, bytes, Mapping[str, str], float], tuple[int, bytes]]
"""``post(url, body, headers, overall_timeout) -> (status, body)``; raises ``OSError`` (or
``http.client.HTTPException``) when no answer came."""


@dataclass(frozen=True)
class RightConfig:
    """What the runner asks for, and how long a right lasts here (``seconds`` = D)."""

    url: str
    """The leader's base URL (``http://host:port``); the path is :data:`RIGHTS_PATH`."""
    seconds: float
    namespace: str
    vm: str
    pod_uid: str
    token_file: Path | None
    """The VM's scaling token: the bearer is its HMAC with the pod uid (pods built
    without a rights audience)."""
    rights_token_file: Path | None = None
    """The projected ServiceAccount token of the controller's rights audience: sent as it
    is, re-read at every ask (the kubelet rotates it); preferred over ``token_file``."""

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + RIGHTS_PATH


def rights_endpoint(url: str) -> tuple[str, int]:
    """``(host, port)`` of a rights URL (:class:`SpecError` if it is not http(s)://host)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SpecError(f"--rights-url {url!r}: expected http(s)://host[:port]")
    try:
        port = parts.port
    except ValueError:
        raise SpecError(f"--rights-url {url!r}: bad port") from None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def right_config(url: str, seconds: float, namespace: str, vm: str, pod_uid: str | None,
                 token_file: Path | None,
                 rights_token_file: Path | None = None) -> RightConfig:
    """The runner's flags as a :class:`RightConfig` (:class:`SpecError` naming what is
    missing: the pod's uid, and a credential: the rights token file or the VM's scaling
    token file)."""
    rights_endpoint(url)
    if not math.isfinite(seconds) or seconds <= 0:
        raise SpecError(f"--right-seconds {seconds!r}: must be a positive number")
    if not pod_uid:
        raise SpecError("--rights-url needs --pod-uid (the pod's uid, from the downward API)")
    if token_file is None and rights_token_file is None:
        raise SpecError("--rights-url needs --scaling-token-file (the VM's token signs the "
                        "request for a right) or --rights-token-file (the pod's projected "
                        "ServiceAccount token)")
    try:
        RightRequest(namespace=namespace, vm=vm, pod_uid=pod_uid)
    except RightsContractError as exc:
        raise SpecError(f"--rights-url: {exc}") from None
    return RightConfig(url=url, seconds=seconds, namespace=namespace, vm=vm,
                       pod_uid=pod_uid, token_file=token_file,
                       rights_token_file=rights_token_file)


def rights_blocked(url: str) -> Blocked:
    """What the guest's network filter closes for the rights URL: its port on *every*
    address, always (the port needs no DNS, and the leader's pod IP serves it as well as
    the Service's), plus the addresses its host resolves to now, to which any fragment is
    dropped. A host that does not resolve only leaves the addresses out, with a warning
    (docs/runner.md, "The guest's network")."""
    host, port = rights_endpoint(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        logger.warning("cannot resolve the rights URL's host {} ({}): the guest's network "
                       "filter still closes port {} on every address, but judges "
                       "fragments to the host's addresses like any others", host, exc, port)
        infos = []
    found: set[IPAddress] = set()
    for _family, _type, _proto, _name, sockaddr in infos:
        with contextlib.suppress(ValueError):
            found.add(ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0]))
    return Blocked(ports=frozenset({port}), addresses=frozenset(found))


def grant_of(status: int, body: bytes) -> RightGrant | None:
    """The grant in an answer: only a 200 whose body is exactly a :class:`RightGrant`."""
    if status != 200 or len(body) > MAX_ANSWER:
        return None
    try:
        return RightGrant.from_dict(json.loads(body))
    except (ValueError, UnicodeDecodeError, RightsContractError):
        return None


def refusal_reason(status: int, body: bytes) -> str | None:
    """The ``reason`` of a refusal answer (any status but 200 whose body is a
    :class:`RightRefusal`); None otherwise."""
    if status == 200 or len(body) > MAX_ANSWER:
        return None
    try:
        return RightRefusal.from_dict(json.loads(body)).reason
    except (ValueError, UnicodeDecodeError, RightsContractError):
        return None


def extended(deadline: float | None, t0: float, grant: RightGrant | None,
             seconds: float) -> float | None:
    """The deadline after an answer to an ask sent at ``t0``: never earlier, and never more
    than ``seconds`` (this runner's D) past ``t0``, whatever the grant says."""
    if grant is None:
        return deadline
    candidate = t0 + min(grant.seconds, seconds)
    return candidate if deadline is None else max(deadline, candidate)


class RightKeeper:
    """The deadline and the renewer's steps (thread-safe; no thread of its own)."""

    def __init__(self, config: RightConfig, clock: Clock, post: Post,
                 jitter: Callable[[float, float], float] | None = None) -> None:
        self.config = config
        self._clock = clock
        self._post = post
        self._jitter = jitter or random.Random().uniform
        """``jitter(low, high)``: the pause before a quick ask (:data:`RETRY_SOON`)."""
        self._retry_soon = False
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._last_grant: float | None = None
        self._failures = 0
        self._condemned = False
        self._first_ask: float | None = None
        self._asks = 0
        self._last_why = ""
        self._guest_started = False
        self.changed = threading.Event()
        """Set on every extension (wakes the watchdog)."""
        self._log = logger.bind(vm=f"{config.namespace}/{config.vm}")

    @property
    def deadline(self) -> float | None:
        with self._lock:
            return self._deadline

    @property
    def last_grant(self) -> float | None:
        """The ``t0`` of the last ask that was granted."""
        with self._lock:
            return self._last_grant

    def granted(self) -> bool:
        """Whether a right was ever granted (QEMU may start)."""
        return self.deadline is not None

    def condemned(self) -> bool:
        """The leader answered :data:`~neonvm.api.rights.CONDEMNED` before any grant: it
        took this pod for dead and will not grant it in its term, so QEMU must never
        start; the runner gives up (exits non-zero) and the VM's restart replaces the
        pod (docs/runner.md, "Self-fencing")."""
        with self._lock:
            return self._condemned

    def guest_started(self) -> None:
        """QEMU has been started (it is called once its process exists, never before):
        every ask sent from now on says so. The runner starts QEMU once in its life, so
        no grant to such an ask can start a guest (docs/protocol.md, "A deposed leader's
        delete still in flight"); an ask already on its way keeps saying not started,
        the safe side."""
        with self._lock:
            self._guest_started = True

    def says_started(self) -> bool:
        """Whether asks now say the guest has started."""
        with self._lock:
            return self._guest_started

    def asking(self) -> tuple[float | None, int, str]:
        """(the ``t0`` of the first ask, None before it; asks sent; why the last one was
        not granted, "" if it was)."""
        with self._lock:
            return self._first_ask, self._asks, self._last_why

    def ask_once(self) -> float:
        """Ask once; returns the ``t0`` it was sent at. Extends the deadline on a grant."""
        t0 = self._clock()
        timeout = request_deadline(self.config.seconds)
        with self._lock:
            if self._first_ask is None:
                self._first_ask = t0
            if self._retry_soon and self._deadline is not None:
                timeout = min(timeout, RETRY_TIMEOUT)
        grant, why, reason, soon = self._ask(timeout)
        with self._lock:
            self._asks += 1
            self._last_why = why
            self._retry_soon = grant is None and soon
            before = self._deadline
            self._deadline = extended(before, t0, grant, self.config.seconds)
            if grant is not None:
                self._last_grant = t0
                self._failures = 0
            else:
                self._failures += 1
                if before is None and reason == CONDEMNED:
                    self._condemned = True
            failures = self._failures
        if grant is not None:
            self.changed.set()
            if before is None:
                self._log.info("right to run granted: {:g}s from each ask, renewed every "
                               "{:g}s", self.config.seconds, renew_interval(self.config.seconds))
        elif failures == 1 or failures % 10 == 0:
            self._log.warning("right to run not renewed ({}; {} asks in a row)", why, failures)
        return t0

    def next_ask(self, t0: float) -> float:
        """When to ask next after an ask sent at ``t0``.

        Once granted: ``t0 + D/3``, or sooner if that would leave no full ask (``D/6``)
        before the deadline, a last chance after two refused asks in a row (it never
        comes sooner than ``D/6`` after ``t0``, so there is at most one per outage); after
        an ask that got no answer or a 5xx, a random :data:`RETRY_SOON` after ``t0``
        (while the deadline lasts). Before the first grant: sooner, backing off from
        :data:`FIRST_RETRY`."""
        interval = renew_interval(self.config.seconds)
        bound = request_deadline(self.config.seconds)
        with self._lock:
            if self._deadline is not None:
                scheduled = min(t0 + interval, max(self._deadline - bound, t0 + bound))
                if self._retry_soon and t0 < self._deadline:
                    return min(scheduled, t0 + self._jitter(*RETRY_SOON))
                return scheduled
            return t0 + min(interval, FIRST_RETRY * (1 << max(0, min(self._failures - 1, 16))))

    def _ask(self, timeout: float) -> tuple[RightGrant | None, str, str | None, bool]:
        """(the grant, why not, the refusal's reason, whether to ask again soon: no
        answer, or a 5xx), the ask bounded by ``timeout`` overall."""
        authorization = self._authorization()
        if isinstance(authorization, tuple):
            return (*authorization, False)
        body = json.dumps(RightRequest(namespace=self.config.namespace, vm=self.config.vm,
                                       pod_uid=self.config.pod_uid).to_dict()).encode()
        headers = {"Content-Type": "application/json", "Authorization": authorization}
        url = self.config.url.rstrip("/") + ask_target(self.says_started())
        end = self._clock() + timeout
        for _ in range(NOT_LEADER_TRIES):
            try:
                status, answer = self._post(url, body, headers, end - self._clock())
            except (OSError, http.client.HTTPException, ValueError) as exc:
                return (None, f"no answer from {self.config.endpoint}: "
                              f"{exc or type(exc).__name__}", None, True)
            if (status != 503 or refusal_reason(status, answer) != NOT_LEADER
                    or self._clock() >= end):
                break
        grant = grant_of(status, answer)
        if grant is None:
            return (None, f"{self.config.endpoint} answered {status} "
                          f"{answer[:200].decode('utf-8', 'replace')!r}",
                    refusal_reason(status, answer), status >= 500)
        return grant, "", None, False


    def _authorization(self) -> str | tuple[None, str, None]:
        """The ``Authorization`` header, read afresh: the projected token as it is, else
        the HMAC of the scaling token; or (None, why not, None)."""
        path = self.config.rights_token_file or self.config.token_file
        assert path is not None  # right_config needs one
        try:
            token = path.read_bytes().strip()
        except OSError as exc:
            return None, f"token file {path}: {exc.strerror or exc}", None
        if not token:
            return None, f"token file {path} is empty", None
        if self.config.rights_token_file is not None:
            try:
                return f"Bearer {token.decode('ascii')}"
            except UnicodeDecodeError:
                return None, f"token file {path} is not ASCII", None
        return authorization_header(token, self.config.pod_uid)


class Watchdog:
    """Kills QEMU once the right's deadline has passed (one step: :meth:`check`)."""

    def __init__(self, keeper: RightKeeper, clock: Clock, kill: Callable[[], None]) -> None:
        self._keeper = keeper
        self._clock = clock
        self._kill = kill
        self._lock = threading.Lock()
        self._armed = False
        self.fired: str | None = None
        """Why QEMU was killed (the log line's text), once it was."""

    def arm(self) -> None:
        """QEMU runs now: from here the deadline is enforced (checked at once)."""
        with self._lock:
            self._armed = True
        self.check()

    def check(self) -> float | None:
        """Kill if armed and past the deadline; returns seconds until the deadline (None:
        fired, or nothing to enforce yet)."""
        deadline = self._keeper.deadline
        now = self._clock()
        with self._lock:
            if not self._armed or self.fired is not None:
                return None
            if deadline is not None and now < deadline:
                return deadline - now
            overdue = now - (now if deadline is None else deadline)
            last = self._keeper.last_grant
            self.fired = (f"self-fenced: no right to run for {overdue:.3f}s (last grant "
                          f"asked {now - (now if last is None else last):.3f}s ago, right "
                          f"{self._keeper.config.seconds:g}s); QEMU killed with SIGKILL")
        logger.bind(vm=f"{self._keeper.config.namespace}/{self._keeper.config.vm}",
                    event="SelfFenced", podUID=self._keeper.config.pod_uid,
                    overdueSeconds=round(overdue, 3),
                    rightSeconds=self._keeper.config.seconds).error("{}", self.fired)
        self._kill()
        return None


def http_post(url: str, body: bytes, headers: Mapping[str, str],
              timeout: float) -> tuple[int, bytes]:
    """POST with an overall deadline: the connection is shut down when it passes."""
    parts = urllib.parse.urlsplit(url)
    host, port = rights_endpoint(url)
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection(host, port, timeout=timeout) if parts.scheme == "https"
        else http.client.HTTPConnection(host, port, timeout=timeout))

    opened: list[socket.socket] = []
    expired = threading.Event()

    def abort() -> None:
        expired.set()
        for sock in opened:  # http.client drops conn.sock once an answer will close
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, abort)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()  # bounded by ``timeout``
        if conn.sock is not None:
            opened.append(conn.sock)
        if expired.is_set():
            raise TimeoutError(f"no answer within {timeout:g}s")
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", target, body=body, headers=dict(headers))
        answer = conn.getresponse()
        data = answer.read(MAX_ANSWER + 1)
        if expired.is_set():
            raise TimeoutError(f"no whole answer within {timeout:g}s")
        return answer.status, data
    finally:
        timer.cancel()
        conn.close()


def boottime() -> float:
    """The runner's deadline clock: monotonic, and unlike ``time.monotonic`` it also
    counts time the machine spent suspended, so a node resumed after a suspend longer
    than its right finds the deadline passed at the watchdog's next look (at most
    :data:`WATCHDOG_MAX_SLEEP` later) instead of letting the guest run for up to D more."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class SelfFence:
    """The real wiring: the renewer and watchdog threads, the kill of one QEMU process."""

    def __init__(self, config: RightConfig, clock: Clock = boottime,
                 post: Post = http_post) -> None:
        self.keeper = RightKeeper(config, clock, post)
        self.watchdog = Watchdog(self.keeper, clock, self._kill)
        self._clock = clock
        self._stop = threading.Event()
        self._pidfd: int | None = None
        self._pid: int | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        config = self.keeper.config
        logger.bind(vm=f"{config.namespace}/{config.vm}").info(
            "self-fencing: asking {} for a right to run of {:g}s every {:g}s; QEMU starts "
            "after the first grant and is killed when the right runs out", config.endpoint,
            config.seconds, renew_interval(config.seconds))
        for target, name in ((self._renew, "right-renewer"), (self._watch, "right-watchdog")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self.keeper.changed.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def condemned(self) -> bool:
        """Refused as condemned before any grant (:meth:`RightKeeper.condemned`)."""
        return self.keeper.condemned()

    def gave_up(self) -> str | None:
        """Why the runner gives up before QEMU started, or None: no right held now,
        :data:`FIRST_GRANT_RIGHTS` D after its first ask (refused, or no answer, all
        along). QEMU has not started (and must not: the supervisor exits instead)."""
        first, asks, why = self.keeper.asking()
        bound = FIRST_GRANT_RIGHTS * self.keeper.config.seconds
        if self._pid is not None or first is None or self.granted():
            return None
        waited = self._clock() - first
        if waited < bound:
            return None
        return (f"no right to run {waited:.0f}s after the first ask ({asks} asks; the "
                f"last: {why or 'granted, since run out'}): QEMU never started; the runner "
                f"gives up after {bound:g}s ({FIRST_GRANT_RIGHTS} D) so that the VM's "
                "restart replaces its pod")

    def granted(self) -> bool:
        """Whether QEMU may start now: a right is held and has not run out."""
        deadline = self.keeper.deadline
        return deadline is not None and self._clock() < deadline

    def arm(self, pid: int) -> None:
        """QEMU was started as ``pid``: hold it by a pidfd (a reused pid is never hit),
        enforce the deadline from now on, and say in every later ask that the guest has
        started (:meth:`RightKeeper.guest_started`). Called once, right after the only
        start of QEMU (the supervisor's)."""
        self.keeper.guest_started()
        self._pid = pid
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(pid)
        self.watchdog.arm()
        self.keeper.changed.set()

    @property
    def fired(self) -> str | None:
        return self.watchdog.fired

    def _kill(self) -> None:
        """SIGKILL through the pidfd; by pid only if there is none or it fails."""
        pidfd, pid = self._pidfd, self._pid
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                return
            except ProcessLookupError:
                return  # QEMU is gone already
            except OSError as exc:
                logger.error("SIGKILL through QEMU's pidfd failed ({}); by pid {}", exc, pid)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _renew(self) -> None:
        while not self._stop.is_set():
            t0 = self._clock()
            try:
                t0 = self.keeper.ask_once()
            except Exception:  # a bug must not end the renewals quietly
                logger.exception("asking for a right to run failed")
            self._stop.wait(max(0.0, self.keeper.next_ask(t0) - self._clock()))

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                # Clear, then check: a change after the clear still wakes the wait.
                self.keeper.changed.clear()
                left = self.watchdog.check()
                if self.watchdog.fired is not None:
                    return
                self.keeper.changed.wait(WATCHDOG_MAX_SLEEP if left is None
                                         else min(left, WATCHDOG_MAX_SLEEP))
        except Exception:
            # A watchdog that cannot watch must not leave the guest running unwatched.
            logger.exception("the self-fencing watchdog failed: killing QEMU")
            self.watchdog.fired = "self-fenced: the watchdog failed; QEMU killed with SIGKILL"
            self._kill()
