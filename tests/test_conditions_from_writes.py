"""Conditions written from the answer to our own write, against the real API server.

A reconcile that starts from the cache and writes (SyncStatus, say) ends with the VM as
stored by that write; the conditions that follow from it (Available, once the phase is
Running) are written with it, in the same PUT, and nothing is read directly first
(docs/protocol.md, "Observing from write responses": conditions may be written from an
answer). A reconcile that would write conditions from the cache alone still reads
directly first.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from neonvm.controller import actions as act
from neonvm.invariant import InvariantChecker
from tests.support import CountingAuthority
from tests.support.harness import get_vm, runner_pods
from tests.support.reconcile import FrozenCache, condition, create_vm, finish, settle
from tests.support.reconcile_observe import Recording

pytestmark = pytest.mark.cluster


def test_conditions_after_a_write_from_the_cache_are_written_without_a_direct_read(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    create_vm(api, namespace, "ready", spec={"enableAcceleration": False})
    key = f"{namespace}/ready"
    reconciler = Recording(controller_api)
    settle(reconciler, key)
    pods = runner_pods(api, namespace, "ready")
    assert len(pods) == 1
    finish(api, namespace, pods[0].metadata.name, "Running")
    # What the watch cache holds once the pod's Running event arrived.
    vm_raw = get_vm(api, namespace, "ready")
    assert vm_raw is not None
    pod_raw = controller_api.sanitize_for_serialization(
        client.CoreV1Api(api).read_namespaced_pod(pods[0].metadata.name, namespace))
    reconciler._cache = FrozenCache(vm_raw, [pod_raw])
    reconciler.counting.reads.clear()
    reconciler.performed.clear()
    writes_before = reconciler.vm_writes

    result = reconciler.reconcile(key, CountingAuthority())

    assert [name for name, _, _ in reconciler.performed] == ["SyncStatus"]
    assert isinstance(result.action, act.Done), result
    vm = get_vm(api, namespace, "ready")
    assert vm is not None and vm["status"]["phase"] == "Running"
    ready = condition(vm["status"], "Available")
    assert ready is not None and ready["status"] == "True", vm["status"]
    # The phase and the Available it implies in one write (conditions.with_ready); the
    # reconcile's end finds no condition left to write.
    assert reconciler.vm_writes - writes_before == 1
    assert sum(reconciler.counting.reads.values()) == 0, (
        f"read directly before writing conditions that follow from our own write's "
        f"answer: {dict(reconciler.counting.reads)}")
