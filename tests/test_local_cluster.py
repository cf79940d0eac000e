"""The local cluster behaves like a real one where the invariant depends on it.

A real kube-scheduler honours scheduling gates, simulated nodes (kwok) run pods and finish
their graceful deletion only at the end of the grace period, kube-controller-manager
garbage-collects pods whose VM is gone, and a node that stops heartbeating keeps its
deleted pods Terminating until it is marked out of service.

Where a test must show that something did *not* happen yet, it uses causality rather
than a clock: a control pod created or deleted alongside shows that the machinery had
every chance to act. Lower bounds on time ("not gone before its deadline") are checked
against the API server's own timestamps; nothing asserts that something was fast.

Runs with ``NEONVM_TEST_NODES >= 2`` (the default); skipped without simulated nodes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.cli import main
from neonvm.controller.reasons import WAITING_FOR_OLD_POD
from neonvm.dev import nodes
from neonvm.dev.cluster import LocalCluster
from tests.support import FAST, wait_for
from tests.support.harness import Replicas, converged, create_vm, get_vm, is_gated

pytestmark = pytest.mark.nodes

JSON_PATCH = "application/json-patch+json"
SAMPLE_VM = Path(__file__).resolve().parent.parent / "examples" / "vm-deploy.yaml"


@pytest.fixture(scope="module", autouse=True)
def simulated_nodes(cluster: LocalCluster) -> None:
    if cluster.spec.nodes < 2:
        pytest.skip("needs NEONVM_TEST_NODES >= 2 (scheduler, controller-manager, kwok)")


def pod_manifest(
    name: str,
    *,
    runner_of: dict[str, Any] | None = None,
    grace: int = 2,
    node: str | None = None,
) -> dict[str, Any]:
    """A pod; with ``runner_of`` (a VM object) a gated runner pod owned by that VM."""
    meta: dict[str, Any] = {"name": name, "labels": {"app": "probe"}}
    spec: dict[str, Any] = {
        "containers": [{"name": "runner", "image": "neonvm-runner:dev"}],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": grace,
    }
    if runner_of is not None:
        vm_meta = runner_of["metadata"]
        meta["labels"] = {types.LABEL_VM_NAME: vm_meta["name"], types.LABEL_VM_UID: vm_meta["uid"]}
        meta["ownerReferences"] = [{
            "apiVersion": types.API_VERSION, "kind": types.KIND, "name": vm_meta["name"],
            "uid": vm_meta["uid"], "controller": True, "blockOwnerDeletion": True,
        }]
        spec["schedulingGates"] = [{"name": types.SCHEDULING_GATE}]
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def create_sample_vm(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    vm: dict[str, Any] = yaml.safe_load(SAMPLE_VM.read_text())
    vm["metadata"] = {"name": f"vm-{uuid.uuid4().hex[:6]}"}
    created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm
    )
    return created


def read(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def running(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod:
    def check() -> client.V1Pod | None:
        pod = read(core, namespace, name)
        return pod if pod is not None and pod.status.phase == "Running" else None

    result: client.V1Pod = wait_for(check, timeout=90, what=f"pod {name} to run")
    return result


def gone(core: client.CoreV1Api, namespace: str, name: str, timeout: float = 90) -> datetime:
    """Wait until the pod is gone; return when that was first observed (UTC)."""
    wait_for(lambda: read(core, namespace, name) is None, timeout=timeout,
             what=f"pod {name} to be gone")
    return datetime.now(UTC)


def ungate(controller_api: client.ApiClient, namespace: str, name: str) -> None:
    client.CoreV1Api(controller_api).patch_namespaced_pod(
        name, namespace, [{"op": "remove", "path": "/spec/schedulingGates"}],
        _content_type=JSON_PATCH,
    )


def test_a_gated_pod_stays_unscheduled_while_an_ungated_one_runs(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    vm = create_sample_vm(api, namespace)
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, pod_manifest("gated", runner_of=vm))
    core.create_namespaced_pod(namespace, pod_manifest("control"))

    running(core, namespace, "control")  # the scheduler and the nodes are at work...

    gated = core.read_namespaced_pod("gated", namespace)  # ...and left this one alone
    assert gated.spec.node_name is None
    assert gated.status.phase == "Pending"
    scheduled = next(c for c in gated.status.conditions if c.type == "PodScheduled")
    assert (scheduled.status, scheduled.reason) == ("False", "SchedulingGated")


def test_an_ungated_runner_pod_is_scheduled_and_becomes_running_and_ready(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    vm = create_sample_vm(api, namespace)
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, pod_manifest("runner", runner_of=vm))
    ungate(controller_api, namespace, "runner")

    pod = running(core, namespace, "runner")
    assert pod.spec.node_name in {nodes.node_name(i) for i in range(2)}
    assert pod.status.pod_ip
    ready = wait_for(
        lambda: next((c for c in (core.read_namespaced_pod("runner", namespace).status.conditions
                                  or []) if c.type == "Ready" and c.status == "True"), None),
        timeout=60, what="the runner pod to be Ready",
    )
    assert ready.status == "True"


def test_a_graceful_delete_keeps_the_pod_terminating_until_its_grace_period_ends(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, pod_manifest("p", grace=4))
    running(core, namespace, "p")

    core.delete_namespaced_pod("p", namespace)
    terminating = core.read_namespaced_pod("p", namespace)
    deadline = terminating.metadata.deletion_timestamp
    assert deadline is not None
    assert terminating.metadata.deletion_grace_period_seconds == 4
    assert terminating.status.phase == "Running"  # still running its guest

    gone_at = gone(core, namespace, "p")
    # The API server's deadline is whole seconds (rounded down); the pod must outlive it.
    assert gone_at >= deadline


def test_a_delayed_termination_outlasts_the_grace_period_until_released(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    for name in ("slow", "control"):
        core.create_namespaced_pod(namespace, pod_manifest(name, grace=1))
    nodes.delay_termination(api, namespace, "slow", 3600)
    for name in ("slow", "control"):
        running(core, namespace, name)

    for name in ("slow", "control"):
        core.delete_namespaced_pod(name, namespace)
    gone(core, namespace, "control")  # same grace period, already over

    slow = core.read_namespaced_pod("slow", namespace)
    assert slow.metadata.deletion_timestamp is not None
    assert slow.metadata.deletion_timestamp < datetime.now(UTC)  # past its deadline

    nodes.delay_termination(api, namespace, "slow", None)  # the guest finally stops
    gone(core, namespace, "slow")


def test_a_guest_exit_ends_the_pod_in_a_terminal_phase(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    for name in ("ok", "crash"):
        core.create_namespaced_pod(namespace, pod_manifest(name))
        running(core, namespace, name)
    nodes.exit_pod(api, namespace, "ok", 0)
    nodes.exit_pod(api, namespace, "crash", 3)

    for name, phase, code in (("ok", "Succeeded", 0), ("crash", "Failed", 3)):
        pod = wait_for(
            lambda name=name, phase=phase: (p := core.read_namespaced_pod(name, namespace))
            and p.status.phase == phase and p,
            timeout=60, what=f"pod {name} to end {phase}",
        )
        assert pod.status.container_statuses[0].state.terminated.exit_code == code


def test_runner_pods_whose_vm_is_deleted_are_garbage_collected(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    vm = create_sample_vm(api, namespace)
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, pod_manifest("runner", runner_of=vm, grace=3))
    ungate(controller_api, namespace, "runner")
    running(core, namespace, "runner")

    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm["metadata"]["name"]
    )
    gone(core, namespace, "runner")
    assert not core.list_namespaced_pod(
        namespace, label_selector=f"{types.LABEL_VM_NAME}={vm['metadata']['name']}"
    ).items


@pytest.fixture
def restore_nodes(api: client.ApiClient) -> Iterator[list[str]]:
    """Nodes a test breaks; restored (on, no out-of-service taint, schedulable) afterwards."""
    broken: list[str] = []
    yield broken
    for name in broken:
        nodes.set_out_of_service(api, name, present=False)
        nodes.power_on(api, name)
        nodes.wait_for_node(api, name, lambda n: n.schedulable, 120, "schedulable again")


@pytest.fixture
def lost_node(cluster: LocalCluster, restore_nodes: list[str]) -> str:
    name = nodes.node_name(cluster.spec.nodes - 1)
    restore_nodes.append(name)
    return name


def test_a_deleted_pod_on_a_not_ready_node_stays_terminating_until_out_of_service(
    api: client.ApiClient, namespace: str, lost_node: str
) -> None:
    core = client.CoreV1Api(api)
    healthy = nodes.node_name(0)
    core.create_namespaced_pod(namespace, pod_manifest("victim", node=lost_node, grace=1))
    core.create_namespaced_pod(namespace, pod_manifest("control", node=healthy, grace=1))
    assert running(core, namespace, "victim").spec.node_name == lost_node
    running(core, namespace, "control")

    nodes.power_off(api, lost_node)
    node = nodes.wait_for_node(api, lost_node, lambda n: n.ready not in ("True", ""), 120,
                               "NotReady")
    assert node.ready == "Unknown"  # kube-controller-manager's verdict: heartbeats stopped

    for name in ("victim", "control"):
        core.delete_namespaced_pod(name, namespace)
    gone(core, namespace, "control")  # a live kubelet finished the same deletion...
    victim = core.read_namespaced_pod("victim", namespace)  # ...the dead one cannot
    assert victim.metadata.deletion_timestamp is not None
    assert victim.metadata.deletion_timestamp < datetime.now(UTC)

    # The operator confirms the node is off and says so; pod GC force-deletes the pod.
    assert nodes.set_out_of_service(api, lost_node, present=True)
    gone(core, namespace, "victim", timeout=120)


def test_the_node_commands_report_and_refuse_in_one_line(cluster: LocalCluster) -> None:
    runner = CliRunner()
    listed = runner.invoke(
        main, ["dev", "node", "list", "-o", "yaml", "--state-dir", str(cluster.state_dir)]
    )
    assert listed.exit_code == 0, listed.output
    rows = yaml.safe_load(listed.output)
    assert {r["node"] for r in rows} >= {nodes.node_name(0), nodes.node_name(1)}

    refused = runner.invoke(
        main, ["dev", "node", "power-off", "no-such-node", "--state-dir", str(cluster.state_dir)]
    )
    assert refused.exit_code == 1
    assert refused.output.strip().splitlines() == ["error: no node 'no-such-node'"]


# ---- with the controller -------------------------------------------------------------------



@pytest.fixture
def controller(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> Iterator[Replicas]:
    """One ``neonvm controller run`` replica for this namespace, killed afterwards."""
    group = Replicas(
        api=api, kubeconfig=cluster.kubeconfig_for("controller"),
        etcd_endpoints=cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        lease_namespace=namespace, log_dir=tmp_path / "replicas",
        extra_args=[*FAST, "--watch-namespace", namespace],
    )
    with group:
        group.start("a")
        yield group
        for r in group:  # shown by pytest only when the test failed
            print(f"---- {r.name} (exit {r.exit_code()}) ----\n{r.log()[-20000:]}")


def running_runner(api: client.ApiClient, namespace: str, vm: str) -> str:
    """Wait until the VM has converged on one Running runner pod; return its name."""
    core = client.CoreV1Api(api)

    def check() -> str | None:
        if not converged(api, namespace, [vm]):
            return None
        name = str((get_vm(api, namespace, vm) or {})["status"]["podName"])
        pod = read(core, namespace, name)
        return name if pod is not None and pod.status.phase == "Running" else None

    name: str = wait_for(check, timeout=120, what=f"VM {vm} to run one runner pod")
    return name


def waiting_replacement(api: client.ApiClient, namespace: str, vm: str, old: str) -> str:
    """Wait until a replacement is committed and the VM says it waits for ``old``."""

    def check() -> str | None:
        status = (get_vm(api, namespace, vm) or {}).get("status") or {}
        waiting = any(c.get("type") == WAITING_FOR_OLD_POD and c.get("status") == "True"
                      for c in [*(status.get("conditions") or []),
                                *(status.get("extraConditions") or [])])
        name = status.get("podName")
        return str(name) if waiting and name and name != old else None

    name: str = wait_for(check, timeout=120, what=f"VM {vm} to wait for {old} to go")
    return name


@pytest.mark.usefixtures("controller", "checker")
def test_the_controllers_replacement_stays_gated_until_the_old_pod_is_gone(
    api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    # A 2 s grace period: the old pod stays past it only because its guest is slow, and
    # once released it goes at once (with the default 30 s it would wait those out).
    create_vm(api, namespace, "vm", restart_policy="Always",
              spec={"terminationGracePeriodSeconds": 2})
    old = running_runner(api, namespace, "vm")

    nodes.delay_termination(api, namespace, old, 3600)  # a guest slow to power down
    core.delete_namespaced_pod(old, namespace)
    new = waiting_replacement(api, namespace, "vm", old)

    # The controller has seen the old pod and decided to wait: the replacement is
    # created and committed, but gated, while the old pod is still there.
    assert is_gated(core.read_namespaced_pod(new, namespace))
    assert core.read_namespaced_pod(old, namespace).metadata.deletion_timestamp is not None

    nodes.delay_termination(api, namespace, old, None)  # the guest is finally off
    gone(core, namespace, old)
    assert running_runner(api, namespace, "vm") == new


@pytest.mark.usefixtures("controller", "checker")
def test_after_a_node_failure_the_replacement_starts_only_once_the_node_is_out_of_service(
    api: client.ApiClient, namespace: str, restore_nodes: list[str]
) -> None:
    core = client.CoreV1Api(api)
    create_vm(api, namespace, "vm", restart_policy="Always")
    old = running_runner(api, namespace, "vm")
    lost_node = core.read_namespaced_pod(old, namespace).spec.node_name
    restore_nodes.append(lost_node)

    nodes.power_off(api, lost_node)
    nodes.wait_for_node(api, lost_node, lambda n: n.ready not in ("True", ""), 120, "NotReady")
    core.delete_namespaced_pod(old, namespace)  # an eviction, or an operator
    new = waiting_replacement(api, namespace, "vm", old)
    assert is_gated(core.read_namespaced_pod(new, namespace))
    assert core.read_namespaced_pod(old, namespace).metadata.deletion_timestamp is not None

    assert nodes.set_out_of_service(api, lost_node, present=True)  # confirmed off
    gone(core, namespace, old, timeout=120)
    assert running_runner(api, namespace, "vm") == new
    assert core.read_namespaced_pod(new, namespace).spec.node_name != lost_node
