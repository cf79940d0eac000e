"""The list+watch cache against the real API server: events, 410 Gone, reconnects."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller.informer import Informer, Obj, Store
from neonvm.dev.cluster import LocalCluster
from tests.support import restart_api_server, wait_for
from tests.support.harness import create_vm, delete_vm

pytestmark = pytest.mark.cluster


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, bool]] = []
        self.relists = 0
        self._lock = threading.Lock()

    def handler(self, key: str, old: Obj | None, new: Obj | None) -> None:
        with self._lock:
            self.events.append((key, new is None))

    def relisted(self, _name: str) -> None:
        self.relists += 1

    def saw(self, key: str, deleted: bool = False) -> bool:
        with self._lock:
            return (key, deleted) in self.events


@pytest.fixture
def vm_lister(api: client.ApiClient, namespace: str) -> Any:
    custom = client.CustomObjectsApi(api)

    def lister(**kw: Any) -> Any:
        return custom.list_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                    types.PLURAL, **kw)
    return lister


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def informer(vm_lister: Any, recorder: Recorder) -> Iterator[Informer]:
    inf = Informer("vms", vm_lister, Store(), recorder.handler, on_relist=recorder.relisted,
                   watch_timeout=5, retry_backoff=0.2)
    yield inf
    inf.stop()


def test_the_cache_follows_creates_updates_and_deletes(
        api: client.ApiClient, namespace: str, informer: Informer, recorder: Recorder) -> None:
    create_vm(api, namespace, "before")
    informer.start()
    wait_for(informer.synced.is_set, 30)
    assert recorder.saw(f"{namespace}/before")
    create_vm(api, namespace, "after")
    wait_for(lambda: recorder.saw(f"{namespace}/after"), 30)
    delete_vm(api, namespace, "after")
    wait_for(lambda: recorder.saw(f"{namespace}/after", deleted=True), 30)
    assert informer.store.get(f"{namespace}/after") is None
    assert informer.store.get(f"{namespace}/before") is not None
    # A quiet watch times out (5 s here) and resumes without a relist.
    create_vm(api, namespace, "later")
    wait_for(lambda: recorder.saw(f"{namespace}/later"), 30)
    assert recorder.relists == 1


def test_a_watch_from_an_expired_version_relists_and_reports_what_it_missed(
        api: client.ApiClient, namespace: str, vm_lister: Any, recorder: Recorder) -> None:
    expired = {"first": True}

    def lister(**kw: Any) -> Any:
        if kw.get("watch") and expired["first"]:
            expired["first"] = False
            create_vm(api, namespace, "missed")  # happens while we are "disconnected"
            kw["resource_version"] = "1"  # long compacted out of the watch cache
        return vm_lister(**kw)

    inf = Informer("vms", lister, Store(), recorder.handler, on_relist=recorder.relisted,
                   watch_timeout=5, retry_backoff=0.2)
    inf.start()
    try:
        wait_for(lambda: recorder.saw(f"{namespace}/missed"), 30, what="relist after 410")
        assert recorder.relists >= 2
    finally:
        inf.stop()


def test_the_cache_reconnects_after_an_api_server_restart(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, informer: Informer,
        recorder: Recorder) -> None:
    informer.start()
    wait_for(informer.synced.is_set, 30)
    # SIGTERM: the server closes its listener and ends the watches at once; the process
    # then takes some 20 s to exit (the other components' long requests), which this
    # test need not wait for before the kill.
    cluster.stop_component("kube-apiserver", timeout=3.0)
    restart_api_server(cluster, api)
    wait_for(lambda: _try_create(api, namespace, "after-restart"), 60)
    wait_for(lambda: recorder.saw(f"{namespace}/after-restart"), 60)


def _try_create(api: client.ApiClient, namespace: str, name: str) -> bool:
    try:
        create_vm(api, namespace, name)
    except Exception:
        return False
    return True


def test_cached_objects_carry_no_managed_fields_and_a_put_of_one_keeps_the_servers(
        api: client.ApiClient, namespace: str, informer: Informer) -> None:
    custom = client.CustomObjectsApi(api)
    create_vm(api, namespace, "lean")
    informer.start()
    wait_for(informer.synced.is_set, 30)
    key = f"{namespace}/lean"
    cached = informer.store.get(key)
    assert cached is not None and "managedFields" not in cached["metadata"]
    server = custom.get_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                 types.PLURAL, "lean")
    assert server["metadata"].get("managedFields"), "the server records field managers"
    # The controller's finalizer write is a PUT of a cached copy; the server must not take
    # the missing list as "clear the field managers".
    body = dict(cached, metadata={**cached["metadata"], "labels": {"lean": "yes"}})
    written = custom.replace_namespaced_custom_object(types.GROUP, types.VERSION, namespace,
                                                      types.PLURAL, "lean", body)
    assert written["metadata"]["labels"] == {"lean": "yes"}
    assert written["metadata"].get("managedFields")
    assert {m["manager"] for m in written["metadata"]["managedFields"]} >= {
        m["manager"] for m in server["metadata"]["managedFields"]}
    wait_for(lambda: (informer.store.get(key) or {}).get("metadata", {}).get("labels")
             == {"lean": "yes"}, 30)
    assert "managedFields" not in (informer.store.get(key) or {})["metadata"]
