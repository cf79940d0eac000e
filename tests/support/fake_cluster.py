"""An in-memory :class:`~neonvm.controller.cluster.Cluster`, for table tests of the driver.

A pure-logic stand-in beside the real-server tests (``tests/test_reconcile*.py``): it
keeps VMs and pods as the API server would hand them out (raw JSON dicts, one
resourceVersion counter for everything) and answers each call with the preconditions and
errors of :mod:`neonvm.controller.cluster`'s table:

* ``put_status`` / ``put_main``: 404 for a missing VM, 409 when the record's
  resourceVersion is not the stored one; a ``put_main`` that removes the last finalizer
  of a VM being deleted deletes it;
* ``create_pod``: 409 when the name is taken; the pod gets a uid, a resourceVersion and
  phase Pending;
* ``ungate_pod``: 404 for a missing pod, 422 when a ``test`` fails (uid,
  resourceVersion, our gate at the index), as a JSON patch does;
* ``delete_pod``: 404 for a missing pod, 409 when the uid (or resourceVersion) differs;
  the pod is gone at once (no graceful termination);
* ``create_secret``: ``generateName`` gets a suffix, the Secret a uid (409 when the name
  is taken); ``get_secret`` / ``delete_secret``: 404 for a missing Secret.

:meth:`FakeCluster.fail` queues an error for the next call(s) of one kind, raised
*instead of* the call (nothing changes); :meth:`FakeCluster.race` queues a change by
someone else, made just before the next call of one kind is answered. Every call is
logged in :attr:`FakeCluster.calls`.
"""

from __future__ import annotations

import base64
import copy
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.api.schema import encode
from neonvm.api.types import VirtualMachineStatus
from neonvm.controller.cluster import VMRecord

CALLS = ("list_pods", "get_vm_raw", "get_pod", "secret_metadata", "namespace_meta",
         "put_status", "put_main",
         "create_pod", "ungate_pod", "delete_pod", "patch_pod_metadata", "username",
         "create_secret", "get_secret", "delete_secret")
"""Every call of the interface, by name (what :meth:`FakeCluster.fail` takes)."""


def api_error(status: int, reason: str = "") -> ApiException:
    """An error as the kubernetes client raises it for an API server answer."""
    exc = ApiException(status=status, reason=reason or f"status {status}")
    exc.body = f'{{"kind": "Status", "code": {status}, "message": "fake {status}"}}'
    return exc


class FakeCluster:
    """VMs and pods in memory, behind the :class:`~neonvm.controller.cluster.Cluster`
    calls."""

    def __init__(self, user: str = "system:serviceaccount:neonvm-system:neonvm") -> None:
        self.vms: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.deleting_namespaces: set[str] = set()
        """Namespaces marked for deletion (every other namespace exists, live)."""
        self.calls: list[tuple[str, str]] = []
        """(call, object name) of every call, in order, failed ones too."""
        self.user = user
        self._rv = 100
        self._uids = 0
        self._faults: dict[str, list[BaseException]] = defaultdict(list)
        self._races: dict[str, list[Callable[[FakeCluster], None]]] = defaultdict(list)

    # ---- set-up and inspection ---------------------------------------------------------

    def fail(self, call: str, *errors: BaseException) -> None:
        """The next ``len(errors)`` calls of ``call`` raise these, in order."""
        assert call in CALLS, call
        self._faults[call].extend(errors)

    def race(self, call: str, change: Callable[[FakeCluster], None]) -> None:
        """Just before the next call of ``call`` is answered, ``change`` is made (another
        writer's change landing between the caller's read and its write)."""
        assert call in CALLS, call
        self._races[call].append(change)

    def pending_faults(self, call: str) -> int:
        return len(self._faults[call]) + len(self._races[call])

    def count(self, call: str) -> int:
        return sum(1 for name, _ in self.calls if name == call)

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_vm(self, raw: dict[str, Any]) -> dict[str, Any]:
        meta = raw["metadata"]
        meta.setdefault("uid", self._uid("vm"))
        meta["resourceVersion"] = self.next_rv()
        self.vms[(meta["namespace"], meta["name"])] = raw
        return raw

    def add_pod(self, raw: dict[str, Any]) -> dict[str, Any]:
        meta = raw["metadata"]
        meta.setdefault("uid", self._uid(meta["name"]))
        meta["resourceVersion"] = self.next_rv()
        raw.setdefault("status", {"phase": "Pending"})
        self.pods[(meta["namespace"], meta["name"])] = raw
        return raw

    def vm(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.vms.get((namespace, name))

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pods.get((namespace, name))

    def _uid(self, what: str) -> str:
        self._uids += 1
        return f"{what}-uid-{self._uids}"

    def _enter(self, call: str, name: str) -> None:
        self.calls.append((call, name))
        if self._races[call]:
            self._races[call].pop(0)(self)
        if self._faults[call]:
            raise self._faults[call].pop(0)

    # ---- reads -------------------------------------------------------------------------

    def list_pods(self, namespace: str, vm_name: str) -> list[dict[str, Any]]:
        self._enter("list_pods", vm_name)
        return [copy.deepcopy(pod) for (ns, _), pod in sorted(self.pods.items())
                if ns == namespace
                and (pod["metadata"].get("labels") or {}).get(types.LABEL_VM_NAME) == vm_name]

    def get_vm_raw(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter("get_vm_raw", name)
        raw = self.vms.get((namespace, name))
        return copy.deepcopy(raw) if raw is not None else None

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter("get_pod", name)
        raw = self.pods.get((namespace, name))
        return copy.deepcopy(raw) if raw is not None else None

    def secret_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        self._enter("secret_metadata", name)
        raw = self.secrets.get((namespace, name))
        return {"metadata": copy.deepcopy(raw["metadata"])} if raw is not None else None

    def namespace_meta(self, name: str) -> dict[str, Any] | None:
        self._enter("namespace_meta", name)
        meta: dict[str, Any] = {"name": name}
        if name in self.deleting_namespaces:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        return {"metadata": meta}

    # ---- VM writes ---------------------------------------------------------------------

    def _stored_vm(self, record: VMRecord) -> dict[str, Any]:
        stored = self.vms.get((record.vm.namespace, record.vm.name))
        if stored is None:
            raise api_error(404, "NotFound")
        if stored["metadata"]["resourceVersion"] != record.resource_version:
            raise api_error(409, "Conflict")
        return stored

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord:
        self._enter("put_status", record.vm.name)
        stored = self._stored_vm(record)
        stored["status"] = encode(status)
        stored["metadata"]["resourceVersion"] = self.next_rv()
        return VMRecord.from_raw(copy.deepcopy(stored))

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord:
        self._enter("put_main", record.vm.name)
        stored = self._stored_vm(record)
        stored["metadata"]["finalizers"] = list(finalizers)
        stored["metadata"]["resourceVersion"] = self.next_rv()
        if not finalizers and stored["metadata"].get("deletionTimestamp"):
            del self.vms[(record.vm.namespace, record.vm.name)]
        return VMRecord.from_raw(copy.deepcopy(stored))

    # ---- pod writes --------------------------------------------------------------------

    def create_pod(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        self._enter("create_pod", name)
        if (namespace, name) in self.pods:
            raise api_error(409, "AlreadyExists")
        raw = copy.deepcopy(manifest)
        raw["metadata"]["namespace"] = namespace
        raw["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
        return copy.deepcopy(self.add_pod(raw))

    def ungate_pod(self, namespace: str, name: str, *, uid: str, resource_version: str,
                   gate_index: int) -> dict[str, Any]:
        self._enter("ungate_pod", name)
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404, "NotFound")
        gates = pod.get("spec", {}).get("schedulingGates") or []
        if (pod["metadata"]["uid"] != uid
                or pod["metadata"]["resourceVersion"] != resource_version
                or gate_index >= len(gates)
                or gates[gate_index].get("name") != types.SCHEDULING_GATE):
            raise api_error(422, "Invalid")  # a failed JSON patch "test"
        del gates[gate_index]
        pod["metadata"]["resourceVersion"] = self.next_rv()
        return copy.deepcopy(pod)

    def patch_pod_metadata(self, namespace: str, name: str, *, uid: str,
                           resource_version: str, metadata: dict[str, Any]) -> dict[str, Any]:
        self._enter("patch_pod_metadata", name)
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404, "NotFound")
        meta = pod["metadata"]
        if meta["uid"] != uid or meta["resourceVersion"] != resource_version:
            raise api_error(409, "Conflict")
        for field, change in metadata.items():
            values = meta.setdefault(field, {})
            for k, v in change.items():
                if v is None:
                    values.pop(k, None)
                else:
                    values[k] = v
        meta["resourceVersion"] = self.next_rv()
        return copy.deepcopy(pod)

    def delete_pod(self, namespace: str, name: str, *, uid: str,
                   resource_version: str | None = None,
                   grace_period_seconds: int | None = None) -> None:
        self._enter("delete_pod", name)
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise api_error(404, "NotFound")
        if pod["metadata"]["uid"] != uid or (
                resource_version is not None
                and pod["metadata"]["resourceVersion"] != resource_version):
            raise api_error(409, "Conflict")
        del self.pods[(namespace, name)]

    # ---- the token Secret (live scaling) -----------------------------------------------

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        meta = body["metadata"]
        name = meta.get("name") or f"{meta['generateName']}{self._uids + 1:05d}"
        self._enter("create_secret", name)
        if (namespace, name) in self.secrets:
            raise api_error(409, "AlreadyExists")
        raw = copy.deepcopy(body)
        raw.pop("stringData", None)
        raw["data"] = {**(body.get("data") or {}), **{
            k: base64.b64encode(v.encode()).decode()
            for k, v in (body.get("stringData") or {}).items()}}
        raw["metadata"].pop("generateName", None)
        raw["metadata"].update(name=name, namespace=namespace, uid=self._uid(name),
                               resourceVersion=self.next_rv())
        self.secrets[(namespace, name)] = raw
        return copy.deepcopy(raw)

    def get_secret(self, namespace: str, name: str) -> dict[str, Any]:
        self._enter("get_secret", name)
        raw = self.secrets.get((namespace, name))
        if raw is None:
            raise api_error(404, "NotFound")
        return copy.deepcopy(raw)

    def delete_secret(self, namespace: str, name: str) -> None:
        self._enter("delete_secret", name)
        if self.secrets.pop((namespace, name), None) is None:
            raise api_error(404, "NotFound")

    def username(self) -> str:
        self._enter("username", "")
        return self.user
