"""A VM's SSH key Secret whose create keeps failing transiently (a KMS outage for Secret
encryption at rest, a Secret webhook with ``failurePolicy: Fail`` that does not answer)
holds its runner pod back only for a bounded time, and says so: ``Degraded``, reason
``CreateFailing``, while it holds, then the pod starts without the key with a Warning
event ``SSHKeyUnavailable`` (neonvm/controller/performers.py, ``_ensure_ssh_secret``;
docs/protocol.md, "The SSH key Secret").

The session's real API server answers the controller's Secret create 500: a validating
webhook for Secret creates in the test's namespace alone, whose server refuses
connections."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube
from neonvm.controller import reasons
from neonvm.controller.authority import RetryableError
from neonvm.controller.create_policy import CREATE_FAILURES_BEFORE_CONDITION
from neonvm.controller.events import EventRecorder
from neonvm.controller.ssh_keys import SECRET_PREFIX
from neonvm.dev.cluster import free_port
from tests.support import wait_for
from tests.support.harness import runner_pods
from tests.support.reconcile import AUTHORITY, condition, create_vm, status_of
from tests.support.reconcile_observe import Recording

WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


def _secret_create_status(api: client.ApiClient, namespace: str) -> int:
    try:
        client.CoreV1Api(api).create_namespaced_secret(namespace, {
            "metadata": {"name": f"probe-{uuid.uuid4().hex[:8]}"}})
    except ApiException as exc:
        return int(exc.status or 0)
    return 201


@pytest.fixture
def failing_secret_creates(api: client.ApiClient, namespace: str) -> Iterator[None]:
    """Every Secret create in ``namespace`` answered 500 by the API server."""
    name = f"fail-secrets-{namespace}"
    kube.request(api, "POST", WEBHOOKS, body={
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration", "metadata": {"name": name},
        "webhooks": [{
            "name": "fail.secrets.test.neon.tech",
            "clientConfig": {"url": f"https://127.0.0.1:{free_port()}/refuse"},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                       "resources": ["secrets"]}],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "failurePolicy": "Fail", "sideEffects": "None",
            "admissionReviewVersions": ["v1"], "timeoutSeconds": 2}]})
    try:
        wait_for(lambda: _secret_create_status(api, namespace) == 500, timeout=60,
                 what="the API server to call the webhook")
        yield
    finally:
        kube.request(api, "DELETE", f"{WEBHOOKS}/{name}")


@pytest.mark.cluster
@pytest.mark.usefixtures("failing_secret_creates")
def test_a_secret_create_that_keeps_failing_holds_the_pod_a_bounded_time_and_says_so(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Not scalable (no scaling token Secret to create); enableSSH unset: the CRD stores
    # NeonVM's true.
    create_vm(api, namespace, "db", spec={"guest": {
        "cpus": {"min": 1, "max": 1, "use": 1}, "memorySlots": {"min": 1, "max": 1, "use": 1},
        "memorySlotSize": "256Mi", "rootDisk": {"image": "vm-postgres:15-bullseye"}}})
    key = f"{namespace}/db"
    reconciler = Recording(controller_api)
    reconciler.ctx.config = dataclasses.replace(reconciler.ctx.config,
                                                create_failing_after=0.0)
    reconciler.ctx.events = EventRecorder(controller_api, "test")

    # It holds the pod back, retried, and from the third failure says why in Degraded.
    for _ in range(CREATE_FAILURES_BEFORE_CONDITION):
        with pytest.raises(RetryableError, match="SSH key Secret"):
            reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert runner_pods(api, namespace, "db") == []
    degraded = condition(status_of(api, namespace, "db"), "Degraded")
    assert degraded is not None and degraded["reason"] == reasons.CREATE_FAILING, degraded
    assert f"SSH key Secret {SECRET_PREFIX}db: 500" in degraded["message"]

    # Past the hold, the pod starts without the key, and a Warning says so.
    reconciler.reconcile(key, AUTHORITY, direct_first=True)
    assert len(runner_pods(api, namespace, "db")) == 1
    warnings = [e for e in client.CoreV1Api(api).list_namespaced_event(namespace).items
                if e.reason == reasons.SSH_KEY_UNAVAILABLE]
    assert [e.type for e in warnings] == ["Warning"]
    assert "starts without an SSH key" in warnings[0].message

