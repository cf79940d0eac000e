"""Restart backoff against the real servers: a runner that exits at once does not churn.

A VM with ``restartPolicy: Always`` whose runner exits as soon as it runs would, without
a backoff, get a new pod every second or two for ever (each attempt is a new pod). Here
the simulated node makes each of the VM's first ``CYCLES`` pods exit (code 1) the moment
it is Running (``neonvm.dev.nodes.exit_pod``, the API behind ``neonvm dev pod exit``),
and a pod watch notes when each new pod appeared and the restart it followed
(``status.restartCount`` and ``status.lastRestartTime``, read right then: the next
restart cannot happen before that pod has run and been made to exit).

What must hold: the pod after restart *n* appears no earlier than ``restart_backoff(n)``
after that restart was recorded (0 s for the first, then 1, 2, 4, 8 s: growing
intervals), exactly one pod per restart (no churn beyond one pod per attempt), and the
last pod, left alone, runs. The controller and this test share the machine's clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import times, types
from neonvm.controller.restarts import restart_backoff
from neonvm.dev import nodes
from neonvm.dev.cluster import LocalCluster
from neonvm.drills.observer import PodWatchChecker
from neonvm.invariant import InvariantChecker
from tests.support import wait_for
from tests.support.failover import vm_status
from tests.support.harness import Replicas, converged, create_vm, get_vm

pytestmark = [pytest.mark.cluster, pytest.mark.nodes]

CYCLES = 5
"""Pods that exit at once; the next one (plan CYCLES + 1) is left to run."""
VM = "crashy"


@dataclass(frozen=True)
class Appearance:
    """A new pod of the VM, and the restart it followed (as the VM said right then)."""

    pod: str
    plan_seq: int
    seen_at: float
    """Wall-clock time the watch delivered its ADDED event (>= its creation)."""
    restart_count: int
    last_restart_time: str | None


@dataclass
class CrashingRunner:
    """Plays a runner that exits at once: the VM's first CYCLES pods exit when Running."""

    api: client.ApiClient
    namespace: str
    appearances: list[Appearance] = field(default_factory=list)
    exited: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(types.LABEL_VM_NAME) != VM:
            return
        name = str(meta.get("name"))
        seq = int((meta.get("annotations") or {}).get(types.ANNOTATION_PLAN_SEQ, "0"))
        if kind == "ADDED":
            seen_at = time.time()
            status = (get_vm(self.api, self.namespace, VM) or {}).get("status") or {}
            with self._lock:
                self.appearances.append(Appearance(
                    name, seq, seen_at, int(status.get("restartCount") or 0),
                    status.get("lastRestartTime")))
        running = (pod.get("status") or {}).get("phase") == "Running"
        if kind != "DELETED" and running and seq <= CYCLES and name not in self.exited:
            try:
                nodes.exit_pod(self.api, self.namespace, name, 1)
            except ApiException as exc:  # gone meanwhile: nothing to make exit
                self.errors.append(f"{name}: {exc.status}")
            self.exited.add(name)


@pytest.fixture
def crashing(api: client.ApiClient, namespace: str) -> Iterator[CrashingRunner]:
    runner = CrashingRunner(api, namespace)
    watch = PodWatchChecker(api, namespace, on_event=runner.on_event).start()
    wait_for(watch.synced.is_set, 30, what="the pod watch's first list")
    try:
        yield runner
    finally:
        report = watch.stop()
        assert report.strict == [], f"two live pods at some revision: {report.strict}"


def test_a_runner_that_exits_at_once_is_restarted_at_growing_intervals_without_churn(
        cluster: LocalCluster, api: client.ApiClient, namespace: str,
        replicas: Replicas, checker: InvariantChecker,
        crashing: CrashingRunner) -> None:
    if not cluster.spec.nodes:
        pytest.skip("needs simulated nodes: pods must run and exit")
    replicas.start("only")
    create_vm(api, namespace, VM, restart_policy="Always",
              spec={"terminationGracePeriodSeconds": 1})

    wait_for(lambda: vm_status(api, namespace, VM).get("restartCount") == CYCLES
             and converged(api, namespace, [VM]), 240,
             what=f"{CYCLES} restarts, then a pod left running")
    wait_for(lambda: len(crashing.appearances) == CYCLES + 1, 30, what="every ADDED event")

    gaps: list[str] = []
    for seq, seen in enumerate(sorted(crashing.appearances, key=lambda a: a.plan_seq), 1):
        assert seen.plan_seq == seq, f"one pod per plan: {crashing.appearances}"
        assert seen.restart_count == seq - 1, "one restart per pod"
        if seq == 1:
            continue
        restarted = times.parse(seen.last_restart_time)
        assert restarted is not None, f"restart #{seq - 1} recorded no lastRestartTime"
        waited = seen.seen_at - restarted.timestamp()
        backoff = restart_backoff(seen.restart_count)
        gaps.append(f"#{seen.restart_count}: {waited:.2f}s (backoff {backoff:.0f}s)")
        assert waited >= backoff, (
            f"pod {seen.pod} appeared {waited:.2f}s after restart #{seen.restart_count}, "
            f"before its backoff of {backoff:.0f}s")
    status = vm_status(api, namespace, VM)
    assert (status["restartCount"], status["planSeq"]) == (CYCLES, CYCLES + 1)
    assert {a.pod for a in crashing.appearances} == {
        f"{VM}-{get_vm(api, namespace, VM)['metadata']['uid'][:8]}-{n}"  # type: ignore[index]
        for n in range(1, CYCLES + 2)}, "exactly one pod per attempt"
    assert crashing.exited == {a.pod for a in crashing.appearances if a.plan_seq <= CYCLES}
    print("\nrestart backoff: pod after restart " + ", ".join(gaps))
