"""The sweeps' and the resync's metadata-only lists are bounded by bytes, and never skip
an item (security review H2; docs/security.md, "Exhaustion"). A VM's metadata alone can
weigh about 880 KB (30,000 empty annotations and their managedFields mirror), so 500 to
a page could exhaust the leader: a page above the byte budget is asked for again with
fewer items. And since a live VM missing from the list would make its pods look
orphaned, every item is decoded and yielded however large it is; a single item above
the budget fails the list, and the sweep then acts on nothing."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from loguru import logger

from neonvm.api import types
from neonvm.controller import sweeps as sweeps_module
from neonvm.controller.informer import MAX_CACHED_VM_BYTES
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.sweeps import Sweeps, live_vm_uids
from neonvm.kube import PageTooLarge
from neonvm.leader.lock import LockManager

pytestmark = pytest.mark.unit

NS = "default"
BUDGET = 64 * 1024
"""The page budget these tests set (the product's is 8 MiB)."""


class Response:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def release_conn(self) -> None:
        pass


class PagedList:
    """Serves ``items`` ``limit`` at a time with ``continue`` tokens, compact JSON as the
    API server writes it; records (continue, limit, bytes served) of every call."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.calls: list[tuple[str | None, int, int]] = []

    def __call__(self, **kw: Any) -> Response:
        start = int(kw.get("_continue") or 0)
        end = start + kw["limit"]
        meta = {"continue": str(end)} if end < len(self.items) else {}
        data = json.dumps({"metadata": meta, "items": self.items[start:end]},
                          separators=(",", ":")).encode()
        self.calls.append((kw.get("_continue"), kw["limit"], len(data)))
        return Response(data)


def vm(uid: str, annotations: int = 0) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": uid, "namespace": NS, "uid": uid}
    if annotations:  # empty annotations and the managedFields entry the server adds
        meta["annotations"] = {f"a{k}": "" for k in range(annotations)}
        meta["managedFields"] = [{"manager": "kubectl", "fieldsV1": {"f:metadata": {
            "f:annotations": {f"f:a{k}": {} for k in range(annotations)}}}}]
    return {"metadata": meta}


@pytest.fixture(autouse=True)
def small_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sweeps_module, "LIST_PAGE_BYTES", BUDGET)


def test_a_page_above_the_byte_budget_is_asked_again_with_a_quarter_of_the_items() -> None:
    vms = PagedList([vm(f"vm-{i:03}") for i in range(300)] +
                    [vm(f"big-{i}", annotations=1500) for i in range(8)] +
                    [vm(f"vm-{i:03}") for i in range(300, 320)])
    uids = live_vm_uids(vms)
    assert uids == {i["metadata"]["uid"] for i in vms.items}
    assert any(size > BUDGET for *_, size in vms.calls)
    for (token, limit, size), (next_token, next_limit, _) in zip(
            vms.calls, vms.calls[1:], strict=False):
        if size > BUDGET:  # dropped before decoding: the same page, fewer items
            assert (next_token, next_limit) == (token, max(1, limit // 4)), vms.calls
        else:
            assert next_token != token, vms.calls
    assert vms.calls[-1][2] <= BUDGET


def test_a_vm_above_the_informers_bound_is_still_listed_by_its_uid() -> None:
    """The informer leaves such a VM out of its cache; the sweeps must not: its uid is
    what keeps its runner pod from being taken for an orphan."""
    big = vm("big", annotations=MAX_CACHED_VM_BYTES // 8)
    assert len(json.dumps(big)) > MAX_CACHED_VM_BYTES
    vms = PagedList([vm("vm-a"), big, vm("vm-b")])
    with pytest.MonkeyPatch.context() as patch:  # a budget above the big one
        patch.setattr(sweeps_module, "LIST_PAGE_BYTES", 4 * len(json.dumps(big)))
        assert live_vm_uids(vms) == {"vm-a", "big", "vm-b"}


def test_one_item_above_the_budget_fails_the_sweep_and_no_pod_is_deleted() -> None:
    big = vm("vm-big", annotations=3000)
    assert len(json.dumps(big)) > BUDGET
    vms = PagedList([vm("vm-a"), big])
    pods = PagedList([{"metadata": {"name": n, "namespace": NS, "uid": f"pod-{n}",
                                    "labels": {types.LABEL_VM_UID: n}}}
                      for n in ("vm-a", "vm-big")])
    with pytest.raises(PageTooLarge):
        live_vm_uids(vms)
    deleted: list[tuple[str, str, str]] = []
    swept: list[set[str]] = []

    class Locks:
        def sweep(self, existing_vm_uids: Any) -> list[Any]:
            swept.append(existing_vm_uids())  # raises: no lock is deleted either
            return []

    Sweeps(delete_pod=lambda *a: deleted.append(a), list_vms=vms, list_pods=pods,
           locks=lambda: cast(LockManager, Locks()), metrics=ControllerMetrics(), log=logger,
           orphan_grace_seconds=0.0).run()  # logs the failure, as every failed sweep
    assert swept == [] and deleted == []
