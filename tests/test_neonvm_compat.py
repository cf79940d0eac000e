"""NeonVM compatibility: NeonVM-shaped manifests apply strictly, converge, and say what is
not implemented; the autoscaler's millicpu patch is accepted; oversized specs are refused.

The manifests under ``examples/neonvm/`` are written in the shapes of NeonVM's samples
(``vm-example.yaml``, ``vm-example-full.yaml``) and of a VM exported from a NeonVM cluster
with its defaults filled in. Each is created object by object with the API server's
strict field validation (what ``kubectl apply --validate=strict`` asks for) and reconciled
by the controller's own :class:`Reconciler`, as the controller's identity.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from neonvm import kube
from neonvm.api import compat, types
from neonvm.api.millicpu import MilliCPU
from neonvm.controller import actions as act
from neonvm.controller.action_table import status_mutation
from neonvm.controller.compat_events import warn_unimplemented
from neonvm.controller.events import EventRecorder
from neonvm.controller.reconciler import Reconciler, ReconcileResult
from tests.support import shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import get_vm, is_gated, runner_pods, vm_manifest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "neonvm"
MANIFESTS = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
AUTHORITY = StaticAuthority(epoch=1, token=10)
NOWHERE = {"neonvm.test/unschedulable": "true"}


def documents(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]


def the_vm(name: str) -> dict[str, Any]:
    (vm,) = [doc for doc in documents(name) if doc["kind"] == types.KIND]
    return vm


# ---- pure: decoding, the compat table, the status the commit writes -------------------------


@pytest.mark.unit
def test_the_exported_vm_decodes_with_millicpu_strings_and_names_its_unimplemented_fields(
) -> None:
    vm = types.VirtualMachine.from_object(the_vm("vm-exported.yaml"))
    cpus = vm.spec.guest.cpus
    assert (cpus.min, cpus.max, cpus.use) == (250, 2000, 500)
    assert vm.status.cpus == MilliCPU(500) and vm.status.memory_size == "2Gi"
    # memhpAutoMovableRatio reaches the guest kernel with virtio-mem (the default).
    assert compat.unimplemented_fields(vm.spec) == [
        "spec.qmpManual", "spec.targetArchitecture",
        "spec.disks[].emptyDisk.discard"]
    dimms = dataclasses.replace(vm.spec.guest, memory_provider="DIMMSlots")
    assert "spec.guest.memhpAutoMovableRatio" in compat.unimplemented_fields(
        dataclasses.replace(vm.spec, guest=dimms))


@pytest.mark.unit
def test_fields_set_to_values_that_ask_for_nothing_are_not_reported() -> None:
    spec = types.VirtualMachine.from_object(vm_manifest("quiet", spec={
        "enableSSH": False, "enableNetworkMonitoring": False, "enableAcceleration": True,
        "extraNetwork": {"enable": False, "interface": "net1"}, "service_links": True,
        "qmp": 20183, "runnerPort": 25183,
        "disks": [{"name": "d", "mountPath": "/d", "watch": False,
                   "emptyDisk": {"size": "1Gi", "discard": False}}]})).spec
    assert compat.unimplemented_fields(spec) == []
    assert compat.unimplemented_message(spec) == ""


@pytest.mark.unit
def test_every_neonvm_spec_field_is_in_the_schema_and_the_compat_doc() -> None:
    schema = types.VirtualMachineSpec
    from neonvm.api.schema import openapi_schema
    props = openapi_schema(schema)["properties"]
    neonvm_spec = {
        "qmp", "qmpManual", "runnerPort", "terminationGracePeriodSeconds", "nodeSelector",
        "affinity", "tolerations", "schedulerName", "serviceAccountName", "podResources",
        "restartPolicy", "imagePullSecrets", "targetArchitecture", "guest",
        "extraInitContainers", "initScript", "disks", "extraNetwork", "service_links",
        "enableAcceleration", "runnerImage", "enableSSH", "tls", "overcommit",
        "targetRevision", "cpuScalingMode", "enableNetworkMonitoring"}
    assert neonvm_spec <= set(props)
    guest = {"kernelImage", "memhpAutoMovableRatio", "appendKernelCmdline", "cpus",
             "memorySlotSize", "memorySlots", "rootDisk", "command", "args", "env", "ports",
             "settings"}
    assert guest <= set(props["guest"]["properties"])
    doc = (Path(__file__).resolve().parent.parent / "docs" / "neonvm-compat.md").read_text()
    for name in neonvm_spec | guest:
        assert f"`{name}`" in doc, f"docs/neonvm-compat.md does not list {name}"
    for u in compat.UNIMPLEMENTED:
        assert f"{u.path.split('.')[-1]}`" in doc, u.path


@pytest.mark.unit
def test_the_commit_records_the_boot_size_and_a_restart_clears_the_size() -> None:
    raw = the_vm("vm-exported.yaml")
    raw.pop("status")
    raw["metadata"].update(uid="u1", resourceVersion="1", generation=1, namespace="ns")
    raw["status"] = {"pendingPod": {"name": "p-1", "planSeq": 1}, "planSeq": 1}
    vm = types.VirtualMachine.from_object(raw)
    lease = act.Fence(epoch=1, token=1)
    committed = status_mutation(act.Commit(name="p-1", uid="pu", reason="r"), lease)(vm)
    assert committed is not None
    assert (committed.cpus, committed.memory_size) == (MilliCPU(500), "2Gi")
    # currentRevision is stamped once the VM runs at the spec's size (tests/test_autoscaler_view.py)
    assert committed.current_revision is None
    vm.status = committed
    restarted = status_mutation(act.Restart(name="p-1", uid="pu", reason="r"), lease)(vm)
    assert restarted is not None and (restarted.cpus, restarted.memory_size) == (None, None)


# ---- real server ----------------------------------------------------------------------------


def create_strict(api: client.ApiClient, namespace: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Create ``obj`` with fieldValidation=Strict: an unknown or duplicate field is an error."""
    kind = obj["kind"]
    if kind == types.KIND:
        created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, obj, field_validation="Strict")
        return created
    core = client.CoreV1Api(api)
    create = {"ConfigMap": core.create_namespaced_config_map,
              "Secret": core.create_namespaced_secret,
              "Service": core.create_namespaced_service}[kind]
    create(namespace, obj, field_validation="Strict")
    return obj


def settle(reconciler: Reconciler, key: str, rounds: int = 10) -> ReconcileResult:
    result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    for _ in range(rounds):
        if isinstance(result.action, act.Done):
            return result
        result = reconciler.reconcile(key, AUTHORITY, direct_first=True)
    return result


def vm_path(namespace: str) -> str:
    return f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}"


def status_of(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm = get_vm(api, namespace, name)
    assert vm is not None
    status: dict[str, Any] = vm.get("status") or {}
    return status


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in [*(status.get("conditions") or []),
                             *(status.get("extraConditions") or [])]
                 if c["type"] == type_), None)


def only_pod(api: client.ApiClient, namespace: str, name: str) -> Any:
    pods = runner_pods(api, namespace, name)
    status = status_of(api, namespace, name)
    assert [p.metadata.name for p in pods] == [status.get("podName")]
    assert not is_gated(pods[0]) and not status.get("pendingPod")
    return pods[0]


def warnings_for(api: client.ApiClient, namespace: str, name: str) -> list[Any]:
    return [e for e in client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items
        if e.type == "Warning" and e.reason == compat.REASON_USED]


@pytest.mark.cluster
@pytest.mark.parametrize("manifest", MANIFESTS)
def test_a_neonvm_shaped_manifest_applies_strictly_and_converges_to_one_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        manifest: str) -> None:
    for obj in documents(manifest):
        create_strict(api, namespace, copy.deepcopy(obj))
    vm = the_vm(manifest)
    name = vm["metadata"]["name"]
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    result = settle(reconciler, f"{namespace}/{name}")
    assert isinstance(result.action, act.Done), result

    pod = only_pod(api, namespace, name)
    status = status_of(api, namespace, name)
    decoded = types.VirtualMachine.from_object(vm).spec
    cpus, memory = compat.configured_size(decoded)
    assert (status["cpus"], status["memorySize"]) == (cpus.to_json(), memory)
    assert pod.spec.containers[0].resources.requests is None or \
        pod.spec.containers[0].resources.requests.get("cpu") == str(cpus)
    # What NeonVM's scheduler plugin and autoscaler-agent read from a runner pod.
    annotations = pod.metadata.annotations
    assert json.loads(annotations["vm.neon.tech/usage"]) == {"cpu": str(cpus), "memory": memory}
    resources = json.loads(annotations["vm.neon.tech/resources"])
    assert resources["cpus"]["use"] == cpus.to_json()
    assert resources["memorySlots"]["use"] == decoded.guest.memory_slots.current
    assert annotations["kubectl.kubernetes.io/default-container"] == "neonvm-runner"
    for key, value in (vm["metadata"].get("annotations") or {}).items():
        assert annotations[key] == value

    # What the controller saw: the stored object, with the CRD's defaults (enableSSH: true).
    stored = types.VirtualMachine.from_object(get_vm(api, namespace, name) or {}).spec
    used = compat.unimplemented_fields(stored)
    reported = condition(status, compat.CONDITION)
    if used:
        assert reported is not None and reported["status"] == "True"
        assert reported["reason"] == compat.REASON_USED
        for field in used:
            assert field in reported["message"]
        (event,) = wait_for(lambda: warnings_for(api, namespace, name), 30,
                            what="the FieldsNotImplemented warning")
        assert all(field in event.message for field in used)
    else:
        assert reported is None
        assert warnings_for(api, namespace, name) == []


@pytest.mark.cluster
def test_strict_validation_refuses_a_field_neonvm_does_not_have(
        api: client.ApiClient, namespace: str) -> None:
    vm = the_vm("vm-exported.yaml")
    vm["spec"]["guest"]["cpus"]["usee"] = "1"
    with pytest.raises(client.ApiException) as err:
        create_strict(api, namespace, vm)
    assert err.value.status == 400
    assert 'unknown field "spec.guest.cpus.usee"' in json.loads(err.value.body)["message"]


@pytest.mark.cluster
def test_the_autoscalers_millicpu_patch_is_accepted_and_the_next_runner_boots_with_it(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_strict(api, namespace, vm_manifest("scaled", restart_policy="Always", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": "250m", "max": 2, "use": "500m"},
                  "memorySlots": {"min": 1, "max": 4, "use": 1}, "memorySlotSize": "256Mi",
                  "rootDisk": {"image": "img", "size": "1Gi"}}}))
    key = f"{namespace}/scaled"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    first = only_pod(api, namespace, "scaled")
    assert first.spec.containers[0].resources.requests["cpu"] == "500m"
    assert status_of(api, namespace, "scaled")["cpus"] == "500m"

    # The autoscaler-agent's patch: cpus.use as a millicpu string, memory slots as an int.
    kube.request(api, "PATCH", f"{vm_path(namespace)}/scaled", [
        {"op": "replace", "path": "/spec/guest/cpus/use", "value": "1500m"},
        {"op": "replace", "path": "/spec/guest/memorySlots/use", "value": 2}],
        content_type="application/json-patch+json")
    raw = get_vm(api, namespace, "scaled")
    assert raw is not None and raw["spec"]["guest"]["cpus"]["use"] == "1500m"
    assert types.VirtualMachine.from_object(raw).spec.guest.cpus.current == 1500
    settle(reconciler, key)
    # No live hot-plug: the running pod keeps its boot size, and status says so.
    assert only_pod(api, namespace, "scaled").metadata.name == first.metadata.name
    assert status_of(api, namespace, "scaled")["cpus"] == "500m"

    client.CoreV1Api(api).patch_namespaced_pod_status(
        first.metadata.name, namespace, {"status": {"phase": "Succeeded"}})
    settle(reconciler, key)
    second = only_pod(api, namespace, "scaled")
    assert second.metadata.name != first.metadata.name
    assert second.spec.containers[0].resources.requests["cpu"] == "1500m"
    env = {e.name: e.value for e in second.spec.containers[0].env or []}
    if "NEONVM_VM_SPEC" in env:
        assert json.loads(env["NEONVM_VM_SPEC"])["guest"]["cpus"]["use"] == "1500m"
    status = status_of(api, namespace, "scaled")
    assert (status["cpus"], status["memorySize"]) == ("1500m", "512Mi")


OVERSIZED = [
    (lambda s: s["guest"]["memorySlots"].update(max=4096), "spec.guest.memorySlots.max",
     "should be less than or equal to 512"),
    (lambda s: s["guest"].update(args=["x"] * 10_000), "spec.guest.args",
     "must have at most 256 items"),
    (lambda s: s["guest"].update(args=["x" * 100_000]), "spec.guest.args[0]",
     "may not be more than 32768 bytes"),
    (lambda s: s["guest"].update(env=[{"name": f"V{i}", "value": "v"} for i in range(1000)]),
     "spec.guest.env", "must have at most 256 items"),
    (lambda s: s.update(initScript="#" * 200_000), "spec.initScript",
     "may not be more than 65536 bytes"),
    (lambda s: s.update(nodeSelector={f"k{i}": "v" for i in range(500)}), "spec.nodeSelector",
     "must have at most 64 items"),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("breakage", "field", "message"), OVERSIZED)
def test_an_oversized_vm_is_refused_by_the_api_server_naming_the_field(
        api: client.ApiClient, namespace: str, breakage: Any, field: str, message: str) -> None:
    vm = vm_manifest("huge")
    breakage(vm["spec"])
    with pytest.raises(client.ApiException) as err:
        create_strict(api, namespace, vm)
    assert err.value.status == 422, err.value.body
    assert field in err.value.body and message in err.value.body, err.value.body


@pytest.mark.cluster
def test_the_api_server_prints_neonvm_columns_for_kubectl_get_neonvm(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    for obj in documents("vm-exported.yaml"):
        create_strict(api, namespace, copy.deepcopy(obj))
    settle(shipped_reconciler(controller_api), f"{namespace}/compute-exported")
    # What kubectl asks for: the server-side Table, with every column (wide).
    method, url, headers, _, _ = api.param_serialize(
        "GET", vm_path(namespace), header_params={
            "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"])
    resp = api.call_api(method, url, header_params=headers, _request_timeout=30)
    resp.read()
    assert resp.status == 200
    table = json.loads(resp.data)
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:12] == ["Name", "Cpus", "Memory", "Pod", "ExtraIP", "Status", "Restarts",
                            "Age", "Node", "Image", "CPUScalingMode", "TargetArchitecture"]
    (row,) = table["rows"]
    cells = dict(zip(columns, row["cells"], strict=True))
    status = status_of(api, namespace, "compute-exported")
    assert (cells["Name"], cells["Cpus"], cells["Memory"], cells["Pod"]) == (
        "compute-exported", "500m", "2Gi", status["podName"])
    assert (cells["CPUScalingMode"], cells["TargetArchitecture"]) == ("QmpScaling", "amd64")
    assert cells["Restarts"] == 0 and cells["Status"] == status["phase"]


@pytest.mark.unit
def test_the_warning_event_is_recorded_once_per_change_of_the_named_fields() -> None:
    recorded: list[tuple[str, str]] = []

    class Events(EventRecorder):
        def record(self, vm: types.VirtualMachine, reason: str, message: str,
                   warning: bool = False) -> None:
            recorded.append((reason, message))

    def with_condition(message: str | None) -> types.VirtualMachine:
        vm = types.VirtualMachine.from_object(vm_manifest("w"))
        if message is not None:
            vm.status.conditions = [types.Condition(type=compat.CONDITION, status="True",
                                                    reason=compat.REASON_USED,
                                                    message=message)]
        return vm

    events = Events(None)
    assert warn_unimplemented(events, with_condition(None), with_condition("a"))
    assert not warn_unimplemented(events, with_condition("a"), with_condition("a"))
    assert warn_unimplemented(events, with_condition("a"), with_condition("a; b"))
    assert not warn_unimplemented(events, with_condition("a"), with_condition(None))
    assert recorded == [(compat.REASON_USED, "a"), (compat.REASON_USED, "a; b")]
