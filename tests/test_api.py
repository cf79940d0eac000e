"""The VirtualMachine API: one source for schema and codec, enforced by the real API server."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kubernetes import client

from neonvm import manifests
from neonvm.api import crd, schema, types
from neonvm.api.millicpu import MilliCPU, MilliCPUError
from neonvm.api.schema import DecodeError, decode, encode
from tests.support.api import sample_vm


@pytest.mark.unit
def test_the_chart_ships_exactly_the_generated_crd_and_policy() -> None:
    for rel, content in manifests.chart_files().items():
        shipped = manifests.CHART_DIR / rel
        assert shipped.read_text() == content, f"{rel} is stale: run 'neonvm manifests write'"


@pytest.mark.unit
def test_a_neonvm_users_spec_round_trips_through_the_dataclasses() -> None:
    spec = sample_vm()["spec"]
    decoded = decode(types.VirtualMachineSpec, spec)
    assert decoded.guest.cpus.current == MilliCPU(1000) and decoded.guest.cpus.current.cores == 1
    assert decoded.guest.memory_slots.max == 2
    assert decoded.disks is not None and decoded.disks[0].empty_disk == {"size": "16Gi"}
    assert encode(decoded)["guest"]["rootDisk"] == spec["guest"]["rootDisk"]


@pytest.mark.unit
def test_a_wrongly_typed_field_is_named_in_the_decode_error() -> None:
    spec = sample_vm()["spec"]
    spec["restartPolicy"] = "Sometimes"
    with pytest.raises(DecodeError, match=r"\.restartPolicy"):
        decode(types.VirtualMachineSpec, spec, ".spec")


@pytest.mark.cluster
def test_the_crd_is_served_as_neonvm_without_a_vm_short_name_and_with_status(
        api: client.ApiClient) -> None:
    resources = client.CustomObjectsApi(api).get_api_resources(types.GROUP, types.VERSION)
    vm = next(r for r in resources.resources if r.name == types.PLURAL)
    assert vm.singular_name == "neonvm"
    assert not vm.short_names, "NeonVM has no short name; 'vm' would collide with KubeVirt"
    assert any(r.name == f"{types.PLURAL}/status" for r in resources.resources)


@pytest.mark.cluster
def test_a_neonvm_vm_deploy_yaml_applies_unchanged(api: client.ApiClient, namespace: str) -> None:
    custom = client.CustomObjectsApi(api)
    created = custom.create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, sample_vm(),
        field_validation="Strict",
    )
    assert created["spec"]["guest"]["rootDisk"]["size"] == "8Gi"
    assert created["spec"]["disks"][1]["tmpfs"] == {"size": "1Gi"}


BAD_SPECS = [
    (lambda s: s["guest"]["cpus"].update(min=-1), "spec.guest.cpus.min"),
    (lambda s: s["guest"]["cpus"].update(min="two"), "spec.guest.cpus.min"),
    (lambda s: s["guest"]["cpus"].update(min="0m"), "min must be above 0"),
    (lambda s: s["guest"]["cpus"].update(min="1500m", max="1.25", use="1.3"),
     "min must not exceed max"),
    (lambda s: s["guest"]["cpus"].update(use="4001m"), "use must lie between min and max"),
    (lambda s: s["guest"]["cpus"].update(max=513), "max is at most 512 vCPUs"),
    (lambda s: s["guest"]["memorySlots"].update(max=513), "spec.guest.memorySlots.max"),
    (lambda s: s["guest"]["cpus"].update(min=4, max=2, use=2), "min must not exceed max"),
    (lambda s: s["guest"]["memorySlots"].update(use=9), "use must lie between min and max"),
    (lambda s: s.update(restartPolicy="Sometimes"), "spec.restartPolicy"),
    (lambda s: s["guest"].update(memorySlotSize="lots"), "spec.guest.memorySlotSize"),
    (lambda s: s["guest"].pop("rootDisk"), "spec.guest.rootDisk"),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("breakage", "message"), BAD_SPECS)
def test_the_api_server_rejects_a_malformed_spec_with_its_validation_message(
    api: client.ApiClient, namespace: str, breakage: Any, message: str
) -> None:
    vm = sample_vm("bad")
    spec = copy.deepcopy(vm["spec"])
    breakage(spec)
    vm["spec"] = spec
    with pytest.raises(client.ApiException) as err:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, vm
        )
    assert err.value.status == 422
    assert message in err.value.body


@pytest.mark.unit
def test_a_cpu_amount_that_is_no_millicpu_is_a_decode_error_naming_the_field() -> None:
    spec = sample_vm()["spec"]
    spec["guest"]["cpus"]["min"] = "two"
    with pytest.raises(DecodeError, match=r"\.guest\.cpus\.min: expected a number"):
        decode(types.VirtualMachineSpec, spec, ".spec")


@pytest.mark.unit
@pytest.mark.parametrize(("given", "milli"), [
    (2, 2000), ("2", 2000), ("0.5", 500), ("250m", 250), ("2.", 2000), ("1.25", 1250),
    ("0.0001", 1), (0.25, 250), (MilliCPU(750), 750),
])
def test_neonvm_millicpu_forms_decode_to_millicpu(given: object, milli: int) -> None:
    cpus = decode(types.CPURange, {"min": given, "max": given, "use": given})
    assert cpus.min == cpus.max == cpus.current == milli
    assert isinstance(cpus.current, MilliCPU)


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["two", "1k", "1e3", "-1", "", "1.5m", True, -1, None, [1]])
def test_what_neonvm_would_refuse_is_not_a_millicpu(bad: object) -> None:
    with pytest.raises(MilliCPUError):
        MilliCPU.parse(bad)


@pytest.mark.unit
@pytest.mark.parametrize(("milli", "json", "vcpus"), [
    (1000, 1, 1), (2000, 2, 2), (500, "500m", 1), (1500, "1500m", 2), (250, "250m", 1),
])
def test_millicpu_encodes_as_neonvm_does_and_rounds_up_to_whole_vcpus(
        milli: int, json: object, vcpus: int) -> None:
    m = MilliCPU(milli)
    assert encode(types.CPURange(min=m, max=m)) == {"min": json, "max": json}
    assert m.rounded_up() == vcpus
    assert MilliCPU.parse(json) == m


INT64_IDENTIFIERS = {"spec.targetRevision.revision.value", "spec.targetRevision.revision.flags"}
"""NeonVM's revision: an int64 identifier and bit set, bounded only by their format."""


def _unbounded(schema: dict[str, Any], path: str) -> list[str]:
    """Spots in a schema where a value of any size would be accepted."""
    out: list[str] = []
    if schema.get("x-kubernetes-int-or-string"):
        if "maxLength" not in schema:
            out.append(f"{path}: int-or-string without maxLength")
        return out
    kind = schema.get("type")
    if kind == "integer" and "maximum" not in schema and path not in INT64_IDENTIFIERS:
        out.append(f"{path}: integer without maximum")
    if kind == "string" and "maxLength" not in schema and "enum" not in schema:
        out.append(f"{path}: string without maxLength")
    if kind == "array":
        if "maxItems" not in schema:
            out.append(f"{path}: array without maxItems")
        out += _unbounded(schema["items"], f"{path}[]")
    if kind == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") and "maxProperties" not in schema:
            out.append(f"{path}: free-form object without maxProperties")
        extra = schema.get("additionalProperties")
        if extra is not None:
            if "maxProperties" not in schema:
                out.append(f"{path}: map without maxProperties")
            out += _unbounded(extra, f"{path}{{}}")
        for name, sub in (schema.get("properties") or {}).items():
            out += _unbounded(sub, f"{path}.{name}")
    return out


@pytest.mark.unit
def test_every_list_string_and_map_of_the_spec_is_bounded_in_the_schema() -> None:
    spec = crd.virtualmachine_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "properties"]["spec"]
    assert _unbounded(spec, "spec") == []
    slots = spec["properties"]["guest"]["properties"]["memorySlots"]["properties"]
    assert {slots[k]["maximum"] for k in ("min", "max", "use")} == {512}


@pytest.mark.unit
def test_the_crd_has_neonvm_names_phases_and_printer_columns() -> None:
    obj = crd.virtualmachine_crd()
    names = obj["spec"]["names"]
    assert (names["singular"], names["plural"]) == ("neonvm", "virtualmachines")
    assert "shortNames" not in names
    version = obj["spec"]["versions"][0]
    columns = [(c["name"], c.get("priority", 0)) for c in version["additionalPrinterColumns"]]
    assert columns[:11] == [
        ("Cpus", 0), ("Memory", 0), ("Pod", 0), ("ExtraIP", 0), ("Status", 0),
        ("Restarts", 0), ("Age", 0), ("Node", 1), ("Image", 1), ("CPUScalingMode", 1),
        ("TargetArchitecture", 1)]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Running", "Succeeded", "Failed",
                                       "PreMigrating", "Migrating", "Scaling"]
    assert {"cpus", "memorySize", "currentRevision", "sshSecretName", "extraNetIP",
            "extraNetMask", "tlsSecretName", "restartCount", "podIP"} <= set(status)


@pytest.mark.unit
def test_decoding_resolves_each_class_type_hints_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Resolving annotations costs ten times the decode itself; the controller decodes a VM
    # several times per step, so the per-class plan must be built once and reused.
    obj = {"metadata": {"name": "a", "namespace": "n", "uid": "u", "resourceVersion": "1"},
           "spec": {"guest": {"cpus": {"use": "250m"}}}}
    first = types.VirtualMachine.from_object(obj)
    monkeypatch.setattr(schema, "get_type_hints", _refuse_resolving)
    assert types.VirtualMachine.from_object(obj) == first


def _refuse_resolving(cls: type) -> None:
    raise AssertionError(f"type hints of {cls.__name__} resolved again")
