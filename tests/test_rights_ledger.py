"""The leader's rights ledger and its endpoint (neonvm/controller/rights.py; the argument:
docs/protocol.md, "Self-fencing").

The ledger's rules over a fake monotonic clock: a pod is condemned only once
max(issued, term_start) + D(1+rho) + epsilon has passed, a condemned pod is never granted
again, and no grant is recorded outside an active term. The endpoint is served on
loopback and asked over real sockets."""

from __future__ import annotations

import http.client
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from neonvm.api.rights import (
    CONDEMNED,
    NOT_LEADER,
    ask_target,
    authorization_header,
)
from neonvm.controller.rights import (
    MAX_BODY,
    RightsLedger,
    RightsServer,
    RightsService,
    TokenCache,
    parse_bind,
)
from tests.support import Clock
from tests.support.rights import ask, caches
from tests.support.rights_ledger import POD_UID, REQUEST, TOKEN, secret

pytestmark = pytest.mark.unit

D, RHO, EPS = 10.0, 0.05, 2.0
BOUND = D * (1 + RHO) + EPS


def ledger_at(clock: Clock, active: bool = True) -> RightsLedger:
    ledger = RightsLedger(clock, rho=RHO, epsilon=EPS)
    ledger.begin_term(lambda: active)
    return ledger


# ---- grant and condemn, in every order --------------------------------------------------


@pytest.mark.parametrize(("steps", "condemned_at"), [
    # (what happens at which offset from term start, when condemn first answers 0)
    ([], BOUND),                                     # never granted: term_start counts
    ([("grant", 5.0)], 5.0 + BOUND),                 # the last grant counts
    ([("grant", 5.0), ("grant", 8.0)], 8.0 + BOUND),
])
def test_a_pod_is_condemned_only_once_its_last_right_is_surely_over(
        steps: list[tuple[str, float]], condemned_at: float) -> None:
    clock = Clock()
    start = clock.now
    ledger = ledger_at(clock)
    for _what, at in steps:
        clock.now = start + at
        assert ledger.grant("p", D) is None
    clock.now = start + condemned_at - 0.001
    assert ledger.condemn("p", D) == pytest.approx(0.001, abs=1e-6)
    assert not ledger.is_condemned("p")
    clock.now = start + condemned_at
    assert ledger.condemn("p", D) == 0.0
    assert ledger.is_condemned("p")


def test_a_condemned_pod_is_never_granted_again_in_its_term() -> None:
    clock = Clock()
    ledger = ledger_at(clock)
    clock.now += BOUND
    assert ledger.condemn("p", D) == 0.0
    assert ledger.grant("p", D) == CONDEMNED
    clock.now += 1000
    assert ledger.grant("p", D) == CONDEMNED
    assert ledger.condemn("p", D) == 0.0


def test_a_condemn_mark_does_not_outlive_its_term() -> None:
    """Process A condemns a fresh pod in term 1, but its DELETE does not land; process B,
    leading in term 2, grants the pod (its guest starts). When A leads again (term 3),
    the old mark must not condemn the pod at once: B's grant keeps its guest alive until
    B's grant + D(1+rho) + epsilon, and A's term 3 is counted from its own start."""
    clock = Clock()
    a = RightsLedger(clock, rho=RHO, epsilon=EPS)  # one ledger per process, for life
    b = RightsLedger(clock, rho=RHO, epsilon=EPS)
    a.begin_term(lambda: True)
    clock.now += BOUND
    assert a.condemn("p", D) == 0.0
    a.end_term()
    clock.now += 5
    b.begin_term(lambda: True)
    clock.now += 1
    assert b.grant("p", D) is None
    granted_at = clock.now
    b.end_term()
    clock.now += 1
    term3 = a.begin_term(lambda: True)
    clock.now += 2
    assert not a.is_condemned("p")
    assert a.remaining("p", D) > 0
    assert a.condemn("p", D) == pytest.approx(term3 + BOUND - clock.now)
    assert a.grant("p", D) is None  # and A may grant it again in term 3
    clock.now = max(granted_at, term3) + BOUND - 0.001
    assert a.condemn("p", D) > 0


def test_a_pod_that_keeps_renewing_is_never_condemned() -> None:
    """A crashed kubelet's runner still renews: its node looks unreachable, but the
    test fails every time, and a failed test marks nothing."""
    clock = Clock()
    ledger = ledger_at(clock)
    for _ in range(20):
        clock.now += D / 3
        assert ledger.grant("p", D) is None
        assert ledger.condemn("p", D) > 0
    assert not ledger.is_condemned("p")


def test_earlier_leaders_grants_count_through_term_start() -> None:
    """A new term (here: of this process) starts the count afresh from its start, even
    for a pod this process never granted."""
    clock = Clock()
    ledger = ledger_at(clock)
    clock.now += 100
    ledger.begin_term(lambda: True)
    clock.now += BOUND - 1
    assert ledger.condemn("p", D) == pytest.approx(1.0)
    clock.now += 1
    assert ledger.condemn("p", D) == 0.0


def test_a_larger_right_granted_earlier_counts_over_a_smaller_annotation() -> None:
    clock = Clock()
    ledger = ledger_at(clock)
    assert ledger.grant("p", 2 * D) is None
    clock.now += BOUND
    assert ledger.condemn("p", D) > 0  # 2D was granted: the bound is 2D(1+rho)+eps
    clock.now += D * (1 + RHO)
    assert ledger.condemn("p", D) == 0.0


def test_no_grant_outside_an_active_term_and_no_condemn_before_one() -> None:
    clock = Clock()
    idle = RightsLedger(clock, rho=RHO, epsilon=EPS)
    assert idle.grant("p", D) == NOT_LEADER
    assert idle.condemn("p", D) == math.inf
    standby = ledger_at(clock, active=False)
    assert standby.grant("p", D) == NOT_LEADER
    ended = ledger_at(clock)
    ended.end_term()
    assert ended.grant("p", D) == NOT_LEADER


def test_pruning_forgets_only_grants_that_no_longer_move_a_deadline() -> None:
    clock = Clock()
    ledger = ledger_at(clock)
    assert ledger.grant("old", D) is None
    clock.now += 500
    assert ledger.grant("new", D) is None  # prunes "old": long over
    assert ledger.condemn("old", D) == 0.0
    assert ledger.condemn("new", D) == pytest.approx(BOUND)


# ---- the endpoint over loopback ----------------------------------------------------------


@pytest.fixture
def served() -> Any:
    clock = Clock()
    ledger = RightsLedger(clock, rho=RHO, epsilon=EPS)
    state: dict[str, Any] = {"caches": caches(), "secret": secret()}
    state["secret_reads"] = 0

    def read(_namespace: str, _name: str) -> dict[str, Any] | None:
        state["secret_reads"] += 1
        doc: dict[str, Any] | None = state["secret"]
        return doc

    tokens = TokenCache(None, read=read)
    state["marks"] = []
    state["pod_gone"] = False

    state["mark"] = None
    """A test's own mark (its answer), in place of the one below."""

    def mark(namespace: str, name: str, uid: str) -> bool:
        if state["mark"] is not None:
            return bool(state["mark"](namespace, name, uid))
        state["marks"].append((namespace, name, uid))
        return not state["pod_gone"]

    state["registry"] = CollectorRegistry()
    service = RightsService(ledger, lambda: state["caches"], tokens, mark,
                            registry=state["registry"])
    with RightsServer(service, "127.0.0.1", 0) as server:
        yield server.port, ledger, clock, state


def test_the_leader_grants_the_current_pod_its_annotated_right(served: Any) -> None:
    port, ledger, clock, _ = served
    ledger.begin_term(lambda: True)
    assert ask(port, REQUEST, authorization_header(TOKEN, POD_UID)) == (200, {"seconds": 10.0})
    clock.now += BOUND - 1
    assert ledger.condemn(POD_UID, 10.0) > 0  # counted from the grant, not term start


def test_answers_are_counted_by_code_and_reason(served: Any) -> None:
    port, ledger, _, state = served
    ledger.begin_term(lambda: True)
    ask(port, REQUEST, authorization_header(TOKEN, POD_UID))
    ask(port, REQUEST, authorization_header(b"other", POD_UID))
    ask(port, REQUEST, authorization_header(TOKEN, POD_UID))
    registry = state["registry"]
    name = "neonvm_controller_rights_answers_total"
    assert registry.get_sample_value(name, {"code": "200", "reason": ""}) == 2
    assert registry.get_sample_value(name, {"code": "401", "reason": "Unauthorized"}) == 1


@pytest.mark.parametrize("term", ["none", "ended", "no-longer-active"])
def test_a_standby_answers_not_leader_and_records_nothing(served: Any, term: str) -> None:
    """Nor does it read the VM's token or write its pod: leadership is looked at first
    (the check inside the grant is the one safety needs; this one saves the work)."""
    port, ledger, clock, state = served
    if term == "ended":
        ledger.begin_term(lambda: True)
        ledger.end_term()
    elif term == "no-longer-active":  # its Lease lost, the term not yet ended
        ledger.begin_term(lambda: False)
    status, doc = ask(port, REQUEST, authorization_header(TOKEN, POD_UID))
    assert (status, doc["reason"]) == (503, NOT_LEADER)
    assert state["secret_reads"] == 0 and state["marks"] == []
    ledger.begin_term(lambda: True)
    clock.now += BOUND
    assert ledger.condemn(POD_UID, 10.0) == 0.0  # nothing was issued


@pytest.mark.parametrize(("change", "status", "reason"), [
    ("wrong_bearer", 401, "Unauthorized"),
    ("scale_bearer", 401, "Unauthorized"),
    ("planted_secret", 401, "Unauthorized"),
    ("other_pod", 403, "NotCurrentPod"),
    ("not_annotated", 403, "NotCurrentPod"),
    ("condemned", 403, CONDEMNED),
    ("moved_on", 403, "NotCurrentPod"),
    ("bad_body", 400, "BadRequest"),
])
def test_the_leader_refuses_what_it_must(served: Any, change: str, status: int,
                                         reason: str) -> None:
    from neonvm.api.scale_protocol import pod_token

    port, ledger, clock, state = served
    ledger.begin_term(lambda: True)
    request, auth = dict(REQUEST), authorization_header(TOKEN, POD_UID)
    raw = None
    if change == "wrong_bearer":
        auth = authorization_header(b"other", POD_UID)
    elif change == "scale_bearer":
        auth = f"Bearer {pod_token(TOKEN, POD_UID)}"
    elif change == "planted_secret":
        state["secret"] = secret(uid="planted")
    elif change == "other_pod":
        request["podUID"] = "pod-uid-2"
        auth = authorization_header(TOKEN, "pod-uid-2")
    elif change == "not_annotated":
        state["caches"] = caches(annotated=False)
    elif change == "moved_on":
        state["caches"] = caches(moved_on=True)
    elif change == "condemned":
        clock.now += BOUND
        assert ledger.condemn(POD_UID, 10.0) == 0.0
    elif change == "bad_body":
        raw = b"{not json"
    got_status, doc = ask(port, request, auth, raw=raw)
    assert (got_status, doc["reason"]) == (status, reason)


def test_a_body_over_the_cap_is_refused_without_being_read(served: Any) -> None:
    port, ledger, _, _ = served
    ledger.begin_term(lambda: True)
    status, doc = ask(port, None, raw=b"x" * (MAX_BODY + 1))
    assert (status, doc["reason"]) == (413, "BadRequest")


def test_the_bind_address_parses() -> None:
    assert parse_bind("0.0.0.0:8082") == ("0.0.0.0", 8082)
    assert parse_bind("[::]:8082") == ("::", 8082)
    assert parse_bind(":9") == ("0.0.0.0", 9)
    with pytest.raises(ValueError):
        parse_bind("nope")


def test_an_old_pod_shutting_down_keeps_its_right_while_it_goes(served: Any) -> None:
    """Its guest may be shutting down gracefully: a lapsing right would kill it."""
    port, ledger, _, state = served
    ledger.begin_term(lambda: True)
    state["caches"] = caches(moved_on=True, terminating=True)
    assert ask(port, REQUEST, authorization_header(TOKEN, POD_UID)) == (200, {"seconds": 10.0})


def test_a_terms_first_grant_to_a_pod_writes_the_pod_first(served: Any) -> None:
    """So that an earlier term's DELETE in flight and this grant cannot both land."""
    port, ledger, clock, state = served
    ledger.begin_term(lambda: True)
    auth = authorization_header(TOKEN, POD_UID)
    assert ask(port, REQUEST, auth)[0] == 200
    assert ask(port, REQUEST, auth)[0] == 200
    assert state["marks"] == [("ns", "vm-p", POD_UID)]  # once per term
    clock.now += 1
    ledger.begin_term(lambda: True)
    state["pod_gone"] = True
    status, doc = ask(port, REQUEST, auth)
    assert (status, doc["reason"]) == (403, "NotCurrentPod")
    assert len(state["marks"]) == 2
    clock.now += BOUND
    assert ledger.condemn(POD_UID, 10.0) == 0.0, "the refused ask recorded nothing"


# ---- a term's write to the pod: only for a runner that has not started its guest --------


def ask_saying(port: int, started: bool | None) -> tuple[int, dict[str, Any]]:
    """One ask of the pod's runner over a real socket, its target saying the guest has
    started (True), not (False: the same target as a runner of the previous release,
    None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", ask_target(bool(started)), body=json.dumps(REQUEST),
                 headers={"Content-Type": "application/json",
                          "Authorization": authorization_header(TOKEN, POD_UID)})
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    conn.close()
    return answer.status, doc


def test_a_runner_whose_guest_has_started_is_granted_without_a_write_to_its_pod(
        served: Any) -> None:
    """Its only QEMU started before it asked, so no grant to it can start a guest; a
    leader change then writes no pod of a running fleet (docs/protocol.md, "A term's
    first grants")."""
    port, ledger, _, state = served
    ledger.begin_term(lambda: True)
    assert ask_saying(port, True) == (200, {"seconds": 10.0})
    assert ask_saying(port, True) == (200, {"seconds": 10.0})
    assert state["marks"] == []
    assert ledger.granted_this_term(POD_UID)


def test_a_grant_without_a_write_is_not_the_terms_write(served: Any) -> None:
    """Whoever holds the pod's credential and says started (a lie, or a runner that did
    start) gets no write; the runner that has not started still gets its write first."""
    port, ledger, _, state = served
    ledger.begin_term(lambda: True)
    assert ask_saying(port, True)[0] == 200
    assert ask_saying(port, False)[0] == 200
    assert ask_saying(port, False)[0] == 200
    assert state["marks"] == [("ns", "vm-p", POD_UID)]  # once, for the not-started ask


def test_each_term_writes_the_pod_again_before_granting_a_runner_not_started(
        served: Any) -> None:
    port, ledger, clock, state = served
    for term in (1, 2):
        ledger.begin_term(lambda: True)
        assert ask_saying(port, None)[0] == 200
        assert ask_saying(port, True)[0] == 200
        assert len(state["marks"]) == term
        clock.now += 1


def test_a_write_made_in_one_term_is_not_the_mark_of_the_next(served: Any) -> None:
    """An ask whose write lands in term 1 and whose grant would be recorded in term 2 of
    the same process is refused 503 (the runner asks again at once): term 1 may have
    condemned the pod after that write and sent a DELETE whose resourceVersion the write
    does not change, so term 2's grant needs a write of its own."""
    port, ledger, clock, state = served
    ledger.begin_term(lambda: True)

    def mark_then_new_term(namespace: str, name: str, uid: str) -> bool:
        state["marks"].append((namespace, name, uid))
        clock.now += 1
        ledger.begin_term(lambda: True)  # term 1 ended while the write was under way
        return True

    state["mark"] = mark_then_new_term
    status, doc = ask_saying(port, False)
    assert (status, doc["reason"]) == (503, NOT_LEADER)
    assert not ledger.granted_this_term(POD_UID)
    state["mark"] = None
    assert ask_saying(port, False)[0] == 200
    assert len(state["marks"]) == 2  # term 2 wrote the pod itself


def test_the_leader_waits_on_the_api_server_for_32_asks_at_once(served: Any) -> None:
    """A term's first asks each wait on the API server (here its write to the pod, held
    until 32 are under way at once): 32 are answered side by side, not 8 at a time, so a
    leader change grants a fleet as fast as the API server answers (docs/protocol.md, "A
    term's first grants are the tighter limit")."""
    port, ledger, _, state = served
    ledger.begin_term(lambda: True)
    together = threading.Barrier(32, timeout=20)

    def held(namespace: str, name: str, uid: str) -> bool:
        together.wait()  # BrokenBarrierError (a 500) unless 32 asks write at once
        return True

    state["mark"] = held
    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda _: ask_saying(port, False)[0], range(32)))
    assert answers == [200] * 32
