"""Table tests of the elector's branches over an in-memory Lease store and a fake clock.

Pure and fast, in the style of client-go's ``leaderelection_test.go``: each case sets up
what the store holds and what the candidate has observed, takes one step of the elector
(acquire, renew, release, the campaign's wait) and checks the outcome and what the store
holds afterwards. The same branches run against the real API server in
``tests/test_election.py``; this file covers the ones a real server cannot be made to
produce on demand (a write racing between our read and our CAS, a renewal failing until
the deadline, remote clocks far off).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from neonvm.leader.election import (
    EXPIRY_TIMER_SLACK,
    JITTER_FACTOR,
    STEP_DOWN_ANNOTATION,
    ElectionConfig,
    EndReason,
    LeaderElector,
    LeaseNamespaceMissing,
    LeaseRecord,
    StepDownRequest,
    _Term,
)
from tests.support.election import FakeClock, FakeLeaseStore, held_by

pytestmark = pytest.mark.unit

LEASE, RENEW, RETRY = 4.0, 2.5, 0.5


def make(store: FakeLeaseStore, clock: FakeClock, identity: str = "me_1",
         **config: Any) -> LeaderElector:
    settings: dict[str, Any] = {"lease_duration": LEASE, "renew_deadline": RENEW,
                                "retry_period": RETRY, "identity": identity,
                                "namespace": "ns", "name": "l", **config}
    return LeaderElector(store, ElectionConfig(**settings), lambda _: None, lambda: None,
                         clock=clock, watch=False)


@pytest.fixture
def store() -> FakeLeaseStore:
    return FakeLeaseStore()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# ---- acquire ----------------------------------------------------------------------------


def test_acquire_creates_a_missing_lease_at_epoch_zero(store: FakeLeaseStore,
                                                       clock: FakeClock) -> None:
    term = make(store, clock)._try_acquire()
    assert term is not None and term.record.transitions == 0
    assert store.spec["holderIdentity"] == "me_1"
    assert store.spec["leaseDurationSeconds"] == 4
    assert term.renewed_at == clock.now


@pytest.mark.parametrize(("case", "spec", "annotations", "wait", "acquired"), [
    ("released: taken at once", {**held_by(""), "leaseDurationSeconds": 1}, None, 0, True),
    ("our own identity from an abandoned term", held_by("me_1"), None, 0, True),
    ("other holder, just seen", held_by("other_1"), None, 0, False),
    ("other holder, seen 3.99 s ago", held_by("other_1"), None, 3.99, False),
    ("other holder, unchanged for the lease duration", held_by("other_1"), None, 4.0, True),
    ("other holder advertising 15 s, unchanged for 4 s", held_by("other_1", duration=15),
     None, 4.0, False),
    ("other holder advertising 15 s, unchanged for 15 s", held_by("other_1", duration=15),
     None, 15.0, True),
    ("expired, with a stale step-down request: request dropped", held_by("other_1"),
     {STEP_DOWN_ANNOTATION: StepDownRequest("other_1", 3).to_annotation()}, 4.0, True),
])
def test_acquire_table(store: FakeLeaseStore, clock: FakeClock, case: str,
                       spec: dict[str, Any], annotations: dict[str, str] | None,
                       wait: float, acquired: bool) -> None:
    store.put(spec, annotations)
    elector = make(store, clock)
    first = elector._try_acquire()
    if wait:
        assert first is None, case
        clock.advance(wait)
        term = elector._try_acquire()
    else:
        term = first
    if acquired:
        assert term is not None, case
        assert term.record.transitions == 4, case  # one more than the replaced 3
        assert store.spec["holderIdentity"] == "me_1"
        assert STEP_DOWN_ANNOTATION not in store.annotations
    else:
        assert term is None, case
        assert store.spec["holderIdentity"] == spec["holderIdentity"], case


def test_observing_a_renewal_restarts_the_expiry_clock(store: FakeLeaseStore,
                                                       clock: FakeClock) -> None:
    store.put(held_by("other_1"))
    elector = make(store, clock)
    assert elector._try_acquire() is None
    clock.advance(3.0)
    store.put(held_by("other_1"))  # the holder renews: a new resourceVersion
    assert elector._try_acquire() is None
    clock.advance(3.0)  # 6 s since first seen, 3 s since the renewal was seen
    assert elector._try_acquire() is None
    assert store.spec["holderIdentity"] == "other_1"
    clock.advance(1.0)
    assert elector._try_acquire() is not None


def _ask(store: FakeLeaseStore, holder: str, epoch: int, at: str) -> None:
    """What a standby's (or the CLI's) step-down request writes: the annotation only."""
    store.put(store.spec, {STEP_DOWN_ANNOTATION: StepDownRequest(holder, epoch, at)
                           .to_annotation()})


def test_step_down_requests_do_not_postpone_the_expiry_of_a_holder_that_stopped_renewing(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    """A request is no renewal: standbys asking a dead holder again and again (each a
    new resourceVersion) must not keep its Lease from expiring."""
    store.put(held_by("dead_1"))  # its last renewal; then it died without releasing
    elector = make(store, clock)
    assert elector._try_acquire() is None
    for at in (1.5, 3.0):
        clock.advance(1.5)
        _ask(store, "dead_1", 3, str(at))
        assert elector._try_acquire() is None
    clock.advance(LEASE - 3.0)
    _ask(store, "dead_1", 3, "4.0")  # one more, just before the attempt
    term = elector._try_acquire()
    assert term is not None and term.record.transitions == 4
    assert STEP_DOWN_ANNOTATION not in store.annotations


def test_a_renewal_after_a_step_down_request_still_restarts_the_expiry_clock(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    store.put(held_by("other_1", renewed=datetime.now(UTC) - timedelta(seconds=1)))
    elector = make(store, clock)
    assert elector._try_acquire() is None
    clock.advance(1.0)
    _ask(store, "other_1", 3, "1.0")
    assert elector._try_acquire() is None
    clock.advance(1.0)
    store.put(held_by("other_1"), store.annotations)  # it renews: a new renewTime
    assert elector._try_acquire() is None
    clock.advance(LEASE - 0.01)  # 6 s after first seen, not yet a lease after the renewal
    assert elector._try_acquire() is None
    clock.advance(0.01)
    assert elector._try_acquire() is not None


def test_a_lease_recreated_with_the_same_spec_restarts_the_expiry_clock(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    spec = held_by("other_1")
    store._store({"metadata": {"name": "l", "uid": "u1"}, "spec": dict(spec)})
    elector = make(store, clock)
    assert elector._try_acquire() is None
    clock.advance(3.0)
    store._store({"metadata": {"name": "l", "uid": "u2"}, "spec": dict(spec)})
    assert elector._try_acquire() is None
    clock.advance(3.0)
    assert elector._try_acquire() is None
    clock.advance(1.0)
    assert elector._try_acquire() is not None


@pytest.mark.parametrize("renew_time_offset", [
    timedelta(hours=-1),   # the holder's wall clock is an hour behind (or it is long dead)
    timedelta(hours=1),    # an hour ahead
    timedelta(0),
])
def test_remote_clock_skew_neither_shortens_nor_extends_the_wait(
        store: FakeLeaseStore, clock: FakeClock, renew_time_offset: timedelta) -> None:
    store.put(held_by("other_1", renewed=datetime.now(UTC) + renew_time_offset))
    elector = make(store, clock)
    assert elector._try_acquire() is None
    clock.advance(LEASE - 0.01)
    assert elector._try_acquire() is None
    clock.advance(0.01)
    assert elector._try_acquire() is not None


def test_a_write_racing_between_read_and_cas_wins_and_we_do_not(store: FakeLeaseStore,
                                                                clock: FakeClock) -> None:
    store.put({**held_by(""), "leaseDurationSeconds": 1})
    elector = make(store, clock)

    def rival() -> None:
        store.before_write = None
        store.put(held_by("rival_1", transitions=4))

    store.before_write = rival
    assert elector._try_acquire() is None
    assert store.spec["holderIdentity"] == "rival_1"
    assert store.spec["leaseTransitions"] == 4
    # What we read first (released) was superseded: the rival's fresh version now runs
    # a full lease duration on our clock.
    assert elector._try_acquire() is None
    clock.advance(LEASE)
    term = elector._try_acquire()
    assert term is not None and term.record.transitions == 5


def test_a_create_racing_with_another_create_loses(store: FakeLeaseStore,
                                                   clock: FakeClock) -> None:
    def rival() -> None:
        store.before_write = None
        store.put(held_by("rival_1", transitions=0))

    store.before_write = rival
    assert make(store, clock)._try_acquire() is None
    assert store.spec["holderIdentity"] == "rival_1"


@pytest.mark.parametrize("error", [TimeoutError("read timed out"), ConnectionError("refused")])
def test_a_failed_read_or_write_is_not_an_acquisition(store: FakeLeaseStore, clock: FakeClock,
                                                      error: Exception) -> None:
    store.fail = [error]
    elector = make(store, clock)
    assert elector._try_acquire() is None  # the read failed
    store.calls.clear()

    def fail_the_write() -> None:
        store.before_write = None
        raise error

    store.before_write = fail_the_write
    assert elector._try_acquire() is None  # the create failed
    assert store.calls == ["get", "create"]
    assert store.obj is None


def test_a_missing_namespace_raises_at_start_and_is_retried_quietly_later(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    store.namespace_exists = False
    elector = make(store, clock)
    with pytest.raises(LeaseNamespaceMissing):
        elector._try_acquire()
    store.namespace_exists = True
    assert elector._try_acquire() is not None
    store.obj = None
    store.namespace_exists = False
    assert elector._try_acquire() is None


# ---- renew ------------------------------------------------------------------------------


def acquired(store: FakeLeaseStore, clock: FakeClock, **config: Any
             ) -> tuple[LeaderElector, _Term]:
    elector = make(store, clock, **config)
    term = elector._try_acquire()
    assert term is not None
    return elector, term


def test_renew_cas_on_our_last_version_moves_the_deadline_to_its_send_time(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    elector, term = acquired(store, clock)
    clock.advance(RETRY)
    before = term.record.resource_version
    assert elector._renew(term, threading.Event()) is None
    assert term.record.resource_version != before
    assert term.renewed_at == clock.now
    assert store.spec["leaseTransitions"] == term.record.transitions


@pytest.mark.parametrize(("case", "interloper", "expected"), [
    ("another holder took it", lambda s: s.put(held_by("other_1", transitions=9)),
     EndReason.DEPOSED),
    ("the Lease was deleted", lambda s: setattr(s, "obj", None), EndReason.DEPOSED),
    ("a newer term of our own identity", lambda s: s.put(held_by("me_1", transitions=9)),
     EndReason.DEPOSED),
    ("step-down naming our term",
     lambda s: s.put(s.spec, {STEP_DOWN_ANNOTATION: StepDownRequest("me_1", 0).to_annotation()}),
     EndReason.STEP_DOWN),
    ("step-down naming an older term of ours: renewed",
     lambda s: s.put(s.spec, {STEP_DOWN_ANNOTATION: StepDownRequest("me_1", 7).to_annotation()}),
     None),
    ("someone added a label: renewed", lambda s: s.put(s.spec, {"x": "y"}), None),
])
def test_renew_conflict_table(store: FakeLeaseStore, clock: FakeClock, case: str,
                              interloper: Callable[[FakeLeaseStore], Any],
                              expected: EndReason | None) -> None:
    elector, term = acquired(store, clock)
    interloper(store)
    clock.advance(RETRY)
    assert elector._renew(term, threading.Event()) is expected, case
    if expected is None:
        assert store.spec["holderIdentity"] == "me_1"
        assert term.record.resource_version == str(store.version), case


def test_renewals_failing_end_the_term_at_the_deadline_from_the_last_send(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    elector, term = acquired(store, clock)
    clock.advance(1.0)
    sent = clock.now
    assert elector._renew(term, threading.Event()) is None
    # From now on every call fails, and each failure takes 0.9 s of (fake) time; between
    # failures the elector waits (really) up to one retry period.
    store.fail = [TimeoutError("timed out")] * 100
    store.on_fail = lambda: clock.advance(0.9)
    reason = elector._renew(term, threading.Event())
    assert reason is EndReason.DEADLINE
    assert clock.now >= sent + RENEW
    # The leader gave up before a follower that saw the renewal at ``sent`` may take over.
    assert sent + RENEW < sent + LEASE


def test_release_empties_the_holder_and_a_follower_takes_it_at_once(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    leader, term = acquired(store, clock)
    follower = make(store, clock, identity="other_1")
    assert follower._try_acquire() is None
    store.put(store.spec, {STEP_DOWN_ANNOTATION: StepDownRequest("me_1", 0).to_annotation()})
    assert leader._renew(term, threading.Event()) is EndReason.STEP_DOWN
    leader._release(term)
    assert store.spec["holderIdentity"] == ""
    assert store.spec["leaseDurationSeconds"] == 1
    assert STEP_DOWN_ANNOTATION not in store.annotations
    taken = follower._try_acquire()  # no clock advance: a released Lease is free now
    assert taken is not None and taken.record.transitions == 1


def test_release_after_someone_else_wrote_does_not_overwrite_them(
        store: FakeLeaseStore, clock: FakeClock) -> None:
    leader, term = acquired(store, clock)
    store.put(held_by("other_1", transitions=5))
    leader._release(term)
    assert store.spec["holderIdentity"] == "other_1"


# ---- the campaign's wait: timer at expiry, and the watch --------------------------------


@pytest.mark.parametrize(("lease", "renew", "retry", "seen_ago"), [
    (4.0, 2.5, 0.5, 3.8),     # the new defaults, 0.2 s before expiry
    (15.0, 10.0, 2.0, 14.0),  # the old defaults, 1 s before expiry
    (15.0, 10.0, 2.0, 0.0),   # far from expiry: one retry period
    (15.0, 10.0, 2.0, 20.0),  # already expired (the read was slow): one retry period
])
def test_the_follower_wakes_at_the_observed_expiry_never_before(
        store: FakeLeaseStore, clock: FakeClock, lease: float, renew: float, retry: float,
        seen_ago: float) -> None:
    store.put(held_by("other_1", duration=int(lease)))
    elector = make(store, clock, lease_duration=lease, renew_deadline=renew,
                   retry_period=retry)
    assert elector._try_acquire() is None
    clock.advance(seen_ago)
    left = lease - seen_ago
    for _ in range(50):
        wait = elector._campaign_wait()
        if 0 < left < retry:
            assert left <= wait <= left + EXPIRY_TIMER_SLACK + 1e-9
        else:
            assert retry <= wait <= retry * JITTER_FACTOR


def test_a_watch_event_wakes_a_waiting_follower(store: FakeLeaseStore,
                                                clock: FakeClock) -> None:
    """The fake clock never moves, so without the watch the wait would never end."""
    store.put(held_by("other_1"))
    config: dict[str, Any] = {"lease_duration": 60.0, "renew_deadline": 30.0, "retry_period": 20.0,
              "identity": "me_1", "namespace": "ns", "name": "l"}
    elector = LeaderElector(store, ElectionConfig(**config), lambda _: None, lambda: None,
                            clock=clock, watch=True)
    stop = threading.Event()
    runner = threading.Thread(target=elector.run, args=(stop,), daemon=True)
    runner.start()
    try:
        woke = threading.Event()
        # Wait (generously) until the follower has read the Lease once and is waiting.
        for _ in range(600):
            if store.calls.count("get") >= 1 and elector._observed.record is not None:
                break
            woke.wait(0.1)
        store.put({**held_by(""), "leaseDurationSeconds": 1})  # released by its holder
        for _ in range(600):
            if store.spec["holderIdentity"] == "me_1":
                break
            woke.wait(0.1)
        assert store.spec["holderIdentity"] == "me_1"
    finally:
        stop.set()
        runner.join(timeout=60)


class CountingStop(threading.Event):
    """A stop event that counts the waits on it and sets itself after ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.waits = 0
        self.limit = limit

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits >= self.limit:
            self.set()
        return self.is_set()


def test_a_watch_the_server_ends_at_once_is_not_reopened_in_a_tight_loop(
        clock: FakeClock) -> None:
    opened: list[float] = []

    class EndsAtOnce(FakeLeaseStore):
        def watch(self, timeout: float) -> Iterator[LeaseRecord | None]:
            opened.append(clock.now)
            return iter(())

    elector = make(EndsAtOnce(), clock)
    stop = CountingStop(limit=3)
    runner = threading.Thread(target=elector._watch_loop, args=(stop,), daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), f"reopened {len(opened)} times without waiting"
    assert len(opened) == 3 and stop.waits == 3  # one wait between reopenings
