"""A VM too large to cache, on the session's real API server (review F2): the shipped
reconciler leaves it alone with Degraded ``ObjectTooLarge``, its status written by a real
PUT of the 300 KiB object, and reconciles it as usual once it is smaller
(neonvm/controller/too_large.py; the pure cases are in tests/test_too_large_vm.py)."""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.informer import MAX_CACHED_VM_BYTES
from neonvm.controller.reasons import DEGRADED, OBJECT_TOO_LARGE, RECOVERED
from tests.support import shipped_reconciler, wait_for
from tests.support.harness import runner_pods
from tests.support.reconcile import NOWHERE, condition, create_vm, settle, status_of


def status_writes_admitted(controller_api: client.ApiClient, namespace: str, name: str) -> bool:
    """Whether the controller's identity may change this VM's status: a dry run. A chart
    release another test installed fences status to its own ServiceAccount cluster-wide,
    and the API server may apply that fence for a moment after the release is deleted."""
    custom = client.CustomObjectsApi(controller_api)
    vm = custom.get_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                             types.PLURAL, name)
    vm["status"] = {**(vm.get("status") or {}), "phase": "Pending"}
    try:
        custom.replace_namespaced_custom_object_status(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name, vm, dry_run="All")
    except ApiException as exc:
        if exc.status != 403:
            raise
        return False
    return True


def test_a_vm_too_large_to_cache_is_left_alone_until_it_shrinks(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # spec.affinity keeps unknown fields: the tenant's own way past the bound.
    blob = {"nodeAffinity": {"x-notes": "x" * (MAX_CACHED_VM_BYTES + 1024)}}
    create_vm(api, namespace, "big", spec={"nodeSelector": NOWHERE, "affinity": blob})
    wait_for(lambda: status_writes_admitted(controller_api, namespace, "big"),
             what="the local cluster's own fence (no other release's) on VM status")
    reconciler = shipped_reconciler(controller_api)
    key = f"{namespace}/big"

    result = settle(reconciler, key)
    assert isinstance(result.action, act.Done), result
    status = status_of(api, namespace, "big")
    cond = condition(status, DEGRADED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", OBJECT_TOO_LARGE)
    assert not status.get("pendingPod") and not status.get("podName")
    assert not runner_pods(api, namespace, "big")

    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "big",
        {"spec": {"affinity": None}})
    settle(reconciler, key)
    status = status_of(api, namespace, "big")
    assert status.get("podName") or status.get("pendingPod"), status
    cond = condition(status, DEGRADED)
    assert cond is not None and (cond["status"], cond["reason"]) == ("False", RECOVERED), cond
