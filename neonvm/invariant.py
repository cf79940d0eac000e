"""An independent checker of the invariant, for tests, drills and the demo.

It shares no code path with the controller: it lists pods labelled for VMs straight from
the API server (quorum reads, ``resourceVersion`` unset) as often as it can, and records
every instant at which a VM had more than one *live* runner pod.

* **strict** (the promise): a pod is live if it is not scheduling-gated and has not
  finished terminating, i.e. it still exists and has not Succeeded or Failed. A pod that
  is shutting down still counts: its guest may still be running.
* **loose** (what a user sees in ``kubectl get pods``): terminating pods are ignored.

A list is one consistent snapshot at one etcd revision, so "two live pods in one list"
is a real violation, never an artefact of the checker.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from neonvm.api import types


@dataclass(frozen=True)
class Violation:
    """At ``resource_version``, VM ``vm`` had these live pods."""

    vm: str
    pods: tuple[str, ...]
    strict: bool
    resource_version: str
    at: float


@dataclass
class CheckerReport:
    samples: int = 0
    strict: list[Violation] = field(default_factory=list)
    loose: list[Violation] = field(default_factory=list)
    errors: int = 0

    @property
    def ok(self) -> bool:
        return not self.strict and not self.loose


def live_pods_by_vm(pods: list[Any], strict: bool = True) -> dict[str, list[str]]:
    """``namespace/vm`` -> names of its live runner pods in one pod list."""
    out: dict[str, list[str]] = {}
    for pod in pods:
        labels = pod.metadata.labels or {}
        vm = labels.get(types.LABEL_VM_NAME)
        if vm is None:
            continue
        gates = pod.spec.scheduling_gates or []
        if any(g.name == types.SCHEDULING_GATE for g in gates):
            continue
        if (pod.status.phase or "Pending") in ("Succeeded", "Failed"):
            continue
        if not strict and pod.metadata.deletion_timestamp is not None:
            continue
        out.setdefault(f"{pod.metadata.namespace}/{vm}", []).append(pod.metadata.name)
    return out


class InvariantChecker:
    """Polls pods in a background thread until stopped; see the module docstring."""

    def __init__(self, api: client.ApiClient, namespace: str | None = None,
                 interval: float = 0.05) -> None:
        self._core = client.CoreV1Api(api)
        self._namespace = namespace
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="invariant-checker", daemon=True)
        self.report = CheckerReport()

    def __enter__(self) -> InvariantChecker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> CheckerReport:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        return self.report

    def check_once(self) -> None:
        if self._namespace:
            resp = self._core.list_namespaced_pod(
                self._namespace, label_selector=types.LABEL_VM_NAME, _request_timeout=5
            )
        else:
            resp = self._core.list_pod_for_all_namespaces(
                label_selector=types.LABEL_VM_NAME, _request_timeout=5
            )
        rv = resp.metadata.resource_version or ""
        now = time.time()
        for strict, sink in ((True, self.report.strict), (False, self.report.loose)):
            for vm, names in live_pods_by_vm(resp.items, strict).items():
                if len(names) > 1:
                    sink.append(Violation(vm, tuple(sorted(names)), strict, rv, now))
        self.report.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # API restarts are part of some tests
                self.report.errors += 1
            self._stop.wait(self._interval)
