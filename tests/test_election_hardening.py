"""Hardening of the election and of a term's start and stop (review findings F1-F6).

Table tests over the in-memory Lease store and fake clock of ``tests/test_election_store.py``
where a real server cannot force the timing (a slow epoch claim, a term that takes longer
to stop than the renew deadline, a 404 on renewal), next to checks on the real API server
where it can (a deleted Lease, the elector's own HTTP client).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import ControllerConfig, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
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
from neonvm.leader.lease_store import KubernetesLeaseStore, LeaseConflict, LeaseNotFound
from tests.support import wait_for

# ---- F6: an exception after the reconcile does not kill the worker ------------------------


class _RaisingOnce:
    """A handler whose turn of ``bad`` raises the first time (a bug after the reconcile)."""

    def __init__(self, bad: str) -> None:
        self.bad = bad
        self.seen: list[str] = []
        self._raised = False
        self._mutex = threading.Lock()

    def process(self, key: str, direct: bool) -> None:
        with self._mutex:
            self.seen.append(key)
            if key == self.bad and not self._raised:
                self._raised = True
                raise RuntimeError("bug in outcome_of_result")


@pytest.mark.unit
def test_f6_an_exception_after_the_reconcile_is_counted_requeued_and_the_worker_lives_on(
) -> None:
    process = SimpleNamespace(
        config=ControllerConfig(workers=1, backoff=Backoff(base=0.01, cap=0.1)),
        metrics=ControllerMetrics(), api=client.ApiClient(), wiring=Wiring(),
        events=EventRecorder(None), etcd=None, etcd_config=SimpleNamespace(prefix="/t"))
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


# ---- F5: a Lease deleted under its holder ends the term at once ---------------------------


@pytest.mark.cluster
def test_f5_a_lease_deleted_under_its_holder_deposes_it_at_once_and_is_recreated(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    store = KubernetesLeaseStore(controller_api, namespace, "f5")
    config = ElectionConfig(namespace=namespace, name="f5", identity="me_f5",
                            lease_duration=4.0, renew_deadline=2.5, retry_period=0.5)
    elector = LeaderElector(None, config, lambda _: None, lambda: None, store=store,
                            watch=False)
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
    assert calls in (["update"], ["update", "get"]), calls
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

    def watch(self, timeout: float) -> Iterator[LeaseRecord | None]:
        return self._inner.watch(timeout)


@pytest.mark.unit
def test_f5_a_404_on_update_is_lease_not_found_and_deposes_without_retrying(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 404 on replace (a server that checks existence before the uid precondition)
    maps to LeaseNotFound, and a holder renewing gets DEPOSED at once, not retries
    until its renew deadline."""
    store = KubernetesLeaseStore(client.ApiClient(), "ns", "l")
    body = ('{"kind":"Status","reason":"NotFound","details":{"name":"l",'
            '"group":"coordination.k8s.io","kind":"leases"},"code":404}')

    def gone(*args: Any, **kwargs: Any) -> LeaseRecord:
        exc = ApiException(status=404, reason="Not Found")
        exc.body = body  # names the Lease, not a namespace
        raise exc

    monkeypatch.setattr(store._leases, "replace", gone)
    base = LeaseRecord.from_object({"metadata": {"resourceVersion": "7"},
                                    "spec": {"holderIdentity": "me_1"}})
    with pytest.raises(LeaseNotFound):
        store.update(base, {}, 1.0)
    config = ElectionConfig(namespace="ns", name="l", identity="me_1")
    calls: list[str] = []
    elector = LeaderElector(None, config, lambda _: None, lambda: None,
                            store=_CountingStore(store, calls), watch=False)
    term = _Term(record=base, renewed_at=time.monotonic())
    assert elector._renew(term, threading.Event()) is EndReason.DEPOSED
    assert calls == ["update"], calls
