"""No resync storm, against the real servers: once VMs converged, neither the periodic
resync nor the converged VMs' own re-checks read them directly (quorum reads); the
resync still finds, by its metadata-only diff, a VM whose cache missed a change."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller.events import EventRecorder
from neonvm.controller.manager import ControllerConfig, ControllerProcess
from neonvm.controller.observe import DirectReader
from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.dev.cluster import LocalCluster
from neonvm.leader.election import ElectionConfig
from tests.support import wait_for
from tests.support.harness import converged, create_vm, get_vm, runner_pods

pytestmark = pytest.mark.cluster

VMS = ["a", "b", "c"]


class DirectReads:
    """Counts the direct (quorum) observations and VM reads, by VM key."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        observe, get_vm_raw = DirectReader.observe, DirectReader.get_vm_raw

        def counted_observe(reader: DirectReader, key: str, lease: Any) -> Any:
            self._count(key)
            return observe(reader, key, lease)

        def counted_get(reader: DirectReader, namespace: str, name: str) -> Any:
            self._count(f"{namespace}/{name}")
            return get_vm_raw(reader, namespace, name)

        monkeypatch.setattr(DirectReader, "observe", counted_observe)
        monkeypatch.setattr(DirectReader, "get_vm_raw", counted_get)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


@pytest.fixture
def leader(cluster: LocalCluster, controller_api: client.ApiClient, namespace: str,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ControllerProcess, DirectReads]]:
    reads = DirectReads(monkeypatch)
    process = ControllerProcess(
        controller_api, cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        ElectionConfig(namespace=namespace, name="resync", lease_duration=4,
                       renew_deadline=3, retry_period=0.5),
        # Everything periodic is fast here, so that many resyncs and re-checks pass.
        ControllerConfig(workers=2, watch_namespace=namespace, resync_seconds=0.5,
                         recheck_seconds=1.0, plan_requeue_seconds=0.5, sweep_seconds=1.0,
                         reconciler=ReconcilerConfig(resync_seconds=0.5)),
        events=EventRecorder(None))
    stop = threading.Event()
    runner = threading.Thread(target=process.run, args=(stop,), daemon=True)
    runner.start()
    try:
        yield process, reads
    finally:
        stop.set()
        runner.join(30)


def counter(process: ControllerProcess, metric: Any, **labels: str) -> float:
    value: float = (metric.labels(**labels) if labels else metric)._value.get()
    return value


def test_converged_vms_are_not_read_directly_by_the_resync_or_their_rechecks(
        api: client.ApiClient, namespace: str,
        leader: tuple[ControllerProcess, DirectReads]) -> None:
    process, reads = leader
    for name in VMS:
        create_vm(api, namespace, name)
    wait_for(lambda: converged(api, namespace, VMS), 120, what="convergence")
    m = process.metrics

    def quiet() -> bool:
        """No direct read over two resyncs and a re-check of every VM."""
        before = reads.total()
        scans = counter(process, m.scans, scan="resync")
        done = counter(process, m.reconciles, result="done")
        wait_for(lambda: counter(process, m.scans, scan="resync") >= scans + 2
                 and counter(process, m.reconciles, result="done") >= done + len(VMS),
                 60, what="two resyncs and a re-check per VM")
        return reads.total() == before

    wait_for(quiet, 120, what="the plan's last direct reads are over")

    def versions() -> dict[str, str]:
        """Every VM's and runner pod's resourceVersion: a window in which one changed
        saw real work (a status sync, a condition), which may read directly."""
        out = {n: str((get_vm(api, namespace, n) or {})["metadata"]["resourceVersion"])
               for n in VMS}
        out.update({p.metadata.name: p.metadata.resource_version
                    for p in runner_pods(api, namespace)})
        return out

    windows = []
    for _ in range(6):
        seen, before = versions(), reads.total()
        scans = counter(process, m.scans, scan="resync")
        done = counter(process, m.reconciles, result="done")
        wait_for(lambda s=scans, d=done: counter(process, m.scans, scan="resync") >= s + 8
                 and counter(process, m.reconciles, result="done") >= d + 3 * len(VMS),
                 120, what="eight resyncs and three re-checks per VM")
        reads_in_window = reads.total() - before
        if versions() == seen:
            assert reads_in_window == 0, (
                f"converged VMs, unchanged, were read directly {reads_in_window} times "
                f"by periodic work: {dict(reads.counts)}")
            break
        windows.append(reads_in_window)
    else:
        pytest.fail(f"no window without a change to a VM or pod: direct reads {windows}")

    # A change the cache missed is still found by the resync's diff: drop the VM's
    # cached copy behind the informer's back (as a lost ADDED event would).
    term = process.term
    assert term is not None
    key = f"{namespace}/a"
    cached = term.vm_store.get(key)
    assert cached is not None
    term.vm_store.discard(key, cached["metadata"]["uid"])
    reads_of_a = reads.counts[key]
    wait_for(lambda: reads.counts[key] > reads_of_a, 60,
             what="the resync's diff requeued the VM the cache lost, read directly")
    assert client.CustomObjectsApi(api).get_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "a")
