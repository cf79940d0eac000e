"""What the leader learns of a runner pod is forgotten when the pod is deleted, not kept
until a count bound: under churn (every restart makes a new pod uid) those memories
would otherwise fill up with pods that are gone (the soak's leader memory,
docs/benchmarks.md "Soak"). Their sizes are served as
``neonvm_controller_remembered_entries`` (docs/metrics.md).

Pure logic over a fake runner-status source; the term's pod handler is fed the informer's
deletion directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import generate_latest

from neonvm.api import types
from neonvm.controller.acceleration import RunnerReports
from neonvm.controller.actions import PodView
from neonvm.controller.config import ControllerConfig
from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.rights import RightsLedger
from neonvm.controller.wiring import Wiring
from neonvm.leader.election import Leadership

pytestmark = pytest.mark.unit


class Refusing:
    """A runner-status source that refuses at once (no runner behind the pod IP)."""

    def get_status(self, host: str, port: int, timeout: float) -> Mapping[str, Any]:
        raise ConnectionRefusedError(host)


def running(uid: str) -> PodView:
    return PodView(name=f"pod-{uid}", uid=uid, owner_uid="uid-vm", gated=False,
                   terminating=False, phase="Running", ip="10.0.0.7")


def raw_pod(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": f"pod-{uid}", "namespace": "ns", "uid": uid,
                         "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {types.LABEL_VM_NAME: "vm"}}}


RAW_VM = {"metadata": {"name": "vm", "namespace": "ns", "uid": "uid-vm",
                       "creationTimestamp": "2026-01-01T00:00:00Z"}, "status": {}}


def a_term(metrics: ControllerMetrics) -> LeaderTerm:
    process = SimpleNamespace(
        config=ControllerConfig(workers=1), metrics=metrics, api=client.ApiClient(),
        wiring=Wiring(), events=EventRecorder(None), etcd=None,
        etcd_config=SimpleNamespace(prefix="/t"), old_crd_warned=threading.Event(),
        rights=RightsLedger(), fencing=None, rights_endpoint=None, rights_reviewer=None)
    leadership = Leadership(epoch=1, identity="me", valid_until=time.monotonic() + 3600)
    return LeaderTerm(process, leadership)  # type: ignore[arg-type]


def test_runner_reports_forget_a_deleted_pod_and_only_it() -> None:
    reports = RunnerReports(Refusing())
    for uid in ("a", "b"):
        assert reports.lookup(running(uid), 1) is None
    assert reports.wait_idle(30)
    assert reports.remembered() == 2
    reports.forget("a")
    reports.forget("never-seen")
    assert reports.remembered() == 1


def test_a_created_pods_time_is_forgotten_when_the_pod_is_deleted_before_running() -> None:
    metrics = ControllerMetrics()
    metrics.lifecycle.runner_created(RAW_VM, raw_pod("p1"))
    metrics.lifecycle.runner_created(RAW_VM, raw_pod("p2"))
    metrics.lifecycle.pod_deleted("p1")
    assert metrics.lifecycle.remembered() == 1


def test_the_terms_pod_deletion_empties_both_memories_and_the_gauge_says_so() -> None:
    metrics = ControllerMetrics()
    term = a_term(metrics)
    reports = term.reconciler.acceleration.reports = RunnerReports(Refusing())
    for uid in ("gone", "kept"):
        metrics.lifecycle.runner_created(RAW_VM, raw_pod(uid))
        assert reports.lookup(running(uid), 1) is None
    assert reports.wait_idle(30)
    term._on_pod("ns/pod-gone", raw_pod("gone"), raw_pod("gone"))  # an update: kept
    assert (reports.remembered(), metrics.lifecycle.remembered()) == (2, 2)
    term._on_pod("ns/pod-gone", raw_pod("gone"), None)  # the informer's deletion
    assert (reports.remembered(), metrics.lifecycle.remembered()) == (1, 1)
    served = generate_latest(metrics.registry).decode()
    assert 'neonvm_controller_remembered_entries{structure="lifecycle_pods"} 1.0' in served
