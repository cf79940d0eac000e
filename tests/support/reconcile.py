"""One reconcile driven directly on the shared cluster: settle, finish, a frozen cache,
conditions and status."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.cluster import VMRecord
from neonvm.controller.fault_wiring import VersionedStore
from neonvm.controller.informer import Informer
from neonvm.controller.observe import Snapshot, make_snapshot
from neonvm.controller.reconciler import Reconciler, ReconcileResult
from tests.support import shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import create_vm as harness_create_vm
from tests.support.harness import get_vm, is_gated, runner_pods

AUTHORITY = StaticAuthority(epoch=1, token=10)


HOLD = "test.neon.tech/hold"


NOWHERE = {"neonvm.test/unschedulable": "true"}
"""Runner pods here are never bound to a node, with or without simulated nodes: their
lifecycle (terminating, finished) is played by the test itself."""


def create_vm(api: client.ApiClient, namespace: str, name: str,
              spec: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    return harness_create_vm(api, namespace, name,
                             spec={"nodeSelector": NOWHERE, **(spec or {})}, **kwargs)


def settle(reconciler: Reconciler, key: str, rounds: int = 10) -> ReconcileResult:
    """Reconcile (direct reads) until the answer is Done."""
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    for _ in range(rounds):
        if isinstance(result.action, act.Done):
            return result
        result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    return result


def status_of(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm = get_vm(api, namespace, name)
    assert vm is not None
    status: dict[str, Any] = vm.get("status") or {}
    return status


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in [*(status.get("conditions") or []),
                             *(status.get("extraConditions") or [])]
                 if c["type"] == type_), None)


def hold(api: client.ApiClient, namespace: str, pod: str) -> None:
    client.CoreV1Api(api).patch_namespaced_pod(pod, namespace,
                                               {"metadata": {"finalizers": [HOLD]}})


def release(api: client.ApiClient, namespace: str, pod: str) -> None:
    client.CoreV1Api(api).patch_namespaced_pod(pod, namespace,
                                               {"metadata": {"finalizers": None}})


def converged_one(api: client.ApiClient, namespace: str, name: str) -> str:
    """The VM's only pod is ungated and is status.podName; returns its name."""
    pods = runner_pods(api, namespace, name)
    status = status_of(api, namespace, name)
    assert [p.metadata.name for p in pods] == [status.get("podName")]
    assert not is_gated(pods[0]) and not status.get("pendingPod")
    return str(status["podName"])


class FrozenCache:
    """A cache stuck at one old snapshot (what a lagging watch cache serves)."""

    def __init__(self, vm_raw: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        self._vm, self._pods = vm_raw, pods

    def observe(self, key: str, lease: act.Fence) -> Snapshot:
        return make_snapshot(VMRecord.from_raw(self._vm), self._pods, lease, direct=False)


def history_through_two_restarts(api: client.ApiClient, controller_api: client.ApiClient,
                                 namespace: str, name: str) -> list[dict[str, Any]]:
    """Run the VM through two pod deletions; return every version of it the watch saw.

    Afterwards plan #3 is committed and running; each older version is what a cache that
    missed everything since shows.
    """
    versions = VersionedStore(depth=200)
    custom = client.CustomObjectsApi(api)

    def list_vms(**kw: Any) -> Any:
        return custom.list_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                    types.PLURAL, **kw)

    informer = Informer("vms", list_vms, versions, lambda *_: None)
    informer.start()
    try:
        wait_for(informer.synced.is_set, 30)
        key = f"{namespace}/{name}"
        reconciler = shipped_reconciler(controller_api)
        settle(reconciler, key)
        for _ in range(2):
            client.CoreV1Api(api).delete_namespaced_pod(converged_one(api, namespace, name),
                                                        namespace)
            # Restart #2 waits out its restart backoff (1 s) before the next plan.
            wait_for(lambda: isinstance(settle(reconciler, key).action, act.Done), 30,
                     what="the replacement converged")
        final = get_vm(api, namespace, name)
        assert final is not None
        wait_for(lambda: (versions.get(key) or {}).get("metadata", {}).get(
            "resourceVersion") == final["metadata"]["resourceVersion"], 30)
        return [v for v in versions.older(key) if v is not None]
    finally:
        informer.stop()


def finish(api: client.ApiClient, namespace: str, pod: str, phase: str) -> None:
    """What the kubelet reports when the runner exits."""
    client.CoreV1Api(api).patch_namespaced_pod_status(pod, namespace, {"status": {"phase": phase}})
