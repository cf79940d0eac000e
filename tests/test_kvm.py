"""KVM for runner pods: the device resource a VM with ``enableAcceleration`` requests, and
the runner's ``AccelerationUnavailable`` report when KVM does not work (this machine:
``/dev/kvm`` without vmx/svm), instead of a silent fallback to TCG.

All quick: the pod manifest is pure, and the runner is run as a real process with a QEMU
stand-in (``/bin/true``) so that only its start-up decisions are exercised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from neonvm.api.schema import decode
from neonvm.api.types import PendingPod, VirtualMachine, VirtualMachineSpec, VirtualMachineStatus
from neonvm.controller.podspec import PodDefaults, runner_pod
from neonvm.runner.host import KvmProbe, acceleration_unavailable, probe_kvm

REPO = Path(__file__).resolve().parent.parent
PLAN = PendingPod(name="db-abcdef01-1", plan_seq=1, token=10, epoch=1, generation=1)
KVM = "devices.kubevirt.io/kvm"


def a_vm(spec: dict[str, Any] | None = None) -> VirtualMachine:
    body: dict[str, Any] = {"guest": {"rootDisk": {"image": "/disks/root.qcow2"}}}
    body.update(spec or {})
    return VirtualMachine(name="db", namespace="ns", uid="abcdef0123", resource_version="1",
                          generation=1, spec=decode(VirtualMachineSpec, body, ".spec"),
                          status=VirtualMachineStatus(), labels={})


def runner_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


@pytest.mark.unit
@pytest.mark.parametrize(("accel", "requested"), [(None, True), (True, True), (False, False)])
def test_acceleration_requests_the_configured_kvm_resource(accel: bool | None,
                                                           requested: bool) -> None:
    spec: dict[str, Any] = {} if accel is None else {"enableAcceleration": accel}
    container = runner_container(runner_pod(a_vm(spec), PLAN, PodDefaults(kvm_resource=KVM)))
    resources = container["resources"]
    for key in ("limits", "requests"):
        assert (resources[key].get(KVM) == "1") is requested, (key, resources)
    assert resources["limits"]["memory"] == resources["requests"]["memory"]
    # NeonVM's default for enableAcceleration is true: only an explicit false turns it off.
    assert env_of(container)["NEONVM_ENABLE_ACCELERATION"] == ("true" if requested else "false")


@pytest.mark.unit
def test_without_a_configured_resource_nothing_is_requested() -> None:
    for spec in ({}, {"enableAcceleration": True},
                 {"enableAcceleration": True,
                  "podResources": {"limits": {"cpu": "1", "memory": "1Gi"}}}):
        container = runner_container(runner_pod(a_vm(spec), PLAN))
        assert KVM not in json.dumps(container["resources"])
    # Given podResources keep their own entries beside the device.
    given = runner_container(runner_pod(
        a_vm({"podResources": {"limits": {"cpu": "1", "memory": "1Gi"}}}), PLAN,
        PodDefaults(kvm_resource=KVM)))["resources"]
    assert given == {"limits": {"cpu": "1", "memory": "1Gi", KVM: "1"},
                     "requests": {KVM: "1"}}


@pytest.mark.unit
def test_acceleration_unavailable_only_when_asked_for_and_kvm_does_not_work(
        tmp_path: Path) -> None:
    missing = probe_kvm(tmp_path / "no-kvm")
    assert not missing.usable
    reason = acceleration_unavailable("auto", True, missing)
    assert reason is not None and reason.startswith("AccelerationUnavailable: ")
    assert str(tmp_path / "no-kvm") in reason
    assert acceleration_unavailable("auto", False, missing) is None  # not asked for
    assert acceleration_unavailable("tcg", True, missing) is None  # TCG chosen on purpose
    assert acceleration_unavailable("auto", True, KvmProbe(True, "ok")) is None


@pytest.mark.unit
def test_the_runner_reports_acceleration_unavailable_in_its_log_and_termination_message(
        tmp_path: Path) -> None:
    """A runner pod's view: NEONVM_ENABLE_ACCELERATION=true (set by the controller) and
    no usable KVM device. The guest still starts (TCG), and the runner says why not KVM
    in a warning and in the termination message the kubelet keeps."""
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"not a kernel")
    spec = tmp_path / "vm.json"
    spec.write_text(json.dumps({"guest": {"kernelImage": str(kernel),
                                          "rootDisk": {"image": ""}}}))
    termination = tmp_path / "termination-log"
    termination.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    env.update({"NEONVM_ENABLE_ACCELERATION": "true",
                "NEONVM_KVM_DEVICE": str(tmp_path / "no-kvm")})
    result = subprocess.run(
        [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec),
         "--qemu", "/bin/true", "--work-dir", str(tmp_path / "work"),
         "--listen-address", "127.0.0.1", "--port", str(_free_port()),
         "--termination-log", str(termination), "--shutdown-timeout", "1"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "accelerator tcg" in result.stderr, result.stderr
    warning = [line for line in result.stderr.splitlines()
               if "AccelerationUnavailable: KVM is not usable" in line]
    assert warning and "WARNING" in warning[0], result.stderr
    assert termination.read_text().startswith(
        f"AccelerationUnavailable: KVM is not usable, the guest runs under TCG: "
        f"{tmp_path / 'no-kvm'}"), termination.read_text()



def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the device plugin ---------------------------------------------------------------------


@pytest.mark.unit
def test_device_plugin_messages_round_trip_through_the_wire_format() -> None:
    from neonvm.runner import kvmplugin as kp

    request = kp.register_request("kvm.sock", KVM)
    assert kp.parse(request) == [(1, b"v1beta1"), (2, b"kvm.sock"), (3, KVM.encode()), (4, b"")]
    devices = [dict(kp.parse(bytes(d))) for _n, d in kp.parse(
        kp.list_and_watch_response(["kvm0", "kvm1"], kp.HEALTHY))]
    assert devices == [{1: b"kvm0", 2: b"Healthy"}, {1: b"kvm1", 2: b"Healthy"}]
    allocate = kp.field_bytes(1, kp.field_bytes(1, b"kvm3")) + \
        kp.field_bytes(1, kp.field_bytes(1, b"kvm4") + kp.field_bytes(1, b"kvm5"))
    assert kp.allocate_request_ids(allocate) == [["kvm3"], ["kvm4", "kvm5"]]
    (container,) = kp.parse(kp.allocate_response(1, "/dev/kvm"))
    (spec,) = kp.parse(bytes(container[1]))
    assert spec[0] == 3 and kp.parse(bytes(spec[1])) == [(1, b"/dev/kvm"), (2, b"/dev/kvm"),
                                                         (3, b"rw")]
    big = kp.field_bytes(1, b"x" * 300)  # a two-byte length varint
    assert kp.parse(big) == [(1, b"x" * 300)]
