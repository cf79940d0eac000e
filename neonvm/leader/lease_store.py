"""Where the Lease lives: a narrow store protocol and its Kubernetes implementation.

The elector (``neonvm/leader/election.py``) makes every decision; this module only reads
and writes one Lease. :class:`LeaseStore` is the seam, shaped like client-go's
``resourcelock.Interface``: ``get``, ``create`` and ``update`` with the ``resourceVersion``
the decision was made from, plus ``watch``, which only says *that* the Lease may have
changed. :class:`KubernetesLeaseStore` is the ``coordination.k8s.io/v1`` implementation;
tests drive the elector over an in-memory store with the same contract.

The contract every store keeps:

* ``get`` is a fresh read (for Kubernetes: a quorum read, never a cache); ``None`` when
  the Lease does not exist.
* ``create`` fails with :class:`LeaseConflict` when the Lease already exists.
* ``update(base, ...)`` succeeds only if the Lease is still at ``base.resource_version``
  (compare-and-swap) and fails with :class:`LeaseConflict` otherwise; the returned record
  carries the new version.
* ``update`` of a Lease that no longer exists fails with :class:`LeaseNotFound` (a
  :class:`LeaseConflict`): the object the write was based on is gone.
* ``renew(base, ...)`` is the holder's write: it succeeds only if the Lease still has
  ``base``'s uid (when ``base`` has one), ``holderIdentity`` and ``leaseTransitions``,
  *whatever its resourceVersion*, and fails with :class:`LeaseConflict` otherwise
  (:class:`LeaseNotFound` when gone). It does not depend on the answer to the previous
  write, so a leader can send the next renewal before the last one returned
  (``docs/leader-election.md``, "Renewals in flight").
* :class:`LeaseNamespaceNotFound` when the Lease's namespace does not exist.
* Any other exception is a transient failure (network, 5xx, timeout): the write may or may
  not have happened, and the caller must not assume either.
* ``watch`` yields once per change it hears of, with the object as the event carried it.
  The elector treats a yield as a *hint to read*: it never decides from the event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube

Timeout = float | tuple[float, float]
"""A request's time limit: one number for the whole request (urllib3's ``total``), or
(connect, read): the connection, TLS handshake included, and the wait for the answer each
get their own limit, so that a slow handshake does not eat the answer's budget."""

STEP_DOWN_ANNOTATION = "leader.vm.neon.tech/step-down"
"""Annotation on the Lease asking one term (holder identity and epoch) to release."""

def _not_found_details(exc: ApiException) -> dict[str, Any]:
    """The ``details`` of a 404's Status body ({} for another status or a bare 404)."""
    if exc.status != 404:
        return {}
    try:
        return dict(json.loads(exc.body or "{}").get("details") or {})
    except (ValueError, TypeError, AttributeError):
        return {}


def _namespace_not_found(exc: ApiException) -> bool:
    """A 404 whose details name a namespace (not the object itself)."""
    return _not_found_details(exc).get("kind") == "namespaces"


def _lease_not_found(exc: ApiException, name: str) -> bool:
    """A 404 whose details name this Lease. A bare 404 (a proxy, a load balancer, an API
    group not served yet) stays a transient error: deposing on it would cost a relist."""
    details = _not_found_details(exc)
    return details.get("kind") == "leases" and details.get("name") == name


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a Lease the election reads, plus the object to write back."""

    holder: str
    lease_duration_seconds: int | None
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    resource_version: str
    step_down: StepDownRequest | None
    raw: dict[str, Any]

    @property
    def uid(self) -> str | None:
        """The Lease object's uid (None for a record not read from a server)."""
        return (self.raw.get("metadata") or {}).get("uid") or None

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> LeaseRecord:
        spec = obj.get("spec") or {}
        meta = obj.get("metadata") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            lease_duration_seconds=spec.get("leaseDurationSeconds"),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str(meta.get("resourceVersion") or ""),
            step_down=StepDownRequest.parse((meta.get("annotations") or {}).get(
                STEP_DOWN_ANNOTATION)),
            raw=obj,
        )


@dataclass(frozen=True)
class StepDownRequest:
    """A request that the term (``holder``, ``epoch``) release the Lease."""

    holder: str
    epoch: int | None
    requested_at: str | None = None

    def names(self, identity: str, epoch: int) -> bool:
        return self.holder == identity and (self.epoch is None or self.epoch == epoch)

    def to_annotation(self) -> str:
        return json.dumps({"holder": self.holder, "epoch": self.epoch,
                           "requestedAt": self.requested_at})

    @classmethod
    def parse(cls, value: str | None) -> StepDownRequest | None:
        if not value:
            return None
        try:
            data = json.loads(value)
            epoch = data.get("epoch")
            return cls(holder=str(data["holder"]),
                       epoch=None if epoch is None else int(epoch),
                       requested_at=data.get("requestedAt"))
        except (ValueError, TypeError, KeyError, AttributeError):
            return None  # a malformed request names nobody


class LeaseClient:
    """Get, create and compare-and-swap one Lease; objects are plain JSON dicts.

    Plain dicts (raw REST calls through :mod:`neonvm.kube`) keep the times exactly as
    the server wrote them, let us send MicroTime strings in the canonical format, and
    load none of the generated API classes (their memory: docs/benchmarks.md).
    """

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        """The REST path of the namespace's Leases."""

    def _call(self, method: str, path: str, timeout: Timeout, body: Any = None,
              content_type: str = "application/json") -> LeaseRecord:
        resp = kube._send(self._api, method, path, body=body, timeout=timeout,
                          headers={"Content-Type": content_type, "Accept": "application/json"})
        resp.read()
        return LeaseRecord.from_object(json.loads(resp.data or b"{}"))

    def get(self, timeout: Timeout) -> LeaseRecord | None:
        """A direct (quorum) read; None when the Lease does not exist."""
        try:
            return self._call("GET", f"{self.collection}/{self.name}", timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, spec: dict[str, Any], timeout: Timeout) -> LeaseRecord:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
        return self._call("POST", self.collection, timeout, body)

    def replace(self, base: LeaseRecord, spec: dict[str, Any], timeout: Timeout,
                drop_step_down: bool = False,
                step_down: StepDownRequest | None = None) -> LeaseRecord:
        """Write ``spec`` over ``base``; 409 Conflict if the Lease changed since ``base``."""
        obj = json.loads(json.dumps(base.raw))  # deep copy, keeps unknown fields
        obj["spec"] = {**(obj.get("spec") or {}), **spec}
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = base.resource_version
        annotations = dict(meta.get("annotations") or {})
        if drop_step_down:
            annotations.pop(STEP_DOWN_ANNOTATION, None)
        if step_down is not None:
            annotations[STEP_DOWN_ANNOTATION] = step_down.to_annotation()
        meta["annotations"] = annotations or None
        return self._call("PUT", f"{self.collection}/{self.name}", timeout, obj)

    def patch_if_held(self, base: LeaseRecord, spec: dict[str, Any], timeout: Timeout,
                      drop_step_down: bool = False) -> LeaseRecord:
        """Write ``spec`` if the Lease still has ``base``'s uid, holder and leaseTransitions
        (a JSON patch whose ``test`` operations are those conditions; no resourceVersion).

        The API server applies the whole patch or nothing: a failed test answers 422.
        """
        return self._call("PATCH", f"{self.collection}/{self.name}", timeout,
                          held_patch(base, spec, drop_step_down),
                          content_type="application/json-patch+json")


def _pointer(*parts: str) -> str:
    """A JSON pointer (RFC 6901) to ``parts``."""
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def held_patch(base: LeaseRecord, spec: dict[str, Any],
               drop_step_down: bool = False) -> list[dict[str, Any]]:
    """The JSON patch of :meth:`LeaseClient.patch_if_held`: tests, then the writes.

    The step-down annotation is removed only when ``base`` carries it (a JSON patch
    ``remove`` of a missing member fails); a request added after ``base`` stays, and the
    next acquisition drops it.
    """
    ops: list[dict[str, Any]] = []
    if base.uid:
        ops.append({"op": "test", "path": "/metadata/uid", "value": base.uid})
    ops.append({"op": "test", "path": "/spec/holderIdentity", "value": base.holder})
    ops.append({"op": "test", "path": "/spec/leaseTransitions", "value": base.transitions})
    ops.extend({"op": "add", "path": _pointer("spec", key), "value": value}
               for key, value in spec.items())
    annotations = (base.raw.get("metadata") or {}).get("annotations") or {}
    if drop_step_down and STEP_DOWN_ANNOTATION in annotations:
        ops.append({"op": "remove",
                    "path": _pointer("metadata", "annotations", STEP_DOWN_ANNOTATION)})
    return ops


class LeaseConflict(Exception):
    """The Lease is not at the version the write was based on (or already exists)."""


class LeaseNamespaceNotFound(Exception):
    """The Lease's namespace does not exist."""


class LeaseNotFound(LeaseConflict):
    """An update found no Lease at all (someone deleted it): a conflict, and for a holder,
    the end of its term (the record it renews from names an object that is gone)."""


class LeaseStore(Protocol):
    """One Lease: fresh reads, create, compare-and-swap update, change hints."""

    def get(self, timeout: float) -> LeaseRecord | None: ...

    def create(self, spec: dict[str, Any], timeout: float) -> LeaseRecord: ...

    def update(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> LeaseRecord: ...

    def renew(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> LeaseRecord: ...

    def watch(self, timeout: float) -> Iterator[LeaseRecord | None]: ...


def split(timeout: float) -> tuple[float, float]:
    """``timeout`` for the connection and again for the answer (see :data:`Timeout`)."""
    return (timeout, timeout)


class KubernetesLeaseStore:
    """:class:`LeaseStore` on a ``coordination.k8s.io/v1`` Lease, through :class:`LeaseClient`.

    Maps the API server's answers onto the store contract: 409 (and the 422 a racing
    create can get, or a failed test of :meth:`renew`) to :class:`LeaseConflict`, a 404
    naming a namespace to :class:`LeaseNamespaceNotFound`, any other 404 on update to
    :class:`LeaseNotFound`; everything else propagates as a transient failure.

    A ``timeout`` of T seconds gives the connection (TCP and TLS handshake) T and the
    answer another T (urllib3's connect and read timeouts), never T in all: through a
    slow network a new connection's handshake costs a round trip, and a total of T left
    the answer too little (a 2.5 s budget became a 0.99 s read timeout), so a request
    that timed out dropped its connection and the next one paid the handshake again.
    """

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self._leases = LeaseClient(api, namespace, name)
        self._watch = kube.Lister(api, self._leases.collection,
                                  field_selector=f"metadata.name={name}")
        self.namespace = namespace
        self.name = name

    def get(self, timeout: float) -> LeaseRecord | None:
        return self._leases.get(split(timeout))

    def create(self, spec: dict[str, Any], timeout: float) -> LeaseRecord:
        try:
            return self._leases.create(spec, split(timeout))
        except ApiException as exc:
            if exc.status in (409, 422):
                raise LeaseConflict(f"the Lease already exists ({exc.status})") from exc
            if _namespace_not_found(exc):
                raise LeaseNamespaceNotFound(self.namespace) from exc
            raise

    def update(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
               drop_step_down: bool = False) -> LeaseRecord:
        try:
            return self._leases.replace(base, spec, split(timeout),
                                        drop_step_down=drop_step_down)
        except ApiException as exc:
            if exc.status == 409:
                raise LeaseConflict(
                    f"the Lease changed since version {base.resource_version}") from exc
            if _namespace_not_found(exc):
                raise LeaseNamespaceNotFound(self.namespace) from exc
            if _lease_not_found(exc, self.name):
                raise LeaseNotFound(
                    f"the Lease is gone (it was at version {base.resource_version})") from exc
            raise

    def renew(self, base: LeaseRecord, spec: dict[str, Any], timeout: float, *,
              drop_step_down: bool = False) -> LeaseRecord:
        try:
            return self._leases.patch_if_held(base, spec, split(timeout),
                                              drop_step_down=drop_step_down)
        except ApiException as exc:
            if exc.status in (409, 422):  # 422: a test failed (holder, epoch or uid)
                raise LeaseConflict(
                    f"the Lease is no longer held by {base.holder!r} at epoch "
                    f"{base.transitions} ({exc.status})") from exc
            if _namespace_not_found(exc):
                raise LeaseNamespaceNotFound(self.namespace) from exc
            if _lease_not_found(exc, self.name):
                raise LeaseNotFound("the Lease is gone") from exc
            raise

    def request_step_down(self, base: LeaseRecord, request: StepDownRequest,
                          timeout: float) -> LeaseRecord:
        """Write ``request`` if the Lease still has ``base``'s uid, holder and epoch (a
        JSON patch with tests, like a renewal: the holder's renewals in between do not
        make it fail); :class:`LeaseConflict` once that term is over."""
        ops = held_patch(base, {})
        annotations = (base.raw.get("metadata") or {}).get("annotations")
        if annotations:
            ops.append({"op": "add", "value": request.to_annotation(),
                        "path": _pointer("metadata", "annotations", STEP_DOWN_ANNOTATION)})
        else:
            ops.append({"op": "add", "path": "/metadata/annotations",
                        "value": {STEP_DOWN_ANNOTATION: request.to_annotation()}})
        try:
            return self._leases._call("PATCH", f"{self._leases.collection}/{self.name}",
                                      split(timeout), ops,
                                      content_type="application/json-patch+json")
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                raise LeaseConflict(f"the term of {base.holder!r} at epoch "
                                    f"{base.transitions} is over ({exc.status})") from exc
            raise

    def watch(self, timeout: float) -> Iterator[LeaseRecord | None]:
        """Watch this one Lease (from "now") for up to ``timeout`` seconds.

        Yields the object of each event (``None`` for a deletion), starting with the
        current object if it exists. Raises :class:`ApiException` when the server refuses
        (403 without the ``watch`` verb); ends quietly when the server closes the watch.
        """
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._watch(
            watch=True, timeout_seconds=max(1, int(timeout)), _preload_content=False,
            _request_timeout=(10, timeout + 10))
        try:
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                kind = event.get("type")
                if kind == "ERROR":
                    return  # e.g. 410 Gone: the caller starts a new watch
                if kind == "DELETED":
                    yield None
                elif kind in ("ADDED", "MODIFIED"):
                    yield LeaseRecord.from_object(event.get("object") or {})
        finally:
            resp.close()
            resp.release_conn()
