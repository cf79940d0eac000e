"""Self-fencing, the runner's side (neonvm/runner/right.py; docs/runner.md, "Self-fencing").

* The renewer (fake clock, fake HTTP): the deadline moves only on a 200 with a valid
  grant, counted from the clock read *before* the ask was sent, never backwards, never
  past this runner's own D; it asks every D/3, sooner before the first grant.
* The watchdog (fake clock): kills exactly once, only once armed (QEMU runs) and the
  deadline has passed.
* The real wiring: the kill holds the QEMU process by a pidfd; an ask has an overall
  deadline against a server that drips its answer.
* A real runner under real QEMU against the shipped rights endpoint (its listener,
  service, ledger and token cache: tests/support/rights.py): no QEMU before the first
  grant; when grants stop, QEMU is SIGKILLed and the runner exits non-zero.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from neonvm.api.rights import (
    CONDEMNED,
    GUEST_STARTED_QUERY,
    NOT_LEADER,
    RIGHTS_PATH,
    RightGrant,
    RightRequest,
    bearer_matches,
    right_bearer,
)
from neonvm.dev.cluster import free_port
from neonvm.runner.errors import SpecError
from neonvm.runner.right import (
    FIRST_GRANT_RIGHTS,
    RETRY_SOON,
    RETRY_TIMEOUT,
    RightConfig,
    RightKeeper,
    SelfFence,
    Watchdog,
    extended,
    grant_of,
    http_post,
    right_config,
    rights_blocked,
)
from neonvm.runner.state import ExitCode
from tests.guest.build import GuestImage
from tests.support import Clock, wait_for
from tests.support.rights import ShippedLeader
from tests.support.runner_right import NAMESPACE, TOKEN, UID, VM, qemu_of, tiny_guest_spec

REPO = Path(__file__).resolve().parent.parent
D = 30.0


# ---- fakes -----------------------------------------------------------------------------------


Answer = tuple[int, bytes] | Exception


@dataclass
class FakeLeader:
    """Answers asks from a script; each answer takes ``latency`` seconds of the clock.

    For the renewer's rule over a fake clock, answers the shipped server never gives
    included (garbage, proxies' pages); a real runner asks the shipped one (at the end)."""

    clock: Clock
    answers: list[Answer] = field(default_factory=list)
    latency: float = 0.0
    asks: list[tuple[str, dict[str, Any], dict[str, str], float]] = field(default_factory=list)

    def __call__(self, url: str, body: bytes, headers: Mapping[str, str],
                 timeout: float) -> tuple[int, bytes]:
        self.asks.append((url, json.loads(body), dict(headers), timeout))
        self.clock.now += self.latency
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def grant(seconds: float = D) -> tuple[int, bytes]:
    return 200, json.dumps({"seconds": seconds}).encode()


NOT_LEADER_ANSWER = (503, json.dumps({"reason": NOT_LEADER}).encode())
OK, NO = grant(), (401, b'{"reason": "Unauthorized"}')
"""NO: a failed ask (a 503 NotLeader is retried at once within the ask: see its tests)."""


def config(tmp_path: Path, seconds: float = D) -> RightConfig:
    token_file = tmp_path / "token"
    if not token_file.exists():
        token_file.write_bytes(TOKEN + b"\n")
    return RightConfig(url="http://rights.example:8080", seconds=seconds, namespace="ns",
                       vm="vm", pod_uid=UID, token_file=token_file)


def keeper(tmp_path: Path, answers: Sequence[Answer], latency: float = 0.0,
           seconds: float = D) -> tuple[RightKeeper, FakeLeader, Clock]:
    clock = Clock()
    leader = FakeLeader(clock, list(answers), latency)
    return RightKeeper(config(tmp_path, seconds), clock, leader), leader, clock


# ---- what counts as a grant (pure) -----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("status", "body", "seconds"), [
    (200, b'{"seconds": 30}', 30.0),
    (200, b'{"seconds": 7.5}', 7.5),
    (503, json.dumps({"reason": NOT_LEADER}).encode(), None),
    (503, b'{"seconds": 30}', None),          # a grant's body under another status
    (403, b'{"reason": "Condemned"}', None),
    (200, b"", None),
    (200, b"<html>proxy error</html>", None),
    (200, b'{"seconds": 0}', None),
    (200, b'{"seconds": -30}', None),
    (200, b'{"seconds": "30"}', None),
    (200, b'{"seconds": 1e400}', None),       # inf
    (200, b'{"seconds": 30, "more": 1}', None),
    (200, b'[30]', None),
    (200, b'\xff\xfe', None),
    (200, b'{"seconds": 30}' + b" " * (64 * 1024), None),  # over the answer cap
])
def test_only_a_200_with_a_valid_grant_counts(status: int, body: bytes,
                                              seconds: float | None) -> None:
    got = grant_of(status, body)
    assert (None if got is None else got.seconds) == seconds


@pytest.mark.unit
@pytest.mark.parametrize(("deadline", "t0", "granted", "expected"), [
    (None, 100.0, None, None),            # no grant yet, none now
    (None, 100.0, 30.0, 130.0),           # first grant: from the send time
    (130.0, 110.0, 30.0, 140.0),          # renewed
    (130.0, 110.0, None, 130.0),          # refused: unchanged
    (140.0, 105.0, 30.0, 140.0),          # an older ask answered late never shortens it
    (130.0, 110.0, 5.0, 130.0),           # a shorter grant never shortens it
    (None, 100.0, 3600.0, 130.0),         # never more than this runner's D past t0
])
def test_the_deadline_only_moves_forward_from_the_send_time(
        deadline: float | None, t0: float, granted: float | None,
        expected: float | None) -> None:
    answer = None if granted is None else RightGrant(granted)
    assert extended(deadline, t0, answer, D) == expected


# ---- the renewer over a fake clock -------------------------------------------------------------


@pytest.mark.unit
def test_an_ask_carries_the_request_the_bearer_and_a_sixth_of_d(tmp_path: Path) -> None:
    right, leader, _clock = keeper(tmp_path, [grant()])
    right.ask_once()
    url, body, headers, timeout = leader.asks[0]
    assert url == "http://rights.example:8080" + RIGHTS_PATH
    assert RightRequest.from_dict(body) == RightRequest(namespace="ns", vm="vm", pod_uid=UID)
    assert headers["Authorization"] == f"Bearer {right_bearer(TOKEN, UID)}"
    assert bearer_matches(headers["Authorization"], TOKEN, UID)
    assert timeout == D / 6


@pytest.mark.unit
def test_the_deadline_counts_from_before_the_ask_was_sent(tmp_path: Path) -> None:
    right, _leader, clock = keeper(tmp_path, [grant()], latency=4.0)
    t0 = clock.now
    assert right.ask_once() == t0
    assert clock.now == t0 + 4.0  # the answer came 4 s later
    assert right.deadline == t0 + D


@pytest.mark.unit
@pytest.mark.parametrize("refusal", [
    (503, json.dumps({"reason": NOT_LEADER}).encode()),
    (500, b"oops"),
    (200, b"garbage"),
    (200, b'{"seconds": 0}'),
    ConnectionRefusedError(111, "Connection refused"),
    TimeoutError("timed out"),
    http.client.RemoteDisconnected("closed"),
], ids=["503-NotLeader", "500", "200-garbage", "200-zero", "refused", "timeout",
        "disconnected"])
def test_a_refusal_or_no_answer_does_not_extend_the_deadline(tmp_path: Path,
                                                             refusal: Answer) -> None:
    right, _leader, clock = keeper(tmp_path, [grant(), refusal, refusal, refusal])
    first = clock.now
    right.ask_once()
    assert right.deadline == first + D
    clock.now += 10
    right.ask_once()
    assert right.deadline == first + D


@pytest.mark.unit
def test_before_any_grant_nothing_may_start(tmp_path: Path) -> None:
    right, _leader, _clock = keeper(tmp_path, [NOT_LEADER_ANSWER] * 3)
    right.ask_once()
    assert not right.granted() and right.deadline is None


@pytest.mark.unit
def test_a_not_leader_answer_is_asked_again_at_once_within_the_asks_deadline(
        tmp_path: Path) -> None:
    """The Service may point at a deposed leader for a moment: a 503 NotLeader is sent
    again at once (three sends at most), each with what is left of the ask's D/6, and
    the deadline still counts from before the first send."""
    right, leader, clock = keeper(tmp_path, [NOT_LEADER_ANSWER, NOT_LEADER_ANSWER, OK],
                                  latency=1.0)
    first = clock.now
    right.ask_once()
    assert right.deadline == first + D and not leader.answers
    assert [ask[3] for ask in leader.asks] == [D / 6, D / 6 - 1, D / 6 - 2]
    # Three NotLeader answers end the ask (a failure); so does the ask's deadline.
    right, leader, _ = keeper(tmp_path, [NOT_LEADER_ANSWER] * 3 + [OK])
    right.ask_once()
    assert not right.granted() and leader.answers == [OK]
    right, leader, _ = keeper(tmp_path, [NOT_LEADER_ANSWER, OK], latency=D / 6)
    right.ask_once()
    assert not right.granted() and leader.answers == [OK]
    # Other refusals are not retried within the ask.
    right, leader, _ = keeper(tmp_path, [NO, OK])
    right.ask_once()
    assert not right.granted() and leader.answers == [OK]


CONDEMNED_ANSWER = (403, json.dumps({"reason": CONDEMNED, "message": "dead"}).encode())


@pytest.mark.unit
def test_a_condemned_refusal_before_any_grant_means_give_up(tmp_path: Path) -> None:
    """The leader took the pod for dead and never grants it in its term: the runner must
    not start QEMU, and must not wait for ever either (its supervisor exits non-zero)."""
    right, _leader, _clock = keeper(tmp_path, [NO, CONDEMNED_ANSWER])
    right.ask_once()
    assert not right.condemned()
    right.ask_once()
    assert right.condemned() and not right.granted()


@pytest.mark.unit
@pytest.mark.parametrize("answer", [NO, NOT_LEADER_ANSWER, ConnectionRefusedError("refused")],
                         ids=["refused", "not-leader", "no-answer"])
def test_a_runner_never_granted_gives_up_some_rights_after_its_first_ask(
        tmp_path: Path, answer: Answer) -> None:
    """Its credential refused for good (a leader of a release that knows another one), or
    no leader answering: QEMU must not start, and the runner must not wait for ever either
    (its supervisor exits non-zero, the pod fails, the VM's restart replaces it)."""
    clock = Clock()
    fence = SelfFence(config(tmp_path), clock, FakeLeader(clock, [answer] * 1000))
    while fence.gave_up() is None:
        clock.now = fence.keeper.next_ask(fence.keeper.ask_once())
        assert not fence.granted()
    waited = clock.now - 1000.0
    assert FIRST_GRANT_RIGHTS * D <= waited <= FIRST_GRANT_RIGHTS * D + D / 3
    reason = fence.gave_up()
    assert reason is not None and reason.startswith("no right to run")


@pytest.mark.unit
def test_a_runner_granted_before_that_bound_never_gives_up_while_its_right_lasts(
        tmp_path: Path) -> None:
    clock = Clock()
    leader = FakeLeader(clock, [NO] * 1000)
    fence = SelfFence(config(tmp_path), clock, leader)
    while clock.now < 1000.0 + FIRST_GRANT_RIGHTS * D - 1:
        clock.now = fence.keeper.next_ask(fence.keeper.ask_once())
    leader.answers[:] = [grant()]
    clock.now = 1000.0 + FIRST_GRANT_RIGHTS * D - 0.5
    fence.keeper.ask_once()
    clock.now += D - 1
    assert fence.granted() and fence.gave_up() is None


@pytest.mark.unit
def test_a_condemned_refusal_after_a_grant_changes_nothing_but_the_renewal(
        tmp_path: Path) -> None:
    # A running guest is killed by its watchdog when the right it holds runs out.
    right, _leader, clock = keeper(tmp_path, [grant(), CONDEMNED_ANSWER])
    right.ask_once()
    clock.now += 10
    right.ask_once()
    assert not right.condemned() and right.deadline == 1000.0 + D


@pytest.mark.unit
@pytest.mark.parametrize("token", [None, b"", b"\n"], ids=["missing", "empty", "blank"])
def test_without_a_token_nothing_is_asked_and_nothing_extends(tmp_path: Path,
                                                              token: bytes | None) -> None:
    right, leader, clock = keeper(tmp_path, [grant(), grant()])
    right.ask_once()
    first = right.deadline
    token_file = right.config.token_file
    assert token_file is not None
    if token is None:
        token_file.unlink()
    else:
        token_file.write_bytes(token)
    clock.now += 10
    right.ask_once()
    assert len(leader.asks) == 1 and right.deadline == first


@pytest.mark.unit
def test_asks_every_third_of_d_once_granted_and_back_off_from_half_a_second_before(
        tmp_path: Path) -> None:
    right, _leader, clock = keeper(tmp_path, [(503, b"{}")] * 8 + [grant()])
    waits = []
    for _ in range(9):
        t0 = right.ask_once()
        waits.append(right.next_ask(t0) - t0)
        clock.now = right.next_ask(t0)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]


@pytest.mark.unit
def test_after_two_failed_asks_one_last_chance_comes_a_sixth_of_d_before_the_deadline(
        tmp_path: Path) -> None:
    right, leader, clock = keeper(tmp_path, [grant(), NO, NO, NO])
    sent = []
    for _ in range(4):
        sent.append(clock.now - 1000.0)
        clock.now = right.next_ask(right.ask_once())
    # asks at 0 (granted: deadline 30), 10 and 20 refused, the last chance at 25 refused
    assert sent == [0.0, 10.0, 20.0, 25.0]
    assert right.deadline == 1000.0 + D and not leader.answers
    assert clock.now - 1000.0 == D  # the next ask would be sent at the deadline: too late


def leader_dead_between(clock: Clock, died: float, back: float,
                        hang: bool) -> Callable[..., tuple[int, bytes]]:
    """A leader that grants, dies silently at ``died`` (its connections refused, or, with
    ``hang``, never answered: each ask takes its whole timeout), and whose successor
    grants from ``back`` on; records each ask's (send time, timeout)."""
    asks: list[tuple[float, float]] = []

    def post(_url: str, _body: bytes, _headers: Mapping[str, str],
             timeout: float) -> tuple[int, bytes]:
        asks.append((clock.now, timeout))
        if not died <= clock.now < back:
            return grant()
        if hang:
            clock.now += timeout
            raise TimeoutError("no answer")
        raise ConnectionRefusedError("refused")

    post.asks = asks  # type: ignore[attr-defined]
    return post


@pytest.mark.unit
@pytest.mark.parametrize("hang", [False, True], ids=["refused", "no-answer"])
def test_a_new_leader_granting_up_to_two_thirds_of_d_less_2s_after_a_silent_death_keeps_the_guest(
        tmp_path: Path, hang: bool) -> None:
    """The worst case: the leader dies just before the runner's scheduled ask, D/3 after
    its last grant, so D - D/3 = 20 s of right are left. After that failed ask the runner
    asks again every 0.5-1 s, each within 2 s, so a successor granting from 18 s after the
    death (2D/3 - RETRY_TIMEOUT) is still reached in time; the old schedule (asks at
    D/3, 2D/3 and a last chance at 5D/6) needed it by 15 s. Back to one ask per D/3 after."""
    clock = Clock()
    died = 1000.0 + D / 3
    post = leader_dead_between(clock, died, died + 2 * D / 3 - RETRY_TIMEOUT, hang)
    right = RightKeeper(config(tmp_path), clock, post, jitter=lambda _low, high: high)
    sent = [right.ask_once()]  # granted: deadline 1000 + D
    while right.deadline == 1000.0 + D and clock.now < right.deadline:
        clock.now = max(clock.now, right.next_ask(sent[-1]))
        sent.append(right.ask_once())
    assert right.deadline is not None and right.deadline > 1000.0 + D, post.asks  # type: ignore[attr-defined]
    assert sent[-1] < 1000.0 + D
    retries = post.asks[2:]  # type: ignore[attr-defined]
    assert retries and all(timeout <= RETRY_TIMEOUT for _, timeout in retries)
    assert right.next_ask(sent[-1]) == sent[-1] + D / 3


@pytest.mark.unit
def test_quick_asks_follow_only_an_ask_with_no_answer_or_a_5xx(tmp_path: Path) -> None:
    """A 4xx refusal keeps the schedule (the last-chance test above); without a grant yet,
    the first-ask backoff applies."""
    right, _leader, clock = keeper(tmp_path, [
        grant(), (503, b"{}"), (500, b"oops"), OSError("reset"), NO])
    t0 = right.ask_once()
    assert right.next_ask(t0) == t0 + D / 3
    for _ in range(3):
        clock.now += 3
        t0 = right.ask_once()
        assert RETRY_SOON[0] <= right.next_ask(t0) - t0 <= RETRY_SOON[1]
    clock.now += 3
    t0 = right.ask_once()
    assert right.next_ask(t0) - t0 == D / 3


# ---- the watchdog over a fake clock --------------------------------------------------------


@dataclass
class Timeline:
    """One run of renewer and watchdog over a fake clock: ``answers`` of the asks sent
    every D/3 from t=0, the watchdog checked every ``step`` seconds."""

    answers: list[Answer]
    killed_at: float | None = None
    kills: int = 0

    def run(self, tmp_path: Path, until: float, step: float = 0.5) -> Timeline:
        right, leader, clock = keeper(tmp_path, list(self.answers))
        start = clock.now

        def kill() -> None:
            self.kills += 1
            if self.killed_at is None:
                self.killed_at = clock.now - start

        dog = Watchdog(right, clock, kill)
        next_ask = clock.now
        while clock.now - start <= until:
            dog.check()  # at a tie the watchdog wins: an ask sent at the deadline is late
            if clock.now >= next_ask:
                next_ask = right.next_ask(right.ask_once()) if leader.answers else math.inf
            if right.granted():
                dog.arm()  # QEMU starts on the first grant
            clock.now += step
        return self


@pytest.mark.unit
@pytest.mark.parametrize(("answers", "killed_at"), [
    ([OK] * 12, None),                       # renewed every 10 s: lives
    ([OK, NO, OK] + [OK] * 9, None),         # one refusal in between: lives
    ([OK, NO, NO, OK] + [OK] * 9, None),     # two in a row: the last-chance ask at 25 s
    ([OK, NO, NO, NO, OK] + [OK] * 9, 30.0),  # three: dead at the first grant + D
    ([OK, OK, NO, NO, NO, NO], 40.0),        # dead D after the last granted ask's send
    # No answer: asked again within a second (RETRY_SOON), so the fourth ask is granted.
    ([OK, ConnectionRefusedError(), TimeoutError(), TimeoutError(), OK] + [OK] * 9, None),
    ([OK] + [TimeoutError()] * 60, 30.0),    # no answer for good: dead at the grant + D
    ([OK, (200, b"garbage"), (200, b'{"seconds": 0}'), NO, OK], 30.0),
])
def test_the_watchdog_kills_once_exactly_when_the_right_runs_out(
        tmp_path: Path, answers: list[Answer], killed_at: float | None) -> None:
    line = Timeline(answers).run(tmp_path, until=100.0)
    assert line.killed_at == killed_at
    assert line.kills == (0 if killed_at is None else 1)


@pytest.mark.unit
def test_the_watchdog_does_nothing_before_it_is_armed(tmp_path: Path) -> None:
    right, _leader, clock = keeper(tmp_path, [grant()])
    right.ask_once()
    kills: list[float] = []
    dog = Watchdog(right, clock, lambda: kills.append(clock.now))
    clock.now += 2 * D
    assert dog.check() is None and kills == []
    dog.arm()  # QEMU started after its right ran out: killed at once
    assert len(kills) == 1 and dog.fired is not None and dog.fired.startswith("self-fenced")


@pytest.mark.unit
def test_the_watchdog_says_how_long_until_the_deadline(tmp_path: Path) -> None:
    right, _leader, clock = keeper(tmp_path, [grant()])
    right.ask_once()
    dog = Watchdog(right, clock, lambda: None)
    dog.arm()
    clock.now += D - 0.25
    assert dog.check() == pytest.approx(0.25)
    clock.now += 0.25
    assert dog.check() is None and dog.fired is not None


# ---- flags ------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"url": "ftp://x"}, "expected http"),
    ({"url": "http://"}, "expected http"),
    ({"pod_uid": None}, "needs --pod-uid"),
    ({"token_file": None}, "needs --scaling-token-file"),
    ({"seconds": 0.0}, "positive"),
    ({"namespace": ""}, "namespace"),
])
def test_self_fencing_flags_name_what_is_missing(tmp_path: Path, kwargs: dict[str, Any],
                                                 message: str) -> None:
    args: dict[str, Any] = {"url": "http://leader:8080", "seconds": D, "namespace": "ns",
                            "vm": "vm", "pod_uid": UID, "token_file": tmp_path / "t"}
    args.update(kwargs)
    with pytest.raises(SpecError, match=message):
        right_config(**args)


@pytest.mark.unit
def test_the_guest_filter_closes_the_rights_urls_port_everywhere_and_its_resolved_address(
        ) -> None:
    """The port needs no DNS: a host that does not resolve at the runner's start (a
    cluster DNS blip) still has its port closed, for the pod's life (docs/runner.md,
    "The guest's network"); tests/test_guestnet_rights.py has the frames."""
    import ipaddress

    from neonvm.runner.guestnet import Blocked
    assert rights_blocked("http://127.0.0.1:8443") == Blocked(
        ports=frozenset({8443}), addresses=frozenset({ipaddress.ip_address("127.0.0.1")}))
    assert rights_blocked("http://192.0.2.7") == Blocked(
        ports=frozenset({80}), addresses=frozenset({ipaddress.ip_address("192.0.2.7")}))
    assert rights_blocked("http://no-such-host.invalid:8082") == Blocked(
        ports=frozenset({8082}), addresses=frozenset())


# ---- the real kill and the real ask ----------------------------------------------------------


def test_the_kill_is_a_sigkill_to_the_armed_process(tmp_path: Path) -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    clock = Clock()
    fence = SelfFence(config(tmp_path, seconds=5.0), clock=clock,
                      post=FakeLeader(clock, [grant(5.0)]))
    try:
        fence.keeper.ask_once()
        fence.arm(victim.pid)
        assert victim.poll() is None  # within its right
        clock.now += 5.0
        fence.watchdog.check()
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert fence.fired is not None
    finally:
        fence.stop()
        if victim.poll() is None:
            victim.kill()
            victim.wait()


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for QEMU."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_asks_say_the_guest_started_only_once_qemu_was_started(
        tmp_path: Path, victim: subprocess.Popen[bytes]) -> None:
    """In the target's query, never in the body (docs/runner.md, "Self-fencing"): asks
    before the first grant, and after it until QEMU runs, say nothing; every ask after
    QEMU was started says so."""
    clock = Clock()
    leader = FakeLeader(clock, [NO, OK, OK, NOT_LEADER_ANSWER, OK, OK])
    fence = SelfFence(config(tmp_path), clock=clock, post=leader)
    try:
        fence.keeper.ask_once()  # refused: waiting for its first grant
        fence.keeper.ask_once()  # granted
        fence.keeper.ask_once()  # granted; QEMU not started yet
        fence.arm(victim.pid)  # QEMU started
        fence.keeper.ask_once()  # NotLeader, sent again at once: both say it
        fence.keeper.ask_once()
        assert victim.poll() is None
    finally:
        fence.stop()
    targets = [urllib.parse.urlsplit(url) for url, _body, _headers, _timeout in leader.asks]
    assert {(t.scheme, t.netloc, t.path) for t in targets} == {
        ("http", "rights.example:8080", RIGHTS_PATH)}
    assert [t.query for t in targets] == ["", "", "", GUEST_STARTED_QUERY,
                                          GUEST_STARTED_QUERY, GUEST_STARTED_QUERY]
    for _url, body, _headers, _timeout in leader.asks:
        assert body == {"namespace": "ns", "vm": "vm", "podUID": UID}


def test_without_a_usable_pidfd_the_kill_goes_by_pid(
        tmp_path: Path, victim: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    fence = SelfFence(config(tmp_path), clock=clock, post=FakeLeader(clock, [grant()]))
    fence.keeper.ask_once()
    fence.arm(victim.pid)
    assert fence._pidfd is not None
    os.close(fence._pidfd)  # the pidfd is unusable (EBADF)
    try:
        clock.now += D
        fence.watchdog.check()
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        fence._pidfd = None
        fence.stop()


def test_a_watchdog_that_fails_kills_qemu_rather_than_leave_it_unwatched(
        tmp_path: Path, victim: subprocess.Popen[bytes]) -> None:
    clock = Clock()
    fence = SelfFence(config(tmp_path), clock=clock,
                      post=FakeLeader(clock, [grant()] * 100))
    fence.keeper.ask_once()
    fence.arm(victim.pid)

    def broken() -> float | None:
        raise RuntimeError("a bug in the watchdog")

    fence.watchdog.check = broken  # type: ignore[method-assign]
    fence.start()
    try:
        assert victim.wait(timeout=30) == -signal.SIGKILL
    finally:
        fence.stop()


class _Drip(BaseHTTPRequestHandler):
    """Answers a grant one byte at a time, slowly: each read is quick, the whole is not.

    A stub, not the shipped server: this is behaviour the leader's endpoint must never
    have (what the runner must survive is a man in the middle or a wedged proxy)."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        body = b'{"seconds": 30}' + b" " * 600
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for byte in body:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.05)

    def log_message(self, *_: Any) -> None:
        pass


def test_an_ask_has_an_overall_deadline_not_one_per_read() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises((OSError, http.client.HTTPException)):
            # the whole answer takes 30 s; each byte comes within 0.05 s
            http_post(f"http://127.0.0.1:{server.server_port}{RIGHTS_PATH}", b"{}", {}, 1.0)
    finally:
        server.shutdown()
        server.server_close()


# ---- a real runner under real QEMU -----------------------------------------------------------


@pytest.fixture
def leader() -> Iterator[Callable[..., ShippedLeader]]:
    """The shipped rights endpoint (tests/support/rights.py) for the runner's VM and pod."""
    made: list[ShippedLeader] = []

    def make(seconds: float, host: str = "127.0.0.1") -> ShippedLeader:
        made.append(ShippedLeader(seconds, token=TOKEN, pod_uid=UID, namespace=NAMESPACE,
                                  vm=VM, host=host))
        return made[-1]

    yield make
    for server in made:
        server.close()


@dataclass
class FencedRunner:
    """A real runner under test, self-fencing against the shipped rights endpoint."""

    proc: subprocess.Popen[bytes]
    leader: ShippedLeader
    work_dir: Path
    log_path: Path
    termination_log: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def qemu(self) -> list[int]:
        return qemu_of(self.work_dir)


@pytest.fixture
def fenced_runner(tmp_path: Path, test_guest: GuestImage,
                  leader: Callable[..., ShippedLeader]) -> Iterator[Callable[[float],
                                                                             FencedRunner]]:
    """Start a runner with ``--rights-url`` (the tiny guest; the right of ``seconds``)
    against a standby :func:`leader` of its own."""
    started: list[FencedRunner] = []

    def start(seconds: float, token: bytes = TOKEN) -> FencedRunner:
        rights = leader(seconds)
        token_file = tmp_path / "token"
        token_file.write_bytes(token + b"\n")
        spec_file = tmp_path / "spec.json"
        spec_file.write_text(json.dumps(tiny_guest_spec(test_guest)))
        termination_log = tmp_path / "termination-log"
        termination_log.write_text("")
        work_dir = tmp_path / "work"
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
        env.update({"NEONVM_VM_NAME": VM, "NEONVM_VM_NAMESPACE": NAMESPACE})
        args = [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
                "--port", str(free_port()), "--listen-address", "127.0.0.1",
                "--work-dir", str(work_dir), "--disks-dir", str(tmp_path / "disks"),
                "--termination-log", str(termination_log),
                "--scaling-token-file", str(token_file), "--pod-uid", UID,
                "--rights-url", rights.url, "--right-seconds", str(seconds)]
        log_path = tmp_path / "runner.log"
        with (tmp_path / "console.log").open("wb") as out, log_path.open("wb") as err:
            proc = subprocess.Popen(args, env=env, stdout=out, stderr=err, cwd=REPO)
        started.append(FencedRunner(proc, rights, work_dir, log_path, termination_log))
        return started[-1]

    yield start
    for runner in started:
        for pid in [runner.proc.pid, *runner.qemu()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if runner.proc.poll() is None:
            runner.proc.kill()
            runner.proc.wait(timeout=30)
        for pid in runner.qemu():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_runner_starts_qemu_only_with_a_right_and_kills_it_when_the_right_runs_out(
        fenced_runner: Callable[[float], FencedRunner]) -> None:
    runner = fenced_runner(3.0)  # asks every 1 s, each within 0.5 s
    leader, proc = runner.leader, runner.proc

    # (a) no term yet: the runner asks, again and again, and starts no QEMU.
    wait_for(lambda: leader.answered(503, NOT_LEADER) >= 4 or proc.poll() is not None,
             timeout=60, what="four asks answered NotLeader")
    assert proc.poll() is None, runner.log()
    assert runner.qemu() == []
    assert "waiting for the first right to run" in runner.log()

    # A term begins: the first grant starts QEMU; renewals keep it.
    leader.lead()
    started = wait_for(runner.qemu, timeout=60, what="QEMU to start")
    wait_for(lambda: "ready marker seen" in runner.log() or proc.poll() is not None,
             timeout=240, interval=0.2, what="the guest to boot")
    assert proc.poll() is None, runner.log()
    grants_while_running = leader.answered(200)
    wait_for(lambda: leader.answered(200) >= grants_while_running + 3, timeout=60,
             what="three renewals")
    assert proc.poll() is None and runner.qemu() == started
    assert leader.marks == [(NAMESPACE, f"{VM}-p", UID)]  # the term's first grant wrote it

    # A leader change: the runner's asks now say its guest has started, so the next
    # term grants it without writing the pod (docs/protocol.md, "A term's first grants").
    leader.depose()
    leader.lead()
    grants_before = leader.answered(200)
    wait_for(lambda: leader.answered(200) > grants_before or proc.poll() is not None,
             timeout=60, what="a grant in the new term")
    assert proc.poll() is None and runner.qemu() == started, runner.log()
    assert leader.marks == [(NAMESPACE, f"{VM}-p", UID)]

    # (b) the term ends and no other begins: the watchdog SIGKILLs QEMU, the runner
    # exits non-zero.
    leader.depose()
    code = proc.wait(timeout=120)
    log = runner.log()
    assert code == ExitCode.QEMU_FAILED, log
    assert "self-fenced: no right to run" in log
    assert "SelfFenced" in log  # the structured line's event field
    assert "QEMU exited with code -9" in log
    assert "ACPI power-down requested" not in log  # killed, never asked
    assert runner.termination_log.read_text().startswith("self-fenced: no right to run")
    assert runner.qemu() == []
    assert log.count("QEMU started") == 1  # and never restarted
    # Every ask was well formed and its bearer right: only grants and NotLeader.
    assert leader.answered() == leader.answered(200) + leader.answered(503, NOT_LEADER)


def test_a_runner_refused_before_its_first_grant_exits_without_ever_starting_qemu(
        fenced_runner: Callable[..., FencedRunner]) -> None:
    """The leader refuses its credential for good (401), as a leader of a release that
    knows another credential does: the runner gives up 4 D after its first ask (here
    2 s) with one clear line, and exits 1, so its pod fails and the VM's restart
    replaces it, instead of a VM shown Running with no guest for ever."""
    runner = fenced_runner(0.5, token=b"not-the-vms-token")
    runner.leader.lead()
    code = runner.proc.wait(timeout=90)
    log = runner.log()
    assert code == ExitCode.RUNNER_ERROR, log
    assert "no right to run" in log and "QEMU never started" in log
    assert "QEMU started" not in log and runner.qemu() == []
    assert runner.termination_log.read_text().startswith("no right to run")
    assert runner.leader.answered(401) >= 2 and runner.leader.answered(200) == 0


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of a live process, in clock ticks (None once it is gone or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[11]) + int(fields[12])


def test_a_runner_frozen_past_its_deadline_kills_qemu_on_the_thaw(
        fenced_runner: Callable[[float], FencedRunner]) -> None:
    """The node frozen and thawed (docs/runner.md, "Self-fencing", not covered): the
    watchdog cannot act while frozen, so this shows only that it acts on the thaw, and
    prints how long, and how much CPU, QEMU had after it (a measurement, not a bound)."""
    seconds = 3.0
    runner = fenced_runner(seconds)
    runner.leader.lead()
    wait_for(lambda: "ready marker seen" in runner.log() or runner.proc.poll() is not None,
             timeout=240, interval=0.2, what="the guest to boot")
    [qemu] = runner.qemu()

    # Freeze the runner, then QEMU (a node stopped process by process), past the deadline.
    os.kill(runner.proc.pid, signal.SIGSTOP)
    os.kill(qemu, signal.SIGSTOP)
    frozen_at = time.monotonic()
    runner.leader.depose()  # and nobody grants meanwhile
    wait_for(lambda: time.monotonic() > frozen_at + 2 * seconds, timeout=60,
             what="the right to run out while frozen")
    before = cpu_ticks(qemu)
    assert before is not None

    # Thaw QEMU first, the worst order: its vCPUs may run before the watchdog does.
    os.kill(qemu, signal.SIGCONT)
    thawed = time.monotonic()
    os.kill(runner.proc.pid, signal.SIGCONT)
    last = before
    while (ticks := cpu_ticks(qemu)) is not None:
        last = ticks
        time.sleep(0.0005)  # poll, but leave the two cores to QEMU and the runner
    ran = time.monotonic() - thawed
    code = runner.proc.wait(timeout=60)
    log = runner.log()
    assert code == ExitCode.QEMU_FAILED, log
    assert "self-fenced: no right to run" in log and "QEMU exited with code -9" in log
    assert runner.qemu() == []
    print(f"\nfreeze-thaw: QEMU lived {ran * 1000:.1f} ms after its SIGCONT and used "
          f"{(last - before) * 1000 // os.sysconf('SC_CLK_TCK')} ms of CPU")


def test_a_runner_stopped_before_its_first_grant_never_starts_qemu(
        fenced_runner: Callable[[float], FencedRunner]) -> None:
    runner = fenced_runner(3.0)
    wait_for(lambda: runner.leader.answered(503, NOT_LEADER) >= 2
             or runner.proc.poll() is not None, timeout=60, what="two asks answered NotLeader")
    runner.proc.send_signal(signal.SIGTERM)
    assert runner.proc.wait(timeout=60) == ExitCode.GUEST_POWERED_OFF, runner.log()
    assert "QEMU started" not in runner.log()
    assert runner.termination_log.read_text().startswith("stopped before QEMU started")


def test_a_runner_condemned_before_its_first_grant_exits_without_starting_qemu(
        fenced_runner: Callable[[float], FencedRunner]) -> None:
    runner = fenced_runner(3.0)
    wait_for(lambda: runner.leader.answered(503, NOT_LEADER) >= 2
             or runner.proc.poll() is not None, timeout=60, what="two asks answered NotLeader")
    assert runner.proc.poll() is None, runner.log()
    runner.leader.condemn()
    assert runner.proc.wait(timeout=60) == ExitCode.RUNNER_ERROR, runner.log()
    assert "QEMU started" not in runner.log()
    assert runner.termination_log.read_text().startswith("condemned by the leader")
    assert runner.qemu() == []
    assert runner.leader.answered(403, CONDEMNED) >= 1 and runner.leader.answered(200) == 0


@pytest.mark.parametrize(("drop", "path", "message"), [
    ("--pod-uid", None, "--rights-url needs --pod-uid"),
    ("--scaling-token-file", None, "--rights-url needs --scaling-token-file"),
    (None, "/nonexistent", "--rights-url needs setpriv"),
])
def test_a_self_fencing_runner_that_cannot_fence_refuses_to_start(
        tmp_path: Path, test_guest: GuestImage,
        drop: str | None, path: str | None,
        message: str) -> None:
    from neonvm.runner.host import optional_binary

    qemu = optional_binary("qemu-system-x86_64")
    assert qemu is not None
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN)
    spec = {"guest": {"kernelImage": str(test_guest.kernel),
                      "initrdImage": str(test_guest.initrd), "rootDisk": {"image": ""}}}
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    flags = {"--pod-uid": UID, "--scaling-token-file": str(token_file)}
    args = [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
            "--qemu", qemu, "--accel", "tcg", "--port", str(free_port()),
            "--listen-address", "127.0.0.1", "--work-dir", str(tmp_path / "work"),
            "--rights-url", "http://127.0.0.1:9",
            "--termination-log", str(tmp_path / "termination-log"),
            *[x for k, v in flags.items() if k != drop for x in (k, v)]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    env["NEONVM_VM_NAMESPACE"] = "tests"
    if path is not None:
        env["PATH"] = path
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO, check=False)
    assert done.returncode == ExitCode.RUNNER_ERROR, done.stderr
    assert f"error: {message}" in done.stderr
    assert "QEMU started" not in done.stderr
