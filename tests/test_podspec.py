"""The runner pod's least-privilege settings and the spec file, as built and as stored.

Unit tests (``-m unit``) read the manifest :func:`neonvm.controller.podspec.runner_pod`
builds. The real-server tests let the reconciler create the pod through the API server
and read it back: once in a namespace that enforces the Pod Security Standard
"restricted" (the API server's own PodSecurity admission decides), once for the spec
file volume. docs/runner.md ("Runner pod security", "Running it") says what and why.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.api.schema import decode, encode
from neonvm.api.types import PendingPod, VirtualMachine, VirtualMachineSpec, VirtualMachineStatus
from neonvm.controller.podspec import PodSpecError, runner_pod
from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.runner.spec import load_spec
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.harness import create_vm, get_vm, runner_pods

AUTHORITY = StaticAuthority(epoch=1, token=10)
PLAN = PendingPod(name="db-abcdef01-1", plan_seq=1, token=10, epoch=1, generation=1)
NOWHERE = {"neonvm.test/unschedulable": "true"}
"""Runner pods here are never bound to a node: only the stored object matters."""
EXEC_STRING_LIMIT = 128 * 1024
"""Linux's MAX_ARG_STRLEN: exec refuses any one argument or environment string longer."""

RESTRICTED_CONTAINER = {
    "privileged": False,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def a_vm(spec: dict[str, Any] | None = None) -> VirtualMachine:
    body: dict[str, Any] = {"guest": {"rootDisk": {"image": "reg/pg:15"}}}
    body.update(spec or {})
    return VirtualMachine(name="db", namespace="ns", uid="abcdef0123", resource_version="1",
                          generation=1, spec=decode(VirtualMachineSpec, body, ".spec"),
                          status=VirtualMachineStatus(), labels={})


def big_guest_env(total: int) -> list[dict[str, str]]:
    """Guest env entries adding up to about ``total`` bytes of JSON."""
    value = "x" * 1000
    return [{"name": f"SETTING_{i}", "value": value} for i in range(total // 1000 + 1)]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env") or []}


# ---- the manifest (pure) -------------------------------------------------------------------


@pytest.mark.unit
def test_a_runner_pod_gets_no_token_and_runs_without_root_or_privilege() -> None:
    pod = runner_pod(a_vm({"disks": [{"name": "scratch", "emptyDisk": {"size": "1Gi"}},
                                     {"name": "conf", "secret": {"secretName": "s"}}]}), PLAN)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
        "seccompProfile": {"type": "RuntimeDefault"}}
    containers = [*spec["initContainers"], *spec["containers"]]
    assert [c["name"] for c in containers] == ["init-rootdisk", "neonvm-runner"]
    for container in containers:
        assert container["securityContext"] == RESTRICTED_CONTAINER, container["name"]
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
    assert not any("hostPath" in v for v in spec["volumes"])
    # A read-only root filesystem: the runner's work dir is an emptyDir.
    (runner,) = spec["containers"]
    assert env_of(runner)["NEONVM_WORK_DIR"] == "/vm/run"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["vm-run"] == {"name": "vm-run", "emptyDir": {}}
    assert {"name": "vm-run", "mountPath": "/vm/run"} in runner["volumeMounts"]


@pytest.mark.unit
@pytest.mark.parametrize(("spec", "start"), [
    ({}, None),
    ({"guest": {"rootDisk": {"image": "i"}, "ports": [{"port": 5432}, {"port": 80}]}}, "80"),
    ({"guest": {"rootDisk": {"image": "i"}, "ports": [{"port": 53, "protocol": "UDP"}]}},
     "53"),
    ({"qmp": 22}, "22"),
    ({"runnerPort": 443, "qmp": 8443}, "443"),
])
def test_a_port_below_1024_lowers_the_unprivileged_port_start_and_adds_no_capability(
        spec: dict[str, Any], start: str | None) -> None:
    pod = runner_pod(a_vm(spec), PLAN)
    security = pod["spec"]["securityContext"]
    if start is None:
        assert "sysctls" not in security
    else:
        assert security["sysctls"] == [
            {"name": "net.ipv4.ip_unprivileged_port_start", "value": start}]
    assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"]}


@pytest.mark.unit
def test_the_spec_reaches_the_runner_as_a_file_projected_from_an_annotation(
        tmp_path: Path) -> None:
    vm = a_vm({"guest": {"rootDisk": {"image": "i"},
                         "env": big_guest_env(EXEC_STRING_LIMIT + 20_000)}})
    pod = runner_pod(vm, PLAN)
    text = pod["metadata"]["annotations"]["vm.neon.tech/spec"]
    assert len(text.encode()) > EXEC_STRING_LIMIT
    assert json.loads(text) == encode(vm.spec)

    spec = pod["spec"]
    (runner,) = spec["containers"]
    env = env_of(runner)
    assert "NEONVM_VM_SPEC" not in env
    assert max(len(v.encode()) for v in env.values()) < 1024, "nothing big in the env"
    assert env["NEONVM_SPEC_FILE"] == "/vm/spec/spec.json"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["vm-spec"] == {"name": "vm-spec", "downwardAPI": {"items": [{
        "path": "spec.json",
        "fieldRef": {"fieldPath": "metadata.annotations['vm.neon.tech/spec']"}}, {
        "path": "resources.json",
        "fieldRef": {"fieldPath": "metadata.annotations['vm.neon.tech/resources']"}}]}}
    assert env["NEONVM_RESOURCES_FILE"] == "/vm/spec/resources.json"
    assert {"name": "vm-spec", "mountPath": "/vm/spec", "readOnly": True} in \
        runner["volumeMounts"]

    # What the kubelet writes into the volume is what the runner decodes.
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(text)
    loaded = load_spec(spec_file, env)
    assert loaded.spec == vm.spec
    assert (loaded.key, loaded.source) == ("ns/db", str(spec_file))


@pytest.mark.unit
def test_a_spec_too_big_for_the_pods_annotations_is_a_pod_spec_error() -> None:
    vm = a_vm({"guest": {"rootDisk": {"image": "i"}, "env": big_guest_env(300 * 1024)}})
    with pytest.raises(PodSpecError, match=r"annotations may hold at most 262144 bytes"):
        runner_pod(vm, PLAN)


# ---- the stored pod (real API server) -----------------------------------------------------------


def reconcile_to_a_pod(api: client.ApiClient, controller_api: client.ApiClient,
                       namespace: str, name: str) -> Any:
    """Plan and create the VM's runner pod; fail with the VM's conditions if none came."""
    reconciler = shipped_reconciler(controller_api, config=ReconcilerConfig(max_steps=3))
    result = reconciler.reconcile(f"{namespace}/{name}", AUTHORITY, direct_first=True)
    pods = runner_pods(api, namespace, name)
    if len(pods) != 1:
        status = (get_vm(api, namespace, name) or {}).get("status") or {}
        raise AssertionError(f"expected one runner pod, found {len(pods)}; last action "
                             f"{result.action!r}; conditions {status.get('conditions')}")
    return pods[0]


@pytest.mark.cluster
def test_a_runner_pod_is_admitted_where_pod_security_restricted_is_enforced(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    client.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest"}}})
    # A container-image root disk (so an init container too), a low guest port, a Secret
    # disk and spec.qmp: everything that could have needed a privilege.
    create_vm(api, namespace, "locked", spec={
        "nodeSelector": NOWHERE, "qmp": 20183,
        "guest": {"cpus": {"min": 1, "max": 1}, "memorySlots": {"min": 1, "max": 1},
                  "memorySlotSize": "256Mi", "rootDisk": {"image": "reg/pg:15"},
                  "ports": [{"port": 80, "name": "http"}]},
        "disks": [{"name": "conf", "mountPath": "/conf", "secret": {"secretName": "conf"}}],
    })

    pod = reconcile_to_a_pod(api, controller_api, namespace, "locked")
    spec = pod.spec
    assert spec.automount_service_account_token is False
    security = spec.security_context
    assert (security.run_as_non_root, security.run_as_user, security.run_as_group,
            security.fs_group) == (True, 65532, 65532, 65532)
    assert security.seccomp_profile.type == "RuntimeDefault"
    assert [(s.name, s.value) for s in security.sysctls] == [
        ("net.ipv4.ip_unprivileged_port_start", "80")]
    for container in [*spec.init_containers, *spec.containers]:
        sc = container.security_context
        assert (sc.privileged, sc.allow_privilege_escalation, sc.read_only_root_filesystem,
                sc.capabilities.drop, sc.capabilities.add) == (
            False, False, True, ["ALL"], None), container.name
    assert not any(m.mount_path.startswith("/var/run/secrets")
                   for m in spec.containers[0].volume_mounts or [])


@pytest.mark.cluster
def test_a_vms_runner_pod_reads_the_spec_from_a_file_projected_from_its_annotation(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    created = create_vm(api, namespace, "filed", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 2}, "memorySlots": {"min": 1, "max": 2},
                  "memorySlotSize": "256Mi", "rootDisk": {"image": "reg/pg:15"},
                  "env": [{"name": f"V{i}", "value": "v" * 200} for i in range(40)]},
    })

    pod = reconcile_to_a_pod(api, controller_api, namespace, "filed")
    stored = json.loads(pod.metadata.annotations["vm.neon.tech/spec"])
    assert stored == encode(decode(VirtualMachineSpec, created["spec"], ".spec"))
    assert len(stored["guest"]["env"]) == 40
    (volume,) = [v for v in pod.spec.volumes if v.name == "vm-spec"]
    assert [(item.path, item.field_ref.field_path) for item in volume.downward_api.items] == [
        ("spec.json", "metadata.annotations['vm.neon.tech/spec']"),
        ("resources.json", "metadata.annotations['vm.neon.tech/resources']")]
    (runner,) = pod.spec.containers
    (mount,) = [m for m in runner.volume_mounts if m.name == "vm-spec"]
    assert (mount.mount_path, mount.read_only) == ("/vm/spec", True)
    env = {e.name: e.value for e in runner.env}
    assert env["NEONVM_SPEC_FILE"] == "/vm/spec/spec.json"
    assert "NEONVM_VM_SPEC" not in env
    assert types.ANNOTATION_TOKEN in pod.metadata.annotations


def test_the_pod_carries_the_annotations_neonvms_scheduler_and_autoscaler_read() -> None:
    vm = VirtualMachine.from_object({
        "metadata": {"name": "db", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": {"guest": {"cpus": {"min": "250m", "max": 2, "use": "500m"},
                           "memorySlots": {"min": 1, "max": 4, "use": 2},
                           "memorySlotSize": "1024Mi", "rootDisk": {"image": "img"}}}})
    annotations = runner_pod(vm, PendingPod(name="db-1", token=1, epoch=1))["metadata"][
        "annotations"]
    assert json.loads(annotations["vm.neon.tech/usage"]) == {"cpu": "500m", "memory": "2Gi"}
    assert json.loads(annotations["vm.neon.tech/resources"]) == {
        "cpus": {"min": "250m", "max": 2, "use": "500m"},
        "memorySlots": {"min": 1, "max": 4, "use": 2}, "memorySlotSize": "1Gi"}
    assert annotations["kubectl.kubernetes.io/default-container"] == "neonvm-runner"


def test_the_vms_annotations_are_copied_but_kubectls_record_and_the_controllers_own() -> None:
    vm = VirtualMachine.from_object({
        "metadata": {"name": "db", "namespace": "ns", "uid": "u1", "annotations": {
            "team/owner": "storage",
            "kubectl.kubernetes.io/last-applied-configuration": "{}",
            "vm.neon.tech/fence-token": "999"}},
        "spec": {"guest": {"rootDisk": {"image": "img"}}}})
    annotations = runner_pod(vm, PendingPod(name="db-1", token=7, epoch=1))["metadata"][
        "annotations"]
    assert annotations["team/owner"] == "storage"
    assert "kubectl.kubernetes.io/last-applied-configuration" not in annotations
    assert annotations[types.ANNOTATION_TOKEN] == "7"


def test_the_pod_records_the_vms_labels_and_annotations_it_copied_and_no_others() -> None:
    """The record (``vm.neon.tech/copied-metadata``) is what later lets a label the VM
    drops be removed from the pod without touching labels others put there."""
    vm = VirtualMachine.from_object({
        "metadata": {"name": "db", "namespace": "ns", "uid": "u1",
                     "labels": {"team": "a", "app.kubernetes.io/name": "mine",
                                "vm.neon.tech/name": "other", "vm.neon.tech/uid": "x"},
                     "annotations": {"team/owner": "storage",
                                     "kubectl.kubernetes.io/default-container": "sidecar",
                                     "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
        "spec": {"guest": {"rootDisk": {"image": "img"}}}})
    meta = runner_pod(vm, PendingPod(name="db-1", token=7, epoch=1))["metadata"]
    assert meta["labels"] == {"team": "a", "app.kubernetes.io/name": "NeonVM",
                              "vm.neon.tech/name": "db", "vm.neon.tech/uid": "u1"}
    assert meta["annotations"]["kubectl.kubernetes.io/default-container"] == "neonvm-runner"
    assert json.loads(meta["annotations"]["vm.neon.tech/copied-metadata"]) == {
        "labels": ["team"], "annotations": ["team/owner"]}
    bare = runner_pod(a_vm(), PendingPod(name="db-1", token=7, epoch=1))["metadata"]
    assert "vm.neon.tech/copied-metadata" not in bare["annotations"]
