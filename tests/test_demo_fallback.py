"""The demo's fallback: a real node that fails half-way leaves one line and nothing running.

``neonvm demo`` starts a real node by default; when that fails, it says why in one line
and goes on with the simulated kwok nodes (docs/real-node.md, "The demo"). The test
makes the kubelet fail for real (``NEONVM_BIN_KUBELET=/bin/false``: containerd starts,
the "kubelet" exits at once), as the docs tell to rehearse it. Opt-in like the other
real-node tests: ``NEONVM_TEST_REAL_NODE=1 pytest tests/test_demo_fallback.py``.
"""

from __future__ import annotations

import os

import pytest
from kubernetes import client

from neonvm.cli.demo import fallback_reason, start_real_node
from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster
from neonvm.dev.realnode import RealNodeError


def _skip_reason() -> str | None:
    if os.environ.get("NEONVM_TEST_REAL_NODE") != "1":
        return "real node not requested (set NEONVM_TEST_REAL_NODE=1; see docs/real-node.md)"
    return realnode.unavailable_reason()


@pytest.mark.unit
def test_fallback_reason_is_one_line_with_the_processes_last_words() -> None:
    exc = RealNodeError(
        "neonvm-real-0-kubelet exited before kubelet healthy; last log lines:\n"
        "I1204 03:00:00 server.go:1 starting\n\n"
        "E1204 03:00:01 run.go:72 \"command failed\" err=\"failed to validate\"\n")
    line = fallback_reason(exc)
    assert "\n" not in line
    assert line.startswith("RealNodeError: neonvm-real-0-kubelet exited before kubelet")
    assert line.endswith('err="failed to validate"')
    assert fallback_reason(ValueError("x" * 1000)).endswith("...")
    assert len(fallback_reason(ValueError("x" * 1000))) == 300
    assert fallback_reason(RuntimeError()) == "RuntimeError: (no message)"
    assert fallback_reason(RealNodeError("rn0-kubelet exited before kubelet healthy; last log "
                                         "lines:\n")) == (
        "RealNodeError: rn0-kubelet exited before kubelet healthy (its log is empty)")


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_demo_falls_back_in_one_line_when_the_kubelet_fails_and_leaves_nothing_running(
    cluster: LocalCluster, api: client.ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = client.CoreV1Api(api)
    node = realnode.RealNode(cluster, 0)
    # A Node left from an earlier run: the scheduler could still put the sample VM's
    # pod there while it shows Ready, so the fallback removes it.
    core.create_node(client.V1Node(metadata=client.V1ObjectMeta(
        name=node.name, labels={realnode.REAL_LABEL: "true"})))
    monkeypatch.setenv("NEONVM_BIN_KUBELET", "/bin/false")
    try:
        why = start_real_node(cluster)
    finally:
        monkeypatch.delenv("NEONVM_BIN_KUBELET")
    try:
        assert why is not None
        assert "\n" not in why
        assert "kubelet exited before kubelet healthy" in why, why
        ctrd, kubelet = node.process_names()
        assert not cluster.process_alive(ctrd, "containerd"), "containerd left running"
        assert not cluster.process_alive(kubelet, "")
        with pytest.raises(client.ApiException) as gone:
            core.read_node(node.name)
        assert gone.value.status == 404
    finally:
        node.stop()
