"""The VirtualMachine API: one source for schema and codec, enforced by the real API server."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from neonvm import manifests
from neonvm.api import types
from neonvm.api.schema import DecodeError, decode, encode

SAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vm-deploy.yaml"


def sample_vm(name: str = "postgres14-disk-test") -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"] = {"name": name}
    return obj


@pytest.mark.unit
def test_the_chart_ships_exactly_the_generated_crd_and_policy() -> None:
    for rel, content in manifests.chart_files().items():
        shipped = manifests.CHART_DIR / rel
        assert shipped.read_text() == content, f"{rel} is stale: run 'neonvm manifests write'"


@pytest.mark.unit
def test_a_neonvm_users_spec_round_trips_through_the_dataclasses() -> None:
    spec = sample_vm()["spec"]
    decoded = decode(types.VirtualMachineSpec, spec)
    assert decoded.guest.cpus.current == 1
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
def test_the_crd_is_served_with_short_name_and_status_subresource(api: client.ApiClient) -> None:
    resources = client.CustomObjectsApi(api).get_api_resources(types.GROUP, types.VERSION)
    vm = next(r for r in resources.resources if r.name == types.PLURAL)
    assert vm.short_names == ["vm"]
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
def test_a_number_field_given_a_string_is_a_decode_error() -> None:
    spec = sample_vm()["spec"]
    spec["guest"]["cpus"]["min"] = "two"
    with pytest.raises(DecodeError, match=r"\.guest\.cpus\.min: expected a number"):
        decode(types.VirtualMachineSpec, spec, ".spec")
