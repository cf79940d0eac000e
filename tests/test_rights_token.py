"""One reader of a VM's scaling token (neonvm/controller/scaling_token.py): live scaling
(``RunnerScaling.token``, the ``/scale`` bearer) and the rights endpoint (``TokenCache``,
the ``/v1/rights`` bearer) take the same token, or none, from the same Secret. Real
Secrets on the session's API server (docs/security.md, "Rights endpoint")."""

from __future__ import annotations

import dataclasses

import pytest
from kubernetes import client

from neonvm.controller.rights import TokenCache
from neonvm.controller.scaling import RunnerScaling, ScalingError
from neonvm.controller.scaling_token import recorded_token
from tests.support.scaling_decide import vm


@pytest.mark.parametrize(("variant", "stored", "token"), [
    ("as created", "tok-123", b"tok-123"),
    ("padded", " tok-123\n", b"tok-123"),       # stripped, as the runner strips its file
    ("blank", " \n", None),                      # no token: neither side signs with it
    ("no key", None, None),
    ("planted", "tok-123", None),                # recreated under its name: another uid
    ("gone", "tok-123", None),
])
def test_live_scaling_and_the_rights_endpoint_read_one_token(
        api: client.ApiClient, namespace: str, variant: str, stored: str | None,
        token: bytes | None) -> None:
    core = client.CoreV1Api(api)
    body = {"metadata": {"name": "tok"},
            "stringData": {"token" if stored is not None else "other": stored or "x"}}
    recorded = core.create_namespaced_secret(namespace, body).metadata.uid
    if variant in ("planted", "gone"):
        core.delete_namespaced_secret("tok", namespace)
    if variant == "planted":
        core.create_namespaced_secret(namespace, body)
    owner = vm()
    owner = dataclasses.replace(owner, namespace=namespace, status=dataclasses.replace(
        owner.status, scaling_token_secret="tok", scaling_token_secret_uid=recorded))

    assert TokenCache(api).token(namespace, "tok", recorded) == token
    if token is None:
        with pytest.raises(ScalingError) as refused:
            RunnerScaling(api).token(owner)
        assert refused.value.permanent, refused.value
    else:
        assert RunnerScaling(api).token(owner).encode() == token


@pytest.mark.unit
def test_a_read_secret_yields_its_token_or_why_not() -> None:
    good = {"metadata": {"uid": "u"}, "data": {"token": "dG9rCg=="}}  # "tok\n"
    assert recorded_token(good, "tok", "u") == b"tok"
    assert recorded_token(good, "tok", "other") == (
        "Secret tok is not the one the controller created (uid u, recorded other): not used")
    assert recorded_token(None, "tok", "u") == "Secret tok not found"
    assert recorded_token({"metadata": {"uid": "u"}, "data": {}}, "tok", "u") == (
        "Secret tok has no 'token'")
    assert recorded_token({"metadata": {"uid": "u"}, "data": {"token": "abc"}}, "tok",
                          "u") == "Secret tok: 'token' is not base64"
