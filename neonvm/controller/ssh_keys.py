"""A VM's SSH key Secret (``enableSSH``): its name, its key pair, and making sure it exists.

NeonVM's contract, kept here: a VM with ``spec.enableSSH: true`` (the CRD's default) has
an immutable Secret ``ssh-neonvm-<vm>`` of type ``kubernetes.io/ssh-auth``, owned by the
VM (``controller: true``), with an ed25519 key pair: ``ssh-publickey`` as one
``authorized_keys`` line, ``ssh-privatekey`` as an unencrypted OpenSSH PEM. The VM's
status names it (``status.sshSecretName``, written with the pod plan by
:func:`neonvm.controller.mutations.record_plan`). The runner pod mounts the public key
alone; the private key never leaves the Secret (docs/neonvm-compat.md, "SSH").

Cost: :func:`ensure_secret` is one create, made by the create of each runner pod
(:func:`neonvm.controller.performers.create_pod`) and never by a reconcile that creates no
pod. An existing Secret (409) is used as it is, whoever made it; a deleted one is made
again, with a new key pair, for the VM's next pod. docs/protocol.md, "The SSH key Secret",
says why this create is not fenced.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, Protocol

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.api.types import VirtualMachine

SECRET_PREFIX = "ssh-neonvm-"
SECRET_TYPE = "kubernetes.io/ssh-auth"
PUBLIC_KEY = "ssh-publickey"
PRIVATE_KEY = "ssh-privatekey"
"""The Secret's data keys (``kubernetes.io/ssh-auth`` requires the private one)."""

Outcome = Literal["created", "exists"]


class SecretCreator(Protocol):
    """The one call this module makes (:class:`~neonvm.controller.cluster.KubeCluster`
    has it)."""

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...


def wants_ssh(vm: VirtualMachine) -> bool:
    """Whether the VM asks for SSH: ``enableSSH`` stored true. Absent (a VM stored before
    the CRD's default) counts as false, as NeonVM's runner reads it."""
    return vm.spec.enable_ssh is True


def secret_name(vm: VirtualMachine) -> str:
    """NeonVM's name for the VM's SSH Secret (VM names are at most 63 characters)."""
    return f"{SECRET_PREFIX}{vm.name}"


def key_pair() -> tuple[bytes, bytes]:
    """A new ed25519 key pair: (public key as an ``authorized_keys`` line ending in a
    newline, private key as an unencrypted ``OPENSSH PRIVATE KEY`` PEM)."""
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH)
    private = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption())
    return public + b"\n", private


def secret_manifest(vm: VirtualMachine, public: bytes, private: bytes) -> dict[str, Any]:
    """The Secret as the controller creates it: NeonVM's shape, plus this controller's VM
    labels (what the admission fence asks of every Secret the controller creates)."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": SECRET_TYPE, "immutable": True,
        "metadata": {
            "name": secret_name(vm), "namespace": vm.namespace,
            "labels": {types.LABEL_VM_NAME: vm.name, types.LABEL_VM_UID: vm.uid},
            "ownerReferences": [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                 "name": vm.name, "uid": vm.uid, "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "data": {PUBLIC_KEY: base64.b64encode(public).decode(),
                 PRIVATE_KEY: base64.b64encode(private).decode()},
    }


class Refused(Exception):
    """The API server refused the create for good (403: no RBAC rule or the admission
    fence; 422; a quota): the pod starts without a key."""


def ensure_secret(secrets: SecretCreator, vm: VirtualMachine) -> Outcome:
    """Create the VM's SSH Secret unless one of that name exists: "created" or "exists".

    A fresh key pair is made for each attempt and thrown away on 409 (microseconds).
    Raises :class:`Refused` for a refusal; a transient error (429, 5xx, no answer)
    propagates: the pod waits for its key, for a bounded time (the performer's
    ``_ensure_ssh_secret``), then starts without it."""
    public, private = key_pair()
    try:
        secrets.create_secret(vm.namespace, secret_manifest(vm, public, private))
    except ApiException as exc:
        if exc.status == 409:
            return "exists"
        if exc.status is None or exc.status == 429 or exc.status >= 500:
            raise
        raise Refused(f"creating the SSH key Secret {secret_name(vm)} was refused "
                      f"({exc.status} {exc.reason})") from None
    return "created"
