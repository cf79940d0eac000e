"""Adversarial review: failing tests that demonstrate findings (no servers needed).

Each test names its finding. They drive the shipped code (decide, the reconciler driver,
the direct reader, the leader term's housekeeping, the informer) against small in-memory
fakes of the Kubernetes client calls, so they run in well under a second each.

* F1: a VM whose name is longer than 63 characters is admitted by the CRD, but its name
  is used as a label value (runner pod label and the label selector of every direct
  list): pod creation is refused and every direct list is a 400, so the VM never runs
  and, once deleted, is stuck terminating forever (the finalizer is never dropped).
* F2: a VM whose ADDED watch event is lost is never reconciled: every periodic requeue
  (mid-plan scan, resync) and the sweep draw their keys from the informer's store, and
  nothing re-lists, so the "a lost watch event never stalls a VM" promise fails.
* F3: a pod with the planned name that is *not* labelled for the VM makes every create
  answer AlreadyExists; the driver re-observes (the labelled list never shows that pod),
  decides CreatePod again, and spins: 30 creates per reconcile, requeued at once, forever.
* F4: "pod gone" is judged from the pod list taken *before* the VM read (docs/protocol.md step 4
  asks for a direct GET of the pod): a pod created and committed between the two reads
  is taken for gone, and a healthy VM is restarted (its new pod deleted).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.api import types
from neonvm.api.crd import virtualmachine_crd
from neonvm.api.types import (
    FINALIZER,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import decide as d
from neonvm.controller import informer as informer_module
from neonvm.controller import podspec
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.events import EventRecorder
from neonvm.controller.fault_wiring import FaultWiring
from neonvm.controller.faults import FaultConfig, Faults
from neonvm.controller.manager import ControllerConfig, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.observe import DirectReader
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from neonvm.controller.rights import RightsLedger
from neonvm.controller.workqueue import WorkQueue
from neonvm.leader.election import Leadership
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
NS = "ns"


# ---- a tiny in-memory API server at the level of the controller's raw REST calls --------


class _Resp:
    """What ``_preload_content=False`` calls return."""

    def __init__(self, obj: Any) -> None:
        self.data = json.dumps(obj).encode()

    def release_conn(self) -> None:
        pass


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for req in filter(None, (s.strip() for s in selector.split(","))):
        key, eq, value = req.partition("=")
        if eq:
            if labels.get(key) != value:
                return False
        elif key not in labels:
            return False
    return True


def _resolve(obj: Any, path: str) -> tuple[Any, str | int]:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    for part in parts[:-1]:
        obj = obj[int(part)] if isinstance(obj, list) else obj[part]
    last: str | int = int(parts[-1]) if isinstance(obj, list) else parts[-1]
    return obj, last


class FakeAPI:
    """The API server's pods and one VM in one namespace, at the level of the controller's
    raw REST calls: :meth:`request` stands in for :func:`neonvm.kube.request`."""

    def __init__(self, vm: dict[str, Any], pods: list[dict[str, Any]] = ()) -> None:  # type: ignore[assignment]
        self.vm: dict[str, Any] | None = copy.deepcopy(vm)
        self.pods: dict[str, dict[str, Any]] = {p["metadata"]["name"]: copy.deepcopy(p)
                                                for p in pods}
        self.rv = 100
        self.creates: list[str] = []
        self.deletes: list[str] = []
        self.on_get_vm: Any = None
        """Hook run inside a VM GET, before it answers (another actor's writes)."""

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def request(self, api: Any, method: str, path: str, body: Any = None,
                query: list[tuple[str, str]] | None = None, **kw: Any) -> dict[str, Any]:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"] and parts[4] == "pods":
            name = parts[5] if len(parts) > 5 else None
            if name is None:
                if method == "GET":
                    return self.list_pods(dict(query or []).get("labelSelector", ""))
                assert method == "POST", (method, path)
                return self.create_pod(parts[3], body)
            handler = {"GET": self.get_pod, "PATCH": self.patch_pod,
                       "DELETE": self.delete_pod}[method]
            return handler(name, body)
        assert parts[:2] == ["apis", types.GROUP] and parts[5] == types.PLURAL, path
        if method == "GET":
            return self.get_vm(parts[6])
        assert method == "PUT", (method, path)
        return self.put_status(body) if parts[-1] == "status" else self.put_main(body)

    # -- pods --
    def list_pods(self, label_selector: str) -> dict[str, Any]:
        items = [copy.deepcopy(p) for p in self.pods.values()
                 if _selector_matches(label_selector,
                                      p["metadata"].get("labels") or {})]
        return {"items": items, "metadata": {"resourceVersion": str(self.rv)}}

    def get_pod(self, name: str, body: Any = None) -> dict[str, Any]:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(pod)

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(body)
        name = pod["metadata"]["name"]
        self.creates.append(name)
        if name in self.pods:
            raise ApiException(status=409, reason="AlreadyExists")
        pod["metadata"].update(uid=f"uid-{name}", resourceVersion=self.next_rv(),
                               namespace=namespace)
        pod["status"] = {"phase": "Pending"}
        self.pods[name] = pod
        return copy.deepcopy(pod)

    def patch_pod(self, name: str, body: Any) -> dict[str, Any]:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiException(status=404, reason="Not Found")
        new = copy.deepcopy(pod)
        for op in body:
            parent, last = _resolve(new, op["path"])
            if op["op"] == "test":
                if parent[last] != op["value"]:  # type: ignore[index]
                    raise ApiException(status=422, reason="test failed")
            elif op["op"] == "remove":
                del parent[last]  # type: ignore[arg-type]
            else:  # pragma: no cover
                raise AssertionError(op)
        new["metadata"]["resourceVersion"] = self.next_rv()
        self.pods[name] = new
        return copy.deepcopy(new)

    def delete_pod(self, name: str, body: Any = None) -> dict[str, Any]:
        pod = self.pods.get(name)
        if pod is None:
            raise ApiException(status=404, reason="Not Found")
        uid = ((body or {}).get("preconditions") or {}).get("uid")
        if uid is not None and uid != pod["metadata"]["uid"]:
            raise ApiException(status=409, reason="Conflict")
        self.deletes.append(name)
        del self.pods[name]  # never scheduled: gone at once
        return {}

    # -- VMs --
    def get_vm(self, name: str) -> dict[str, Any]:
        if self.on_get_vm is not None:
            hook, self.on_get_vm = self.on_get_vm, None
            hook(self)
        if self.vm is None or self.vm["metadata"]["name"] != name:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.vm)

    def _check_rv(self, body: dict[str, Any]) -> None:
        assert self.vm is not None
        if body["metadata"].get("resourceVersion") != self.vm["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")

    def put_status(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_rv(body)
        assert self.vm is not None
        self.vm["status"] = copy.deepcopy(body.get("status") or {})
        self.vm["metadata"]["resourceVersion"] = self.next_rv()
        return copy.deepcopy(self.vm)

    def put_main(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_rv(body)
        assert self.vm is not None
        self.vm["metadata"]["finalizers"] = list(body["metadata"].get("finalizers") or [])
        self.vm["metadata"]["resourceVersion"] = self.next_rv()
        return copy.deepcopy(self.vm)


def vm_object(status: dict[str, Any], name: str = "vm") -> dict[str, Any]:
    return {
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": name, "namespace": NS, "uid": UID, "resourceVersion": "10",
                     "generation": 1, "finalizers": [FINALIZER]},
        "spec": {"restartPolicy": "Always", "guest": {"rootDisk": {"image": "img"}}},
        "status": status,
    }


def reconciler_on(fake: FakeAPI, monkeypatch: pytest.MonkeyPatch) -> Reconciler:
    """A reconciler whose every API call (reads, VM writes, pod writes) ``fake`` answers."""
    monkeypatch.setattr(kube, "request", fake.request)
    return shipped_reconciler(client.ApiClient(), config=ReconcilerConfig(max_steps=30))


def runner_pod_object(vm: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod exactly as the controller would have created it for ``vm``."""
    decoded = VirtualMachine.from_object(vm)
    plan = PendingPod(name=name, plan_seq=1, token=1, epoch=1, generation=1)
    pod = podspec.runner_pod(decoded, plan)
    pod["metadata"].update(uid=f"uid-{name}", resourceVersion="50")
    pod["status"] = {"phase": "Pending"}
    return pod


# ---- F1: VM names over 63 characters ------------------------------------------------------

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _longest_admitted_name() -> int:
    """The longest metadata.name the CRD admits (253 unless it says otherwise)."""
    schema = virtualmachine_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    limit = 253
    meta = schema.get("properties", {}).get("metadata", {})
    limit = min(limit, meta.get("properties", {}).get("name", {}).get("maxLength", limit))
    for rule in schema.get("x-kubernetes-validations", []) or []:
        m = re.search(r"metadata\.name\.size\(\)\s*<(=?)\s*(\d+)", rule.get("rule", ""))
        if m:
            limit = min(limit, int(m.group(2)) - (0 if m.group(1) else 1))
    return limit


def test_f1_every_vm_name_the_crd_admits_yields_valid_pod_labels_and_selectors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = "v" * _longest_admitted_name()
    vm = VirtualMachine(name=name, namespace=NS, uid=UID, resource_version="1", generation=1,
                        spec=VirtualMachineSpec(), status=VirtualMachineStatus(),
                        finalizers=[FINALIZER])
    plan = PendingPod(name=d.plan_name(vm, 1), plan_seq=1, token=1, epoch=1, generation=1)
    pod = podspec.runner_pod(vm, plan)
    assert len(pod["metadata"]["name"]) <= 253, (
        f"runner pod name has {len(pod['metadata']['name'])} chars (> 253): refused (422)")
    for key, value in pod["metadata"]["labels"].items():
        assert len(value) <= 63 and LABEL_VALUE.match(value), (
            f"runner pod label {key}={value[:20]}... ({len(value)} chars) is not a valid "
            f"label value: the API server refuses the pod (422)")

    selectors: list[str] = []

    def list_pods(api: Any, method: str, path: str, query: Any = None,
                  **kw: Any) -> dict[str, Any]:
        selectors.append(dict(query or []).get("labelSelector", ""))
        return {"items": []}

    reader = DirectReader(KubeCluster(client.ApiClient()))
    monkeypatch.setattr(kube, "request", list_pods)
    reader.list_pods(NS, name)
    for req in selectors[0].split(","):
        _key, _eq, value = req.partition("=")
        assert len(value) <= 63 and LABEL_VALUE.match(value), (
            f"the direct pod list uses selector value of {len(value)} chars: the API server "
            f"answers 400, so no direct observation (create, ungate, delete, finalize) is "
            f"ever possible and a deleted VM is stuck terminating")


# ---- F2: a lost ADDED event -----------------------------------------------------------------


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


def test_f2_a_vm_whose_added_event_was_lost_is_still_reconciled(
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
        rights_endpoint=None,
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


# ---- F3: an unlabelled pod holding the planned name ----------------------------------------


def test_f3_a_planned_name_taken_by_a_pod_not_labelled_for_the_vm_does_not_spin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = f"vm-{UID[:8]}-1"
    vm = vm_object({"phase": "Pending", "planSeq": 1,
                    "pendingPod": {"name": x, "planSeq": 1, "token": 1, "epoch": 1,
                                   "generation": 1}})
    intruder = {"metadata": {"name": x, "namespace": NS, "uid": "intruder",
                             "resourceVersion": "7", "labels": {"app": "something-else"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
                "status": {"phase": "Running"}}
    fake = FakeAPI(vm, [intruder])
    result = reconciler_on(fake, monkeypatch).reconcile(f"{NS}/vm", StaticAuthority(),
                                                        direct_first=True)
    assert fake.creates.count(x) <= 2, (
        f"create {x} answered AlreadyExists {fake.creates.count(x)} times in one reconcile "
        f"(ended with {type(result.action).__name__}: {result.action.reason}, requeue after "
        f"{result.requeue_after}s): the driver spins instead of dropping the plan")


# ---- F4: gone judged from the list taken before the VM read ---------------------------------


def test_f4_a_pod_committed_between_the_list_and_the_vm_read_is_not_taken_for_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = f"vm-{UID[:8]}-1"
    vm = vm_object({"phase": "Pending", "planSeq": 1,
                    "pendingPod": {"name": x, "planSeq": 1, "token": 1, "epoch": 1,
                                   "generation": 1}})
    fake = FakeAPI(vm)

    def another_actor_creates_and_commits(api: FakeAPI) -> None:
        # Between our LIST (no pods yet) and our GET of the VM, another actor (a second
        # controller instance, or one whose pause outlived its term) creates X and
        # commits it. X is healthy and gated.
        assert api.vm is not None
        api.pods[x] = runner_pod_object(api.vm, x)
        api.vm["status"].update(podName=x, podUID=f"uid-{x}", pendingPod=None)
        api.vm["status"] = {k: v for k, v in api.vm["status"].items() if v is not None}
        api.vm["metadata"]["resourceVersion"] = api.next_rv()

    fake.on_get_vm = another_actor_creates_and_commits
    reconciler_on(fake, monkeypatch).reconcile(f"{NS}/vm", StaticAuthority(), direct_first=True)
    assert fake.vm is not None
    status = fake.vm["status"]
    assert status.get("restartCount", 0) == 0 and x not in fake.deletes, (
        f"{x} existed and was healthy, yet it was taken for gone (it was missing from the "
        f"list taken before the VM read): restartCount={status.get('restartCount')}, "
        f"deleted={fake.deletes}, podName={status.get('podName')}")
