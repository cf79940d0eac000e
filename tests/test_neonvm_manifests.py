"""NeonVM's own manifests apply and run as they are; admission as NeonVM's webhook does it.

``tests/neonvm_manifests/`` holds this project's copies of NeonVM's ``vm-deploy.yaml``,
its samples and the VMs of its e2e suite (written from their fields). Each is created
object by object with the API server's strict field validation (what
``kubectl apply --validate=strict`` asks for), then a controller replica runs it on the
simulated nodes until the VM is Running. NeonVM's e2e VMs name
``schedulerName: autoscale-scheduler`` (its scheduler plugin); the module starts a plain
kube-scheduler under that name, as NeonVM's clusters have one.

Then what NeonVM's webhook does, here without a webhook: CPU amounts written as numbers
(stored as NeonVM stores them, by neonvm/api/admission.py), the CRD's defaults, the
fields that never change after creation, reserved disk and port names
(docs/neonvm-compat.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from neonvm import kube
from neonvm.api import compat, types
from neonvm.api.millicpu import MilliCPU
from neonvm.controller.podspec import NEONVM_KVM_RESOURCE, PodDefaults, runner_pod
from neonvm.dev.cluster import LocalCluster
from neonvm.runner.qemu import build_launch_plan
from tests.support import replica_group, wait_for
from tests.support.harness import get_vm, runner_pods, vm_manifest
from tests.support.runner import context, kernel_spec, option_values, spec_of

HERE = Path(__file__).resolve().parent / "neonvm_manifests"
RUNNABLE = sorted(str(p.relative_to(HERE)) for p in HERE.rglob("*.yaml")
                  if "VirtualMachineMigration" not in p.read_text()
                  and p.relative_to(HERE).parts[0] != "autoscaling")
"""Not ``autoscaling/``: NeonVM's whole e2e suite, verbatim, run by test_neonvm_e2e.py."""


class _KubectlLoader(yaml.SafeLoader):
    """YAML as kubectl reads it: a timestamp stays a string (``updatedAt: 2006-01-02T...``)."""


_KubectlLoader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def documents(rel: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all((HERE / rel).read_text(), Loader=_KubectlLoader) if d]


def collection(obj: dict[str, Any], namespace: str) -> str:
    group_version = obj["apiVersion"]
    plural = {"VirtualMachine": types.PLURAL, "VirtualMachineMigration":
              "virtualmachinemigrations"}.get(obj["kind"], obj["kind"].lower() + "s")
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return f"{root}/namespaces/{namespace}/{plural}"


def create_strict(api: client.ApiClient, namespace: str, obj: dict[str, Any]) -> Any:
    """POST with fieldValidation=Strict: an unknown or duplicate field is an error."""
    return kube.request(api, "POST", collection(obj, namespace), obj,
                        query=[("fieldValidation", "Strict")])


def refusal(api: client.ApiClient, method: str, path: str, body: Any,
            content_type: str = "application/merge-patch+json") -> str:
    """The API server's message for a request it must refuse with a 422."""
    with pytest.raises(client.ApiException) as err:
        kube.request(api, method, path, body, content_type=content_type)
    assert err.value.status == 422, err.value.body
    return kube.api_error_message(err.value)


def vm_path(namespace: str, name: str = "") -> str:
    base = f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}"
    return f"{base}/{name}" if name else base


# ---- NeonVM's manifests, as they are ---------------------------------------------------------


def neonvm_encoding(value: object) -> object:
    """How NeonVM's webhook stores a CPU amount: whole vCPUs an int, else "<n>m"."""
    return MilliCPU.parse(value).to_json()


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("manifest", RUNNABLE)
def test_a_neonvm_manifest_applies_strictly_as_it_is_and_its_vm_runs(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path,
        autoscale_scheduler: str, manifest: str) -> None:
    objects = documents(manifest)
    for obj in objects:
        create_strict(api, namespace, obj)
    (vm,) = [o for o in objects if o["kind"] == types.KIND]
    name = vm["metadata"]["name"]
    stored = get_vm(api, namespace, name)
    assert stored is not None
    written = vm["spec"]["guest"]["cpus"]
    assert stored["spec"]["guest"]["cpus"] == {k: neonvm_encoding(v) for k, v in written.items()}
    assert stored["spec"]["cpuScalingMode"] == vm["spec"].get("cpuScalingMode", "QmpScaling")

    with replica_group(cluster, api, namespace, tmp_path / "replicas") as group:
        group.start("c1")

        def running() -> dict[str, Any] | None:
            status = (get_vm(api, namespace, name) or {}).get("status") or {}
            return status if status.get("phase") == "Running" else None

        status = wait_for(running, 90, what=f"{manifest}: VM {name} Running")
    (pod,) = runner_pods(api, namespace, name)
    assert pod.metadata.name == status["podName"] and pod.status.phase == "Running"
    assert pod.spec.scheduler_name == vm["spec"].get("schedulerName", "default-scheduler")
    # No service_links in the manifest: the pod keeps Kubernetes' default, as NeonVM's.
    assert pod.spec.enable_service_links is True
    cpus = MilliCPU.parse(written.get("use", written["min"]))
    assert status["cpus"] == cpus.to_json()
    ports = [(p.name, p.container_port) for p in pod.spec.containers[0].ports][1:]
    assert ports == [(p.get("name"), p["port"]) for p in vm["spec"]["guest"].get("ports", [])]


@pytest.mark.cluster
def test_a_virtual_machine_migration_is_not_served(api: client.ApiClient, namespace: str
                                                   ) -> None:
    (migration,) = documents("samples/vm-example-migration.yaml")
    with pytest.raises(client.ApiException) as err:
        create_strict(api, namespace, migration)
    assert err.value.status == 404


# ---- CPU amounts as numbers --------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize(("written", "stored"), [
    (0.25, "250m"), (1.0, 1), (1.1, "1100m"), (3.25, "3250m"), (0.0001, "1m"), (2, 2),
    ("0.5", "0.5"), ("250m", "250m"),
])
def test_a_cpu_amount_written_as_a_number_is_stored_as_neonvm_stores_it(
        api: client.ApiClient, namespace: str, written: object, stored: object) -> None:
    vm = vm_manifest("floats", spec={"guest": {
        **vm_manifest("x")["spec"]["guest"],
        "cpus": {"min": written, "max": written, "use": written}}})
    created = create_strict(api, namespace, vm)
    assert created["spec"]["guest"]["cpus"] == {"min": stored, "max": stored, "use": stored}
    decoded = types.VirtualMachine.from_object(created).spec.guest.cpus
    assert decoded.min == decoded.max == decoded.current == MilliCPU.parse(written)


@pytest.mark.cluster
def test_the_autoscalers_merge_patch_may_write_a_number_too(
        api: client.ApiClient, namespace: str) -> None:
    create_strict(api, namespace, vm_manifest("agent", spec={"guest": {
        **vm_manifest("x")["spec"]["guest"], "cpus": {"min": 0.25, "max": 2, "use": 0.25}}}))
    patched = kube.request(api, "PATCH", vm_path(namespace, "agent"),
                           {"spec": {"guest": {"cpus": {"use": 0.75}}}},
                           content_type="application/merge-patch+json")
    assert patched["spec"]["guest"]["cpus"] == {"min": "250m", "max": 2, "use": "750m"}


@pytest.mark.cluster
@pytest.mark.parametrize("bad", [True, "two", [1], -0.5])
def test_what_is_no_cpu_amount_is_still_refused(api: client.ApiClient, namespace: str,
                                                bad: object) -> None:
    vm = vm_manifest("bad", spec={"guest": {**vm_manifest("x")["spec"]["guest"],
                                            "cpus": {"min": bad, "max": 2}}})
    message = refusal(api, "POST", vm_path(namespace), vm, "application/json")
    assert "spec.guest.cpus.min" in message


# ---- defaults ------------------------------------------------------------------------------------


ADOPTED_DEFAULTS = {
    "restartPolicy": "Always", "runnerPort": 25183, "qmp": 20183, "enableAcceleration": True,
    "enableSSH": True, "enableNetworkMonitoring": False, "cpuScalingMode": "QmpScaling",
}


@pytest.mark.cluster
def test_the_api_server_stores_neonvms_defaults(api: client.ApiClient, namespace: str) -> None:
    vm = vm_manifest("plain")
    vm["spec"]["guest"].pop("memorySlotSize")
    vm["spec"].update(
        guest={**vm["spec"]["guest"], "env": [{"name": "A"}], "ports": [{"port": 5432}]},
        disks=[{"name": "d", "mountPath": "/d", "emptyDisk": {"size": "1Gi"}}],
        extraNetwork={}, tls={})
    spec = create_strict(api, namespace, vm)["spec"]
    assert {k: spec.get(k) for k in ADOPTED_DEFAULTS} == ADOPTED_DEFAULTS
    guest = spec["guest"]
    assert guest["memorySlotSize"] == "1Gi"
    assert guest["rootDisk"]["imagePullPolicy"] == "IfNotPresent"
    assert guest["env"] == [{"name": "A", "value": ""}]
    assert guest["ports"] == [{"port": 5432, "protocol": "TCP"}]
    assert spec["disks"][0]["readOnly"] is False and spec["disks"][0]["watch"] is False
    assert spec["extraNetwork"] == {"enable": False, "interface": "net1"}
    assert spec["tls"] == {"mountPath": "/var/tls"}
    # Not adopted: NeonVM's 5 s grace period (30 s here) and its second QMP port.
    assert "terminationGracePeriodSeconds" not in spec and "qmpManual" not in spec
    # enableSSH true (NeonVM's default) is built here (the SSH key Secret): not reported.
    decoded = types.VirtualMachine.from_object({"spec": spec}).spec
    assert "spec.enableSSH" not in compat.unimplemented_fields(decoded)


# ---- what never changes after creation -----------------------------------------------------------


IMMUTABLE = [
    ({"guest": {"cpus": {"min": 2, "max": 2, "use": 2}}}, "cpus.min is immutable"),
    ({"guest": {"cpus": {"max": 4}}}, "cpus.max is immutable"),
    ({"guest": {"memorySlots": {"min": 2, "use": 2}}}, "memorySlots.min is immutable"),
    ({"guest": {"memorySlots": {"max": 4}}}, "memorySlots.max is immutable"),
    ({"guest": {"ports": [{"port": 80}]}}, "ports is immutable"),
    ({"guest": {"ports": None}}, "ports is immutable"),
    ({"guest": {"rootDisk": {"size": "2Gi"}}}, "rootDisk is immutable"),
    ({"guest": {"command": ["/bin/true"]}}, "command is immutable"),
    ({"guest": {"args": ["-x"]}}, "args is immutable"),
    ({"guest": {"env": [{"name": "B", "value": "2"}]}}, "env is immutable"),
    ({"guest": {"settings": {"swap": "2Gi"}}}, "settings is immutable"),
    ({"disks": None}, "disks is immutable"),
    ({"podResources": {"limits": {"cpu": "2"}}}, "podResources is immutable"),
    ({"enableAcceleration": False}, "enableAcceleration is immutable"),
    ({"enableSSH": False}, "enableSSH is immutable"),
    ({"initScript": "echo"}, "initScript is immutable"),
    ({"enableNetworkMonitoring": True}, "enableNetworkMonitoring is immutable"),
    ({"cpuScalingMode": "SysfsScaling"}, "cpuScalingMode is not allowed to be changed"),
    ({"targetArchitecture": "arm64"}, "targetArchitecture is not allowed to be changed"),
]


def immutable_vm(name: str) -> dict[str, Any]:
    vm = vm_manifest(name, spec={"targetArchitecture": "amd64", "disks": [
        {"name": "d", "mountPath": "/d", "emptyDisk": {"size": "1Gi"}}]})
    vm["spec"]["guest"].update(cpus={"min": 1, "max": 2, "use": 1}, ports=[{"port": 5432}],
                               command=["/bin/sh"], args=["-c"], env=[{"name": "A"}],
                               settings={"swap": "1Gi"})
    return vm


@pytest.mark.cluster
@pytest.mark.parametrize(("patch", "message"), IMMUTABLE)
def test_a_field_neonvm_makes_immutable_is_refused_on_update(
        api: client.ApiClient, namespace: str, patch: dict[str, Any], message: str) -> None:
    create_strict(api, namespace, immutable_vm("fixed"))
    assert message in refusal(api, "PATCH", vm_path(namespace, "fixed"), {"spec": patch})


@pytest.mark.cluster
def test_what_the_autoscaler_and_users_may_still_change(
        api: client.ApiClient, namespace: str) -> None:
    vm = immutable_vm("free")
    del vm["spec"]["targetArchitecture"]
    create_strict(api, namespace, vm)
    path = vm_path(namespace, "free")
    for patch in ({"guest": {"cpus": {"use": "1500m"}, "memorySlots": {"use": 2}}},
                  {"guest": {"cpus": {"min": "1000m", "max": "2"}}},  # the same amounts
                  {"targetArchitecture": "arm64"},  # unset before: may be set once
                  {"overcommit": {"cpu": "2"}}, {"nodeSelector": {"a": "b"}},
                  {"restartPolicy": "Never"}):
        kube.request(api, "PATCH", path, {"spec": patch},
                     content_type="application/merge-patch+json")
    spec = (get_vm(api, namespace, "free") or {})["spec"]
    assert spec["guest"]["cpus"] == {"min": "1000m", "max": "2", "use": "1500m"}
    assert spec["targetArchitecture"] == "arm64" and spec["restartPolicy"] == "Never"


# ---- names NeonVM reserves, and kernelImage ------------------------------------------------------


REFUSED = [
    (lambda s: s.update(disks=[{"name": "swapdisk", "mountPath": "/s", "tmpfs": {"size": "1Mi"}}]),
     "reserved for .spec.disks[].name"),
    (lambda s: s.update(disks=[{"name": "rootdisk", "mountPath": "/s", "tmpfs": {"size": "1Mi"}}]),
     "reserved for .spec.disks[].name"),
    (lambda s: s.update(disks=[{"name": "d" * 33, "mountPath": "/s", "tmpfs": {"size": "1Mi"}}]),
     "may not be more than 32 bytes"),
    (lambda s: s["guest"].update(ports=[{"name": "qmp", "port": 1234}]),
     "'qmp' and 'runner' are reserved names"),
    (lambda s: s["guest"].update(ports=[{"name": "runner", "port": 1234}]),
     "'qmp' and 'runner' are reserved names"),
    (lambda s: s["guest"].update(kernelImage="neondatabase/vm-kernel:6.6"),
     "NeonVM's form, a container image holding /vmlinuz, is not supported"),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("breakage", "message"), REFUSED)
def test_a_reserved_name_or_a_kernel_image_reference_is_refused_at_create(
        api: client.ApiClient, namespace: str, breakage: Any, message: str) -> None:
    vm = vm_manifest("reserved")
    breakage(vm["spec"])
    assert message in refusal(api, "POST", vm_path(namespace), vm, "application/json")


# ---- the runner pod and the runner, for NeonVM's shapes ------------------------------------------


def built(spec: dict[str, Any], defaults: PodDefaults | None = None) -> dict[str, Any]:
    vm = types.VirtualMachine.from_object({
        **vm_manifest("p", spec=spec),
        "metadata": {"name": "p", "namespace": "n", "uid": "u-1", "resourceVersion": "1"}})
    return runner_pod(vm, types.PendingPod(name="p-1", plan_seq=1), defaults)


@pytest.mark.unit
@pytest.mark.parametrize(("links", "expected"), [(None, None), (False, False), (True, True)])
def test_service_links_are_passed_to_the_pod_as_neonvm_does(links: bool | None,
                                                            expected: bool | None) -> None:
    spec = {} if links is None else {"service_links": links}
    assert built(spec)["spec"].get("enableServiceLinks") is expected
    decoded = types.VirtualMachine.from_object(vm_manifest("p", spec=spec)).spec
    assert "spec.service_links" not in compat.unimplemented_fields(decoded)


@pytest.mark.unit
def test_neonvms_kvm_resource_name_can_be_requested() -> None:
    assert NEONVM_KVM_RESOURCE == "neonvm/kvm"
    limits = built({}, PodDefaults(kvm_resource=NEONVM_KVM_RESOURCE))["spec"]["containers"][0][
        "resources"]["limits"]
    assert limits[NEONVM_KVM_RESOURCE] == "1"


@pytest.mark.unit
def test_a_port_number_named_twice_is_forwarded_once_and_listed_twice_on_the_pod(
        tmp_path: Path) -> None:
    ports = [{"name": "postgres", "port": 5432}, {"name": "pooler", "port": 5432},
             {"name": "dns", "port": 5432, "protocol": "UDP"}]
    plan = build_launch_plan(spec_of(kernel_spec(ports=ports)),
                             context(tmp_path, listen_address="0.0.0.0"))
    (netdev,) = option_values(plan.argv, "-netdev")
    assert netdev.count("hostfwd=tcp:0.0.0.0:5432-:5432") == 1
    assert netdev.count("hostfwd=udp:0.0.0.0:5432-:5432") == 1
    assert plan.forwarded_ports == (5432,)
    pod_ports = built({"guest": {**vm_manifest("x")["spec"]["guest"], "ports": ports}})[
        "spec"]["containers"][0]["ports"]
    assert [(p.get("name"), p["containerPort"]) for p in pod_ports[1:]] == [
        ("postgres", 5432), ("pooler", 5432), ("dns", 5432)]


@pytest.mark.cluster
def test_the_pod_with_a_port_number_named_twice_is_accepted(
        controller_api: client.ApiClient, namespace: str) -> None:
    pod = built({"guest": {**vm_manifest("x")["spec"]["guest"], "ports": [
        {"name": "postgres", "port": 5432}, {"name": "pooler", "port": 5432}]}})
    pod["metadata"].pop("ownerReferences")
    pod["metadata"]["namespace"] = namespace
    created = kube.request(controller_api, "POST", f"/api/v1/namespaces/{namespace}/pods", pod,
                           query=[("dryRun", "All")])
    assert [p["name"] for p in created["spec"]["containers"][0]["ports"]] == [
        "runner", "postgres", "pooler"]
    assert json.loads(json.dumps(created["spec"].get("enableServiceLinks"))) is True
