"""The election and a leader term's start and stop, at their edges.

Table tests over the in-memory Lease store and fake clock of ``tests/support/election.py``
where a real server cannot force the timing (a slow epoch claim, a term that takes longer
to stop than the renew deadline, a 404 on renewal), next to checks on the real API server
where it can (a deleted Lease, the elector's own HTTP client).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.controller import manager as manager_module
from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import ControllerConfig, ControllerProcess, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.rights import RightsLedger
from neonvm.controller.wiring import Wiring
from neonvm.controller.workqueue import Backoff
from neonvm.leader.election import (
    ElectionConfig,
    EndReason,
    LeaderElector,
    Leadership,
    LeaseRecord,
    LeaseStore,
    _Term,
)
from neonvm.leader.etcd import Etcd, EtcdConfig
from neonvm.leader.lease_store import KubernetesLeaseStore, LeaseConflict, LeaseNotFound
from neonvm.leader.lock import Installation, LockTable
from tests.support import wait_for
from tests.support.election import FakeClock, FakeLeaseStore

# ---- an exception after the reconcile does not kill the worker ------------------------


class _RaisingOnce:
    """A handler whose turn of ``bad`` raises the first time (a bug after the reconcile)."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        self.seen: list[str] = []
        self._raised = False
        self._mutex = threading.Lock()

    def process(self, key: str, direct: bool) -> SimpleNamespace:
        with self._mutex:
            self.seen.append(key)
            if key == self.bad and not self._raised:
                self._raised = True
                raise RuntimeError("bug in outcome_of_result")
        return SimpleNamespace(kind="done")  # what the worker reads of an outcome


@pytest.mark.unit
def test_an_exception_after_the_reconcile_is_counted_requeued_and_the_worker_lives_on(
) -> None:
    process = SimpleNamespace(
        config=ControllerConfig(workers=1, backoff=Backoff(base=0.01, cap=0.1)),
        metrics=ControllerMetrics(), api=client.ApiClient(), wiring=Wiring(),
        events=EventRecorder(None), etcd=None, etcd_config=SimpleNamespace(prefix="/t"),
        old_crd_warned=threading.Event(), rights=RightsLedger(), fencing=None,
            rights_endpoint=None, rights_reviewer=None)
    leadership = Leadership(epoch=1, identity="me", valid_until=time.monotonic() + 3600)
    term = LeaderTerm(process, leadership)  # type: ignore[arg-type]
    handler = _RaisingOnce("ns/bad")
    term.handler = handler  # type: ignore[assignment]
    worker = threading.Thread(target=term._worker, daemon=True)
    worker.start()
    try:
        term.queue.add("ns/bad")
        wait_for(lambda: "ns/bad" in handler.seen, 10, what="the first turn")
        term.queue.add("ns/good")
        wait_for(lambda: "ns/good" in handler.seen, 10,
                 what="the worker to take the next key after a turn raised")
        wait_for(lambda: handler.seen.count("ns/bad") >= 2, 10,
                 what="the key whose turn raised to be retried")
        assert worker.is_alive()
        assert term.queue.failures("ns/bad") >= 1, "requeued with backoff"
        errors = process.metrics.registry.get_sample_value(
            "neonvm_controller_worker_errors_total")
        assert errors == 1
    finally:
        term.stopping.set()
        term.queue.shut_down()
        worker.join(5)


# ---- a Lease deleted under its holder ends the term at once ---------------------------


@pytest.mark.cluster
def test_a_lease_deleted_under_its_holder_deposes_it_at_once_and_is_recreated(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    store = KubernetesLeaseStore(controller_api, namespace, "f5")
    config = ElectionConfig(namespace=namespace, name="f5", identity="me_f5",
                            lease_duration=4.0, renew_deadline=2.5, retry_period=0.5)
    elector = LeaderElector(store, config, lambda _: None, lambda: None, watch=False)
    term = elector._try_acquire()
    assert term is not None
    assert elector._renew(term, threading.Event()) is None
    client.CoordinationV1Api(api).delete_namespaced_lease("f5", namespace)  # someone else
    # The API server answers a replace of the deleted object (whose body carries the old
    # uid) with 409 (uid precondition), not 404: a conflict either way.
    with pytest.raises(LeaseConflict):
        store.update(term.record, {"renewTime": None}, 10)
    # Not "transient, retry until the renew deadline": deposed after one re-read.
    calls: list[str] = []
    elector._lease = _CountingStore(store, calls)
    assert elector._renew(term, threading.Event()) is EndReason.DEPOSED
    assert calls in (["renew"], ["renew", "get"]), calls
    elector._lease = store
    again = elector._try_acquire()
    assert again is not None, "the next campaign re-creates the Lease"
    assert store.get(10) is not None


class _CountingStore:
    def __init__(self, inner: LeaseStore, calls: list[str]) -> None:
        self._inner = inner
        self.calls = calls

    def get(self, timeout: float) -> LeaseRecord | None:
        self.calls.append("get")
        return self._inner.get(timeout)

    def create(self, spec: dict[str, Any], timeout: float) -> LeaseRecord:
        self.calls.append("create")
        return self._inner.create(spec, timeout)

    def update(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> LeaseRecord:
        self.calls.append("update")
        return self._inner.update(base, spec, timeout, drop_step_down=drop_step_down)

    def renew(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> LeaseRecord:
        self.calls.append("renew")
        return self._inner.renew(base, spec, timeout, drop_step_down=drop_step_down)

    def watch(self, timeout: float) -> Iterator[LeaseRecord | None]:
        return self._inner.watch(timeout)


@pytest.mark.unit
def test_a_404_on_update_is_lease_not_found_and_deposes_without_retrying(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 on replace or on the renewal's patch (a server that checks existence before
    the uid precondition) maps to LeaseNotFound, and a holder renewing gets DEPOSED at
    once, not retries until its renew deadline."""
    store = KubernetesLeaseStore(client.ApiClient(), "ns", "l")
    body = ('{"kind":"Status","reason":"NotFound","details":{"name":"l",'
            '"group":"coordination.k8s.io","kind":"leases"},"code":404}')

    def gone(*args: Any, **kwargs: Any) -> LeaseRecord:
        exc = ApiException(status=404, reason="Not Found")
        exc.body = body  # names the Lease, not a namespace
        raise exc

    monkeypatch.setattr(store._leases, "replace", gone)
    monkeypatch.setattr(store._leases, "patch_if_held", gone)
    base = LeaseRecord.from_object({"metadata": {"resourceVersion": "7"},
                                    "spec": {"holderIdentity": "me_1"}})
    with pytest.raises(LeaseNotFound):
        store.update(base, {}, 1.0)
    with pytest.raises(LeaseNotFound):
        store.renew(base, {}, 1.0)
    config = ElectionConfig(namespace="ns", name="l", identity="me_1")
    calls: list[str] = []
    elector = LeaderElector(_CountingStore(store, calls), config, lambda _: None, lambda: None,
                            watch=False)
    term = _Term(record=base, renewed_at=time.monotonic())
    assert elector._renew(term, threading.Event()) is EndReason.DEPOSED
    assert calls == ["renew"], calls


# ---- a term that takes longer than the renew deadline to stop ----------------------------

SHORT = {"lease_duration": 1.0, "renew_deadline": 0.6, "retry_period": 0.2}
STOP_TAKES = 1.5  # the work's own shutdown, well past the 0.6 s renew deadline


class SlowStoppingWork:
    """``on_started`` that runs until ``lost``, then takes ``STOP_TAKES`` s to return, and
    records when each term's work ran (monotonic start and end)."""

    def __init__(self) -> None:
        self.spans: list[list[float]] = []
        self.mutex = threading.Lock()

    def __call__(self, leadership: Leadership) -> None:
        with self.mutex:
            span = [time.monotonic()]
            self.spans.append(span)
        leadership.lost.wait()
        time.sleep(STOP_TAKES)
        with self.mutex:
            span.append(time.monotonic())

    def running(self) -> int:
        with self.mutex:
            return sum(1 for s in self.spans if len(s) == 1)


def _elector(store: FakeLeaseStore, work: SlowStoppingWork, **config: Any) -> LeaderElector:
    settings: dict[str, Any] = {**SHORT, "identity": "me_1", "namespace": "ns", "name": "l",
                                **config}
    return LeaderElector(store, ElectionConfig(**settings), work, lambda: None,
                         watch=False)


@pytest.mark.unit
def test_a_term_slower_to_stop_than_the_renew_deadline_still_releases_the_lease() -> None:
    store = FakeLeaseStore()
    work = SlowStoppingWork()
    elector = _elector(store, work)
    stop = threading.Event()
    runner = threading.Thread(target=elector.run, args=(stop,), daemon=True)
    runner.start()
    wait_for(lambda: work.running() == 1, 10, what="leading")
    stop.set()
    runner.join(30)
    assert not runner.is_alive()
    assert work.running() == 0, "the work returned before the elector finished"
    assert store.spec["holderIdentity"] == "", "released once the work had returned"
    assert store.spec["leaseDurationSeconds"] == 1


@pytest.mark.unit
def test_a_new_term_never_starts_while_the_last_one_is_still_stopping() -> None:
    store = FakeLeaseStore()
    work = SlowStoppingWork()
    elector = _elector(store, work)
    stop = threading.Event()
    overlaps: list[int] = []

    def watch_overlap() -> None:
        while not stop.is_set():
            if work.running() > 1:
                overlaps.append(work.running())
            time.sleep(0.01)

    runner = threading.Thread(target=elector.run, args=(stop,), daemon=True)
    watcher = threading.Thread(target=watch_overlap, daemon=True)
    runner.start()
    watcher.start()
    try:
        first = wait_for(lambda: elector.leadership, 10, what="the first term")
        assert first is not None
        # The term ends from outside (say, check() saw the deadline); this replica still
        # names itself holder, so it could re-acquire at once.
        first.lost.set()
        wait_for(lambda: len(work.spans) >= 2, 30, what="the next term")
    finally:
        stop.set()
        runner.join(30)
        watcher.join(5)
    assert not overlaps, f"two terms' work ran at once in one process: {overlaps}"
    assert work.spans[1][0] >= work.spans[0][1], work.spans


@pytest.mark.unit
def test_health_stays_live_while_a_term_stops_within_the_grace_and_reports_stuck_work(
) -> None:
    store = FakeLeaseStore()
    release = threading.Event()
    terms: list[int] = []

    def stuck_work(leadership: Leadership) -> None:
        terms.append(leadership.epoch)
        leadership.lost.wait()
        release.wait()

    elector = LeaderElector(store, ElectionConfig(**SHORT, identity="me_1", namespace="ns",
                                                 name="l", shutdown_grace=1.0),
                            stuck_work, lambda: None, watch=False)
    stop = threading.Event()
    runner = threading.Thread(target=elector.run, args=(stop,), daemon=True)
    runner.start()
    try:
        term = wait_for(lambda: elector.leadership, 10, what="leading")
        assert term is not None
        term.lost.set()
        began = time.monotonic()
        healthy_while_in_grace = []
        while time.monotonic() - began < 1.0:
            try:
                elector.health_check()
                healthy_while_in_grace.append(True)
            except RuntimeError as exc:
                healthy_while_in_grace.append(False)
                print(exc)
            time.sleep(0.05)
        assert all(healthy_while_in_grace)

        def unhealthy() -> str | None:
            try:
                elector.health_check()
            except RuntimeError as exc:
                return str(exc)
            return None

        reason = wait_for(unhealthy, 30, what="health to report the stuck work")
        assert reason is not None and "has not stopped" in reason
        assert elector.leadership is None
        assert terms == [0], "no new term while the last one's work has not returned"
    finally:
        release.set()
        stop.set()
        runner.join(30)


@pytest.mark.unit
def test_an_old_terms_end_does_not_clear_a_newer_term(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """``ControllerProcess._lead``'s cleanup forgets only its own term."""
    finish = threading.Event()

    class BlockingTerm:
        def __init__(self, process: Any, leadership: Leadership) -> None:
            self.leadership = leadership

        def run(self) -> None:
            finish.wait(10)

    monkeypatch.setattr(manager_module, "LeaderTerm", BlockingTerm)
    process = SimpleNamespace(_term=None)
    old = Leadership(epoch=1, identity="me", valid_until=time.monotonic() + 3600)
    runner = threading.Thread(target=ControllerProcess._lead, args=(process, old),
                              daemon=True)
    runner.start()
    wait_for(lambda: process._term is not None, 10, what="the old term recorded")
    newer = SimpleNamespace(leadership="newer")
    process._term = newer  # a newer term was recorded while the old one was stopping
    finish.set()
    runner.join(10)
    assert process._term is newer


class CountingEtcd(Etcd):
    """The real client, counting transactions and lease revocations."""

    def __init__(self, config: EtcdConfig) -> None:
        super().__init__(config)
        self.txns = 0
        self.revokes = 0

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        self.txns += 1
        return super().txn(*args, **kwargs)

    def revoke_lease(self, *args: Any, **kwargs: Any) -> bool:
        self.revokes += 1
        return super().revoke_lease(*args, **kwargs)


@pytest.mark.cluster
def test_a_stopping_term_gives_its_locks_up_with_one_revoke_not_a_txn_per_lock(
        cluster: Any) -> None:
    prefix = f"/t-{uuid.uuid4().hex[:8]}"
    config = cluster.locks_etcd_config(prefix)
    etcd = CountingEtcd(config)
    try:
        process = SimpleNamespace(
            config=ControllerConfig(workers=0), metrics=ControllerMetrics(),
            api=client.ApiClient(), wiring=Wiring(), events=EventRecorder(None), etcd=etcd,
            etcd_config=config, installation=Installation("ns", "f1"),
            old_crd_warned=threading.Event(), rights=RightsLedger(), fencing=None,
            rights_endpoint=None, rights_reviewer=None)
        leadership = Leadership(epoch=3, identity="me_f1",
                                valid_until=time.monotonic() + 3600)
        term = LeaderTerm(process, leadership)  # type: ignore[arg-type]
        locks = term.locks()
        for i in range(20):
            locks.acquire("ns", f"vm{i}", f"uid{i}", leadership.epoch)
        assert len(LockTable(etcd, prefix).list()) == 20
        etcd.txns = etcd.revokes = 0
        term._shutdown([])
        assert LockTable(etcd, prefix).list() == [], "every lock key is gone"
        assert etcd.revokes == 1
        assert etcd.txns == 0, f"{etcd.txns} transactions on the way out"
    finally:
        etcd.close()


# ---- a slow epoch claim ---------------------------------------------------------------


class SlowFloor:
    """An epoch floor whose claim takes ``takes`` seconds of the fake clock (and, while
    ``hold`` is set, waits for it to be cleared: a claim still in progress)."""

    def __init__(self, clock: FakeClock, takes: float) -> None:
        self.clock = clock
        self.takes = takes
        self.hold = threading.Event()
        self.entered = threading.Event()
        self.go = threading.Event()

    def claim(self, epoch: int, identity: str) -> bool:
        self.entered.set()
        if self.hold.is_set():
            self.go.wait(30)
        self.clock.advance(self.takes)
        return True


def _lead_once(store: FakeLeaseStore, clock: FakeClock, floor: SlowFloor
               ) -> tuple[LeaderElector, list[float], threading.Event, threading.Thread,
                          list[EndReason]]:
    started: list[float] = []
    config = ElectionConfig(namespace="ns", name="l", identity="me_1")  # 4 / 2.5 / 0.5 s
    elector = LeaderElector(store, config, lambda lead: started.append(lead.remaining()),
                            lambda: None, epoch_floor=floor, clock=clock, watch=False)
    term = elector._try_acquire()
    assert term is not None
    stop = threading.Event()
    reasons: list[EndReason] = []
    runner = threading.Thread(target=lambda: reasons.append(elector._lead(term, stop)),
                              daemon=True)
    runner.start()
    return elector, started, stop, runner, reasons


@pytest.mark.unit
@pytest.mark.parametrize(("claim_takes", "starts"), [
    (0.0, True),    # the usual case
    (1.5, True),    # slow, within the term's window (retry 0.5 + renew deadline 2.5 s)
    (3.0, False),   # as long as the window: the term does not start
])
def test_a_slow_epoch_claim_never_starts_a_term_with_its_deadline_spent(
        claim_takes: float, starts: bool) -> None:
    store, clock = FakeLeaseStore(), FakeClock()
    floor = SlowFloor(clock, claim_takes)
    elector, started, stop, runner, reasons = _lead_once(store, clock, floor)
    try:
        if starts:
            wait_for(lambda: started, 10, what="the term's work to start")
            # Renewals go on during the claim (none answered yet on this fake clock, or
            # one did): the work starts with belief left, never more than one window.
            assert 0 < started[0] <= elector.config.belief
        else:
            runner.join(10)
            assert reasons == [EndReason.DEADLINE]
            assert started == [], "no work under a term whose deadline passed"
    finally:
        stop.set()
        runner.join(10)


@pytest.mark.unit
def test_health_does_not_call_a_term_that_is_still_claiming_its_epoch_wedged() -> None:
    store, clock = FakeLeaseStore(), FakeClock()
    floor = SlowFloor(clock, 0.0)
    floor.hold.set()
    elector, _started, stop, runner, _ = _lead_once(store, clock, floor)
    try:
        assert floor.entered.wait(10)
        clock.advance(elector.config.lease_duration + 1.0)  # the claim waits on etcd
        elector.health_check()  # starting, not wedged
        clock.advance(60.0)
        with pytest.raises(RuntimeError, match="claiming the epoch"):
            elector.health_check()
    finally:
        floor.go.set()
        stop.set()
        runner.join(10)


# ---- the elector's own client ----------------------------------------------------------


@pytest.mark.unit
def test_the_elector_renews_through_its_own_client_and_pool_with_the_same_identity(
) -> None:
    api = client.ApiClient(client.Configuration())
    api.set_default_header("Impersonate-User", "someone")
    process = ControllerProcess(
        api, EtcdConfig(endpoints=("http://127.0.0.1:1",), prefix="/t-f3"),
        ElectionConfig(namespace="ns", name="f3"), ControllerConfig(),
        events=EventRecorder(None))
    try:
        store = process.elector._lease
        assert isinstance(store, KubernetesLeaseStore)
        own: client.ApiClient = store._leases._api
        assert own is not api, "the elector shares the workers' ApiClient"
        assert own.rest_client.pool_manager is not api.rest_client.pool_manager
        assert own.configuration.host == api.configuration.host
        assert own.default_headers["Impersonate-User"] == "someone"
    finally:
        process.etcd.close()
        getattr(process, "elector_api", api).close()
        api.close()


# ---- review of the hardening: the narrower promises ------------------------------------------


@pytest.mark.unit
def test_a_bare_404_on_update_stays_a_transient_error_not_a_deposition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a 404 that names this Lease deposes its holder; one from a proxy or an API
    group not yet served (no details) is retried within the renew deadline like any
    transient error, so it costs no false step-down."""
    store = KubernetesLeaseStore(client.ApiClient(), "ns", "l")

    def bare(*args: Any, **kwargs: Any) -> LeaseRecord:
        exc = ApiException(status=404, reason="Not Found")
        exc.body = "404 page not found"
        raise exc

    monkeypatch.setattr(store._leases, "replace", bare)
    base = LeaseRecord.from_object({"metadata": {"resourceVersion": "7"},
                                    "spec": {"holderIdentity": "me_1"}})
    with pytest.raises(ApiException) as raised:
        store.update(base, {}, 1.0)
    assert not isinstance(raised.value, LeaseConflict)


@pytest.mark.unit
def test_a_stopping_term_opens_no_new_lock_session() -> None:
    """A worker left over from a stopping term that reaches for the locks gets
    AuthorityLost, not a fresh etcd session whose keepalive would outlive the term."""
    stopping = threading.Event()
    stopping.set()
    term = SimpleNamespace(_locks_mutex=threading.Lock(), stopping=stopping, _locks=None,
                           _session=None)
    with pytest.raises(manager_module.AuthorityLost):
        LeaderTerm.locks(term)  # type: ignore[arg-type]
    assert term._session is None


@pytest.mark.unit
def test_the_electors_client_never_resends_after_a_read_timeout() -> None:
    """A renewal resent by urllib3 after a read timeout could block for several times its
    budget; the elector's own client retries only connections that never carried it."""
    api = client.ApiClient()
    own = Wiring().elector_api(api)
    retries = own.configuration.retries
    assert retries is not None and retries is not False
    assert retries.read == 0 and retries.status == 0 and retries.other == 0
    assert api.configuration.retries is None  # the workers' client is untouched
