"""The controller's scaling calls put names read from objects into REST paths
percent-quoted (security review F2): a token Secret name recorded in a VM's status, or
a pod name, is one path segment, whatever it holds. The "API server" is a recording
server on loopback, so the test sees the paths as sent. docs/security.md, "Names stay
in their namespace".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client

from neonvm.controller.scaling import RunnerScaling, ScalingError
from tests.support.hostile_runners import RecordingServer
from tests.support.scaling_decide import vm

HOSTILE_NAME = "x?dryRun=All#frag%2e%2e"
QUOTED = "x%3FdryRun%3DAll%23frag%252e%252e"


@pytest.fixture
def api_server() -> Iterator[RecordingServer]:
    server = RecordingServer()
    yield server
    server.close()


def _scaling(server: RecordingServer) -> RunnerScaling:
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.port}"
    return RunnerScaling(client.ApiClient(config))


@pytest.mark.unit
def test_a_token_secret_name_from_status_is_one_quoted_path_segment(
        api_server: RecordingServer) -> None:
    scaling = _scaling(api_server)
    v = vm()
    v.status.scaling_token_secret = HOSTILE_NAME
    v.status.scaling_token_secret_uid = "uid-of-the-secret"
    with pytest.raises(ScalingError):  # the recorder's answer is no Secret of that uid
        scaling.token(v)
    scaling.discard_token("ns", HOSTILE_NAME)
    paths = [(a.method, a.path) for a in api_server.asked]
    assert paths == [("GET", f"/api/v1/namespaces/ns/secrets/{QUOTED}"),
                     ("DELETE", f"/api/v1/namespaces/ns/secrets/{QUOTED}")], paths


@pytest.mark.unit
def test_a_pod_name_is_one_quoted_path_segment() -> None:
    from neonvm.controller import scaling

    assert scaling._pod_path("ns", HOSTILE_NAME) == f"/api/v1/namespaces/ns/pods/{QUOTED}"
    with pytest.raises(ValueError):
        scaling._pod_path("ns", "..")
