"""Many VMs created at once: every one converges, each with exactly one runner pod.

``count`` VirtualMachines are created as fast as a few client threads can (at once, as
far as the controller can tell), with a leader and a standby running as separate
processes. The test waits until every VM has converged: exactly one runner pod labelled
for it, ungated, not terminating, named ``status.podName``, and no plan pending. It then
checks that no VM was planned twice (``planSeq`` 1, no restart) and that a pod watch saw
no VM with two live pods at any revision, and prints the convergence time and the rate
in VMs/s (also in ``docs/reconciler.md``, "Scale").

The 200-VM case is sized for CI; the 1,000-VM case is ``slow``. Convergence is the
controller's part: with simulated nodes the pods are also scheduled (each asks for
10m CPU and 16Mi, so up to 220 fit on the two nodes); pods beyond the nodes' capacity
stay Pending, which the controller is not asked to change.

The polling checker of the other tests is not used here: a quorum list of 1,000 pods
decoded by the client costs seconds of CPU, which would be taken from the controller
being measured. The watch-based checker evaluates every revision instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.drills.observer import PodWatchChecker
from tests.support import wait_for
from tests.support.failover import leader_of
from tests.support.harness import Replicas, is_gated, list_vms, runner_pods, vm_manifest

pytestmark = [pytest.mark.cluster]

SCALE_ARGS = ["--lease-duration", "15", "--renew-deadline", "10", "--retry-period", "2",
              "--session-ttl", "15", "--workers", "8", "--plan-requeue", "10",
              "--resync", "120", "--sweep", "30"]
"""Production-like settings (the failover tests' short leases and 1 s plan requeue are
meant for a handful of VMs)."""
SPEC = {"terminationGracePeriodSeconds": 1,
        "podResources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                         "limits": {"cpu": "100m", "memory": "64Mi"}}}
CREATE_THREADS = 8


@dataclass(frozen=True)
class Progress:
    """One look at the namespace: how many VMs have converged, and what is left."""

    vms: int
    converged: int
    pods: int
    stuck: tuple[str, ...]
    """A few VMs that have not converged, with why (for the failure message)."""

    @property
    def done(self) -> bool:
        return self.converged == self.vms


def progress(api: client.ApiClient, namespace: str, expected: int) -> Progress:
    """Pods listed, then the VMs: two lists for the whole namespace, not one read per VM."""
    pods = runner_pods(api, namespace)
    vms = list_vms(api, namespace)
    by_vm: dict[str, list[Any]] = {}
    for p in pods:
        by_vm.setdefault(p.metadata.labels[types.LABEL_VM_NAME], []).append(p)
    ok = 0
    stuck: list[str] = []
    for vm in vms:
        name = vm["metadata"]["name"]
        status = vm.get("status") or {}
        mine = by_vm.get(name, [])
        why = None
        if len(mine) != 1:
            why = f"{len(mine)} pods"
        elif status.get("pendingPod"):
            why = "plan pending"
        elif mine[0].metadata.name != status.get("podName"):
            why = f"pod {mine[0].metadata.name} is not podName {status.get('podName')}"
        elif is_gated(mine[0]) or mine[0].metadata.deletion_timestamp is not None:
            why = "pod gated or terminating"
        if why is None:
            ok += 1
        elif len(stuck) < 5:
            stuck.append(f"{name}: {why}")
    return Progress(vms=max(len(vms), expected), converged=ok, pods=len(pods),
                    stuck=tuple(stuck))


@pytest.fixture
def pod_watch(api: client.ApiClient, namespace: str) -> Iterator[PodWatchChecker]:
    watch = PodWatchChecker(api, namespace).start()
    wait_for(watch.synced.is_set, 30, what="the pod watch's first list")
    try:
        yield watch
    finally:
        watch.stop()


def create_all(api: client.ApiClient, namespace: str, names: list[str]) -> None:
    custom = client.CustomObjectsApi(api)

    def create(name: str) -> None:
        custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, vm_manifest(name, spec=SPEC),
            _request_timeout=60)

    with ThreadPoolExecutor(CREATE_THREADS) as pool:
        list(pool.map(create, names))


@pytest.mark.parametrize("count", [
    pytest.param(200, id="200"),
    pytest.param(1000, id="1000", marks=[
        pytest.mark.slow, pytest.mark.timeout(3600),
        pytest.mark.skipif(os.environ.get("NEONVM_SCALE_LARGE") != "1",
                           reason="1,000 VMs take minutes: set NEONVM_SCALE_LARGE=1")]),
])
def test_vms_created_at_once_all_converge_each_with_exactly_one_pod(
        count: int, api: client.ApiClient, namespace: str,
        replicas: Replicas, pod_watch: PodWatchChecker) -> None:
    leader = replicas.start("leader", args=SCALE_ARGS)
    assert leader_of(replicas) is leader
    replicas.start("standby", args=SCALE_ARGS)
    names = [f"vm-{i:04d}" for i in range(count)]

    started = time.monotonic()
    create_all(api, namespace, names)
    created = time.monotonic() - started
    last: list[Progress] = []

    def all_converged() -> bool:
        last[:] = [progress(api, namespace, count)]
        return last[0].done

    wait_for(all_converged, 120 + count * 1.5, interval=1.0,
             what=f"{count} VMs converged (last: {last})")
    took = time.monotonic() - started

    final = progress(api, namespace, count)
    assert (final.vms, final.converged, final.pods) == (count, count, count)
    for vm in list_vms(api, namespace):
        status = vm["status"]
        assert (status["planSeq"], status["restartCount"]) == (1, 0), \
            f"{vm['metadata']['name']} was planned more than once: {status}"
    report = pod_watch.stop()
    assert report.strict == [] and report.loose == [], "two live pods for one VM"
    assert report.unexpected_deletions == []
    assert leader.running(), "the leader lasted the whole run"
    print(f"\nscale: {count} VMs created in {created:.1f}s, all converged "
          f"{took:.1f}s after the first create: {count / took:.1f} VMs/s "
          f"(watch: {report.events} events, {report.gaps} gaps, 0 violations)")
