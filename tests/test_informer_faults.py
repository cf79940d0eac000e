"""Poison objects against the real API server: a VirtualMachine whose spec is nested too
deep for Python's JSON decoder.

The API server accepts a document nested up to 10,000 levels (Go's ``encoding/json``
limit; ``spec.affinity`` preserves unknown fields, so it keeps them all), and
``json.loads`` gives up at about 1,000 (``RecursionError``). Before, such a VM failed
every re-list of the VM informer and every replay of its watch event, so the caches
never synced and every new term stepped down at its sync deadline.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.controller.informer import Informer, Obj, Store, Undecodable
from neonvm.controller.sweeps import iter_items
from neonvm.dev.cluster import LocalCluster
from tests.support import health_port, metrics_of, replica_group, wait_for
from tests.support.harness import converged, create_vm, get_vm, runner_pods, vm_manifest

pytestmark = pytest.mark.cluster

POISON_DEPTH = 2000
"""Levels of nesting under ``spec.affinity``: twice what Python decodes."""


def vms_path(namespace: str) -> str:
    return f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}"


def raw_call(api: client.ApiClient, method: str, path: str, text: str = "",
             content_type: str = "application/json") -> int:
    """A request whose body is sent as written and whose answer is not decoded (the
    generated client would do both, and fail on either); the status."""
    resp = api.rest_client.pool_manager.request(
        method, api.configuration.host + path, body=text.encode() if text else None,
        headers={"Content-Type": content_type, "Accept": "application/json"})
    return int(resp.status)


def nested_json(depth: int) -> str:
    """An affinity nested ``depth`` levels deep, as JSON text."""
    return '{"nodeAffinity":' + '{"x":' * (depth - 1) + "1" + "}" * depth


def create_poison(api: client.ApiClient, namespace: str, name: str,
                  depth: int = POISON_DEPTH) -> None:
    body = vm_manifest(name)
    head = json.dumps({k: v for k, v in body.items() if k != "spec"})[:-1]
    text = (f'{head}, "spec": {{"guest": {json.dumps(body["spec"]["guest"])}, '
            f'"affinity": {nested_json(depth)}}}}}')
    status = raw_call(api, "POST", vms_path(namespace), text)
    assert status == 201, status


def cure(api: client.ApiClient, namespace: str, name: str) -> None:
    """Drop the deep affinity (a merge patch): the VM becomes an ordinary one."""
    status = raw_call(api, "PATCH", f"{vms_path(namespace)}/{name}",
                      json.dumps({"spec": {"affinity": None}}),
                      "application/merge-patch+json")
    assert status == 200, status


def relabel(api: client.ApiClient, namespace: str, name: str, value: str) -> None:
    status = raw_call(api, "PATCH", f"{vms_path(namespace)}/{name}",
                      json.dumps({"metadata": {"labels": {"touched": value}}}),
                      "application/merge-patch+json")
    assert status == 200, status


@pytest.fixture
def poisoned(api: client.ApiClient, namespace: str) -> Iterator[list[str]]:
    """Names of poison VMs to delete at the end (the namespace fixture's clean-up lists
    VMs with the generated client, which cannot decode them)."""
    names: list[str] = []
    yield names
    for name in names:
        raw_call(api, "PATCH", f"{vms_path(namespace)}/{name}",
                 json.dumps({"metadata": {"finalizers": None}}), "application/merge-patch+json")
        raw_call(api, "DELETE", f"{vms_path(namespace)}/{name}")


class Seen:
    """What an informer reported: changes by key, undecodable objects, re-lists."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.changes: list[tuple[str, bool]] = []
        self.undecodable: list[Undecodable] = []
        self.relists = 0

    def handler(self, key: str, old: Obj | None, new: Obj | None) -> None:
        with self.lock:
            self.changes.append((key, new is None))

    def poison(self, found: Undecodable) -> None:
        with self.lock:
            self.undecodable.append(found)

    def relisted(self, _name: str) -> None:
        with self.lock:
            self.relists += 1


def test_the_api_server_accepts_a_spec_nested_far_deeper_than_python_decodes(
        api: client.ApiClient, namespace: str, poisoned: list[str]) -> None:
    """The premise: 2,000 levels are stored, 10,000 is where the API server stops."""
    poisoned.append("deep")
    create_poison(api, namespace, "deep")
    resp = kube.Lister(api, vms_path(namespace))(_request_timeout=30)
    text = resp.data
    with pytest.raises(RecursionError):
        json.loads(text)
    doc_depth_limit = 10_000  # root, spec, affinity, then the affinity's own levels
    create_poison(api, namespace, "deepest", depth=doc_depth_limit - 2)
    poisoned.append("deepest")
    body = vm_manifest("too-deep")
    head = json.dumps({k: v for k, v in body.items() if k != "spec"})[:-1]
    refused = raw_call(api, "POST", vms_path(namespace),
                       f'{head}, "spec": {{"guest": {json.dumps(body["spec"]["guest"])}, '
                       f'"affinity": {nested_json(doc_depth_limit - 1)}}}}}')
    assert refused == 400


def test_a_vm_nested_too_deep_is_skipped_and_reported_once_per_version_and_the_rest_is_cached(
        api: client.ApiClient, namespace: str, poisoned: list[str]) -> None:
    create_vm(api, namespace, "before")
    poisoned.append("deep")
    create_poison(api, namespace, "deep")
    seen = Seen()
    informer = Informer("vms", kube.Lister(api, vms_path(namespace)), Store(compact=True),
                        seen.handler, on_relist=seen.relisted, on_undecodable=seen.poison,
                        watch_timeout=5, retry_backoff=0.2, relist_seconds=1.0)
    informer.start()
    try:
        # The re-list skips it and caches the rest: the caches sync.
        wait_for(informer.synced.is_set, 60, what="the caches to sync")
        assert informer.store.get(f"{namespace}/before") is not None
        assert informer.store.get(f"{namespace}/deep") is None
        # Re-lists (one a second here) do not report it again.
        wait_for(lambda: seen.relists >= 3, 60, what="three re-lists")
        assert [u.key for u in seen.undecodable] == [f"{namespace}/deep"]
        first = seen.undecodable[0]
        assert first.metadata["name"] == "deep" and first.metadata["uid"]
        assert "cannot be decoded" in first.reason

        # The watch goes on past it: a new version is reported, a new VM is cached.
        relabel(api, namespace, "deep", "once")
        create_vm(api, namespace, "after")
        wait_for(lambda: informer.store.get(f"{namespace}/after") is not None, 60,
                 what="a VM created after the poison to be cached")
        wait_for(lambda: len(seen.undecodable) == 2, 60, what="the new version reported")
        assert seen.undecodable[1].metadata["resourceVersion"] != \
            first.metadata["resourceVersion"]
        assert informer.store.get(f"{namespace}/deep") is None

        # Cured, it is an ordinary VM again.
        cure(api, namespace, "deep")
        cached = wait_for(lambda: informer.store.get(f"{namespace}/deep"), 60,
                          what="the cured VM to be cached")
        assert "affinity" not in cached["spec"]
        assert get_vm(api, namespace, "deep") is not None  # decodable everywhere now
    finally:
        informer.stop()


def test_a_cached_vm_that_turns_poison_leaves_the_cache_as_if_deleted(
        api: client.ApiClient, namespace: str, poisoned: list[str]) -> None:
    """A decodable VM patched into a poison one: its older version is not kept (nothing
    would be decided from a spec the server no longer has), and the handler hears of it."""
    create_vm(api, namespace, "turns")
    poisoned.append("turns")
    seen = Seen()
    informer = Informer("vms", kube.Lister(api, vms_path(namespace)), Store(compact=True),
                        seen.handler, on_undecodable=seen.poison, watch_timeout=5,
                        retry_backoff=0.2)
    informer.start()
    try:
        wait_for(lambda: informer.store.get(f"{namespace}/turns"), 60, what="cached")
        patch = '{"spec": {"affinity": ' + nested_json(POISON_DEPTH) + "}}"
        assert raw_call(api, "PATCH", f"{vms_path(namespace)}/turns", patch,
                        "application/merge-patch+json") == 200
        wait_for(lambda: seen.undecodable, 60, what="the poison version reported")
        assert informer.store.get(f"{namespace}/turns") is None
        assert (f"{namespace}/turns", True) in seen.changes
    finally:
        informer.stop()


def test_the_metadata_only_lists_of_the_resync_and_sweeps_read_past_a_poison_vm(
        api: client.ApiClient, namespace: str, poisoned: list[str]) -> None:
    """A metadata-only list carries ``managedFields``, which mirror the deep spec: the
    resync and the sweeps still read every VM's name, uid and resourceVersion."""
    create_vm(api, namespace, "plain")
    poisoned.append("deep")
    create_poison(api, namespace, "deep")
    lister = kube.Lister(api, vms_path(namespace))
    items = list(iter_items(lister, metadata_only=True))
    assert sorted(i["metadata"]["name"] for i in items) == ["deep", "plain"]
    assert all(i["metadata"]["uid"] and i["metadata"]["resourceVersion"] for i in items)
    with pytest.raises(kube.TooDeep):  # a full list is never read with parts dropped
        list(iter_items(lister))
    with pytest.raises(kube.TooDeep):  # nor is a direct read
        kube.request(api, "GET", f"{vms_path(namespace)}/deep")


# ---- real replicas ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_poison_vm_gets_a_warning_event_and_every_other_vm_converges_in_one_term(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, poisoned: list[str],
        tmp_path: Path) -> None:
    create_vm(api, namespace, "first")
    poisoned.append("deep")
    create_poison(api, namespace, "deep")
    with replica_group(cluster, api, namespace, tmp_path / "replicas", workers=4) as group:
        leader = group.start("r0")
        wait_for(lambda: group.leader() is leader, 60, what="r0 to lead")
        wait_for(lambda: "caches synced" in leader.log(), 60, what="the caches to sync")
        transitions = lease_transitions(api, namespace)
        others = [f"vm{i}" for i in range(4)]
        for name in others:
            create_vm(api, namespace, name)
        relabel(api, namespace, "deep", "later")  # a new version: one more Event
        wait_for(lambda: converged(api, namespace, ["first", *others]), 180,
                 what="every other VM to converge")

        def undecodable_events() -> list[Any]:
            return [e for e in client.CoreV1Api(api).list_namespaced_event(
                namespace, field_selector="involvedObject.name=deep").items
                if e.reason == "Undecodable"]

        events = wait_for(undecodable_events, 60, what="a Warning Event on the poison VM")
        assert all(e.type == "Warning" and "cannot be decoded" in e.message for e in events)
        port = wait_for(lambda: health_port(leader), 30, what="the health port")
        assert metrics_of(port)["neonvm_controller_undecodable_objects_total"] >= 1
        assert runner_pods(api, namespace, "deep") == []
        # One term throughout: no sync deadline missed, no step-down.
        assert group.leader() is leader and leader.running()
        assert lease_transitions(api, namespace) == transitions
        assert "stepping down" not in leader.log()


def lease_transitions(api: client.ApiClient, namespace: str) -> int:
    lease = client.CoordinationV1Api(api).read_namespaced_lease("neonvm-controller", namespace)
    return int(lease.spec.lease_transitions or 0)
