"""Hardening of the election and of a term's start and stop (review findings F1-F6).

Table tests over the in-memory Lease store and fake clock of ``tests/test_election_store.py``
where a real server cannot force the timing (a slow epoch claim, a term that takes longer
to stop than the renew deadline, a 404 on renewal), next to checks on the real API server
where it can (a deleted Lease, the elector's own HTTP client).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from kubernetes import client

from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import ControllerConfig, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.wiring import Wiring
from neonvm.controller.workqueue import Backoff
from neonvm.leader.election import Leadership
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
