"""The runner's rights token outlives a kubelet outage: the kubelet rotates the projected
token at 80 % of its ``expirationSeconds`` (neonvm/controller/podspec.py,
``RIGHTS_TOKEN_SECONDS``), so a kubelet that stops just before its rotation leaves the
runner a token whose remaining life is all the guest has before the leader's review
refuses it and the guest self-fences (docs/protocol.md, "Self-fencing", "No eviction
from a node that stops reporting").

Real tokens on the session's API server, reviewed by the shipped rights endpoint as the
controller's identity (tests/support/rights_sa_token.py)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.controller.podspec import RIGHTS_TOKEN_SECONDS
from neonvm.dev.cluster import LocalCluster
from tests.support.rights_sa_token import (
    ACCOUNT,
    AUDIENCE,
    ReviewingLeader,
    forged,
    pod,
    service_account,
)

ROTATION = 0.8
"""The kubelet replaces a projected token once it has lived 80 % of its expirationSeconds."""
OUTAGE = 15 * 60
"""A kubelet outage the guest must ride out (a crash loop, an upgrade, a node cut off from
the API server while the runner still reaches the leader)."""


@pytest.fixture
def leader(controller_api: client.ApiClient) -> Iterator[ReviewingLeader]:
    served = ReviewingLeader(controller_api)
    yield served
    served.close()


def _claims(token: str) -> dict[str, int]:
    payload = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))


def test_the_api_server_issues_the_rights_token_for_the_whole_requested_life(
        api: client.ApiClient, namespace: str) -> None:
    """What the kubelet asks for the pod's projected volume is what it gets (the session
    API server caps no token below it)."""
    service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    answer = kube.request(
        api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{ACCOUNT}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
              "spec": {"audiences": [AUDIENCE], "expirationSeconds": RIGHTS_TOKEN_SECONDS,
                       "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                          "name": "vm-p", "uid": uid}}})
    claims = _claims(str(answer["status"]["token"]))
    assert claims["exp"] - claims["iat"] == RIGHTS_TOKEN_SECONDS


def test_a_token_the_kubelet_stopped_rotating_fifteen_minutes_ago_is_still_granted(
        api: client.ApiClient, cluster: LocalCluster, namespace: str,
        leader: ReviewingLeader) -> None:
    """The worst case: the kubelet stopped just before it would have rotated the token, and
    has not come back for :data:`OUTAGE`. The runner's token is the one it last wrote; the
    API server still vouches for it, and the leader grants."""
    account = service_account(api, namespace)
    uid = pod(api, namespace, "vm-p")
    leader.show(namespace, "vm", "vm-p", uid)
    issued = time.time() - ROTATION * RIGHTS_TOKEN_SECONDS - OUTAGE
    token = forged(cluster.state_dir / "pki" / "sa.key", namespace, "vm-p", uid, account,
                   issued=issued, expires=issued + RIGHTS_TOKEN_SECONDS)
    status, body = leader.ask(namespace, "vm", uid, token)
    assert status == 200, body
    assert leader.reviewer.reviews == 1  # the API server's own word, not the leader's filter
