"""Observing from write responses, against the real API server (docs/protocol.md,
"Observing from write responses" and "Authority checks").

The driver builds its next observation from the answer to a write that took effect, so a
VM goes from created to started with one direct observation and the ungate's own list;
Restart, DeletePod and RemoveFinalizer are still decided from a fresh direct read, and
the lock is checked once per write rather than before every decision.
"""

from __future__ import annotations

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.invariant import InvariantChecker
from tests.support import CountingAuthority, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import get_vm, is_gated, runner_pods
from tests.support.reconcile import (
    FrozenCache,
    converged_one,
    create_vm,
    history_through_two_restarts,
    hold,
    release,
    settle,
)
from tests.support.reconcile_observe import Recording

pytestmark = pytest.mark.cluster


def test_a_new_vm_is_started_with_one_direct_observation_and_the_ungate_list(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    create_vm(api, namespace, "quick")
    reconciler = Recording(controller_api)
    authority = CountingAuthority()
    result = reconciler.reconcile(f"{namespace}/quick", authority)

    steps = [name for name, _, _ in reconciler.performed]
    assert steps[:5] == ["AddFinalizer", "RecordPlan", "CreatePod", "Commit", "Ungate"], steps
    pods = runner_pods(api, namespace, "quick")
    assert len(pods) == 1 and not is_gated(pods[0])
    vm = get_vm(api, namespace, "quick")
    assert vm is not None and vm["status"]["podName"] == pods[0].metadata.name
    assert isinstance(result.action, act.Done | act.Wait), result
    # The first observation (no cache here: direct), then every step from the previous
    # write's answer; the ungate lists the pods once more, after the commit was seen.
    assert reconciler.counting.reads == {"list_pods": 2, "get_vm": 1}, (
        reconciler.counting.reads, reconciler.performed)
    assert all(from_write for _, from_write, _ in reconciler.performed[1:])
    # The authority: once at the start, then once per write (the VM's PUTs, including
    # the conditions written at the end, and the create and the ungate).
    pod_writes = sum(1 for name, _, _ in reconciler.performed if name in ("CreatePod", "Ungate"))
    assert authority.checks == 1 + reconciler.vm_writes + pod_writes, (
        authority.checks, reconciler.vm_writes, pod_writes)


def test_a_new_vm_seen_in_the_cache_is_started_with_the_ungate_list_as_its_only_read(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    """The create is decided from the answer to RecordPlan (the VM as stored), not from a
    direct read: a VM that the watch brought in reaches a started pod with one quorum
    read, the ungate's own list; and no condition is left to write at its end."""
    # enableSSH defaults to true (NeonVM's default), which adds the SSH key Secret's
    # create (tests/test_ssh_keys.py counts it); this test counts a plain VM's calls.
    created = create_vm(api, namespace, "cached",
                        spec={"enableAcceleration": False, "enableSSH": False})
    reconciler = Recording(controller_api)
    reconciler._cache = FrozenCache(created, [])
    result = reconciler.reconcile(f"{namespace}/cached", CountingAuthority())

    steps = [name for name, _, _ in reconciler.performed]
    assert steps == ["AddFinalizer", "RecordPlan", "CreatePod", "Commit", "Ungate"], steps
    assert isinstance(result.action, act.Done), result
    pods = runner_pods(api, namespace, "cached")
    assert len(pods) == 1 and not is_gated(pods[0])
    # The create from RecordPlan's answer: not direct, built from a write.
    assert reconciler.performed[2] == ("CreatePod", True, False), reconciler.performed
    assert reconciler.counting.reads == {"list_pods": 1}, reconciler.counting.reads
    # The finalizer, the plan, the record of the live scaling token Secret (this VM can
    # be scaled live), the commit carrying Ready; nothing at the end.
    status = (get_vm(api, namespace, "cached") or {})["status"]
    assert status.get("scalingTokenSecret") and reconciler.vm_writes == 4, (
        reconciler.vm_writes, status)


def test_restart_delete_and_finalizer_removal_are_decided_from_a_fresh_direct_read(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    create_vm(api, namespace, "careful")
    key = f"{namespace}/careful"
    reconciler = Recording(controller_api)
    settle(reconciler, key)
    old = runner_pods(api, namespace, "careful")[0].metadata.name
    hold(api, namespace, old)
    client.CoreV1Api(api).delete_namespaced_pod(old, namespace)
    settle(reconciler, key, rounds=2)  # Restart, a new plan, waiting for the old pod
    release(api, namespace, old)
    wait_for(lambda: len(runner_pods(api, namespace, "careful")) == 1, 30, what="old pod gone")
    settle(reconciler, key)
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "careful")
    for _ in range(10):
        reconciler.reconcile(key, StaticAuthority(epoch=1, token=10), direct_first=True)
        if get_vm(api, namespace, "careful") is None:
            break
    assert get_vm(api, namespace, "careful") is None

    dangerous = [(name, from_write, direct) for name, from_write, direct in reconciler.performed
                 if name in ("Restart", "DeletePod", "RemoveFinalizer")]
    assert {name for name, _, _ in dangerous} == {"Restart", "DeletePod", "RemoveFinalizer"}
    assert all(direct and not from_write for _, from_write, direct in dangerous), dangerous
    # ... while the plan steps in between were taken from write answers.
    assert any(from_write for _, from_write, _ in reconciler.performed)


def test_a_plan_seen_only_in_a_stale_cache_is_not_created_but_read_directly(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker) -> None:
    """The create is decided only from a direct observation or from the answer to our own
    VM write (docs/protocol.md, "Why the create needs no pod list"). A cache that still
    shows plan #1, committed, run and restarted twice since, must not bring plan #1's pod
    name back: the driver reads directly, sees plan #3 running, and creates nothing."""
    create_vm(api, namespace, "guard")
    history = history_through_two_restarts(api, controller_api, namespace, "guard")
    running = converged_one(api, namespace, "guard")
    planned = [v for v in history
               if str(((v.get("status") or {}).get("pendingPod") or {}).get("name", ""))
               .endswith("-1") and not (v.get("status") or {}).get("podName")]
    assert planned, "the watch saw the version with plan #1 recorded, not yet committed"

    reconciler = Recording(controller_api)
    reconciler._cache = FrozenCache(planned[0], [])
    result = reconciler.reconcile(f"{namespace}/guard", CountingAuthority())

    steps = [name for name, _, _ in reconciler.performed]
    assert "CreatePod" not in steps, reconciler.performed
    assert reconciler.counting.reads["get_vm"] >= 1, reconciler.counting.reads
    assert isinstance(result.action, act.Done), result
    assert [p.metadata.name for p in runner_pods(api, namespace, "guard")] == [running]
