"""The VirtualMachine API (``vm.neon.tech/v1``) as dataclasses.

These classes are the single source of truth: the CRD's OpenAPI schema is generated from
them (:mod:`neonvm.api.crd`) and the controller decodes objects into them. Field names
follow NeonVM so that an existing ``vm-deploy.yaml`` applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from neonvm.api.schema import api_field, decode, encode

GROUP = "vm.neon.tech"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "VirtualMachine"
PLURAL = "virtualmachines"
SINGULAR = "virtualmachine"
SHORT_NAMES = ["vm"]

FINALIZER = "vm.neon.tech/finalizer"
LABEL_VM_NAME = "vm.neon.tech/name"
LABEL_VM_UID = "vm.neon.tech/uid"
ANNOTATION_TOKEN = "vm.neon.tech/fence-token"
ANNOTATION_EPOCH = "vm.neon.tech/fence-epoch"
ANNOTATION_PLAN_SEQ = "vm.neon.tech/plan-seq"
SCHEDULING_GATE = "vm.neon.tech/runner-fence"
"""Scheduling gate every runner pod is created with; removed only after commit."""

RestartPolicy = Literal["Always", "OnFailure", "Never"]
Phase = Literal["Pending", "Running", "Succeeded", "Failed"]


@dataclass
class IntRange:
    """A min/max/use triple (CPUs or memory slots); use must lie in [min, max]."""

    __validations__ = (
        ("self.min <= self.max", "min must not exceed max"),
        ("!has(self.use) || (self.use >= self.min && self.use <= self.max)",
         "use must lie between min and max"),
    )

    min: int = api_field("Lower bound.", minimum=1, required=True, default=1)
    max: int = api_field("Upper bound.", minimum=1, required=True, default=1)
    use: int | None = api_field("Current amount; defaults to min.", minimum=1)

    @property
    def current(self) -> int:
        return self.use if self.use is not None else self.min


@dataclass
class CPURange:
    """CPU bounds in cores (fractions allowed); use must lie in [min, max]."""

    __validations__ = IntRange.__validations__

    min: float = api_field("Lower bound in cores.", minimum=0, exclusive_minimum=True,
                           required=True, default=1.0)
    max: float = api_field("Upper bound in cores.", minimum=0, exclusive_minimum=True,
                           required=True, default=1.0)
    use: float | None = api_field("Current cores; defaults to min.", minimum=0,
                                  exclusive_minimum=True)

    @property
    def current(self) -> float:
        return self.use if self.use is not None else self.min


@dataclass
class RootDisk:
    """The guest's root disk image."""

    image: str = api_field("Disk image (container image in NeonVM, or a file path for the "
                           "local runner).", required=True, min_length=1, default="")
    size: str | None = api_field("Disk size.", quantity=True)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = api_field(
        "When to pull the disk image."
    )


@dataclass
class EnvVar:
    """An environment variable for the guest command."""

    name: str = api_field("Variable name.", required=True, min_length=1, default="")
    value: str | None = api_field("Variable value.")


@dataclass
class Port:
    """A port the guest listens on."""

    port: int = api_field("Port number.", minimum=1, maximum=65535, required=True, default=0)
    name: str | None = api_field("Port name.")
    protocol: Literal["TCP", "UDP"] | None = api_field("Protocol (default TCP).")


@dataclass
class Guest:
    """What runs inside the VM: its size, disk, kernel and command."""

    cpus: CPURange = api_field("CPU bounds.", default_factory=CPURange)
    memory_slots: IntRange = api_field("Memory slot bounds.", default_factory=IntRange)
    memory_slot_size: str = api_field("Size of one memory slot.", quantity=True, default="1Gi")
    root_disk: RootDisk = api_field("Root disk.", default_factory=RootDisk, required=True)
    kernel_image: str | None = api_field("Kernel to boot directly (optional).")
    initrd_image: str | None = api_field("Initial ramdisk to boot with the kernel (optional).")
    append_kernel_cmdline: str | None = api_field("Extra kernel command line.")
    command: list[str] | None = api_field("Guest entrypoint override.")
    args: list[str] | None = api_field("Guest arguments.")
    env: list[EnvVar] | None = api_field("Guest environment.")
    ports: list[Port] | None = api_field("Ports the guest exposes.")
    settings: dict[str, Any] | None = api_field("Guest settings (sysctls, ...).", free_form=True)


@dataclass
class Disk:
    """An extra disk; exactly one source (emptyDisk, configMap, secret, tmpfs) is expected."""

    name: str = api_field("Disk name.", required=True, min_length=1, default="",
                          pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    mount_path: str | None = api_field("Mount point in the guest.")
    read_only: bool | None = api_field("Mount read-only.")
    empty_disk: dict[str, Any] | None = api_field("A fresh disk of a given size.", free_form=True)
    config_map: dict[str, Any] | None = api_field("A disk built from a ConfigMap.",
                                                  free_form=True)
    secret: dict[str, Any] | None = api_field("A disk built from a Secret.", free_form=True)
    tmpfs: dict[str, Any] | None = api_field("A tmpfs of a given size.", free_form=True)


@dataclass
class VirtualMachineSpec:
    """Desired state of a VirtualMachine."""

    guest: Guest = api_field("The guest.", default_factory=Guest, required=True)
    restart_policy: RestartPolicy = api_field(
        "What to do when the runner pod ends: Always restart, restart OnFailure, or Never.",
        default="Always",
    )
    runner_image: str | None = api_field("Image of the runner pod.")
    disks: list[Disk] | None = api_field("Extra disks.")
    node_selector: dict[str, str] | None = api_field("Node selector for the runner pod.")
    tolerations: list[dict[str, Any]] | None = api_field("Tolerations for the runner pod.",
                                                         free_form=True)
    affinity: dict[str, Any] | None = api_field("Affinity for the runner pod.", free_form=True)
    termination_grace_period_seconds: int | None = api_field(
        "Grace period for the guest to power down.", minimum=0)
    pod_resources: dict[str, Any] | None = api_field(
        "Resources of the runner container (requests/limits).", free_form=True)
    scheduler_name: str | None = api_field("Scheduler for the runner pod.")
    service_account_name: str | None = api_field("Service account of the runner pod.")
    image_pull_secrets: list[dict[str, Any]] | None = api_field(
        "Pull secrets for the runner pod.", free_form=True)
    runner_port: int | None = api_field("Runner HTTP port.", minimum=1, maximum=65535)
    qmp: int | None = api_field("QMP port (NeonVM compatibility).", minimum=1, maximum=65535)
    enable_ssh: bool | None = api_field("NeonVM compatibility; not used by this controller.",
                                        json="enableSSH")


@dataclass
class PendingPod:
    """The plan record: the runner pod about to be created, written before creating it."""

    name: str = api_field("Exact name the pod will be created with.", default="")
    plan_seq: int = api_field("Plan sequence number this name was derived from.", default=0)
    token: int = api_field("Fencing token (etcd revision of the lock) at planning.", default=0)
    epoch: int = api_field("Leader epoch at planning.", default=0)
    generation: int = api_field("VM generation the plan was made for.", default=0)


@dataclass
class Fence:
    """Highest (epoch, token) that wrote this status; older writers are refused."""

    epoch: int = api_field("Leader epoch.", default=0)
    token: int = api_field("Lock fencing token.", default=0)


@dataclass
class Condition:
    """A standard Kubernetes condition."""

    type: str = api_field("Condition type.", default="")
    status: Literal["True", "False", "Unknown"] = api_field("Status.", default="Unknown")
    reason: str | None = api_field("Machine-readable reason.")
    message: str | None = api_field("Human-readable message.")
    last_transition_time: str | None = api_field("When status last changed (RFC 3339).")
    observed_generation: int | None = api_field("Generation the condition was set for.")


@dataclass
class VirtualMachineStatus:
    """Observed state, and the controller's resumable plan."""

    phase: Phase | None = api_field("Pending, Running, Succeeded or Failed.")
    pod_name: str | None = api_field("The committed runner pod.")
    pod_uid: str | None = api_field("UID of the committed runner pod.", json="podUID")
    pending_pod: PendingPod | None = api_field("Plan record: pod being created.")
    plan_seq: int = api_field("Last plan sequence number used; only ever increases.",
                              default=0)
    pod_ip: str | None = api_field("Runner pod IP.", json="podIP")
    node: str | None = api_field("Node of the runner pod.")
    restart_count: int = api_field("Times the runner pod was replaced.", default=0)
    last_restart_time: str | None = api_field(
        "When the last restart was recorded (RFC 3339); the next plan waits out the "
        "restart backoff from here.")
    restart_streak: int = api_field(
        "Restarts in a row, each within 10 minutes of the previous one; the restart "
        "backoff grows with it and resets once a runner pod has lasted longer.", default=0)
    conditions: list[Condition] = api_field("Conditions (Ready, Degraded, ...).",
                                            default_factory=list)
    observed_generation: int | None = api_field("Generation last acted on.")
    fence: Fence | None = api_field("Highest writer (epoch, token) seen.")


@dataclass
class VirtualMachine:
    """A VirtualMachine object as the controller sees it."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    generation: int
    spec: VirtualMachineSpec
    status: VirtualMachineStatus
    deletion_timestamp: str | None = None
    finalizers: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> VirtualMachine:
        """Decode an API object (as the API server returns it)."""
        meta = obj.get("metadata") or {}
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            uid=meta.get("uid", ""),
            resource_version=meta.get("resourceVersion", ""),
            generation=int(meta.get("generation") or 0),
            spec=decode(VirtualMachineSpec, obj.get("spec"), ".spec"),
            status=decode(VirtualMachineStatus, obj.get("status"), ".status"),
            deletion_timestamp=meta.get("deletionTimestamp"),
            finalizers=list(meta.get("finalizers") or []),
            labels=dict(meta.get("labels") or {}),
        )

    def status_object(self) -> dict[str, Any]:
        """The status as API JSON."""
        out: dict[str, Any] = encode(self.status)
        return out

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"
