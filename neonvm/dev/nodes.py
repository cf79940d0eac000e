"""Simulated nodes for the local cluster (kwok), and the fault knobs drills and tests use.

kwok plays the kubelet for every Node labelled ``sim.vm.neon.tech/node=true`` that is not
powered off (label ``sim.vm.neon.tech/power=off``). The node and pod stages it plays are
``neonvm/dev/kwok/*.yaml``: a bound pod becomes Running and Ready within about a second;
a gracefully deleted pod stays Terminating until its ``deletionTimestamp`` (the time of
the delete plus its grace period) and is then deleted, as a kubelet would once the
container is gone. The node heartbeat is its Lease in ``kube-node-lease``, renewed every
quarter of ``NODE_LEASE_SECONDS``.

What is guaranteed:

* ``ensure_nodes`` leaves exactly ``cluster.spec.nodes`` simulated nodes, named
  ``node_name(0..n-1)``, and the RBAC kwok's identity needs. It never powers a node on or
  off and never touches taints: those are fault state that survives ``neonvm dev up``.
* ``power_off`` takes the node out of kwok's selection. From then on nothing renews its
  Lease and no stage runs for its pods: kube-controller-manager marks it NotReady
  (``Ready=Unknown``) after its node-monitor grace period, and a pod deleted meanwhile
  stays Terminating for as long as the node is off, exactly as with a dead kubelet.
* ``set_out_of_service`` adds or removes the ``node.kubernetes.io/out-of-service`` taint
  with a conditional write (resourceVersion precondition, re-read on conflict).
  kube-controller-manager's pod GC then force-deletes the Terminating pods on the node,
  but only while the node is also not Ready (Kubernetes >= 1.28, no feature gate).
* ``delay_termination`` makes one pod stay Terminating N seconds past its deletion
  timestamp; ``exit_pod`` makes one running pod's "guest" exit with a code.

What is not:

* A stage that was already scheduled when a node is powered off still runs: a pod whose
  graceful deletion began before the power-off may still disappear on time.
* Powering a node off is not a network partition: the API server and kwok stay up, only
  the node's kubelet role stops. Powering it back on resumes the stages where they were.
* The out-of-service taint is only safe when the node is really off. On a real cluster,
  force-deleting a pod whose node is still running leaves its guest running: two guests.

kwok is a development and test tool; nothing here is part of the shipped controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm import kube
from neonvm.dev.common import KWOK_USER, ClusterError

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

SIMULATED_LABEL = "sim.vm.neon.tech/node"
"""Marks a Node as one of the local cluster's simulated nodes (value ``true``)."""
POWER_LABEL = "sim.vm.neon.tech/power"
"""``on`` or ``off``; kwok manages only nodes that are not ``off``."""
KWOK_NODE_SELECTOR = f"{SIMULATED_LABEL}=true,{POWER_LABEL}!=off"

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
OUT_OF_SERVICE_VALUE = "nodeshutdown"

EXTRA_TERMINATION_ANNOTATION = "sim.vm.neon.tech/extra-termination-seconds"
"""On a pod: stay Terminating this many seconds past the deletion timestamp."""
EXIT_CODE_ANNOTATION = "sim.vm.neon.tech/exit-code"
"""On a running pod: its containers exit with this code (0: Succeeded, else Failed)."""

NODE_LEASE_SECONDS = 20
"""kwok renews each node Lease every 5 s; kube-controller-manager's grace is 20 s."""
POD_CIDR = "10.244.0.0/16"
KWOK_CLUSTER_ROLE = "neonvm-dev-kwok"
STAGES_DIR = Path(__file__).resolve().parent / "kwok"

MERGE_PATCH = "application/merge-patch+json"


class NodeError(ClusterError):
    """A node knob cannot be applied (no such simulated node, bad value)."""


def node_name(index: int) -> str:
    return f"neonvm-node-{index}"


def stage_files() -> list[Path]:
    """kwok's configuration, shipped as package data (``neonvm/dev/kwok/*.yaml``): its
    stages and its own options (``kwok-config.yaml``)."""
    files = sorted(STAGES_DIR.glob("*.yaml"))
    if not files:
        raise ClusterError(f"no kwok stage files in {STAGES_DIR} (broken installation?)")
    return files


def kwok_argv(cluster: LocalCluster, binary: str) -> list[str]:
    """The command line of the ``kwok`` component.

    ``--server-address`` serves kwok's ``/healthz`` over plain HTTP on the ``kwok`` port,
    which is what the cluster's health check polls.
    """
    return [
        binary,
        f"--kubeconfig={cluster.kubeconfig_for('kwok')}",
        f"--manage-nodes-with-label-selector={KWOK_NODE_SELECTOR}",
        f"--server-address=127.0.0.1:{cluster.spec.ports['kwok']}",
        f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
        f"--cidr={POD_CIDR}",
        *(f"--config={f}" for f in stage_files()),
    ]


def kwok_rbac() -> list[dict[str, Any]]:
    """What kwok needs to play kubelet for the simulated nodes, and no more."""
    rules = [
        {"apiGroups": [""], "resources": ["nodes"],
         "verbs": ["get", "list", "watch", "patch", "update"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": [""], "resources": ["pods"],
         "verbs": ["get", "list", "watch", "delete", "patch"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["get", "list", "watch", "create", "update", "patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
         "verbs": ["create", "patch", "update"]},
    ]
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": KWOK_CLUSTER_ROLE},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": KWOK_CLUSTER_ROLE},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": KWOK_CLUSTER_ROLE},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": KWOK_USER}],
        },
    ]


def node_object(index: int, pods: int = 110) -> dict[str, Any]:
    """A simulated Node as created (taking ``pods`` pods); kwok fills in conditions and
    node info."""
    name = node_name(index)
    # Room for ``pods`` runner pods of a CPU and a GiB each, not just the pod count.
    resources = {"cpu": str(max(64, pods)), "memory": f"{max(256, pods)}Gi", "pods": str(pods)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                SIMULATED_LABEL: "true",
                POWER_LABEL: "on",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        "status": {
            "allocatable": resources,
            "capacity": resources,
            "addresses": [
                # Loopback, so that an API server proxying to a simulated node (logs, exec;
                # it prefers InternalIP for the real nodes' sake) never leaves the machine.
                {"type": "InternalIP", "address": f"127.0.{index // 250 + 1}.{index % 250 + 1}"},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def ensure_nodes(cluster: LocalCluster, progress: Callable[[str], None] = lambda _m: None) -> None:
    """Apply kwok's RBAC and make the set of simulated Nodes match ``cluster.spec.nodes``.

    Called by ``LocalCluster.up`` before kwok starts (so kwok's first request is already
    authorized) and on every ``up`` (so ``--nodes`` can grow or shrink a running cluster).
    """
    api = kube.api_client(cluster.kubeconfig)
    try:
        for obj in kwok_rbac():
            kube.apply(api, obj)
        core = client.CoreV1Api(api)
        existing = {
            n.metadata.name for n in core.list_node(label_selector=f"{SIMULATED_LABEL}=true").items
        }
        wanted = {node_name(i): i for i in range(cluster.spec.nodes)}
        for name, index in wanted.items():
            if name in existing:
                continue
            try:
                core.create_node(node_object(index, cluster.spec.pods_per_node))
            except ApiException as e:
                if e.status != 409:
                    raise
        for name in sorted(existing - set(wanted)):
            core.delete_node(name)
            progress(f"removed simulated node {name}")
        progress(f"simulated nodes: {', '.join(wanted) or 'none'}")
    finally:
        api.close()


# ---- observing nodes ---------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedNode:
    """A simulated node as the API server sees it right now."""

    name: str
    power: str
    ready: str
    """The Ready condition's status: ``True``, ``False``, ``Unknown``, or ``""`` (none yet)."""
    taints: tuple[str, ...]
    pods: int
    terminating: int

    @property
    def out_of_service(self) -> bool:
        return any(t.split("=", 1)[0].split(":", 1)[0] == OUT_OF_SERVICE_TAINT
                   for t in self.taints)

    @property
    def schedulable(self) -> bool:
        """Ready, powered on, and without the NoSchedule/NoExecute taints a bad node gets."""
        return self.ready == "True" and self.power != "off" and not any(
            t.endswith((":NoSchedule", ":NoExecute")) for t in self.taints
        )


def _ready_status(node: client.V1Node) -> str:
    for c in (node.status and node.status.conditions) or []:
        if c.type == "Ready":
            return str(c.status)
    return ""


def _taint_text(t: client.V1Taint) -> str:
    return f"{t.key}={t.value}:{t.effect}" if t.value else f"{t.key}:{t.effect}"


def list_nodes(api: client.ApiClient) -> list[SimulatedNode]:
    """Every simulated node with its power, readiness, taints and pod counts."""
    core = client.CoreV1Api(api)
    nodes = core.list_node(label_selector=f"{SIMULATED_LABEL}=true").items
    pods = core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=").items
    out = []
    for n in sorted(nodes, key=lambda n: n.metadata.name):
        on_node = [p for p in pods if p.spec.node_name == n.metadata.name]
        out.append(SimulatedNode(
            name=n.metadata.name,
            power=(n.metadata.labels or {}).get(POWER_LABEL, "on"),
            ready=_ready_status(n),
            taints=tuple(_taint_text(t) for t in (n.spec.taints or [])),
            pods=len(on_node),
            terminating=sum(1 for p in on_node if p.metadata.deletion_timestamp),
        ))
    return out


def get_node(api: client.ApiClient, name: str) -> SimulatedNode:
    for node in list_nodes(api):
        if node.name == name:
            return node
    raise NodeError(f"no simulated node {name!r} (see 'neonvm dev node list')")


def wait_for_node(
    api: client.ApiClient,
    name: str,
    condition: Callable[[SimulatedNode], bool],
    timeout: float,
    what: str,
) -> SimulatedNode:
    """Poll until ``condition`` holds for node ``name``; NodeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    node = get_node(api, name)
    while not condition(node):
        if time.monotonic() > deadline:
            raise NodeError(f"node {name} not {what} after {timeout:.0f}s "
                            f"(ready={node.ready or '-'}, taints={list(node.taints)})")
        time.sleep(0.5)
        node = get_node(api, name)
    return node


def wait_nodes_schedulable(cluster: LocalCluster, timeout: float = 90.0) -> None:
    """Wait until every powered-on simulated node is Ready and free of not-ready taints.

    kube-controller-manager taints a new node ``not-ready:NoSchedule`` until it sees the
    node Ready; waiting for the taint to go means the scheduler can place pods at once.
    """
    api = kube.api_client(cluster.kubeconfig)
    try:
        for i in range(cluster.spec.nodes):
            name = node_name(i)
            if get_node(api, name).power == "off":
                continue
            wait_for_node(api, name, lambda n: n.schedulable, timeout, "schedulable")
    finally:
        api.close()


# ---- fault knobs -------------------------------------------------------------------------


def _require_simulated(core: client.CoreV1Api, name: str) -> client.V1Node:
    try:
        node = core.read_node(name)
    except ApiException as e:
        if e.status == 404:
            raise NodeError(f"no node {name!r}") from e
        raise
    if (node.metadata.labels or {}).get(SIMULATED_LABEL) != "true":
        raise NodeError(f"node {name!r} is not a simulated node (no {SIMULATED_LABEL}=true)")
    return node


def power_off(api: client.ApiClient, name: str) -> None:
    """Stop simulating the node's kubelet: no heartbeats, no pod progress, from now on."""
    _set_power(api, name, "off")


def power_on(api: client.ApiClient, name: str) -> None:
    """Resume the node's kubelet: it turns Ready again and its pods' stages resume."""
    _set_power(api, name, "on")


def _set_power(api: client.ApiClient, name: str, state: str) -> None:
    core = client.CoreV1Api(api)
    _require_simulated(core, name)
    core.patch_node(name, {"metadata": {"labels": {POWER_LABEL: state}}},
                    _content_type=MERGE_PATCH)
    logger.bind(node=name).info("simulated node powered {}", state)


def set_out_of_service(api: client.ApiClient, name: str, present: bool) -> bool:
    """Add (``present``) or remove the out-of-service taint; return whether it changed.

    The write carries the node's resourceVersion, so a concurrent taint change by
    kube-controller-manager (not-ready, unreachable) is never overwritten: on 409 the
    node is re-read and the intent applied again to the fresh copy.
    """
    core = client.CoreV1Api(api)
    for _attempt in range(20):
        node = _require_simulated(core, name)
        taints = list(node.spec.taints or [])
        has = any(t.key == OUT_OF_SERVICE_TAINT for t in taints)
        if has == present:
            return False
        if present:
            new = [*(_taint_dict(t) for t in taints),
                   {"key": OUT_OF_SERVICE_TAINT, "value": OUT_OF_SERVICE_VALUE,
                    "effect": "NoExecute"}]
        else:
            new = [_taint_dict(t) for t in taints if t.key != OUT_OF_SERVICE_TAINT]
        body = {"metadata": {"resourceVersion": node.metadata.resource_version},
                "spec": {"taints": new}}
        try:
            core.patch_node(name, body, _content_type=MERGE_PATCH)
        except ApiException as e:
            if e.status == 409:
                continue
            raise
        logger.bind(node=name).info("out-of-service taint {}", "added" if present else "removed")
        return True
    raise NodeError(f"node {name}: taint update kept conflicting; try again")


def _taint_dict(t: client.V1Taint) -> dict[str, Any]:
    d: dict[str, Any] = {"key": t.key, "effect": t.effect}
    if t.value:
        d["value"] = t.value
    if t.time_added:
        d["timeAdded"] = t.time_added.isoformat().replace("+00:00", "Z")
    return d


def delay_termination(
    api: client.ApiClient, namespace: str, pod: str, extra_seconds: int | None
) -> None:
    """Make ``pod`` stay Terminating ``extra_seconds`` past its deletion timestamp.

    ``None`` removes the delay; a pod already past its deletion timestamp then goes at
    once. Works before or during the pod's termination.
    """
    if extra_seconds is not None and extra_seconds < 0:
        raise NodeError("extra termination seconds must be >= 0")
    value = None if extra_seconds is None else str(int(extra_seconds))
    _annotate_pod(api, namespace, pod, EXTRA_TERMINATION_ANNOTATION, value)


def exit_pod(api: client.ApiClient, namespace: str, pod: str, exit_code: int) -> None:
    """Make a running pod's containers exit with ``exit_code`` (its guest powered off)."""
    if not 0 <= exit_code <= 255:
        raise NodeError("exit code must be 0..255")
    _annotate_pod(api, namespace, pod, EXIT_CODE_ANNOTATION, str(exit_code))


def _annotate_pod(
    api: client.ApiClient, namespace: str, pod: str, key: str, value: str | None
) -> None:
    core = client.CoreV1Api(api)
    try:
        core.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": {key: value}}},
                                  _content_type=MERGE_PATCH)
    except ApiException as e:
        if e.status == 404:
            raise NodeError(f"no pod {namespace}/{pod}") from e
        raise
    logger.bind(pod=f"{namespace}/{pod}").info("set {}={}", key, value)
