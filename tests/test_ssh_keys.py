"""enableSSH (NeonVM's default, true): the VM's SSH key Secret, status.sshSecretName, and the
public key on its way to the guest; the private key nowhere but in the Secret.

The key pair, the Secret's shape, the create's outcomes, the pod's volume and the runner's
guest disk are pure and quick; against the real API server: one Secret create per runner
pod and no status write of its own, a deleted Secret made again for the next pod
(docs/neonvm-compat.md, "SSH"). NeonVM's own kuttl asserts of the Secret and the status
run in tests/test_neonvm_e2e.py.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.api import types
from neonvm.api.schema import decode
from neonvm.api.types import PendingPod, VirtualMachine, VirtualMachineSpec
from neonvm.controller import actions as act
from neonvm.controller import mutations, podspec, ssh_keys
from neonvm.invariant import InvariantChecker
from neonvm.runner import runtimedisk
from neonvm.runner.initramfs import RunnerKernel
from neonvm.runner.main import read_authorized_keys
from neonvm.runner.qemu import build_launch_plan
from tests.support import CountingAuthority, wait_for
from tests.support.harness import get_vm, runner_pods
from tests.support.reconcile import create_vm, settle
from tests.support.reconcile_observe import Recording
from tests.support.runner import context
from tests.support.vmbuilder_boot import (  # boot_kit: the fixture
    REPO,
    boot_kit,  # noqa: F401
    boot_skip_reason,
    free_port,
)

UID = "8d6c3f52-0000-4000-8000-000000000001"


def vm_of(enable_ssh: bool | None = True, recorded: bool = True) -> VirtualMachine:
    spec: dict[str, Any] = {"guest": {"cpus": {"min": 1, "max": 1},
                                      "memorySlots": {"min": 1, "max": 1},
                                      "memorySlotSize": "1Gi",
                                      "rootDisk": {"image": "vm-postgres:15-bullseye"}}}
    if enable_ssh is not None:
        spec["enableSSH"] = enable_ssh
    status = {"sshSecretName": "ssh-neonvm-db"} if recorded else {}
    return VirtualMachine.from_object({
        "metadata": {"name": "db", "namespace": "ns", "uid": UID, "generation": 1,
                     "resourceVersion": "1"},
        "spec": spec, "status": status})


# ---- the key pair and the Secret ------------------------------------------------------------


@pytest.mark.unit
def test_a_key_pair_is_an_authorized_keys_line_and_the_openssh_private_key_of_it() -> None:
    public, private = ssh_keys.key_pair()
    assert public.startswith(b"ssh-ed25519 ") and public.endswith(b"\n")
    assert public.count(b"\n") == 1
    assert private.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key = serialization.load_ssh_private_key(private, password=None)  # unencrypted
    assert isinstance(key, Ed25519PrivateKey)
    assert key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH) + b"\n" == public
    assert ssh_keys.key_pair()[0] != public  # a new pair each time


@pytest.mark.unit
def test_the_secret_has_neonvms_name_type_keys_and_controlling_owner() -> None:
    vm = vm_of()
    secret = ssh_keys.secret_manifest(vm, b"pub\n", b"priv")
    assert secret["type"] == "kubernetes.io/ssh-auth" and secret["immutable"] is True
    meta = secret["metadata"]
    assert (meta["name"], meta["namespace"]) == ("ssh-neonvm-db", "ns")
    assert meta["ownerReferences"] == [{
        "apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine", "name": "db", "uid": UID,
        "controller": True, "blockOwnerDeletion": True}]
    assert meta["labels"] == {types.LABEL_VM_NAME: "db", types.LABEL_VM_UID: UID}
    assert {k: base64.b64decode(v) for k, v in secret["data"].items()} == {
        "ssh-publickey": b"pub\n", "ssh-privatekey": b"priv"}


class Creator:
    """Answers the one create with ``status`` (None: created); records the bodies."""

    def __init__(self, status: int | None = None) -> None:
        self.status = status
        self.bodies: list[dict[str, Any]] = []

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        if self.status is not None:
            raise ApiException(status=self.status, reason="test")
        return body


@pytest.mark.unit
@pytest.mark.parametrize(("status", "outcome"), [
    (None, "created"),
    (409, "exists"),  # whoever made it (the tenant's own pair included): used as it is
    (403, ssh_keys.Refused),
    (422, ssh_keys.Refused),
    (503, ApiException),  # transient: the pod waits, the step is retried
    (429, ApiException),
])
def test_ensuring_the_secret_is_one_create_whatever_the_answer(
        status: int | None, outcome: str | type[Exception]) -> None:
    creator = Creator(status)
    if isinstance(outcome, str):
        assert ssh_keys.ensure_secret(creator, vm_of()) == outcome
    else:
        with pytest.raises(outcome):
            ssh_keys.ensure_secret(creator, vm_of())
    assert len(creator.bodies) == 1


@pytest.mark.unit
@pytest.mark.parametrize(("enable_ssh", "recorded"), [(True, "ssh-neonvm-db"), (False, None),
                                                      (None, None)])
def test_the_plans_status_write_records_the_secret_name_only_with_enable_ssh(
        enable_ssh: bool | None, recorded: str | None) -> None:
    vm = vm_of(enable_ssh, recorded=False)
    plan = PendingPod(name="db-1", plan_seq=1, token=1, epoch=1, generation=1)
    new = mutations.record_plan(act.RecordPlan(plan=plan, observed_seq=0),
                                act.Fence(epoch=1, token=1))(vm)
    assert new is not None and new.ssh_secret_name == recorded


# ---- the runner pod: the public key alone ---------------------------------------------------


def pod_of(vm: VirtualMachine) -> dict[str, Any]:
    plan = PendingPod(name="db-1", plan_seq=1, token=1, epoch=1, generation=1)
    return podspec.runner_pod(vm, plan)


def secret_volumes(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in pod["spec"].get("volumes") or []
            if (v.get("secret") or {}).get("secretName", "").startswith("ssh-neonvm-")]


@pytest.mark.unit
def test_the_runner_pod_mounts_only_the_public_key_of_the_vms_secret() -> None:
    pod = pod_of(vm_of())
    (volume,) = secret_volumes(pod)
    assert volume["secret"] == {"secretName": "ssh-neonvm-db", "optional": True, "items": [
        {"key": "ssh-publickey", "path": "authorized_keys", "mode": 0o644}]}
    (container,) = pod["spec"]["containers"]
    assert {"name": volume["name"], "mountPath": "/vm/ssh", "readOnly": True} in (
        container["volumeMounts"])
    assert {"name": "NEONVM_SSH_AUTHORIZED_KEYS_FILE",
            "value": "/vm/ssh/authorized_keys"} in container["env"]
    assert "ssh-privatekey" not in str(pod)
    assert not any(v.get("name") == volume["name"] for c in pod["spec"].get(
        "initContainers") or [] for v in c.get("volumeMounts") or [])


@pytest.mark.unit
@pytest.mark.parametrize(("enable_ssh", "recorded"), [(False, True), (None, True), (True, False)])
def test_no_key_volume_without_enable_ssh_or_a_recorded_secret(enable_ssh: bool | None,
                                                                recorded: bool) -> None:
    pod = pod_of(vm_of(enable_ssh, recorded))
    assert secret_volumes(pod) == []
    assert "NEONVM_SSH_AUTHORIZED_KEYS_FILE" not in str(pod)


# ---- the runner: the key on NeonVM's ssh-authorized-keys disk -------------------------------


RUNNER_KERNEL = RunnerKernel(kernel=Path("/vm/kernel/vmlinuz"),
                             initrd=Path("/vm/kernel/initrd.cpio"))
KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ6v3 test\n"


def spec_of(enable_ssh: bool | None) -> VirtualMachineSpec:
    data: dict[str, Any] = {"guest": {"rootDisk": {"image": "/disks/root.qcow2"}}}
    if enable_ssh is not None:
        data["enableSSH"] = enable_ssh
    return decode(VirtualMachineSpec, data, ".spec")


@pytest.mark.unit
def test_a_vmbuilder_guest_gets_the_key_on_a_disk_its_mounts_sh_mounts_on_mnt_ssh(
        tmp_path: Path) -> None:
    plan = build_launch_plan(spec_of(True), context(
        tmp_path, runner_kernel=RUNNER_KERNEL, guest_init=True, ssh_authorized_keys=KEY))
    images = {d.name: d for d in plan.disk_images}
    disk = images[runtimedisk.SSH_LABEL]
    assert disk.kind == "file" and disk.contents == runtimedisk.iso9660_image(
        {"authorized_keys": KEY}, label="ssh-authorized-keys")
    assert any(f"file={disk.path}" in a for a in plan.argv)
    # After the runtime disk, which vminit finds as /dev/vdb.
    drives = [a.split(",")[0] for a in plan.argv if a.startswith("virtio-blk-pci")]
    assert drives[:3] == ["virtio-blk-pci"] * 3
    assert [a for a in plan.argv if a.startswith("virtio-blk-pci")][1].startswith(
        "virtio-blk-pci,drive=runtime,")
    iso = tmp_path / "ssh.iso"
    iso.write_bytes(disk.contents or b"")
    out = subprocess.run(["blkid", "-p", "-o", "export", str(iso)], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert "TYPE=iso9660" in out and "LABEL=ssh-authorized-keys" in out
    mounts = images[runtimedisk.RUNTIME_SERIAL].contents or b""
    assert (b"/neonvm/bin/mount -t iso9660 -o ro,mode=0644 "
            b'"$(/neonvm/bin/blkid -L ssh-authorized-keys)" /mnt/ssh') in mounts


@pytest.mark.unit
@pytest.mark.parametrize(("enable_ssh", "key", "guest_init"), [
    (False, KEY, True), (None, KEY, True),  # not asked for
    (True, None, True),  # no key mounted (no Secret): no disk, and mounts.sh mounts nothing
    (True, KEY, False),  # this project's own init: no sshd contract, no disk
])
def test_no_key_disk_otherwise(tmp_path: Path, enable_ssh: bool | None, key: bytes | None,
                               guest_init: bool) -> None:
    plan = build_launch_plan(spec_of(enable_ssh), context(
        tmp_path, runner_kernel=RUNNER_KERNEL, guest_init=guest_init, ssh_authorized_keys=key))
    assert runtimedisk.SSH_LABEL not in {d.name for d in plan.disk_images}
    assert not any("ssh" in a for a in plan.argv)


@pytest.mark.unit
def test_the_runner_reads_the_key_file_if_there_and_not_empty(tmp_path: Path) -> None:
    path = tmp_path / "authorized_keys"
    assert read_authorized_keys(None) is None
    assert read_authorized_keys(path) is None  # the optional volume without its Secret
    path.write_bytes(b"\n")
    assert read_authorized_keys(path) is None
    path.write_bytes(KEY)
    assert read_authorized_keys(path) == KEY


@pytest.mark.unit
def test_an_oversize_planted_key_boots_the_guest_without_a_key_and_says_why(
        tmp_path: Path) -> None:
    """Whoever may create Secrets in the namespace may plant ``ssh-neonvm-<vm>`` with a
    huge public key: that must not stop the VM from starting (docs/security.md)."""
    path = tmp_path / "authorized_keys"
    path.write_bytes(KEY + b"x" * (64 * 1024))
    said: list[str] = []
    sink = logger.add(lambda m: said.append(str(m)), level="WARNING")
    try:
        assert read_authorized_keys(path) is None
    finally:
        logger.remove(sink)
    assert any("no SSH key" in line and str(path) in line for line in said), said


# ---- against the API server -----------------------------------------------------------------


def public_key(api: client.ApiClient, namespace: str, name: str) -> bytes:
    secret = client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    assert secret.type == "kubernetes.io/ssh-auth" and secret.immutable
    return base64.b64decode(secret.data["ssh-publickey"])


@pytest.mark.cluster
def test_one_secret_create_per_runner_pod_and_a_deleted_secret_is_made_again(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        checker: InvariantChecker, monkeypatch: pytest.MonkeyPatch) -> None:
    create_vm(api, namespace, "db")  # enableSSH unset: the CRD stores NeonVM's true
    key = f"{namespace}/db"
    reconciler = Recording(controller_api)
    creates: list[str] = []
    cluster_create = reconciler.ctx.cluster.create_secret

    def counted(ns: str, body: dict[str, Any]) -> dict[str, Any]:
        creates.append(body["metadata"].get("name") or body["metadata"]["generateName"])
        return cluster_create(ns, body)

    monkeypatch.setattr(reconciler.ctx.cluster, "create_secret", counted)
    settle(reconciler, key)
    vm = get_vm(api, namespace, "db") or {}
    assert vm["spec"]["enableSSH"] is True
    assert vm["status"]["sshSecretName"] == "ssh-neonvm-db"
    assert creates == ["ssh-neonvm-db"]
    # The same status writes as a VM without SSH: the name rode on the plan's write.
    assert [name for name, _, _ in reconciler.performed][:5] == [
        "AddFinalizer", "RecordPlan", "CreatePod", "Commit", "Ungate"]
    first = public_key(api, namespace, "ssh-neonvm-db")
    (pod,) = runner_pods(api, namespace, "db")
    volumes = [v for v in pod.spec.volumes if v.secret and v.secret.secret_name
               == "ssh-neonvm-db"]
    assert [[i.key for i in v.secret.items] for v in volumes] == [["ssh-publickey"]]
    owner = client.CoreV1Api(api).read_namespaced_secret(
        "ssh-neonvm-db", namespace).metadata.owner_references
    assert [(o.kind, o.uid, o.controller) for o in owner] == [
        ("VirtualMachine", vm["metadata"]["uid"], True)]

    # Reconciles that create no pod make no create.
    settle(reconciler, key)
    reconciler.reconcile(key, CountingAuthority())
    assert creates == ["ssh-neonvm-db"]

    # The tenant deletes the Secret: the VM's next pod gets a new one, with a new pair.
    client.CoreV1Api(api).delete_namespaced_secret("ssh-neonvm-db", namespace)
    client.CoreV1Api(api).delete_namespaced_pod(pod.metadata.name, namespace,
                                                grace_period_seconds=0)
    settle(reconciler, key, rounds=20)
    (replacement,) = runner_pods(api, namespace, "db")
    assert replacement.metadata.name != pod.metadata.name
    assert creates == ["ssh-neonvm-db", "ssh-neonvm-db"]
    assert public_key(api, namespace, "ssh-neonvm-db") != first


# ---- a vm-builder guest under TCG (opt-in: NEONVM_TEST_BOOT=1) ------------------------------


BOOT_SKIP = boot_skip_reason()


@pytest.mark.slow
@pytest.mark.skipif(BOOT_SKIP is not None, reason=BOOT_SKIP or "")
def test_a_vmbuilder_guest_finds_the_public_key_where_its_sshd_reads_it(
        tmp_path: Path, boot_kit: tuple[Path, Path]) -> None:  # noqa: F811
    """The real runner, given the key file as the pod gives it, boots the vm-builder test
    disk; the guest's mounts.sh mounts the key disk, and /mnt/ssh/authorized_keys holds
    the key, read-only (vm-builder's sshd reads it there; the test disk has no sshd)."""
    qcow2, kernel_dir = boot_kit
    public, _private = ssh_keys.key_pair()
    keys = tmp_path / "ssh" / "authorized_keys"
    keys.parent.mkdir()
    keys.write_bytes(public)
    script = ("/neonvm/bin/echo VMBUILDER_ENTRYPOINT key: $(/neonvm/bin/cat "
              "/mnt/ssh/authorized_keys); /neonvm/bin/grep ' /mnt/ssh ' /proc/mounts | "
              "/neonvm/bin/sed 's/^/VMBUILDER_ENTRYPOINT mount: /'; "
              "/neonvm/bin/touch /mnt/ssh/x 2>/dev/null || "
              "/neonvm/bin/echo VMBUILDER_ENTRYPOINT read-only; "
              "/neonvm/bin/echo VMBUILDER_ENTRYPOINT report done; exec /neonvm/bin/sleep 600")
    spec = {"enableSSH": True, "guest": {
        "cpus": {"min": 1, "max": 1}, "memorySlotSize": "256Mi",
        "memorySlots": {"min": 1, "max": 1}, "rootDisk": {"image": str(qcow2)},
        "command": ["/neonvm/bin/sh", "-c", script]}}
    spec_file = tmp_path / "vm.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    console = tmp_path / "console.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEONVM_")}
    with console.open("wb") as out, (tmp_path / "runner.log").open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "neonvm.runner.main", "--spec-file", str(spec_file),
             "--kernel-dir", str(kernel_dir), "--accel", "tcg", "--work-dir",
             str(tmp_path / "work"), "--listen-address", "127.0.0.1", "--port", str(free_port()),
             "--ssh-authorized-keys-file", str(keys)],
            stdout=out, stderr=err, env=env, cwd=REPO)
    try:
        wait_for(lambda: b"VMBUILDER_ENTRYPOINT report done" in console.read_bytes()
                 or proc.poll() is not None, timeout=300, interval=0.5,
                 what="the guest's report")
        text = console.read_text(errors="replace")
        assert proc.poll() is None, text[-3000:] + (tmp_path / "runner.log").read_text()[-3000:]
        assert f"VMBUILDER_ENTRYPOINT key: {public.decode().strip()}" in text, text[-3000:]
        assert "VMBUILDER_ENTRYPOINT mount: " in text and " iso9660 ro," in text, text[-3000:]
        assert "VMBUILDER_ENTRYPOINT read-only" in text, text[-3000:]
        assert "PRIVATE KEY" not in text
    finally:
        proc.kill()
        proc.wait()
