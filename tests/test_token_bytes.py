"""A tenant's edit of its VM's token Secret to bytes that are not text (S5 of the last
security review): the token is refused as "no token" by both of its users, and live
scaling of that VM fails closed with a permanent error instead of raising out of its
reconcile (docs/security.md, "Names stay in their namespace"). The Secret is a real one on
the session's API server."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest
from kubernetes import client

from neonvm.controller.scaling import RunnerScaling, ScalingError
from neonvm.controller.scaling_token import recorded_token
from tests.support.scaling_token import recorded_vm

NOT_TEXT = b"\xff\xfe\x80token"


def secret(token: bytes, uid: str = "old-uid") -> dict[str, Any]:
    return {"metadata": {"uid": uid},
            "data": {"token": base64.b64encode(token).decode()}}


@pytest.mark.unit
def test_a_token_that_is_not_utf8_text_is_no_token() -> None:
    assert recorded_token(secret(NOT_TEXT), "tok", "old-uid") == (
        "Secret tok: 'token' is not UTF-8 text: not used")
    # Text tokens, the controller's own included, are unchanged.
    assert recorded_token(secret(b"abc_DEF-123\n"), "tok", "old-uid") == b"abc_DEF-123"
    assert recorded_token(secret("é-token".encode()), "tok", "old-uid") == "é-token".encode()


def test_live_scaling_of_a_vm_whose_token_is_not_text_fails_closed_without_raising(
        api: client.ApiClient, namespace: str) -> None:
    made = client.CoreV1Api(api).create_namespaced_secret(namespace, {
        "metadata": {"name": "vm-scaling-old"},
        "data": {"token": base64.b64encode(NOT_TEXT).decode()}})
    vm = dataclasses.replace(recorded_vm(), namespace=namespace)
    vm.status.scaling_token_secret_uid = made.metadata.uid
    with pytest.raises(ScalingError) as refused:
        RunnerScaling(api).token(vm)
    assert refused.value.permanent
    assert "not UTF-8 text" in str(refused.value)
