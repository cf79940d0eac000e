"""A self-fencing runner pod's credential for its right: a projected ServiceAccount token of
the controller's rights audience, in the runner container alone, never where the guest or
the tenant's root-disk image can read it (neonvm/controller/podspec.py,
``rights_token_volume``; docs/security.md, "Rights endpoint")."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION, RIGHTS_TOKEN_FILE_ENV
from neonvm.api.types import (
    Disk,
    PendingPod,
    RootDisk,
    VirtualMachine,
    VirtualMachineSpec,
)
from neonvm.controller import podspec
from neonvm.runner.main import runner_options
from tests.support.rights import fencing_vm

AUDIENCE = "vm.neon.tech/rights/ops/nvm-neonvm-controller"
PLAN = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
ON = podspec.PodDefaults(right_seconds=30.0, rights_url="http://rights:8082",
                         rights_audience=AUDIENCE)


def token_volumes(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod["spec"].get("volumes") or [] if "projected" in v]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


@pytest.mark.unit
@pytest.mark.parametrize("v", [fencing_vm(), fencing_vm(scalable=True),
                               fencing_vm("neonvm-scaling-x", scalable=True)],
                         ids=["no-secret", "scalable-no-secret", "scalable-with-secret"])
def test_with_an_audience_a_vm_self_fences_with_a_projected_token_of_it(
        v: VirtualMachine) -> None:
    """No scaling token Secret is needed (the chart's default install has none)."""
    pod = podspec.runner_pod(v, PLAN, ON)
    assert pod["metadata"]["annotations"][RIGHT_SECONDS_ANNOTATION] == "30"
    (volume,) = token_volumes(pod)
    assert volume == {"name": podspec.RIGHTS_TOKEN_VOLUME, "projected": {"sources": [{
        "serviceAccountToken": {"audience": AUDIENCE, "expirationSeconds": 7200,
                                "path": "token"}}]}}
    (runner,) = pod["spec"]["containers"]
    assert {"name": podspec.RIGHTS_TOKEN_VOLUME, "mountPath": "/vm/rights",
            "readOnly": True} in runner["volumeMounts"]
    names = [e["name"] for e in runner["env"]]
    assert env(runner)[RIGHTS_TOKEN_FILE_ENV] == "/vm/rights/token"
    assert names.count("NEONVM_POD_UID") == 1
    assert env(runner)["NEONVM_POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert pod["spec"]["automountServiceAccountToken"] is False


@pytest.mark.unit
def test_without_an_audience_nothing_is_projected_and_a_token_secret_is_still_needed() -> None:
    before = podspec.PodDefaults(right_seconds=30.0, rights_url="http://rights:8082")
    assert token_volumes(podspec.runner_pod(fencing_vm("neonvm-scaling-x"), PLAN, before)) == []
    assert RIGHT_SECONDS_ANNOTATION not in podspec.runner_pod(fencing_vm(), PLAN, before)[
        "metadata"]["annotations"]
    off = dataclasses.replace(ON, right_seconds=0.0)
    assert token_volumes(podspec.runner_pod(fencing_vm(), PLAN, off)) == []
    own = fencing_vm(runner_image="mine:1")  # its runner may not kill its guest: no right, no token
    assert token_volumes(podspec.runner_pod(own, PLAN, ON)) == []


@pytest.mark.unit
def test_the_token_reaches_neither_a_guest_disk_nor_the_root_disk_image() -> None:
    """Guest disks are made from the mounts under /vm/disks only, and the init container
    runs the tenant's root-disk image: neither holds the token, whatever the disks are
    named."""
    disks = [Disk(name="rights", config_map={"name": "cm"}),
             Disk(name="vm-rights-token", secret={"secretName": "s"}),
             Disk(name="token", empty_disk={"size": "1Gi"})]
    pod = podspec.runner_pod(fencing_vm(disks=disks, guest=dataclasses.replace(
        VirtualMachineSpec().guest, root_disk=RootDisk(image="tenant/disk:1"))), PLAN, ON)
    (runner,) = pod["spec"]["containers"]
    (init,) = pod["spec"]["initContainers"]
    (mount,) = [m for m in runner["volumeMounts"] if m["name"] == podspec.RIGHTS_TOKEN_VOLUME]
    assert not mount["mountPath"].startswith("/vm/disks")
    assert all(m["name"] != podspec.RIGHTS_TOKEN_VOLUME for m in init["volumeMounts"])
    assert RIGHTS_TOKEN_FILE_ENV not in env(init)
    assert [v["name"] for v in token_volumes(pod)] == [podspec.RIGHTS_TOKEN_VOLUME]
    disk_volumes = {v["name"] for v in pod["spec"]["volumes"] if v["name"].startswith("disk-")}
    assert podspec.RIGHTS_TOKEN_VOLUME not in disk_volumes and len(disk_volumes) == 3


@pytest.mark.unit
def test_the_runner_reads_the_token_file_from_the_environment_the_pod_sets() -> None:
    command = click.command()(runner_options(lambda **_: None))
    (option,) = [p for p in command.params if p.name == "rights_token_file"]
    assert isinstance(option, click.Option) and option.envvar == RIGHTS_TOKEN_FILE_ENV


def test_the_api_server_accepts_the_pod_with_its_projected_token(
        controller_api: client.ApiClient, namespace: str) -> None:
    """expirationSeconds is within what the API allows (600 s and up), and a projected
    token needs the pod's service account named (the controller names "default" when the
    VM names none); the stored pod keeps the volume."""
    pod = podspec.runner_pod(dataclasses.replace(fencing_vm(), namespace=namespace), PLAN, ON)
    assert pod["spec"]["serviceAccountName"] == "default"
    created = kube.request(controller_api, "POST", f"/api/v1/namespaces/{namespace}/pods",
                           body=pod)
    (stored,) = token_volumes(created)
    assert stored["projected"]["sources"] == token_volumes(pod)[0]["projected"]["sources"]
