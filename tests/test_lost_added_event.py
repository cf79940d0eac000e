"""A VM whose ADDED watch event is lost is still reconciled: the leader term re-lists, so
the periodic requeues and the sweep, which draw their keys from the informer's store, come
to it ("a lost watch event never stalls a VM", docs/protocol.md). Pure: the listers and the
watch are fakes, the leader term and its informers are the shipped ones."""

from __future__ import annotations

import copy
import json
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.api.types import FINALIZER
from neonvm.controller import informer as informer_module
from neonvm.controller.events import EventRecorder
from neonvm.controller.fault_wiring import FaultWiring
from neonvm.controller.faults import FaultConfig, Faults
from neonvm.controller.manager import ControllerConfig, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.rights import RightsLedger
from neonvm.controller.workqueue import WorkQueue
from neonvm.leader.election import Leadership

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
NS = "ns"


class _Resp:
    """What ``_preload_content=False`` calls return."""

    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj).encode()

    def release_conn(self) -> None:
        pass


def vm_object(status: dict[str, Any], name: str = "vm") -> dict[str, Any]:
    return {
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": name, "namespace": NS, "uid": UID, "resourceVersion": "10",
                     "generation": 1, "finalizers": [FINALIZER]},
        "spec": {"restartPolicy": "Always", "guest": {"rootDisk": {"image": "img"}}},
        "status": status,
    }


class _WatchResp:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def release_conn(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class _RecordingQueue(WorkQueue):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def add(self, key: str, direct: bool = False, *, periodic: bool = False) -> None:
        self.seen.add(key)
        super().add(key, direct, periodic=periodic)

    def add_after(self, key: str, delay: float, direct: bool = False, *,
                  periodic: bool = False) -> None:
        self.seen.add(key)
        super().add_after(key, delay, direct, periodic=periodic)


def test_a_vm_whose_added_event_was_lost_is_still_reconciled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    vm = vm_object({}, name="vm1")
    state = {"created": False, "added_sent": False}

    def fake_events(resp: _WatchResp) -> Any:
        yield from resp.events
        time.sleep(0.05)  # a quiet watch that ends (server-side timeout), then reconnects

    monkeypatch.setattr(informer_module, "_events", fake_events)

    def list_vms(watch: bool = False, **kw: Any) -> Any:
        if watch:
            if state["created"] and not state["added_sent"]:
                state["added_sent"] = True
                return _WatchResp([{"type": "ADDED", "object": copy.deepcopy(vm)}])
            return _WatchResp([])
        items = [copy.deepcopy(vm)] if state["created"] else []
        state["created"] = True  # the VM is created right after the first list
        return _Resp({"items": items, "metadata": {"resourceVersion": "5"}})

    def list_pods(watch: bool = False, **kw: Any) -> Any:
        if watch:
            return _WatchResp([])
        return _Resp({"items": [], "metadata": {"resourceVersion": "5"}})

    faults = Faults(FaultConfig(drop_watch_events=0.999999, seed=1))
    process = SimpleNamespace(
        config=ControllerConfig(workers=0, resync_seconds=0.3, plan_requeue_seconds=0.1,
                                sweep_seconds=0.3),
        metrics=ControllerMetrics(), api=client.ApiClient(), wiring=FaultWiring(faults),
        events=EventRecorder(None), etcd=None, etcd_config=SimpleNamespace(prefix="/t"),
        old_crd_warned=threading.Event(), rights=RightsLedger(), fencing=None,
        rights_endpoint=None, rights_reviewer=None,
    )
    leadership = Leadership(epoch=1, identity="me", valid_until=time.monotonic() + 3600)
    term = LeaderTerm(process, leadership)  # type: ignore[arg-type]
    term.queue = term.handler.queue = _RecordingQueue()
    term._list_vms, term._list_pods = list_vms, list_pods
    term.informers[0]._lister = list_vms
    term.informers[1]._lister = list_pods

    class NoLocks:
        def sweep(self, uids: Any) -> list[Any]:
            uids() if callable(uids) else None
            return []

        def held(self) -> list[Any]:
            return []

    term.locks = lambda: NoLocks()  # type: ignore[method-assign,assignment,return-value]

    runner = threading.Thread(target=term.run, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and f"{NS}/vm1" not in term.queue.seen:
            time.sleep(0.05)
        assert state["added_sent"], "the fake never delivered the ADDED event"
        assert f"{NS}/vm1" in term.queue.seen, (
            "the VM exists on the server but was never queued: its ADDED event was lost, "
            "and the resync, the mid-plan scan and the sweep only look at the cache")
    finally:
        leadership.lost.set()
        runner.join(5)
