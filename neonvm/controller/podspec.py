"""The runner pod for a VM plan: a pure function from (VM, plan) to a pod manifest.

What every runner pod carries, whatever the spec says (the fence depends on it):

* exactly the planned name (``status.pendingPod.name``);
* the scheduling gate ``vm.neon.tech/runner-fence``, so it cannot start until the
  controller has committed it and seen it as the VM's only pod;
* a controlling owner reference to the VM (``controller: true``,
  ``blockOwnerDeletion: true``), so the garbage collector removes it with the VM;
* labels ``vm.neon.tech/name`` and ``vm.neon.tech/uid`` (how the controller lists a VM's
  pods) and NeonVM's ``app.kubernetes.io/name: NeonVM`` (over a VM label of that key, as
  NeonVM sets it), annotations with the fencing token, leader epoch and plan sequence number;
* the VM's other labels and annotations, and the record of which keys were copied
  (``vm.neon.tech/copied-metadata``), by which the running pod is kept in step with the
  VM (:mod:`neonvm.controller.autoscaler_view`);
* ``restartPolicy: Never``: the controller applies the VM's restart policy itself, by a
  new plan, so a pod never comes back to life under the same name.

From the spec: image (``spec.runnerImage`` or the controller's default), resources
(``spec.podResources`` or derived from the guest's CPUs and memory), node selector,
tolerations, affinity, scheduler, service account, pull secrets, grace period, extra
disks as volumes, and the runner contract (command ``neonvm-runner``, the spec as a file,
probes on the runner port).

The spec travels as a file, not an environment variable: the annotation
``vm.neon.tech/spec`` holds it as JSON and a downward-API volume projects that annotation
to ``/vm/spec/spec.json`` (``NEONVM_SPEC_FILE``). exec refuses any single environment
string over 128 KiB, so a large spec in a variable made a pod that could be created but
never started. Annotations are limited to 256 KiB in total; a spec that does not fit is a
:class:`PodSpecError` here, with its size, rather than a refusal at create.

Least privilege, whatever the spec says (docs/runner.md, "Runner pod security"): no
service-account token, uid/gid 65532 (``runAsNonRoot``), seccomp ``RuntimeDefault``, and
in every container no privilege escalation, all capabilities dropped and a read-only root
filesystem (the runner writes only to its work-dir emptyDir and the disk volumes). The
pod meets the Pod Security Standard "restricted". A port below 1024 (runner, guest or
QMP) is allowed by the namespaced sysctl ``net.ipv4.ip_unprivileged_port_start``, not by
a capability.

Not checked here: whether the API server will accept the result. A spec that passes the
CRD schema but cannot be realised (say, requests above limits) is refused at create, and
the driver turns that refusal into a Degraded condition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kubernetes.utils import parse_quantity

from neonvm.api import types
from neonvm.api.quantity import format_bytes
from neonvm.api.rights import (
    RIGHT_SECONDS_ANNOTATION,
    RIGHT_SECONDS_ENV,
    RIGHTS_CLOSED_ENV,
    RIGHTS_TOKEN_FILE_ENV,
    RIGHTS_URL_ENV,
    annotation_value,
)
from neonvm.api.schema import encode
from neonvm.api.types import PendingPod, VirtualMachine
from neonvm.controller import autoscaler_view
from neonvm.controller.autoscaler_view import ANNOTATION_OVERCOMMIT, overcommit_json

RUNNER_PORT = 25183
RUNNER_COMMAND = "neonvm-runner"
RUNNER_CONTAINER = "neonvm-runner"
LABEL_APP_NAME = autoscaler_view.LABEL_APP_NAME
APP_NAME = "NeonVM"
"""The label NeonVM puts on every runner pod (its e2e suite selects runner pods by it)."""
DEFAULT_RUNNER_IMAGE = "ghcr.io/neonvm/neonvm-runner:0.1.0"
DISKS_DIR = "/vm/disks"
ROOT_DISK_DIR = "/vm/images"
ROOT_DISK_VOLUME = "vm-images"
MEMORY_OVERHEAD = 256 * 1024 * 1024
"""Memory for QEMU and the runner itself, on top of the guest's memory."""
ANNOTATION_GENERATION = "vm.neon.tech/generation"
ANNOTATION_SPEC = "vm.neon.tech/spec"
ANNOTATION_BUILT_SIZE = "vm.neon.tech/built-size"
"""The guest size the pod was built with: ``<cpus.use in millicores>,<memory slots>,
<memory slot bytes>`` (what its guest boots at; the commit records it, whatever the spec
says by then). Its runner counts memory slots in that slot size for the pod's life, so
live scaling is planned only while the spec's ``memorySlotSize`` is the same. Pods built
before the third field existed carry the first two only."""
"""The VM spec as JSON, projected into the runner's spec file."""
ANNOTATION_USAGE = "vm.neon.tech/usage"
"""NeonVM's usage annotation, read by its scheduler plugin and autoscaler-agent: JSON
``{"cpu": <quantity>, "memory": <quantity>}``, the size the guest runs at (at creation
the size it boots at; live scaling rewrites it once the runner applied a new size)."""
ANNOTATION_RESOURCES = "vm.neon.tech/resources"
"""NeonVM's resources annotation: JSON of the guest's CPU and memory-slot bounds
(``cpus``/``memorySlots`` with ``min``/``max``/``use``, ``memorySlotSize``) as the spec
had them when the pod was built."""
ANNOTATION_DEFAULT_CONTAINER = autoscaler_view.ANNOTATION_DEFAULT_CONTAINER
"""So that ``kubectl logs``/``exec`` on a runner pod pick the runner container."""
COPIED_ANNOTATIONS_SKIPPED = autoscaler_view.NOT_COPIED_ANNOTATIONS
"""VM annotations not copied to the runner pod (as in NeonVM); neither is any under
``vm.neon.tech/``, which belong to this controller
(:func:`~neonvm.controller.autoscaler_view.copied_annotation`)."""
SPEC_DIR = "/vm/spec"
SPEC_FILE = f"{SPEC_DIR}/spec.json"
RESOURCES_FILE = f"{SPEC_DIR}/resources.json"
"""The pod's ``vm.neon.tech/resources`` annotation as the kubelet projects it (refreshed
when the controller rewrites it after a live scale): the runner caps QEMU's CPU time at
its ``cpus.use`` (:mod:`neonvm.runner.cpulimit`)."""
SPEC_VOLUME = "vm-spec"
WORK_DIR = "/vm/run"
"""The runner's work dir (QMP socket, root overlay, disk images): an emptyDir."""
WORK_VOLUME = "vm-run"
RUNNER_UID = 65532
"""uid and gid of every container of a runner pod (the usual "nonroot" id)."""
MAX_ANNOTATIONS_BYTES = 256 * 1024
"""The API server's limit on the total size of a pod's annotations (keys and values)."""
UNPRIVILEGED_PORT_SYSCTL = "net.ipv4.ip_unprivileged_port_start"
SCALING_DIR = "/vm/scaling"
"""Where the VM's scaling-token Secret is mounted (live scaling)."""
SCALING_VOLUME = "vm-scaling-token"
POD_UID_ENV = "NEONVM_POD_UID"


def pod_uid_var() -> dict[str, Any]:
    """The pod's uid, from the downward API (a scaling bearer's HMAC input, a right's ask)."""
    return {"name": POD_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}


def scalable(vm: VirtualMachine) -> bool:
    """Whether the spec's bounds leave room for live scaling (then the pod gets a token)."""
    guest = vm.spec.guest
    return guest.cpus.max != guest.cpus.min or guest.memory_slots.max != guest.memory_slots.min


NEONVM_KVM_RESOURCE = "neonvm/kvm"
"""The extended resource NeonVM's runner pods request for ``/dev/kvm`` (served on NeonVM's
nodes by a generic device plugin). Pass it as ``--kvm-resource`` to use such nodes as they
are; this package's own plugin (``neonvm runner kvm-device-plugin``) serves the name it is
given."""


class PodSpecError(ValueError):
    """The VM spec passed the schema but no pod can be built from it."""


@dataclass(frozen=True)
class PodDefaults:
    """Controller-wide defaults for runner pods."""

    runner_image: str = DEFAULT_RUNNER_IMAGE
    image_pull_policy: str = "IfNotPresent"
    kvm_resource: str | None = None
    """Extended resource that puts ``/dev/kvm`` into a container (a device plugin's:
    NeonVM's is :data:`NEONVM_KVM_RESOURCE`, KubeVirt's ``devices.kubevirt.io/kvm``),
    requested by VMs with acceleration on. None: nothing is requested (the cluster has no
    such plugin)."""
    right_seconds: float = 0.0
    """Self-fencing: the right to run each runner is granted (0: off). docs/protocol.md,
    "Self-fencing"."""
    rights_url: str | None = None
    """Self-fencing: the leader's rights endpoint runners ask (None: off)."""
    rights_audience: str | None = None
    """Self-fencing: the audience of the projected ServiceAccount token a runner presents
    for its right (:func:`rights_token_volume`); None: runners present the HMAC of the
    VM's scaling token instead, and only a VM with one self-fences."""


def fencing_eligible(vm: VirtualMachine, defaults: PodDefaults) -> bool:
    """Whether the VM's pods self-fence once it has a token: on in the controller, and the
    VM runs the controller's runner image (a runner of the owner's choice may not kill
    its guest when its right runs out, and the controller would then force-delete a pod
    whose guest still runs). Such a VM gets a scaling token Secret even when it cannot
    scale: the runner's bearer is derived from it."""
    image = vm.spec.runner_image
    return bool(defaults.right_seconds > 0 and defaults.rights_url
                and (not image or image == defaults.runner_image))


def self_fencing(vm: VirtualMachine, defaults: PodDefaults) -> bool:
    """Whether the VM's next pod self-fences: :func:`fencing_eligible`, and its runner has
    a credential to ask with: the projected token of ``rights_audience``, or else the
    VM's recorded scaling token (mounted into the pod)."""
    return bool(fencing_eligible(vm, defaults)
                and (defaults.rights_audience or vm.status.scaling_token_secret))


RIGHTS_TOKEN_DIR = "/vm/rights"
"""Where the runner's rights token is projected (outside ``/vm/disks``: nothing under it
becomes a guest disk)."""
RIGHTS_TOKEN_VOLUME = "vm-rights-token"
RIGHTS_TOKEN_SECONDS = 7200
"""The projected token's ``expirationSeconds``. The kubelet rotates it at 80 % of that, so
a kubelet that stops (a crash loop, an upgrade, a node cut off from the API server) leaves
a token the API server accepts for 20 % of it plus its 60 s of skew: about 25 min, not
the 3 min of the API's minimum (600 s), before the leader's review refuses it and the
guest self-fences. A bound token is void once its pod is gone, whatever its expiry
(docs/security.md, "Rights endpoint"; docs/protocol.md, "Self-fencing")."""


def rights_token_volume(audience: str) -> tuple[dict[str, Any], dict[str, Any],
                                                 list[dict[str, Any]]]:
    """(volume, runner mount, runner env) of a self-fencing runner's credential: a
    ServiceAccount token bound to the pod, of ``audience`` only, projected into the runner
    container alone (never an init container, never a disk). The leader verifies it by a
    TokenReview (docs/security.md, "Rights endpoint")."""
    volume = {"name": RIGHTS_TOKEN_VOLUME, "projected": {"sources": [{
        "serviceAccountToken": {"audience": audience,
                                "expirationSeconds": RIGHTS_TOKEN_SECONDS,
                                "path": "token"}}]}}
    mount = {"name": RIGHTS_TOKEN_VOLUME, "mountPath": RIGHTS_TOKEN_DIR, "readOnly": True}
    env = [{"name": RIGHTS_TOKEN_FILE_ENV, "value": f"{RIGHTS_TOKEN_DIR}/token"}]
    return volume, mount, env


UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NODE_FAILURE_TAINTS = (UNREACHABLE_TAINT, "node.kubernetes.io/not-ready")
"""The taints the node lifecycle controller puts on a node that stops reporting."""


def fencing_tolerations(tolerations: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A self-fencing pod's tolerations: the VM's, plus :data:`NODE_FAILURE_TAINTS`
    ``NoExecute`` with no ``tolerationSeconds`` for each the VM does not tolerate itself.

    Without them Kubernetes gives the pod 300 s and then evicts it (a graceful delete),
    which restarts a VM whose runner still renews (a crashed kubelet); a self-fencing pod
    on a node that is really gone is force-deleted by the leader once its right is surely
    over (docs/protocol.md, "Self-fencing")."""
    result = list(tolerations or [])
    for key in NODE_FAILURE_TAINTS:
        if not any(t.get("key") in (key, None, "") and t.get("effect") in ("NoExecute", None, "")
                   for t in result):
            result.append({"key": key, "operator": "Exists", "effect": "NoExecute"})
    return result


def runner_pod(vm: VirtualMachine, plan: PendingPod,
               defaults: PodDefaults | None = None) -> dict[str, Any]:
    """The pod manifest for ``plan`` (raises :class:`PodSpecError` for unbuildable specs)."""
    defaults = defaults or PodDefaults()
    spec = vm.spec
    port = spec.runner_port or RUNNER_PORT
    copied = autoscaler_view.copied_metadata(vm)
    labels = dict(copied["labels"])
    labels.update({LABEL_APP_NAME: APP_NAME, types.LABEL_VM_NAME: vm.name,
                   types.LABEL_VM_UID: vm.uid})
    container: dict[str, Any] = {
        "name": RUNNER_CONTAINER,
        "image": spec.runner_image or defaults.runner_image,
        "imagePullPolicy": defaults.image_pull_policy,
        "command": [RUNNER_COMMAND],
        "env": [
            {"name": "NEONVM_SPEC_FILE", "value": SPEC_FILE},
            {"name": "NEONVM_RESOURCES_FILE", "value": RESOURCES_FILE},
            {"name": "NEONVM_WORK_DIR", "value": WORK_DIR},
            {"name": "NEONVM_VM_NAME", "value": vm.name},
            {"name": "NEONVM_VM_NAMESPACE", "value": vm.namespace},
            {"name": "NEONVM_VM_UID", "value": vm.uid},
            {"name": "NEONVM_POD_NAME", "value": plan.name},
            {"name": "NEONVM_RUNNER_PORT", "value": str(port)},
            {"name": "NEONVM_DISKS_DIR", "value": DISKS_DIR},
            # NeonVM's default is true: the runner reports AccelerationUnavailable when
            # KVM does not work in the pod, instead of falling back to TCG silently.
            {"name": "NEONVM_ENABLE_ACCELERATION",
             "value": "false" if spec.enable_acceleration is False else "true"},
        ],
        "ports": [{"name": "runner", "containerPort": port, "protocol": "TCP"}],
        "livenessProbe": _probe("/healthz", port, period=10, failures=3),
        "readinessProbe": _probe("/ready", port, period=5, failures=1),
        "resources": _with_kvm(_resources(vm), vm, defaults.kvm_resource),
        "securityContext": _container_security(),
    }
    if spec.enable_acceleration is False:
        # NeonVM's meaning of false: the guest runs under TCG even where /dev/kvm works.
        container["env"].append({"name": "NEONVM_ACCEL", "value": "tcg"})
    for guest_port in spec.guest.ports or []:
        # Every port as NeonVM lists it, the same number twice included (its sample has
        # 5432 as "postgres" and "pooler"); the runner forwards each number once.
        entry: dict[str, Any] = {"containerPort": guest_port.port,
                                 "protocol": guest_port.protocol or "TCP"}
        if guest_port.name:
            entry["name"] = guest_port.name
        container["ports"].append(entry)
    volumes, mounts = _disks(vm)
    volumes += [
        {"name": SPEC_VOLUME, "downwardAPI": {"items": [{
            "path": SPEC_FILE.rsplit("/", 1)[1],
            "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_SPEC}']"}}, {
            "path": RESOURCES_FILE.rsplit("/", 1)[1],
            "fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION_RESOURCES}']"}}]}},
        {"name": WORK_VOLUME, "emptyDir": {}},
    ]
    mounts += [{"name": SPEC_VOLUME, "mountPath": SPEC_DIR, "readOnly": True},
               {"name": WORK_VOLUME, "mountPath": WORK_DIR}]
    init_containers = []
    image = spec.guest.root_disk.image
    if image and not image.startswith("/"):
        # A container image carries the disk (NeonVM's convention: /disk.qcow2); an init
        # container copies it into a volume the runner boots from. An absolute path is
        # a file already on the node (local runner tests), used as it is.
        volumes.append({"name": ROOT_DISK_VOLUME, "emptyDir": {}})
        mounts.append({"name": ROOT_DISK_VOLUME, "mountPath": ROOT_DISK_DIR})
        init_containers.append({
            "name": "init-rootdisk",
            "image": image,
            "imagePullPolicy": spec.guest.root_disk.image_pull_policy
            or defaults.image_pull_policy,
            "command": ["cp", "/disk.qcow2", f"{ROOT_DISK_DIR}/rootdisk.qcow2"],
            "volumeMounts": [{"name": ROOT_DISK_VOLUME, "mountPath": ROOT_DISK_DIR}],
            "securityContext": _container_security(),
        })
        container["env"].append(
            {"name": "NEONVM_ROOT_DISK", "value": f"{ROOT_DISK_DIR}/rootdisk.qcow2"})
    if scalable(vm):
        # Live scaling (docs/runner.md, "Live scaling"): the fence floor of this pod (so a
        # plan recorded before the pod existed is refused), the CPU scaling mode, and the
        # bearer token from the Secret the controller created and recorded in status.
        # Without one (a controller not allowed to create it) the pod still starts, and
        # its runner refuses to scale (401); the floor is there all the same.
        fence = vm.status.fence
        floor = (f"{fence.epoch if fence else 0},{fence.token if fence else 0},"
                 f"{vm.status.scale_seq}")
        container["env"] += [
            {"name": "NEONVM_SCALING_FENCE_FLOOR", "value": floor},
            {"name": "NEONVM_CPU_SCALING_MODE",
             "value": spec.cpu_scaling_mode or "QmpScaling"},
        ]
    fencing = self_fencing(vm, defaults)
    if (scalable(vm) or fencing) and vm.status.scaling_token_secret:
        # The token (a self-fencing runner's bearer too, scalable or not).
        volumes.append({"name": SCALING_VOLUME, "secret": {
            "secretName": vm.status.scaling_token_secret, "optional": True,
            "items": [{"key": "token", "path": "token"}]}})
        mounts.append({"name": SCALING_VOLUME, "mountPath": SCALING_DIR,
                       "readOnly": True})
        container["env"] += [
            {"name": "NEONVM_SCALING_TOKEN_FILE", "value": f"{SCALING_DIR}/token"},
            # The runner expects HMAC(token, its pod uid): a token is good for one pod.
            pod_uid_var(),
        ]
    if fencing:
        # Self-fencing (docs/runner.md, "Self-fencing"): QEMU runs only while the leader
        # keeps granting this pod a right; the annotation tells the controller so.
        container["env"] += [
            {"name": RIGHTS_URL_ENV, "value": str(defaults.rights_url)},
            {"name": RIGHT_SECONDS_ENV, "value": annotation_value(defaults.right_seconds)},
        ]
        if defaults.rights_audience:
            volume, mount, env = rights_token_volume(defaults.rights_audience)
            volumes.append(volume)
            mounts.append(mount)
            container["env"] += env
            if not any(e["name"] == POD_UID_ENV for e in container["env"]):
                container["env"].append(pod_uid_var())
    elif defaults.rights_url:
        # Not self-fencing, but the leader's rights listener is reachable from this pod:
        # its guest filter closes the port all the same (docs/security.md).
        container["env"].append({"name": RIGHTS_CLOSED_ENV, "value": str(defaults.rights_url)})
    ssh = ssh_public_key_volume(vm)
    if ssh is not None:
        volumes.append(ssh[0])
        mounts.append(ssh[1])
        container["env"].append(ssh[2])
    container["volumeMounts"] = mounts
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "schedulingGates": [{"name": types.SCHEDULING_GATE}],
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(vm, port),
        "containers": [container],
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    optional = {
        "volumes": volumes or None,
        "nodeSelector": spec.node_selector,
        "tolerations": fencing_tolerations(spec.tolerations) if fencing else spec.tolerations,
        "affinity": spec.affinity,
        "schedulerName": spec.scheduler_name,
        # A projected token needs it named (admission names "default" anyway, if on).
        "serviceAccountName": spec.service_account_name
        or ("default" if fencing and defaults.rights_audience else None),
        "imagePullSecrets": spec.image_pull_secrets,
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        # As NeonVM: unset leaves Kubernetes' default (true).
        "enableServiceLinks": spec.service_links,
    }
    pod_spec.update({k: v for k, v in optional.items() if v is not None})
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": plan.name,
            "namespace": vm.namespace,
            "labels": labels,
            "annotations": {
                **copied["annotations"],
                ANNOTATION_DEFAULT_CONTAINER: RUNNER_CONTAINER,
                ANNOTATION_USAGE: _usage_json(vm),
                ANNOTATION_RESOURCES: _resources_json(vm),
                types.ANNOTATION_TOKEN: str(plan.token),
                types.ANNOTATION_EPOCH: str(plan.epoch),
                types.ANNOTATION_PLAN_SEQ: str(plan.plan_seq),
                ANNOTATION_GENERATION: str(vm.generation),
                ANNOTATION_BUILT_SIZE: f"{int(spec.guest.cpus.current)},"
                                       f"{spec.guest.memory_slots.current},"
                                       f"{slot_bytes(spec.guest.memory_slot_size) or ''}",
            },
            "ownerReferences": [{
                "apiVersion": types.API_VERSION,
                "kind": types.KIND,
                "name": vm.name,
                "uid": vm.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }],
        },
        "spec": pod_spec,
    }
    annotations = pod["metadata"]["annotations"]
    overcommit = overcommit_json(vm)
    if overcommit is not None:
        annotations[ANNOTATION_OVERCOMMIT] = overcommit
    record = autoscaler_view.copied_record(copied)
    if record is not None:
        annotations[autoscaler_view.ANNOTATION_COPIED] = record
    if fencing:
        annotations[RIGHT_SECONDS_ANNOTATION] = annotation_value(defaults.right_seconds)
    annotations[ANNOTATION_SPEC] = _spec_annotation(vm, annotations)
    return pod


def _memory_slot_quantity(vm: VirtualMachine) -> str:
    """``memorySlotSize`` in canonical form ("1Gi" for "1024Mi"), else as written."""
    size = slot_bytes(vm.spec.guest.memory_slot_size)
    return format_bytes(size) if size else str(vm.spec.guest.memory_slot_size)


def _usage_json(vm: VirtualMachine) -> str:
    """:data:`ANNOTATION_USAGE` for the size the pod boots at."""
    guest = vm.spec.guest
    size = slot_bytes(guest.memory_slot_size)
    memory = format_bytes(size * guest.memory_slots.current) if size else ""
    return json.dumps({"cpu": str(guest.cpus.current), "memory": memory},
                      separators=(",", ":"))


def _resources_json(vm: VirtualMachine) -> str:
    """:data:`ANNOTATION_RESOURCES`: the guest's bounds in NeonVM's JSON shape."""
    cpus, slots = vm.spec.guest.cpus, vm.spec.guest.memory_slots
    return json.dumps({
        "cpus": {"min": cpus.min.to_json(), "max": cpus.max.to_json(),
                 "use": cpus.current.to_json()},
        "memorySlots": {"min": slots.min, "max": slots.max, "use": slots.current},
        "memorySlotSize": _memory_slot_quantity(vm),
    }, separators=(",", ":"))


def _spec_annotation(vm: VirtualMachine, others: dict[str, str]) -> str:
    """The spec as compact JSON, if it fits beside the other annotations."""
    text = json.dumps(encode(vm.spec), sort_keys=True, separators=(",", ":"))
    used = sum(len(k.encode()) + len(v.encode()) for k, v in others.items())
    size = len(ANNOTATION_SPEC) + len(text.encode())
    if used + size > MAX_ANNOTATIONS_BYTES:
        raise PodSpecError(
            f"the spec is {len(text.encode())} bytes as JSON; the runner pod carries it in "
            f"the annotation {ANNOTATION_SPEC}, and a pod's annotations may hold at most "
            f"{MAX_ANNOTATIONS_BYTES} bytes in total")
    return text


def _container_security() -> dict[str, Any]:
    """Every container of a runner pod: no privilege, no capability, read-only root."""
    return {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security(vm: VirtualMachine, runner_port: int) -> dict[str, Any]:
    """Non-root with the runtime's seccomp profile; low ports through a namespaced sysctl.

    A non-root process cannot be given CAP_NET_BIND_SERVICE through the pod spec (no
    ambient capabilities), so a port below 1024 lowers the network namespace's
    unprivileged port start to that port instead: a "safe" sysctl, allowed by the
    restricted Pod Security Standard.
    """
    security: dict[str, Any] = {
        "runAsNonRoot": True,
        "runAsUser": RUNNER_UID,
        "runAsGroup": RUNNER_UID,
        "fsGroup": RUNNER_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    ports = [runner_port, *(p.port for p in vm.spec.guest.ports or [])]
    if vm.spec.qmp is not None:
        ports.append(vm.spec.qmp)
    lowest = min(ports)
    if lowest < 1024:
        security["sysctls"] = [{"name": UNPRIVILEGED_PORT_SYSCTL, "value": str(lowest)}]
    return security


def has_our_gate(pod: dict[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == types.SCHEDULING_GATE for g in gates)


def _probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def _quantity(value: object, what: str) -> Decimal:
    try:
        q = parse_quantity(value)
    except (ValueError, InvalidOperation, TypeError):
        raise PodSpecError(f"{what}: {value!r} is not a resource quantity") from None
    if not isinstance(q, Decimal):
        q = Decimal(q)
    return q


def _resources(vm: VirtualMachine) -> dict[str, Any]:
    """``spec.podResources`` as given, or requests/limits derived from the guest's size."""
    if vm.spec.pod_resources is not None:
        return dict(vm.spec.pod_resources)
    guest = vm.spec.guest
    slot = _quantity(guest.memory_slot_size, "guest.memorySlotSize")
    if slot <= 0:
        raise PodSpecError("guest.memorySlotSize must be positive")
    memory = int(slot * guest.memory_slots.max) + MEMORY_OVERHEAD
    cpu_request = millicores(guest.cpus.current.cores)
    cpu_limit = millicores(autoscaler_view.cpu_limit(vm).cores)  # NeonVM's quota rule
    return {
        "requests": {"cpu": cpu_request, "memory": _bytes(memory)},
        "limits": {"cpu": cpu_limit, "memory": _bytes(memory)},
    }


def _with_kvm(resources: dict[str, Any], vm: VirtualMachine,
              kvm_resource: str | None) -> dict[str, Any]:
    """One ``kvm_resource`` in limits and requests (extended resources need both equal)
    when the VM wants acceleration and the controller names a resource."""
    if not kvm_resource or vm.spec.enable_acceleration is False:
        return resources
    out = {k: dict(v) for k, v in resources.items() if isinstance(v, dict)}
    for key in ("limits", "requests"):
        out.setdefault(key, {})[kvm_resource] = "1"
    return out


def _bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that divides it (what kubectl shows)."""
    for suffix, size in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def millicores(cores: float) -> str:
    """A CPU quantity of ``cores`` (whole cores, else millicores)."""
    milli = max(1, round(cores * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _disks(vm: VirtualMachine) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    for disk in vm.spec.disks or []:
        sources = [s for s in ("empty_disk", "config_map", "secret", "tmpfs")
                   if getattr(disk, s) is not None]
        if len(sources) != 1:
            raise PodSpecError(
                f"disk {disk.name!r}: exactly one of emptyDisk, configMap, secret, tmpfs "
                f"is expected, got {len(sources)}")
        volume: dict[str, Any] = {"name": f"disk-{disk.name}"}
        if disk.config_map is not None:
            volume["configMap"] = dict(disk.config_map)
        elif disk.secret is not None:
            volume["secret"] = dict(disk.secret)
        else:
            source = disk.empty_disk if disk.empty_disk is not None else disk.tmpfs
            assert source is not None
            empty: dict[str, Any] = {}
            if disk.tmpfs is not None:
                empty["medium"] = "Memory"
            if source.get("size") is not None:
                _quantity(source["size"], f"disk {disk.name} size")
                empty["sizeLimit"] = source["size"]
            volume["emptyDir"] = empty
        volumes.append(volume)
        mounts.append({"name": volume["name"], "mountPath": f"{DISKS_DIR}/{disk.name}",
                       "readOnly": bool(disk.read_only)})
    return volumes, mounts


def built_size(meta: dict[str, Any]) -> tuple[int, int] | None:
    """(millicores, memory slots) from a pod's :data:`ANNOTATION_BUILT_SIZE`; None when
    absent or malformed (a pod built before the annotation existed)."""
    raw = (meta.get("annotations") or {}).get(ANNOTATION_BUILT_SIZE)
    try:
        milli, slots = (int(v) for v in str(raw).split(",")[:2])
    except (TypeError, ValueError):
        return None
    return (milli, slots) if milli > 0 and slots >= 0 else None


def built_slot_bytes(meta: dict[str, Any]) -> int | None:
    """The memory slot size (bytes) from a pod's :data:`ANNOTATION_BUILT_SIZE`; for a pod
    built before that field existed, from the spec it carries (:data:`ANNOTATION_SPEC`,
    which its runner reads its slot size from). None when neither says."""
    annotations = meta.get("annotations") or {}
    raw = str(annotations.get(ANNOTATION_BUILT_SIZE) or "").split(",")
    if len(raw) != 3:
        try:
            spec = json.loads(annotations.get(ANNOTATION_SPEC) or "null")
            return slot_bytes(str(spec["guest"]["memorySlotSize"]))
        except (ValueError, TypeError, KeyError):
            return None
    try:
        value = int(raw[2])
    except ValueError:
        return None
    return value if value > 0 else None


def slot_bytes(quantity: str | None) -> int | None:
    """``memorySlotSize`` in bytes; None when it does not parse (or is not positive)."""
    from neonvm.api.quantity import QuantityError, parse_bytes

    try:
        value = parse_bytes(quantity or "")
    except QuantityError:
        return None
    return value if value > 0 else None


def runner_port_of(spec: dict[str, Any]) -> int | None:
    """The ``runner`` port the pod's runner container listens on (from the pod's own spec,
    not the VM's current one); None when not found."""
    for container in spec.get("containers") or []:
        if container.get("name") != RUNNER_CONTAINER:
            continue
        for port in container.get("ports") or []:
            if port.get("name") == "runner" and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return None


SSH_DIR = "/vm/ssh"
"""Where the runner container finds the VM's SSH public key (NeonVM's path; outside
``/vm/disks``, so it never becomes a guest disk of its own)."""
SSH_VOLUME = "vm-ssh-publickey"
SSH_KEYS_ENV = "NEONVM_SSH_AUTHORIZED_KEYS_FILE"


def ssh_public_key_volume(vm: VirtualMachine) -> tuple[dict[str, Any], dict[str, Any],
                                                       dict[str, Any]] | None:
    """(volume, runner mount, runner env) giving the runner the VM's SSH public key, or
    None (``enableSSH`` not true, or no Secret recorded in status). Only the Secret's
    ``ssh-publickey`` item is projected, as ``authorized_keys``: the private key never
    reaches the pod, let alone the guest. Optional: a Secret that could not be created
    (or was deleted) leaves the file absent, and the guest boots without a key
    (docs/neonvm-compat.md, "SSH")."""
    from neonvm.controller import ssh_keys

    if not ssh_keys.wants_ssh(vm) or not vm.status.ssh_secret_name:
        return None
    # The name derived from the VM's (the one status records), never read from status.
    volume = {"name": SSH_VOLUME, "secret": {
        "secretName": ssh_keys.secret_name(vm), "optional": True,
        "items": [{"key": ssh_keys.PUBLIC_KEY, "path": "authorized_keys", "mode": 0o644}]}}
    mount = {"name": SSH_VOLUME, "mountPath": SSH_DIR, "readOnly": True}
    return volume, mount, {"name": SSH_KEYS_ENV, "value": f"{SSH_DIR}/authorized_keys"}
