"""The leader's rights endpoint as shipped, for tests (neonvm/controller/rights.py; the
protocol: docs/protocol.md, "Self-fencing").

:class:`ShippedLeader` serves the real :class:`~neonvm.controller.rights.RightsServer`
(its HTTP listener), :class:`~neonvm.controller.rights.RightsService`,
:class:`~neonvm.controller.rights.RightsLedger` and
:class:`~neonvm.controller.rights.TokenCache` on a real socket, over caches holding one
VM and its pod, so that a real runner asks the code a leader runs and a regression in it
fails the test. Also the caches, Secret and ask helpers the rights tests share."""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import time
from typing import Any

from prometheus_client import CollectorRegistry

from neonvm.api.millicpu import MilliCPU
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION, RIGHTS_PATH, annotation_value
from neonvm.api.types import FINALIZER, VirtualMachine, VirtualMachineSpec, VirtualMachineStatus
from neonvm.controller.observe import pod_index
from neonvm.controller.rights import RightsLedger, RightsServer, RightsService, TokenCache

ANSWERS = "neonvm_controller_rights_answers_total"
SECRET_UID = "sec-uid"


class Cache(dict[str, Any]):
    """A term's cache by ``namespace/name``, pods also by their VM's key."""

    def by_index(self, value: str) -> list[dict[str, Any]]:
        return [p for p in self.values() if pod_index(p) == value]


def caches(namespace: str = "ns", vm_name: str = "vm", vm_uid: str = "vm-uid-1",
           pod_uid: str = "pod-uid-1", seconds: float = 10.0, *, annotated: bool = True,
           moved_on: bool = False, terminating: bool = False) -> tuple[Cache, Cache]:
    """A VM whose current pod is ``pod_uid`` (``<vm>-p``), self-fencing with a right of
    ``seconds`` (unless not ``annotated``), its token in the Secret ``tok``
    (:func:`secret`); ``moved_on``: another pod committed since; ``terminating``: the
    pod is shutting down."""
    vm = {"metadata": {"name": vm_name, "namespace": namespace, "uid": vm_uid},
          "status": {"podName": f"{vm_name}-p", "podUID": pod_uid,
                     "scalingTokenSecret": "tok", "scalingTokenSecretUID": SECRET_UID}}
    annotations = {RIGHT_SECONDS_ANNOTATION: annotation_value(seconds)} if annotated else {}
    pod: dict[str, Any] = {"metadata": {
        "name": f"{vm_name}-p", "namespace": namespace, "uid": pod_uid,
        "annotations": annotations, "labels": {"vm.neon.tech/name": vm_name},
        "ownerReferences": [{"uid": vm_uid, "controller": True}]}}
    if moved_on:
        vm["status"].update(podName=f"{vm_name}-q", podUID=f"{pod_uid}-q")
    if terminating:
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return (Cache({f"{namespace}/{vm_name}": vm}),
            Cache({f"{namespace}/{vm_name}-p": pod}))


def secret(token: bytes, uid: str = SECRET_UID) -> dict[str, Any]:
    """The token Secret as the API server gives it."""
    return {"metadata": {"uid": uid}, "data": {"token": base64.b64encode(token).decode()}}


def ask(port: int, body: Any, authorization: str | None = None, raw: bytes | None = None,
        host: str = "127.0.0.1") -> tuple[int, dict[str, Any]]:
    """One ``POST /v1/rights`` over a real socket: (status, body)."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    conn.request("POST", RIGHTS_PATH, body=raw if raw is not None else json.dumps(body),
                 headers=headers)
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    conn.close()
    return answer.status, doc


class ShippedLeader:
    """The shipped rights endpoint on ``host`` (a free port), for one VM ``namespace/vm``
    whose current pod is ``pod_uid`` with a right of ``seconds``, its scaling token
    ``token``.

    It starts as a standby (no term: every ask is answered 503 ``NotLeader``). The test
    moves it as a leader's life would: :meth:`lead` (a term begins), :meth:`depose` (it
    ends), :meth:`condemn`. What it answered is read from the service's own counter."""

    def __init__(self, seconds: float, *, token: bytes, pod_uid: str, namespace: str,
                 vm: str, host: str = "127.0.0.1") -> None:
        self.seconds = seconds
        self.pod_uid = pod_uid
        self.skipped = 0.0
        """Seconds the ledger's clock was moved on (:meth:`condemn`)."""
        self.synced = True
        """Whether the term's caches have synced (until then a term answers 503)."""
        self.marks: list[tuple[str, str, str]] = []
        self.ledger = RightsLedger(lambda: time.monotonic() + self.skipped)
        self._caches = caches(namespace, vm, pod_uid=pod_uid, seconds=seconds)
        self._secret = secret(token)
        self.registry = CollectorRegistry()
        service = RightsService(self.ledger, lambda: self._caches if self.synced else None,
                                TokenCache(None, read=lambda _ns, _name: self._secret),
                                self._mark, registry=self.registry)
        self.server = RightsServer(service, host, 0).start()
        self.url = f"http://{host}:{self.server.port}"

    def _mark(self, namespace: str, name: str, uid: str) -> bool:
        """The pod write before a term's first grant: the pod is there."""
        self.marks.append((namespace, name, uid))
        return True

    def lead(self) -> None:
        """A term begins (its caches synced): asks are answered by the ledger."""
        self.synced = True
        self.ledger.begin_term(lambda: True)

    def depose(self) -> None:
        """The term ends: every ask is answered 503 ``NotLeader`` again."""
        self.ledger.end_term()

    def condemn(self) -> None:
        """A term begins and its ledger condemns the pod before it was ever granted (as
        :class:`~neonvm.controller.fencing.SelfFencing` does for a pod on a lost node):
        the ledger's clock is moved on to when the pod's right is surely over rather
        than waited out. Meanwhile asks are answered 503, as a term's are until its
        caches have synced, so that no grant slips in first. Every ask is refused as
        ``Condemned`` from then on."""
        self.synced = False
        self.ledger.begin_term(lambda: True)
        self.skipped += self.ledger.remaining(self.pod_uid, self.seconds)
        assert self.ledger.condemn(self.pod_uid, self.seconds) == 0.0
        self.synced = True

    def answered(self, code: int | None = None, reason: str | None = None) -> int:
        """How many asks the service answered (with that status code and reason)."""
        total = 0.0
        for metric in self.registry.collect():
            for sample in metric.samples:
                if (sample.name == ANSWERS
                        and code in (None, int(sample.labels["code"]))
                        and reason in (None, sample.labels["reason"])):
                    total += sample.value
        return int(total)

    def close(self) -> None:
        self.server.stop()


def fencing_vm(token: str | None = None, *, scalable: bool = False,
               **spec: Any) -> VirtualMachine:
    """A VM ``ns/vm`` for pod-spec tests of self-fencing (``scalable``: cpus.max 2, so it
    may scale live), with a scaling token Secret recorded when ``token``."""
    v = VirtualMachine(name="vm", namespace="ns", uid="0123456789abcdef",
                       resource_version="1", generation=1,
                       spec=VirtualMachineSpec(restart_policy="Always", **spec),
                       status=VirtualMachineStatus(scaling_token_secret=token,
                                                   scaling_token_secret_uid="s-uid"
                                                   if token else None),
                       finalizers=[FINALIZER])
    if not scalable:
        return v
    guest = dataclasses.replace(v.spec.guest, cpus=dataclasses.replace(
        v.spec.guest.cpus, max=MilliCPU.parse("2")))
    return dataclasses.replace(v, spec=dataclasses.replace(v.spec, guest=guest))
