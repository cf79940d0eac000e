"""Self-fencing on the local cluster: a self-fencing pod on a node that stops heartbeating
is force-deleted once its right is surely over, and replaced; nobody marks the node out
of service (docs/protocol.md, "Self-fencing").

Simulated (kwok) nodes run the pods, so no runner ever asks for a right: the pod "never
got a grant since term start", and the bound that counts is the term's start. To make
that bound the one that binds, the controller is stopped before the node is powered off
and a new replica is started once the node is NotReady: its term starts after the node
was lost, and the pod may go only ``D(1+rho)+epsilon`` after it.

No timed assertions: the order of events is read from the API objects (the Lease's
``acquireTime``, the node's NotReady transition, the ``SelfFenced`` Event). A pod without
the annotation still waits for out-of-service: tests/test_local_cluster.py,
test_after_a_node_failure_the_replacement_starts_only_once_the_node_is_out_of_service.
"""

from __future__ import annotations

import base64
import socket
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api.rights import (
    DEFAULT_EPSILON,
    DEFAULT_RHO,
    NOT_LEADER,
    RIGHT_SECONDS_ANNOTATION,
    authorization_header,
)
from neonvm.controller.fencing import SELF_FENCED
from neonvm.controller.rights import TERM_ANNOTATION, api_mark_pod
from neonvm.dev import nodes
from neonvm.dev.cluster import LocalCluster, free_port
from tests.support import FAST, wait_for
from tests.support.harness import Replicas, converged, create_vm, get_vm, runner_pods
from tests.support.rights import ask as rights_ask

pytestmark = pytest.mark.nodes

D = 5.0
"""The right's length given to the controller (short, so the test is short)."""
BOUND = D * (1 + DEFAULT_RHO) + DEFAULT_EPSILON
TRUNCATION = timedelta(seconds=1)
"""Event and condition times are stored in whole seconds (rounded down)."""


@pytest.fixture(scope="module", autouse=True)
def simulated_nodes(cluster: LocalCluster) -> None:
    if cluster.spec.nodes < 2:
        pytest.skip("needs NEONVM_TEST_NODES >= 2 (scheduler, controller-manager, kwok)")


@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    """Self-fencing replicas (D = 5 s) for this namespace; none started yet."""
    group = Replicas(
        api=api, kubeconfig=cluster.kubeconfig_for("controller"),
        etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        lease_namespace=namespace, log_dir=tmp_path / "replicas",
        extra_args=[*FAST, "--watch-namespace", namespace, "--right-seconds", f"{D:g}",
                    # Simulated runners never ask; the URL only switches self-fencing on.
                    "--rights-url", "http://127.0.0.1:9"],
    )
    with group:
        yield group
        for r in group:  # shown by pytest only when the test failed
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-20000:]}")


@pytest.fixture
def restore_nodes(api: client.ApiClient) -> Iterator[list[str]]:
    broken: list[str] = []
    yield broken
    for name in broken:
        nodes.power_on(api, name)
        nodes.wait_for_node(api, name, lambda n: n.schedulable, 120, "schedulable again")


def running_pod(api: client.ApiClient, namespace: str, vm: str,
                not_on: str | None = None) -> Any:
    """Wait until the VM has converged on one Running runner pod (not on ``not_on``)."""
    def check() -> Any:
        if not converged(api, namespace, [vm]):
            return None
        name = ((get_vm(api, namespace, vm) or {}).get("status") or {}).get("podName")
        pods = [p for p in runner_pods(api, namespace, vm) if p.metadata.name == name]
        if not pods or pods[0].status.phase != "Running":
            return None
        return pods[0] if pods[0].spec.node_name != not_on else None

    return wait_for(check, timeout=120, what=f"VM {vm} to run one runner pod")


def lease_acquired(api: client.ApiClient, namespace: str, identity: str) -> datetime:
    def check() -> datetime | None:
        try:
            lease = client.CoordinationV1Api(api).read_namespaced_lease(
                "neonvm-controller", namespace)
        except ApiException:
            return None
        if lease.spec.holder_identity != identity:
            return None
        at = lease.spec.acquire_time
        return at if isinstance(at, datetime) else None
    result = wait_for(check, timeout=60, what=f"{identity} to lead")
    assert result is not None
    return result


def not_ready_since(api: client.ApiClient, node: str) -> datetime:
    ready = next(c for c in client.CoreV1Api(api).read_node(node).status.conditions
                 if c.type == "Ready")
    assert ready.status != "True"
    at = ready.last_transition_time
    assert isinstance(at, datetime)
    return at


def self_fenced_events(api: client.ApiClient, namespace: str) -> list[Any]:
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    return [e for e in events if e.reason == SELF_FENCED]


@pytest.mark.usefixtures("checker")
def test_a_self_fencing_pod_on_a_lost_node_is_replaced_once_its_right_is_surely_over(
        api: client.ApiClient, namespace: str, replicas: Replicas,
        restore_nodes: list[str]) -> None:
    core = client.CoreV1Api(api)
    first = replicas.start("a")
    # A VM that cannot scale: it gets a token all the same (its runner's bearer).
    create_vm(api, namespace, "vm", restart_policy="Always", spec={"guest": {
        "cpus": {"min": 1, "max": 1, "use": 1},
        "memorySlots": {"min": 1, "max": 1, "use": 1}, "memorySlotSize": "256Mi",
        "rootDisk": {"image": "vm-postgres:15-bullseye", "size": "1Gi"}}})
    old = running_pod(api, namespace, "vm")
    assert old.metadata.annotations[RIGHT_SECONDS_ANNOTATION] == f"{D:g}"
    assert ((get_vm(api, namespace, "vm") or {}).get("status") or {}).get("scalingTokenSecret")
    lost = old.spec.node_name
    restore_nodes.append(lost)

    # The leader goes first, so that the term that replaces the pod starts after the
    # node was lost; then the node stops heartbeating.
    first.terminate()
    nodes.power_off(api, lost)
    nodes.wait_for_node(api, lost, lambda n: n.ready not in ("True", ""), 120, "NotReady")
    lost_at = not_ready_since(api, lost)
    second = replicas.start("b")
    term_start = lease_acquired(api, namespace, second.identity)
    assert term_start >= lost_at

    def replaced() -> Any:
        pods = runner_pods(api, namespace, "vm")
        return None if any(p.metadata.uid == old.metadata.uid for p in pods) else pods
    wait_for(replaced, timeout=120, what=f"{old.metadata.name} to be force-deleted")
    new = running_pod(api, namespace, "vm", not_on=lost)

    # Exactly one replacement, on another node, and nobody marked the node out of service.
    assert [p.metadata.name for p in runner_pods(api, namespace, "vm")] == [new.metadata.name]
    assert new.metadata.uid != old.metadata.uid
    node = core.read_node(lost)
    assert not any(t.key == nodes.OUT_OF_SERVICE_TAINT for t in node.spec.taints or [])

    # The force-delete came only once the right was surely over: after the node was
    # lost and at least D(1+rho)+epsilon after the term began (no grant in this term).
    events = self_fenced_events(api, namespace)
    assert len(events) == 1, [e.message for e in events]
    fenced_at: datetime = events[0].first_timestamp
    assert fenced_at >= lost_at
    assert fenced_at + TRUNCATION >= term_start.astimezone(UTC) + timedelta(seconds=BOUND), (
        f"force-deleted at {fenced_at}, term began {term_start}, bound {BOUND:g}s")
    assert old.metadata.name in events[0].message


def serving(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def ask(port: int, namespace: str, vm: str, pod_uid: str, token: bytes) -> tuple[int, Any]:
    return rights_ask(port, {"namespace": namespace, "vm": vm, "podUID": pod_uid},
                      authorization_header(token, pod_uid))


def test_the_leader_grants_the_current_pod_and_points_the_rights_service_at_itself(
        api: client.ApiClient, namespace: str, replicas: Replicas) -> None:
    """The endpoint, served by real replicas: the leader answers with the pod's right
    (bearer from the VM's own token Secret), a standby answers NotLeader, and the
    EndpointSlice of the rights Service names the leader's port; a new leader takes it."""
    ports = {"a": free_port(), "b": free_port()}

    def start(name: str) -> Any:
        return replicas.start(name, args=[
            "--rights-bind", f"127.0.0.1:{ports[name]}",
            # The slice is read, not routed (an EndpointSlice refuses loopback).
            "--rights-service", f"{namespace}/rights", "--pod-ip", "10.255.0.1"])

    first = start("a")
    lease_acquired(api, namespace, first.identity)
    start("b")
    create_vm(api, namespace, "vm", restart_policy="Always")
    pod = running_pod(api, namespace, "vm")
    status = (get_vm(api, namespace, "vm") or {})["status"]
    secret = client.CoreV1Api(api).read_namespaced_secret(status["scalingTokenSecret"],
                                                         namespace)
    token = base64.b64decode(secret.data["token"]).strip()

    wait_for(lambda: all(serving(port) for port in ports.values()), timeout=60,
             what="both replicas to serve rights")
    assert ask(ports["a"], namespace, "vm", pod.metadata.uid, token) == (200, {"seconds": D})
    code, doc = ask(ports["b"], namespace, "vm", pod.metadata.uid, token)
    assert (code, doc["reason"]) == (503, NOT_LEADER)
    code, doc = ask(ports["a"], namespace, "vm", pod.metadata.uid, b"not the token")
    assert code == 401

    def slice_port() -> int | None:
        try:
            found = client.DiscoveryV1Api(api).read_namespaced_endpoint_slice(
                "rights-leader", namespace)
        except ApiException:
            return None
        port: int = found.ports[0].port
        return port
    assert wait_for(lambda: slice_port() == ports["a"], timeout=30, what="slice -> a")

    first.terminate()
    second = next(r for r in replicas if r.name == "b")
    lease_acquired(api, namespace, second.identity)
    assert wait_for(lambda: slice_port() == ports["b"], timeout=60, what="slice -> b")
    assert wait_for(lambda: ask(ports["b"], namespace, "vm", pod.metadata.uid, token)
                    == (200, {"seconds": D}), timeout=60, what="b to grant")


def test_marking_a_pod_before_a_terms_first_grant_needs_that_very_pod(
        api: client.ApiClient, namespace: str) -> None:
    """The write that orders a grant against a DELETE in flight: it lands only on the pod
    of that uid (another uid, or a deleted pod, is no grant)."""
    core = client.CoreV1Api(api)
    pod = core.create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x"}],
                 "schedulingGates": [{"name": "hold"}]}})
    mark = api_mark_pod(api, lambda: "7")
    assert mark(namespace, "p", pod.metadata.uid)
    annotations = core.read_namespaced_pod("p", namespace).metadata.annotations
    assert annotations[TERM_ANNOTATION].startswith("7.")
    assert not mark(namespace, "p", "00000000-0000-0000-0000-000000000000")
    core.delete_namespaced_pod("p", namespace, grace_period_seconds=0)
    wait_for(lambda: not any(p.metadata.name == "p"
                             for p in core.list_namespaced_pod(namespace).items),
             timeout=30, what="the pod to go")
    assert not mark(namespace, "p", pod.metadata.uid)
