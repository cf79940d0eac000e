"""The VirtualMachine API (``vm.neon.tech/v1``) as dataclasses.

These classes are the single source of truth: the CRD's OpenAPI schema is generated from
them (:mod:`neonvm.api.crd`) and the controller decodes objects into them. Field names
follow NeonVM so that an existing ``vm-deploy.yaml`` applies unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from neonvm.api.millicpu import MilliCPU
from neonvm.api.schema import api_field, decode

GROUP = "vm.neon.tech"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "VirtualMachine"
PLURAL = "virtualmachines"
SINGULAR = "neonvm"
"""NeonVM's singular (``kubectl get neonvm``)."""
SHORT_NAMES: list[str] = []
"""NeonVM declares none; ``vm`` would collide with KubeVirt's VirtualMachine."""

FINALIZER = "vm.neon.tech/finalizer"
LABEL_VM_NAME = "vm.neon.tech/name"
LABEL_VM_UID = "vm.neon.tech/uid"
ANNOTATION_TOKEN = "vm.neon.tech/fence-token"
ANNOTATION_EPOCH = "vm.neon.tech/fence-epoch"
ANNOTATION_PLAN_SEQ = "vm.neon.tech/plan-seq"
ANNOTATION_SCALE_FENCE = "vm.neon.tech/scale-fence"
"""``epoch,token,seq`` of the scaling plan whose size a runner pod's usage and resources
annotations carry (written by the plan's fenced tell, docs/protocol.md, "Live scaling")."""
ANNOTATION_RESIZE_REFUSED = "vm.neon.tech/resize-refused"
"""``epoch,token,seq`` of the scaling plan whose in-place resize of the runner pod the API
server refused for good (or took at another CPU request): no plan is made to redo it
(docs/protocol.md, "Live scaling", "The pod's record")."""
SCHEDULING_GATE = "vm.neon.tech/runner-fence"
"""Scheduling gate every runner pod is created with; removed only after commit."""

RestartPolicy = Literal["Always", "OnFailure", "Never"]
Phase = Literal["Pending", "Running", "Succeeded", "Failed", "PreMigrating", "Migrating",
                "Scaling"]
"""NeonVM's seven phases; this controller sets Pending, Running, Succeeded and Failed."""
CpuScalingMode = Literal["QmpScaling", "SysfsScaling"]
CPUArchitecture = Literal["amd64", "arm64"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

# Bounds of the spec (issue: a huge spec must be refused by the API server, not by the
# runner pod's creation or exec). NeonVM caps memory slots at 512.
MAX_MEMORY_SLOTS = 512
MAX_VCPUS = 512
"""Upper bound of ``guest.cpus.max`` (whole vCPUs); QEMU/KVM's own limits are near here."""
MIN_OVERCOMMIT = "0.001"
"""The smallest overcommit factor (1m): NeonVM's scheduler plugin divides a VM's usage
by the factor's thousandths, so zero (or a negative factor) would break its sums."""
MAX_OVERCOMMIT = "10"
"""The largest overcommit factor: a VM counts at least a tenth of its usage, whoever
writes its spec (NeonVM itself sets no bound; docs/security.md)."""
MAX_MILLICPU_LENGTH = 12
DNS_LABEL = 63
NAME_LENGTH = 253
PATH_LENGTH = 4096
IMAGE_LENGTH = 1024
SHORT_STRING = 256
ARG_LENGTH = 32768
COMMAND_ITEMS = 32
ARG_ITEMS = 256
ENV_ITEMS = 256
ENV_VALUE_LENGTH = 32768
PORT_ITEMS = 64
DISK_ITEMS = 32
SYSCTL_ITEMS = 256
SELECTOR_ITEMS = 64
TOLERATION_ITEMS = 64
PULL_SECRET_ITEMS = 32
INIT_CONTAINER_ITEMS = 8
INIT_SCRIPT_LENGTH = 65536
KEY_TO_PATH_ITEMS = 256

_DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN_PATTERN = f"^{_DNS_SUBDOMAIN}$"
"""An object name (RFC 1123 subdomain, as Kubernetes names Secrets, ConfigMaps and pods).

Names the controller puts into REST paths carry it, so the API server refuses a name
such as ``../../kube-system/secrets/x`` before the controller can read it (see
docs/security.md, "Tenants")."""
OPTIONAL_DNS_SUBDOMAIN_PATTERN = f"^({_DNS_SUBDOMAIN})?$"
"""The same, or empty (status fields the controller clears by writing "")."""

SCALING_TOKEN_SECRET_PREFIX = "neonvm-scaling-"
"""Every live scaling token Secret's name starts with it (the controller creates them by
generateName); no VM may mount a Secret so named (``disks[].secret``)."""


RESERVED_DISK_NAMES = ("virtualmachineimages", "rootdisk", "runtime", "swapdisk", "sysfscgroup",
                       "ssh-privatekey", "ssh-publickey", "ssh-authorized-keys", "tls")
"""Names NeonVM's webhook refuses for ``spec.disks[].name`` (its runner's own volumes)."""
DISK_NAME_LENGTH = 32
"""NeonVM's webhook refuses a longer disk name."""
RESERVED_PORT_NAMES = ("qmp", "runner")
"""``qmp`` is NeonVM's reserved port name; ``runner`` is the runner pod's own port here, so a
guest port of that name would make a pod the API server refuses."""
DEFAULT_CPU_SCALING_MODE = "QmpScaling"
"""What NeonVM's controller writes into an unset ``spec.cpuScalingMode`` (its deployment's
``--default-cpu-scaling-mode``); here the CRD's default stores it."""


def _unchanged(field: str) -> tuple[str, str, str]:
    """A transition rule on the parent of ``field``: neither added, removed nor changed."""
    return (f"has(self.{field}) == has(oldSelf.{field}) && "
            f"(!has(self.{field}) || self.{field} == oldSelf.{field})",
            f"{field} is immutable", f".{field}")


def _set_once(field: str) -> tuple[str, str, str]:
    """A transition rule on the parent of ``field``: it may be set when unset, then not
    changed or removed (NeonVM's "allowed to change from nil only")."""
    return (f"!has(oldSelf.{field}) || (has(self.{field}) && self.{field} == oldSelf.{field})",
            f"{field} is not allowed to be changed once it's set", f".{field}")


def _cpu_unchanged(bound: str) -> tuple[str, str, str]:
    """``cpus.<bound>`` keeps its amount (``1``, ``"1"`` and ``"1000m"`` are one amount)."""
    new, old = f"self.cpus.{bound}", f"oldSelf.cpus.{bound}"
    return (f"has(self.cpus) == has(oldSelf.cpus) && (!has(self.cpus) || "
            f"quantity(string({new})).compareTo(quantity(string({old}))) == 0)",
            f"cpus.{bound} is immutable", f".cpus.{bound}")


def _slots_unchanged(bound: str) -> tuple[str, str, str]:
    return (f"has(self.memorySlots) == has(oldSelf.memorySlots) && (!has(self.memorySlots) "
            f"|| self.memorySlots.{bound} == oldSelf.memorySlots.{bound})",
            f"memorySlots.{bound} is immutable", f".memorySlots.{bound}")


def _millicpu_rules() -> tuple[tuple[str, str], ...]:
    def q(expr: str) -> str:
        return f"quantity(string({expr}))"

    return (
        (f"{q('self.min')}.isGreaterThan(quantity('0'))", "min must be above 0"),
        (f"!{q('self.max')}.isLessThan({q('self.min')})", "min must not exceed max"),
        (f"!{q('self.max')}.isGreaterThan(quantity('{MAX_VCPUS}'))",
         f"max is at most {MAX_VCPUS} vCPUs"),
        (f"!has(self.use) || (!{q('self.use')}.isLessThan({q('self.min')}) && "
         f"!{q('self.max')}.isLessThan({q('self.use')}))",
         "use must lie between min and max"),
    )


@dataclass
class IntRange:
    """A min/max/use triple of memory slots; use must lie in [min, max]."""

    __validations__ = (
        ("self.min <= self.max", "min must not exceed max"),
        ("!has(self.use) || (self.use >= self.min && self.use <= self.max)",
         "use must lie between min and max"),
    )

    min: int = api_field("Lower bound.", minimum=1, maximum=MAX_MEMORY_SLOTS, int32=True,
                         required=True, default=1)
    max: int = api_field("Upper bound.", minimum=1, maximum=MAX_MEMORY_SLOTS, int32=True,
                         required=True, default=1)
    use: int | None = api_field("Current amount; defaults to min.", minimum=1,
                                maximum=MAX_MEMORY_SLOTS, int32=True)

    @property
    def current(self) -> int:
        return self.use if self.use is not None else self.min


@dataclass
class CPURange:
    """CPU bounds in NeonVM's MilliCPU: an integer of whole vCPUs (2) or a string ("0.5",
    "250m"); use must lie in [min, max]. QEMU boots ceil(use) vCPUs with room for ceil(max)."""

    __validations__ = _millicpu_rules()

    min: MilliCPU = api_field("Lower bound (vCPUs: 2, \"0.5\" or \"250m\").", required=True,
                              default=MilliCPU(1000), minimum=0, maximum=MAX_VCPUS,
                              max_length=MAX_MILLICPU_LENGTH)
    max: MilliCPU = api_field("Upper bound (vCPUs: 2, \"0.5\" or \"250m\").", required=True,
                              default=MilliCPU(1000), minimum=0, maximum=MAX_VCPUS,
                              max_length=MAX_MILLICPU_LENGTH)
    use: MilliCPU | None = api_field("Current amount; defaults to min. The autoscaler "
                                     "patches it as a millicpu string (\"500m\").",
                                     minimum=0, maximum=MAX_VCPUS,
                                     max_length=MAX_MILLICPU_LENGTH)

    def __post_init__(self) -> None:
        # Python callers may pass vCPUs as int or float (2, 0.5): the same meaning as JSON.
        self.min = MilliCPU.parse(self.min)
        self.max = MilliCPU.parse(self.max)
        if self.use is not None:
            self.use = MilliCPU.parse(self.use)

    @property
    def current(self) -> MilliCPU:
        return self.use if self.use is not None else self.min


@dataclass
class RootDisk:
    """The guest's root disk image."""

    image: str = api_field("Disk image (container image in NeonVM, or a file path for the "
                           "local runner).", required=True, min_length=1, default="",
                           max_length=IMAGE_LENGTH)
    size: str | None = api_field("Disk size.", quantity=True)
    image_pull_policy: PullPolicy | None = api_field("When to pull the disk image.",
                                                     schema_default="IfNotPresent")
    execute: list[str] | None = api_field(
        "Commands the guest may run through the runner (NeonVM's vm-builder 'execute' list).",
        max_items=COMMAND_ITEMS, item_max_length=PATH_LENGTH)


@dataclass
class EnvVar:
    """An environment variable for the guest command."""

    name: str = api_field("Variable name.", required=True, min_length=1, default="",
                          max_length=NAME_LENGTH)
    value: str | None = api_field("Variable value.", max_length=ENV_VALUE_LENGTH,
                                  schema_default="")


@dataclass
class Port:
    """A port the guest listens on."""

    __validations__ = (
        ("!has(self.name) || !(self.name in " + repr(list(RESERVED_PORT_NAMES)) + ")",
         "'qmp' and 'runner' are reserved names for .spec.guest.ports[].name", ".name"),
    )

    port: int = api_field("Port number.", minimum=1, maximum=65535, required=True, default=0)
    name: str | None = api_field("Port name.", max_length=DNS_LABEL)
    protocol: Literal["TCP", "UDP"] | None = api_field("Protocol (default TCP).",
                                                        schema_default="TCP")


@dataclass
class GuestSettings:
    """Additional settings for the guest (NeonVM's GuestSettings)."""

    sysctl: list[str] | None = api_field("Lines for the guest's sysctl.conf.",
                                         max_items=SYSCTL_ITEMS, item_max_length=SHORT_STRING)
    swap: str | None = api_field("Size of a swap disk to add.", quantity=True)


@dataclass
class Guest:
    """What runs inside the VM: its size, disk, kernel and command."""

    # What NeonVM's webhook keeps from changing (cpus.use and memorySlots.use stay free:
    # the autoscaler's). Rules sit here, not on the fields, so that removing one is seen.
    __validations__ = (
        _cpu_unchanged("min"), _cpu_unchanged("max"),
        _slots_unchanged("min"), _slots_unchanged("max"),
        ("self.rootDisk == oldSelf.rootDisk", "rootDisk is immutable", ".rootDisk"),
        _unchanged("ports"), _unchanged("command"), _unchanged("args"), _unchanged("env"),
        _unchanged("settings"),
        ("!has(self.kernelImage) || self.kernelImage.startsWith('/')",
         "kernelImage is an absolute path of a kernel file in the runner's image here; "
         "NeonVM's form, a container image holding /vmlinuz, is not supported: leave it "
         "unset to boot the runner's own kernel (docs/neonvm-compat.md)", ".kernelImage"),
    )

    cpus: CPURange = api_field("CPU bounds.", default_factory=CPURange)
    memory_slots: IntRange = api_field("Memory slot bounds (at most 512 slots).",
                                       default_factory=IntRange)
    memory_slot_size: str = api_field("Size of one memory slot.", quantity=True, default="1Gi",
                                      schema_default="1Gi")
    memory_provider: Literal["VirtioMem", "DIMMSlots"] | None = api_field(
        "How memory above min is plugged live: VirtioMem (unset; NeonVM's only mechanism) or "
        "DIMMSlots (ACPI DIMMs, for a guest kernel without virtio_mem; NeonVM's removed "
        "field).")
    root_disk: RootDisk = api_field("Root disk.", default_factory=RootDisk, required=True)
    kernel_image: str | None = api_field(
        "Kernel to boot directly: an absolute file path in the runner's image (NeonVM: a "
        "container image, refused here).", max_length=PATH_LENGTH)
    initrd_image: str | None = api_field("Initial ramdisk to boot with the kernel (optional).",
                                         max_length=PATH_LENGTH)
    append_kernel_cmdline: str | None = api_field("Extra kernel command line.",
                                                  max_length=PATH_LENGTH)
    memhp_auto_movable_ratio: str | None = api_field(
        "Maximum MOVABLE:KERNEL memory ratio in percent for hot-plugged memory (NeonVM).",
        max_length=SHORT_STRING)
    command: list[str] | None = api_field("Guest entrypoint override.",
                                          max_items=COMMAND_ITEMS, item_max_length=ARG_LENGTH)
    args: list[str] | None = api_field("Guest arguments.", max_items=ARG_ITEMS,
                                       item_max_length=ARG_LENGTH)
    env: list[EnvVar] | None = api_field("Guest environment.", max_items=ENV_ITEMS)
    ports: list[Port] | None = api_field("Ports the guest exposes.", max_items=PORT_ITEMS)
    settings: dict[str, Any] | None = api_field("Guest settings: sysctl lines, swap size.",
                                                shape=GuestSettings)


@dataclass
class KeyToPath:
    """A key of a ConfigMap or Secret, and the file it becomes."""

    key: str = api_field("Key.", required=True, default="", max_length=NAME_LENGTH)
    path: str = api_field("Relative file path.", required=True, default="",
                          max_length=PATH_LENGTH)
    mode: int | None = api_field("File mode bits.", minimum=0, maximum=0o777, int32=True)


@dataclass
class ConfigMapSource:
    """A ConfigMap whose keys become files on the disk (core/v1 ConfigMapVolumeSource)."""

    name: str | None = api_field("ConfigMap name.", max_length=NAME_LENGTH,
                                 pattern=DNS_SUBDOMAIN_PATTERN)
    items: list[KeyToPath] | None = api_field("Keys to project (default: all).",
                                              max_items=KEY_TO_PATH_ITEMS)
    default_mode: int | None = api_field("Default file mode bits.", minimum=0, maximum=0o777,
                                         int32=True)
    optional: bool | None = api_field("Whether the ConfigMap may be missing.")


@dataclass
class SecretSource:
    """A Secret whose keys become files on the disk (core/v1 SecretVolumeSource)."""

    __validations__ = (
        (f"!has(self.secretName) || !self.secretName.startsWith('{SCALING_TOKEN_SECRET_PREFIX}')",
         f"a Secret named {SCALING_TOKEN_SECRET_PREFIX}... is a VM's live scaling token, "
         "which no VM may mount"),
    )

    secret_name: str | None = api_field("Secret name (not a scaling token's).",
                                        max_length=NAME_LENGTH,
                                        pattern=DNS_SUBDOMAIN_PATTERN)
    items: list[KeyToPath] | None = api_field("Keys to project (default: all).",
                                              max_items=KEY_TO_PATH_ITEMS)
    default_mode: int | None = api_field("Default file mode bits.", minimum=0, maximum=0o777,
                                         int32=True)
    optional: bool | None = api_field("Whether the Secret may be missing.")


@dataclass
class EmptyDiskSource:
    """A fresh disk that lives as long as the runner pod."""

    size: str = api_field("Disk size.", quantity=True, required=True, default="")
    discard: bool | None = api_field("Mount with the discard option (NeonVM).")
    enable_quotas: bool | None = api_field("Mount ext4 with prjquota (NeonVM).")


@dataclass
class TmpfsDiskSource:
    """A tmpfs in the guest."""

    size: str = api_field("Size of the tmpfs.", quantity=True, required=True, default="")


@dataclass
class Disk:
    """An extra disk; exactly one source (emptyDisk, configMap, secret, tmpfs) is expected."""

    __validations__ = (
        ("!(self.name in " + repr(list(RESERVED_DISK_NAMES)) + ")",
         "the name is reserved for .spec.disks[].name (NeonVM's runner uses it): "
         + ", ".join(RESERVED_DISK_NAMES), ".name"),
    )

    name: str = api_field("Disk name (not a reserved one).", required=True, min_length=1,
                          default="", pattern=_DNS_LABEL_PATTERN, max_length=DISK_NAME_LENGTH)
    mount_path: str | None = api_field("Mount point in the guest.", max_length=PATH_LENGTH)
    read_only: bool | None = api_field("Mount read-only.", schema_default=False)
    watch: bool | None = api_field("Watch the source for changes (NeonVM; configMap and "
                                   "secret disks).", schema_default=False)
    empty_disk: dict[str, Any] | None = api_field("A fresh disk of a given size.",
                                                  shape=EmptyDiskSource)
    config_map: dict[str, Any] | None = api_field("A disk built from a ConfigMap.",
                                                  shape=ConfigMapSource)
    secret: dict[str, Any] | None = api_field("A disk built from a Secret.", shape=SecretSource)
    tmpfs: dict[str, Any] | None = api_field("A tmpfs of a given size.", shape=TmpfsDiskSource)


@dataclass
class Toleration:
    """A core/v1 Toleration of the runner pod."""

    key: str | None = api_field("Taint key.", max_length=NAME_LENGTH)
    operator: Literal["Exists", "Equal"] | None = api_field("Exists or Equal.")
    value: str | None = api_field("Taint value.", max_length=DNS_LABEL)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = api_field(
        "Taint effect to match.")
    toleration_seconds: int | None = api_field("How long a NoExecute taint is tolerated.",
                                               maximum=2**31 - 1)


@dataclass
class LocalObjectReference:
    """A name in the VM's namespace."""

    name: str | None = api_field("Name.", max_length=NAME_LENGTH,
                                 pattern=DNS_SUBDOMAIN_PATTERN)


@dataclass
class ResourceClaim:
    """A core/v1 ResourceClaim reference."""

    name: str = api_field("Claim name.", required=True, default="", max_length=NAME_LENGTH)
    request: str | None = api_field("Request within the claim.", max_length=NAME_LENGTH)


@dataclass
class PodResources:
    """core/v1 ResourceRequirements of the runner container."""

    limits: dict[str, Any] | None = api_field("Limits.", quantity=True, max_properties=16)
    requests: dict[str, Any] | None = api_field("Requests.", quantity=True, max_properties=16)
    claims: list[ResourceClaim] | None = api_field("Dynamic resource claims.", max_items=16)


@dataclass
class ExtraNetwork:
    """An extra interface on a Multus network (NeonVM)."""

    enable: bool | None = api_field("Enable the extra interface.", schema_default=False)
    interface: str | None = api_field("Interface name (NeonVM's default net1).",
                                      max_length=15, schema_default="net1")
    multus_network: str | None = api_field("NetworkAttachmentDefinition name.",
                                           max_length=NAME_LENGTH)


@dataclass
class TLSProvisioning:
    """Certificates provisioned for the VM (NeonVM)."""

    certificate_issuer: str | None = api_field("cert-manager issuer.", max_length=NAME_LENGTH)
    expire_after: str | None = api_field("Certificate lifetime (a Go duration).",
                                         max_length=64)
    renew_before: str | None = api_field("Renew this long before expiry (a Go duration).",
                                         max_length=64)
    server_name: str | None = api_field("Common name of the certificate.",
                                        max_length=NAME_LENGTH)
    mount_path: str | None = api_field("Directory in the guest for tls.key and tls.crt.",
                                       max_length=PATH_LENGTH, schema_default="/var/tls")


def _factor_rule(field: str) -> tuple[str, str, str]:
    """``field`` (an overcommit factor) is a number in
    [:data:`MIN_OVERCOMMIT`, :data:`MAX_OVERCOMMIT`]."""
    q = f"quantity(string(self.{field}))"
    return (f"!has(self.{field}) || (!{q}.isLessThan(quantity('{MIN_OVERCOMMIT}')) && "
            f"!{q}.isGreaterThan(quantity('{MAX_OVERCOMMIT}')))",
            f"{field} must be a factor from {MIN_OVERCOMMIT} to {MAX_OVERCOMMIT}",
            f".{field}")


@dataclass
class OvercommitSettings:
    """Factors by which to discount the VM's resource usage (NeonVM), each from 0.001 to
    10: NeonVM's scheduler plugin divides the VM's usage by it (docs/security.md)."""

    __validations__ = (_factor_rule("cpu"), _factor_rule("memory"))

    cpu: str | None = api_field("CPU overcommit factor.", quantity=True)
    memory: str | None = api_field("Memory overcommit factor.", quantity=True)


@dataclass
class Revision:
    """An identifier of a spec configuration, set by an external party (NeonVM)."""

    value: int = api_field("Value (int64; an identifier, so not bounded further).",
                           required=True, default=0)
    flags: int = api_field("Bit flags (int64); their meaning is up to the writer.",
                           required=True, default=0)


@dataclass
class RevisionWithTime:
    """A Revision and when it was last updated."""

    revision: Revision = api_field("Revision.", required=True, default_factory=Revision)
    updated_at: str = api_field("When (RFC 3339).", required=True, default="",
                                max_length=64)


@dataclass
class VirtualMachineSpec:
    """Desired state of a VirtualMachine (every field of NeonVM's v1 spec)."""

    # NeonVM's webhook: these never change after creation (docs/neonvm-compat.md).
    __validations__ = (
        _unchanged("disks"), _unchanged("podResources"), _unchanged("enableAcceleration"),
        _unchanged("enableSSH"), _unchanged("initScript"), _unchanged("enableNetworkMonitoring"),
        _set_once("cpuScalingMode"), _set_once("targetArchitecture"),
    )

    guest: Guest = api_field("The guest.", default_factory=Guest, required=True)
    restart_policy: RestartPolicy = api_field(
        "What to do when the runner pod ends: Always restart, restart OnFailure, or Never.",
        default="Always", schema_default="Always",
    )
    runner_image: str | None = api_field("Image of the runner pod.", max_length=IMAGE_LENGTH)
    disks: list[Disk] | None = api_field("Extra disks.", max_items=DISK_ITEMS)
    node_selector: dict[str, str] | None = api_field(
        "Node selector for the runner pod.", max_properties=SELECTOR_ITEMS,
        item_max_length=DNS_LABEL)
    tolerations: list[dict[str, Any]] | None = api_field("Tolerations for the runner pod.",
                                                         shape=Toleration,
                                                         max_items=TOLERATION_ITEMS)
    affinity: dict[str, Any] | None = api_field(
        "Affinity for the runner pod (core/v1 Affinity).", free_form=True, max_properties=3)
    termination_grace_period_seconds: int | None = api_field(
        "Grace period for the guest to power down.", minimum=0, maximum=86400)
    pod_resources: dict[str, Any] | None = api_field(
        "Resources of the runner container (requests/limits).", shape=PodResources)
    scheduler_name: str | None = api_field("Scheduler for the runner pod.",
                                           max_length=NAME_LENGTH)
    service_account_name: str | None = api_field("Service account of the runner pod.",
                                                 max_length=NAME_LENGTH)
    image_pull_secrets: list[dict[str, Any]] | None = api_field(
        "Pull secrets for the runner pod.", shape=LocalObjectReference,
        max_items=PULL_SECRET_ITEMS)
    runner_port: int | None = api_field("Runner HTTP port.", minimum=1, maximum=65535,
                                        int32=True, schema_default=25183)
    qmp: int | None = api_field("NeonVM's QMP port; here a second QMP monitor on a unix "
                                "socket, no TCP port.", minimum=1, maximum=65535, int32=True,
                                schema_default=20183)
    qmp_manual: int | None = api_field("NeonVM's second QMP port, for manual use "
                                       "(default 20184).", minimum=1, maximum=65535,
                                       int32=True)
    enable_ssh: bool | None = api_field(
        "Give the guest an SSH key: the controller creates the Secret ssh-neonvm-<name> "
        "(an ed25519 key pair) and the runner gives the public key to a vm-builder guest.",
        json="enableSSH", schema_default=True)
    target_architecture: CPUArchitecture | None = api_field(
        "CPU architecture of the node the VM runs on: amd64 or arm64.")
    extra_init_containers: list[dict[str, Any]] | None = api_field(
        "Init containers of the runner pod (core/v1 Container).", free_form=True,
        max_properties=64, max_items=INIT_CONTAINER_ITEMS)
    init_script: str | None = api_field("A script run in the runner container before the VM "
                                        "starts.", max_length=INIT_SCRIPT_LENGTH)
    extra_network: ExtraNetwork | None = api_field("Extra interface on a Multus network.")
    service_links: bool | None = api_field(
        "enableServiceLinks of the runner pod (unset: Kubernetes' default, true).",
        json="service_links")
    enable_acceleration: bool | None = api_field("Use KVM (NeonVM's default: true).",
                                                 schema_default=True)
    tls: TLSProvisioning | None = api_field("Certificates to provision for the VM.")
    overcommit: OvercommitSettings | None = api_field(
        "Factors by which to discount the VM's resource usage.")
    target_revision: RevisionWithTime | None = api_field(
        "Set by an external party with a spec change; copied to status.currentRevision once "
        "the change reached the VM.")
    cpu_scaling_mode: CpuScalingMode | None = api_field(
        "How CPUs are scaled: QmpScaling (hot-plug) or SysfsScaling (online in the guest).",
        schema_default=DEFAULT_CPU_SCALING_MODE)
    enable_network_monitoring: bool | None = api_field("Enable network monitoring (NeonVM).",
                                                       schema_default=False)


@dataclass
class PendingPod:
    """The plan record: the runner pod about to be created, written before creating it."""

    name: str = api_field("Exact name the pod will be created with.", default="",
                          max_length=NAME_LENGTH, pattern=OPTIONAL_DNS_SUBDOMAIN_PATTERN)
    plan_seq: int = api_field("Plan sequence number this name was derived from.", default=0)
    token: int = api_field("Fencing token (etcd revision of the lock) at planning.", default=0)
    epoch: int = api_field("Leader epoch at planning.", default=0)
    generation: int = api_field("VM generation the plan was made for.", default=0)


@dataclass
class PendingScale:
    """The scaling plan: the size the committed runner pod is being changed to, recorded by
    CAS before its runner is asked. The runner is sent the fence (epoch, token, seq)."""

    cpus: int = api_field("Target vCPUs (whole: ceil of spec.guest.cpus.use).", default=0,
                          minimum=0, maximum=MAX_VCPUS, int32=True)
    memory_slots: int = api_field("Target memory slots (spec.guest.memorySlots.use).",
                                  default=0, minimum=0, maximum=MAX_MEMORY_SLOTS, int32=True)
    seq: int = api_field("Scale sequence number (status.scaleSeq when recorded).", default=0)
    epoch: int = api_field("Leader epoch at planning.", default=0)
    token: int = api_field("Fencing token (etcd revision of the lock) at planning.",
                           default=0)
    pod_name: str = api_field("The committed runner pod this plan is for.", default="",
                              max_length=NAME_LENGTH, pattern=OPTIONAL_DNS_SUBDOMAIN_PATTERN)
    pod_uid: str = api_field("UID of that pod.", default="", json="podUID")
    generation: int = api_field("VM generation the plan was made for.", default=0)


@dataclass(frozen=True)
class Fence:
    """Highest (epoch, token) that wrote this status; older writers are refused. Also
    the authority a controller acts under (leader epoch, the VM lock's fencing token)."""

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


def neonvm_condition(condition: dict[str, Any]) -> bool:
    """A condition (as JSON) that goes in ``status.conditions``: ``Available``, or
    ``Degraded`` while it is True. NeonVM writes Degraded only when something failed, so a
    healthy VM's list holds Available alone there too."""
    kind = condition.get("type")
    return kind == "Available" or (kind == "Degraded" and condition.get("status") == "True")


@dataclass
class VirtualMachineStatus:
    """Observed state, and the controller's resumable plan."""

    phase: Phase | None = api_field(
        "NeonVM's phases: Pending, Running, Succeeded, Failed, PreMigrating, Migrating, "
        "Scaling (this controller sets the first four).")
    pod_name: str | None = api_field("The committed runner pod.", max_length=NAME_LENGTH,
                                     pattern=OPTIONAL_DNS_SUBDOMAIN_PATTERN)
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
    conditions: list[Condition] = api_field(
        "NeonVM's conditions, as NeonVM writes them: Available, and Degraded while it is "
        "True. This controller's other conditions are in extraConditions.",
        default_factory=list)
    extra_conditions: list[Condition] = api_field(
        "This controller's (NeonVM has no such field): its conditions that NeonVM does not "
        "write (WaitingForOldPod, Scaling, RestartBackoff, FieldsNotImplemented, "
        "AccelerationUnavailable, and Degraded once it is False), in the same shape.",
        default_factory=list)
    observed_generation: int | None = api_field("Generation last acted on.")
    fence: Fence | None = api_field("Highest writer (epoch, token) seen.")
    cpus: MilliCPU | None = api_field(
        "vCPUs of the committed runner pod: the size it was built with until "
        "a live scaling change is committed, then what its runner reported the guest has.")
    memory_size: str | None = api_field(
        "Memory of the committed runner pod: memorySlots.use x memorySlotSize it was built "
        "with until a live scaling change is committed, then what its runner reported.",
        quantity=True)
    pending_scale: PendingScale | None = api_field(
        "Plan record of a live scaling change in progress (phase Scaling meanwhile).")
    scale_seq: int = api_field("Last scale sequence number used; only ever increases.",
                               default=0)
    scale_look_pod_uid: str | None = api_field(
        "This controller's (NeonVM has no such field): UID of the committed runner pod "
        "whose runner is still looked at (GET /scale) after a scaling plan for it was "
        "dropped, since a PUT /scale of that plan sent earlier may still land and an "
        "unplug it started may still finish. Set by the drop (with scaleLookSince); "
        "cleared by the status write that adopts (or confirms) the size the runner "
        "reports once the late-PUT window has passed and no removal is pending, by the "
        "write that gives the look up an hour after the drop, by a new scaling plan, "
        "and with the pod.", json="scaleLookPodUID")
    scale_look_since: str | None = api_field(
        "This controller's (NeonVM has no such field): when the drop that set "
        "scaleLookPodUID was written (RFC 3339, the dropping controller's clock). The "
        "late-PUT window and the look's give-up bound are measured from it; set and "
        "cleared with scaleLookPodUID.", json="scaleLookSince")
    scaling_token_secret: str | None = api_field(
        "Name of the live scaling token Secret the controller created for this VM (with a "
        "generated name); new runner pods mount it.", max_length=NAME_LENGTH,
        pattern=OPTIONAL_DNS_SUBDOMAIN_PATTERN)
    scaling_token_secret_uid: str | None = api_field(
        "UID of that Secret as its creation returned it: a Secret with another UID is "
        "never used.", json="scalingTokenSecretUID")
    current_revision: RevisionWithTime | None = api_field(
        "spec.targetRevision as of the spec the committed runner pod was built from.")
    extra_net_ip: str | None = api_field("IP on the extra network (NeonVM; not set here).",
                                         json="extraNetIP")
    extra_net_mask: str | None = api_field("Mask on the extra network (NeonVM; not set "
                                           "here).", json="extraNetMask")
    ssh_secret_name: str | None = api_field("Secret holding the VM's SSH key pair (with "
                                            "enableSSH).", json="sshSecretName")
    tls_secret_name: str | None = api_field("Secret holding the VM's certificate (NeonVM; "
                                            "not set here).", json="tlsSecretName")

    def __post_init__(self) -> None:
        # In memory one list holds every condition, whichever list of the object it
        # came from: code finds a condition by its type alone (wire_form splits them).
        if self.extra_conditions:
            self.conditions = [*self.conditions, *self.extra_conditions]
            self.extra_conditions = []

    def wire_form(self, out: dict[str, Any]) -> dict[str, Any]:
        """The status's JSON (:func:`~neonvm.api.schema.encode`) with its conditions split:
        NeonVM's (:func:`neonvm_condition`) in ``conditions``, the rest in
        ``extraConditions``, so that a check of the whole ``conditions`` list written for
        NeonVM (kuttl's asserts) sees what NeonVM writes. docs/neonvm-compat.md,
        "Conditions"."""
        every = out.pop("conditions", [])
        out.pop("extraConditions", None)
        ours = [c for c in every if neonvm_condition(c)]
        extra = [c for c in every if not neonvm_condition(c)]
        if ours:
            out["conditions"] = ours
        if extra:
            out["extraConditions"] = extra
        return out


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
    annotations: dict[str, str] = field(default_factory=dict)
    creation_timestamp: str | None = None

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
            annotations=dict(meta.get("annotations") or {}),
            creation_timestamp=meta.get("creationTimestamp"),
        )

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"
