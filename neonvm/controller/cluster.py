"""The driver's one seam to the API server: the calls a reconcile makes, as an interface.

:class:`Cluster` names every call the driver (:mod:`neonvm.controller.reconciler`) and
its direct reader (:class:`~neonvm.controller.observe.DirectReader`) make of the API
server for a VM, and nothing else:

===================  ============================================================
call                 what it is (statuses its callers handle themselves)
===================  ============================================================
``list_pods``        quorum list of the pods labelled for a VM
``get_vm_raw``       quorum GET of a VM (404: None)
``get_pod``          quorum GET of a pod (404: None)
``secret_metadata``  quorum GET of a Secret's metadata only (404: None; 403 is
                     "may not look", in ``DirectReader.secret_exists``)
``namespace_meta``   quorum GET of a VM's Namespace's metadata only (404: None;
                     any error is "cannot tell", in ``TerminatingNamespaces.look``)
``put_status``       PUT ``/status`` carrying the record's resourceVersion (409:
                     the conflict helper re-reads and re-applies the intent)
``put_main``         PUT of the main resource with new finalizers, the same way
``create_pod``       create a runner pod under exactly the manifest's name (every
                     status is sorted by ``classify_create_error``; 409: the name
                     is taken)
``ungate_pod``       remove our gate at an index, only if uid, resourceVersion and
                     that gate still match: a JSON patch with ``test`` operations
                     (404, 409, 422: a precondition failed; 403: refused)
``delete_pod``       delete a pod with a uid (and resourceVersion) precondition
                     (404: gone; 409: replaced)
``username``         who this client is to the API server (for messages; any error
                     is only named)
``create_secret``    create a VM's scaling-token Secret (live scaling; 429 and 5xx
                     hold the pod back, other refusals start it unscalable) or its
                     SSH key Secret (:mod:`~neonvm.controller.ssh_keys`; 409: there)
``get_secret``       quorum GET of a Secret, data included (404 raises: its two
                     callers in live scaling sort it themselves)
``delete_secret``    delete a token Secret that was not recorded (any error is
                     only logged)
===================  ============================================================

The error contract is the Kubernetes client's, so that the performers' handling is the
same whatever sits behind the interface: an answer of the API server that is not a
success raises :class:`kubernetes.client.exceptions.ApiException` with its ``status``
(409 a precondition or name conflict, 404 gone, 422 invalid or a failed ``test``, 403
refused, 429 and 5xx transient), and no answer at all (connection refused, a timeout)
raises :class:`urllib3.exceptions.HTTPError` or :class:`OSError`. Every error a caller
does not handle itself goes up to the handler, which sorts it
(:func:`neonvm.controller.handler.outcome_of_error`).

:class:`KubeCluster` is the shipped implementation (the ``kubernetes`` client, every
request with a 30 s timeout). Tests run the shipped driver over an in-memory one
(``tests/support/fake_cluster.py``). The Secret calls are
:class:`~neonvm.controller.scaling.RunnerScaling`'s (the VM's token Secret,
:class:`TokenSecrets`); its calls to the runner and its pod annotations do not go
through this interface.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.api.schema import encode
from neonvm.api.types import VirtualMachine, VirtualMachineStatus
from neonvm.controller.scaling_token import secret_path, secrets_path

PARTIAL_METADATA = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
"""Accept header asking the API server for an object's metadata alone."""

TIMEOUT = 30
"""Seconds each request may take."""
NAMESPACE_TIMEOUT = 5
"""Seconds a Namespace read may take: it only spares a create the API server would
refuse, so a worker does not wait on it long."""

JSON_PATCH = "application/json-patch+json"


@dataclass(frozen=True)
class VMRecord:
    """A decoded VM together with the raw object it was decoded from."""

    vm: VirtualMachine
    raw: dict[str, Any]

    @classmethod
    def from_raw(cls, raw: dict[str, Any]) -> VMRecord:
        return cls(vm=VirtualMachine.from_object(raw), raw=raw)

    @property
    def resource_version(self) -> str:
        return self.vm.resource_version


class ClusterReads(Protocol):
    """The quorum reads (``resourceVersion`` unset: the API server answers from etcd)."""

    def list_pods(self, namespace: str, vm_name: str) -> list[dict[str, Any]]:
        """The pods labelled ``vm.neon.tech/name=<vm_name>``."""
        ...

    def get_vm_raw(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def secret_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Secret as ``PartialObjectMetadata``: never its data."""
        ...


class TokenSecrets(Protocol):
    """The Secret calls of live scaling's token (:class:`~neonvm.controller.scaling.
    RunnerScaling`): errors raise as the rest of :class:`Cluster`'s, 404 included."""

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create the Secret ``body`` (``generateName`` allowed); the Secret as created."""
        ...

    def get_secret(self, namespace: str, name: str) -> dict[str, Any]:
        """The Secret ``name`` with its data (a quorum read; 404 raises)."""
        ...

    def delete_secret(self, namespace: str, name: str) -> None:
        """Delete the Secret ``name``."""
        ...


class Cluster(ClusterReads, TokenSecrets, Protocol):
    """Every call the driver makes of the API server (the module doc has the table)."""

    def namespace_meta(self, name: str) -> dict[str, Any] | None:
        """The Namespace ``name`` as ``PartialObjectMetadata`` (is it being deleted?)."""
        ...

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord:
        """PUT ``/status`` with ``record``'s resourceVersion; the VM as stored."""
        ...

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord:
        """PUT of ``record`` with ``finalizers``, with its resourceVersion; as stored."""
        ...

    def create_pod(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create the pod; the pod as created (409: the name is taken)."""
        ...

    def ungate_pod(self, namespace: str, name: str, *, uid: str, resource_version: str,
                   gate_index: int) -> dict[str, Any]:
        """Remove scheduling gate ``gate_index`` (ours) if the pod still has ``uid``,
        ``resource_version`` and our gate at that index; the pod as patched."""
        ...

    def patch_pod_metadata(self, namespace: str, name: str, *, uid: str,
                           resource_version: str, metadata: dict[str, Any]) -> dict[str, Any]:
        """Merge ``metadata`` (labels, annotations; None removes a key) into the pod if it
        still has ``uid`` and ``resource_version``; the pod as patched."""
        ...

    def delete_pod(self, namespace: str, name: str, *, uid: str,
                   resource_version: str | None = None,
                   grace_period_seconds: int | None = None) -> None:
        """Delete the pod if it still has ``uid`` (and ``resource_version``, if given);
        ``grace_period_seconds`` 0 removes it at once (a self-fenced pod)."""
        ...

    def username(self) -> str:
        """Who this client is to the API server (a SelfSubjectReview)."""
        ...


def ungate_patch(uid: str, resource_version: str, gate_index: int) -> list[dict[str, Any]]:
    """The JSON patch of :meth:`Cluster.ungate_pod`: three ``test`` operations (uid,
    resourceVersion, our gate at that index), then the removal of that gate only."""
    return [
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
        {"op": "test", "path": f"/spec/schedulingGates/{gate_index}/name",
         "value": types.SCHEDULING_GATE},
        {"op": "remove", "path": f"/spec/schedulingGates/{gate_index}"},
    ]


class VMWriter:
    """The two conditional writes of a VM: PUT ``/status`` and PUT of the main resource.

    Both carry ``metadata.resourceVersion`` of the record they are given, so the API
    server refuses them (409) if the VM changed since that version: never a blind write.
    """

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord:
        """PUT /status carrying the resourceVersion of ``record`` (never a blind patch)."""
        vm = record.vm
        body = {
            "apiVersion": types.API_VERSION,
            "kind": types.KIND,
            "metadata": {"name": vm.name, "namespace": vm.namespace,
                         "resourceVersion": record.resource_version},
            "status": encode(status),
        }
        raw = kube.request(self._api, "PUT", f"{vm_path(vm.namespace, vm.name)}/status",
                           body=body, timeout=TIMEOUT)
        return VMRecord.from_raw(raw)

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord:
        """PUT of the main resource with new finalizers, carrying the resourceVersion."""
        body = copy.deepcopy(record.raw)
        body["metadata"]["finalizers"] = finalizers
        vm = record.vm
        raw = kube.request(self._api, "PUT", vm_path(vm.namespace, vm.name), body=body,
                           timeout=TIMEOUT)
        return VMRecord.from_raw(raw)


class KubeCluster(VMWriter):
    """:class:`Cluster` through raw REST calls (:func:`neonvm.kube.request`; what the
    controller ships): plain JSON in and out, none of the client's generated API classes
    (importing one costs a replica memory: docs/benchmarks.md, "At scale")."""

    def list_pods(self, namespace: str, vm_name: str) -> list[dict[str, Any]]:
        body = kube.request(self._api, "GET", f"/api/v1/namespaces/{namespace}/pods",
                            query=[("labelSelector", f"{types.LABEL_VM_NAME}={vm_name}")],
                            timeout=TIMEOUT)
        items: list[dict[str, Any]] = body.get("items") or []
        return items

    def get_vm_raw(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.get_or_none(self._api, vm_path(namespace, name), timeout=TIMEOUT)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.get_or_none(self._api, f"/api/v1/namespaces/{namespace}/pods/"
                                f"{kube.path_segment(name)}", timeout=TIMEOUT)

    def secret_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        return kube.get_or_none(self._api, f"/api/v1/namespaces/{namespace}/secrets/"
                                f"{kube.path_segment(name)}", accept=PARTIAL_METADATA,
                                timeout=TIMEOUT)

    def namespace_meta(self, name: str) -> dict[str, Any] | None:
        # The path names the namespace itself, so a Role in that namespace may grant it
        # (controller.watchNamespace): the API server authorizes GET /api/v1/namespaces/X
        # as a request in namespace X.
        return kube.get_or_none(self._api, f"/api/v1/namespaces/{kube.path_segment(name)}",
                                accept=PARTIAL_METADATA, timeout=NAMESPACE_TIMEOUT)

    def create_pod(self, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        # A raw request: the generated method validates the manifest into a typed model
        # and the answer into another, then the caller wanted a dict again (CPU under
        # the GIL every worker shares). The API server validates
        # the pod; its answer is the JSON decoded as it came.
        return kube.request(self._api, "POST", f"/api/v1/namespaces/{namespace}/pods",
                            body=manifest, timeout=TIMEOUT)

    def ungate_pod(self, namespace: str, name: str, *, uid: str, resource_version: str,
                   gate_index: int) -> dict[str, Any]:
        return kube.request(self._api, "PATCH",
                            f"/api/v1/namespaces/{namespace}/pods/{kube.path_segment(name)}",
                            body=ungate_patch(uid, resource_version, gate_index),
                            content_type=JSON_PATCH, timeout=TIMEOUT)

    def patch_pod_metadata(self, namespace: str, name: str, *, uid: str,
                           resource_version: str, metadata: dict[str, Any]) -> dict[str, Any]:
        body = {"metadata": {**metadata, "uid": uid, "resourceVersion": resource_version}}
        return kube.request(self._api, "PATCH",
                            f"/api/v1/namespaces/{namespace}/pods/{kube.path_segment(name)}",
                            body=body, content_type="application/merge-patch+json",
                            timeout=TIMEOUT)

    def delete_pod(self, namespace: str, name: str, *, uid: str,
                   resource_version: str | None = None,
                   grace_period_seconds: int | None = None) -> None:
        preconditions = {"uid": uid}
        if resource_version is not None:
            preconditions["resourceVersion"] = resource_version
        body: dict[str, Any] = {"preconditions": preconditions}
        if grace_period_seconds is not None:
            body["gracePeriodSeconds"] = grace_period_seconds
        kube.request(self._api, "DELETE",
                     f"/api/v1/namespaces/{namespace}/pods/{kube.path_segment(name)}",
                     body=body, timeout=TIMEOUT)

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return kube.request(self._api, "POST", secrets_path(namespace), body=body,
                            timeout=TIMEOUT)

    def get_secret(self, namespace: str, name: str) -> dict[str, Any]:
        return kube.request(self._api, "GET", secret_path(namespace, name), timeout=TIMEOUT)

    def delete_secret(self, namespace: str, name: str) -> None:
        kube.request(self._api, "DELETE", secret_path(namespace, name), timeout=TIMEOUT)

    def username(self) -> str:
        review = kube.request(
            self._api, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            timeout=10)
        return str(((review.get("status") or {}).get("userInfo") or {}).get("username"))


def vm_path(namespace: str, name: str) -> str:
    """The REST path of a VirtualMachine."""
    return (f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}/"
            f"{kube.path_segment(name)}")
