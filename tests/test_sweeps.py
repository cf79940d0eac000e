"""The orphan-pod sweep, over fake paginated lists: what it deletes, what it leaves, and
that it never holds the whole pod list (the real-server test is
``tests/test_reconcile_failover.py::test_a_pod_whose_vm_vanished_without_the_controller_is_swept``)."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import dataclass
from typing import Any, cast

import pytest
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.api import types
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.sweeps import METADATA_LIST, Sweeps
from neonvm.leader.lock import LockManager

pytestmark = pytest.mark.unit

NS = "default"


@dataclass
class Response:
    data: bytes

    def release_conn(self) -> None:
        pass


class PagedList:
    """A lister serving ``items`` ``limit`` at a time with ``continue`` tokens, as the API
    server does; it records every call's keywords."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kw: Any) -> Response:
        self.calls.append(kw)
        start = int(kw.get("_continue") or 0)
        end = start + kw["limit"]
        meta = {"continue": str(end)} if end < len(self.items) else {}
        return Response(json.dumps({"metadata": meta,
                                    "items": self.items[start:end]}).encode())


def recording(name: str, lister: PagedList, order: list[str]) -> Any:
    """``lister``, noting ``name`` in ``order`` at each call."""
    def call(**kw: Any) -> Response:
        order.append(name)
        return lister(**kw)
    return call


def pod(name: str, vm_uid: str | None, *, deleting: bool = False,
        padding: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "uid": f"pod-uid-{name}",
                            "labels": {types.LABEL_VM_UID: vm_uid} if vm_uid else {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    if padding:  # what managedFields weigh in a real metadata-only list
        meta["managedFields"] = [{"manager": "x" * padding}]
    return {"metadata": meta}


def vm(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": uid, "namespace": NS, "uid": uid}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sweeps(pods: PagedList, vms: PagedList, clock: Clock, deleted: list[tuple[str, str, str]],
           grace: float = 30.0) -> Sweeps:
    def delete_pod(namespace: str, name: str, uid: str) -> None:
        deleted.append((namespace, name, uid))

    return Sweeps(delete_pod=delete_pod, list_vms=vms, list_pods=pods,
                  locks=lambda: pytest.fail("the orphan sweep takes no locks"),
                  metrics=ControllerMetrics(), log=logger, orphan_grace_seconds=grace,
                  clock=clock)


def test_a_pod_whose_vm_is_listed_is_never_deleted_and_an_orphan_only_after_the_grace() -> None:
    pods = PagedList([pod("kept", "vm-1"), pod("orphan", "vm-gone"),
                      pod("going", "vm-gone", deleting=True), pod("unowned", None)])
    vms = PagedList([vm("vm-1")])
    clock = Clock()
    deleted: list[tuple[str, str, str]] = []
    sweep = sweeps(pods, vms, clock, deleted)

    sweep.orphan_pods()
    assert deleted == []  # first seen orphaned now: the grace starts

    clock.now += 29.0
    sweep.orphan_pods()
    assert deleted == []

    clock.now += 2.0
    sweep.orphan_pods()
    assert deleted == [(NS, "orphan", "pod-uid-orphan")]


def test_both_lists_are_metadata_only_and_pods_are_listed_before_vms() -> None:
    order: list[str] = []
    pods, vms = PagedList([pod("p", "vm-1")]), PagedList([vm("vm-1")])

    deleted: list[tuple[str, str, str]] = []
    Sweeps(delete_pod=lambda *a: deleted.append(a), list_vms=recording("vms", vms, order),
           list_pods=recording("pods", pods, order), locks=lambda: pytest.fail("no locks"),
           metrics=ControllerMetrics(), log=logger, orphan_grace_seconds=0.0,
           clock=Clock()).orphan_pods()
    assert order == ["pods", "vms"]
    assert all(c["_headers"] == {"Accept": METADATA_LIST} for c in pods.calls + vms.calls)
    assert deleted == []


def test_a_pod_already_gone_or_replaced_is_skipped_and_the_sweep_goes_on() -> None:
    pods = PagedList([pod("gone", "vm-x"), pod("replaced", "vm-x"), pod("next", "vm-x")])
    deleted: list[str] = []

    def delete_pod(namespace: str, name: str, uid: str) -> None:
        if name in ("gone", "replaced"):
            raise ApiException(status=404 if name == "gone" else 409)
        deleted.append(name)

    Sweeps(delete_pod=delete_pod, list_vms=PagedList([]), list_pods=pods,
           locks=lambda: pytest.fail("no locks"), metrics=ControllerMetrics(), log=logger,
           orphan_grace_seconds=0.0, clock=Clock()).orphan_pods()
    assert deleted == ["next"]


def test_the_sweep_holds_one_page_of_the_pod_list_at_a_time_not_the_whole_list() -> None:
    # 20 pages of 500 pods, each pod's metadata padded to about 4 KiB, as managedFields
    # make it: the whole list decoded would be far above the bound below.
    pods = PagedList([pod(f"p{i}", f"vm-{i}", padding=4000) for i in range(10_000)])
    vms = PagedList([vm(f"vm-{i}") for i in range(10_000)])
    page_bytes = len(pods(limit=500).data)
    pods.calls.clear()
    tracemalloc.start()
    try:
        sweeps(pods, vms, Clock(), []).orphan_pods()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(pods.calls) == 20
    # A page is held twice at most (its bytes and its decoded items), with the fake's
    # own encoding of it: well under 6 pages, against 20 pages for the whole list.
    assert peak < 6 * page_bytes, (peak, page_bytes)


def test_a_run_lists_pods_then_reads_the_locks_then_lists_vms_once_for_both_sweeps() -> None:
    order: list[str] = []
    pods, vms = PagedList([pod("orphan", "vm-gone")]), PagedList([vm("vm-1")])

    class Locks:
        def sweep(self, existing_vm_uids: Any) -> list[Any]:
            order.append("locks")
            assert existing_vm_uids() == {"vm-1"}
            return []

    deleted: list[tuple[str, str, str]] = []
    Sweeps(delete_pod=lambda *a: deleted.append(a), list_vms=recording("vms", vms, order),
           list_pods=recording("pods", pods, order), locks=lambda: cast(LockManager, Locks()),
           metrics=ControllerMetrics(),
           log=logger, orphan_grace_seconds=0.0, clock=Clock()).run()
    assert order == ["pods", "locks", "vms"]
    assert deleted == [(NS, "orphan", "pod-uid-orphan")]
