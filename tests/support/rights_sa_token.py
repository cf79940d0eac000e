"""A runner's projected ServiceAccount token on a real API server, and the shipped rights
endpoint reviewing it (neonvm/controller/rights.py, ``TokenReviewer``; docs/security.md,
"Rights endpoint").

:func:`mint` asks the TokenRequest API for a token bound to a pod, as the kubelet does for
a projected ``serviceAccountToken`` volume; :func:`forged` signs claims with the cluster's
own service-account key (a token the API server would have issued, for an expiry it will
not issue). :class:`ReviewingLeader` serves the real ``RightsServer`` with a
``TokenReviewer`` over the controller's identity, its caches showing one VM whose current
pod the test names."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from kubernetes import client
from prometheus_client import CollectorRegistry

from neonvm import kube
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION, annotation_value
from neonvm.controller.rights import (
    RightsLedger,
    RightsServer,
    RightsService,
    TokenCache,
    TokenReviewer,
)
from tests.support.rights import ANSWERS, Cache, ask

AUDIENCE = "vm.neon.tech/rights/ops/nvm-neonvm-controller"
ISSUER = "https://kubernetes.default.svc.cluster.local"
"""The session cluster's ``--service-account-issuer`` (neonvm/dev/cluster.py)."""
ACCOUNT = "runner"


def service_account(api: client.ApiClient, namespace: str, name: str = ACCOUNT) -> str:
    """Create a ServiceAccount; its uid."""
    created = kube.request(api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                           body={"metadata": {"name": name}})
    return str(created["metadata"]["uid"])


NO_SCHEDULER = "neonvm-test-no-scheduler"
"""A ``schedulerName`` that no scheduler serves: a pod naming it is never bound to a node."""


def pod(api: client.ApiClient, namespace: str, name: str, account: str = ACCOUNT) -> str:
    """Create a pod running as ``account``; its uid. It names :data:`NO_SCHEDULER`, so it
    is never bound to a node and only the test writes or deletes it. Bound to a simulated
    node, it would be kwok's: kwok deletes a pod it saw terminating by name, with no uid
    precondition, so its late delete of a force-deleted pod could remove a new pod made at
    once under the same name."""
    created = kube.request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body={
        "metadata": {"name": name},
        "spec": {"serviceAccountName": account, "automountServiceAccountToken": False,
                 "schedulerName": NO_SCHEDULER,
                 "containers": [{"name": "runner", "image": "neonvm-runner:test"}]}})
    return str(created["metadata"]["uid"])


def delete_pod(api: client.ApiClient, namespace: str, name: str) -> None:
    """Delete the pod at once (grace 0); one of :func:`pod` (on no node) is gone from the
    API server when the answer comes."""
    kube.request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                 body={"gracePeriodSeconds": 0})


def mint(api: client.ApiClient, namespace: str, pod_name: str, pod_uid: str, *,
         audience: str = AUDIENCE, account: str = ACCOUNT) -> str:
    """A token of ``audience`` bound to the pod, from the TokenRequest API (600 s, the
    kubelet's projected token)."""
    answer = kube.request(
        api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"audiences": [audience], "expirationSeconds": 600,
                       "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                          "name": pod_name, "uid": pod_uid}}})
    return str(answer["status"]["token"])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged(key_file: Path, namespace: str, pod_name: str, pod_uid: str, account_uid: str,
           *, expires: float, audience: str = AUDIENCE, issued: float | None = None) -> str:
    """A pod-bound token signed (RS256) with the cluster's service-account key, expiring at
    wall time ``expires`` (issued at ``issued``, else 700 s ago): the claims the API server
    itself writes."""
    key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
    assert isinstance(key, rsa.RSAPrivateKey)
    now = int(time.time() - 700 if issued is None else issued)
    claims = {"aud": [audience], "exp": int(expires), "iat": now, "nbf": now,
              "iss": ISSUER, "sub": f"system:serviceaccount:{namespace}:{ACCOUNT}",
              "kubernetes.io": {"namespace": namespace,
                                "pod": {"name": pod_name, "uid": pod_uid},
                                "serviceaccount": {"name": ACCOUNT, "uid": account_uid}}}
    signing = (_b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode()) + "."
               + _b64(json.dumps(claims).encode()))
    signature = key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{signing}.{_b64(signature)}"


def vm_caches(namespace: str, vm_name: str, pod_name: str, pod_uid: str,
              seconds: float = 30.0, ip: str = "") -> tuple[Cache, Cache]:
    """The leader's caches: VM ``namespace/vm_name`` whose current pod is ``pod_name`` of
    ``pod_uid`` (IP ``ip``, if any), self-fencing, with no scaling token (the chart's
    default install)."""
    vm_uid = f"{vm_name}-uid"
    vm = {"metadata": {"name": vm_name, "namespace": namespace, "uid": vm_uid},
          "status": {"podName": pod_name, "podUID": pod_uid}}
    current = {"metadata": {
        "name": pod_name, "namespace": namespace, "uid": pod_uid,
        "annotations": {RIGHT_SECONDS_ANNOTATION: annotation_value(seconds)},
        "labels": {"vm.neon.tech/name": vm_name},
        "ownerReferences": [{"uid": vm_uid, "controller": True}]},
        "status": {"podIP": ip} if ip else {}}
    return (Cache({f"{namespace}/{vm_name}": vm}),
            Cache({f"{namespace}/{pod_name}": current}))


class ReviewingLeader:
    """The shipped rights endpoint, leading, reviewing tokens as ``api`` (the controller's
    identity) with :data:`AUDIENCE`; no Secret is ever read (a read would fail the test).
    :meth:`show` sets what its caches say is the VM's current pod."""

    def __init__(self, api: client.ApiClient, reviewer: TokenReviewer | None = None) -> None:
        self.ledger = RightsLedger()
        self.ledger.begin_term(lambda: True)
        self.caches: tuple[Cache, Cache] | None = None
        self.reviewer = reviewer or TokenReviewer(api, AUDIENCE)
        self.registry = CollectorRegistry()

        def no_secret(namespace: str, name: str) -> dict[str, Any] | None:
            raise AssertionError(f"read Secret {namespace}/{name}")

        service = RightsService(self.ledger, lambda: self.caches,
                                TokenCache(None, read=no_secret), lambda *_: True,
                                registry=self.registry, reviewer=self.reviewer)
        self.server = RightsServer(service, "127.0.0.1", 0).start()

    def show(self, namespace: str, vm: str, pod_name: str, pod_uid: str,
             ip: str = "") -> None:
        self.caches = vm_caches(namespace, vm, pod_name, pod_uid, ip=ip)

    def ask(self, namespace: str, vm: str, pod_uid: str,
            token: str) -> tuple[int, dict[str, Any]]:
        return ask(self.server.port, {"namespace": namespace, "vm": vm, "podUID": pod_uid},
                   f"Bearer {token}")

    def answered(self, code: int) -> int:
        return int(sum(s.value for m in self.registry.collect() for s in m.samples
                       if s.name == ANSWERS and s.labels["code"] == str(code)))

    def close(self) -> None:
        self.server.stop()
