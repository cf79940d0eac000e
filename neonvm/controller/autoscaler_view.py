"""What NeonVM's autoscaler stack reads after a live scale: pure derivations.

The autoscaler-agent (``pkg/agent``) and the scheduler plugin (``pkg/plugin``) of NeonVM's
stack read the VM and its runner pod, not the runner. After a scale has landed they
expect:

* the pod's ``vm.neon.tech/resources`` annotation (:func:`resources_json`) and
  ``vm.neon.tech/usage`` (:func:`usage_json`) to say the new size (written by
  :mod:`neonvm.controller.scaling` in the same fenced patch as before);
* ``status.cpus`` to carry the fractional amount asked for (``250m``), not the whole
  vCPUs the runner plugged (:func:`landed_cpus`), set by the plan whose annotation
  write carries that fraction (a change within the same whole vCPUs is a plan too);
* ``status.currentRevision`` to be ``spec.targetRevision`` stamped with the time it
  landed (:func:`propagate_revision`), once status reports the spec's size;
* the VM's labels and annotations on the pod (its ``autoscaling.neon.tech/`` ones among
  them; not this controller's ``vm.neon.tech/`` keys), and NeonVM's
  ``vm.neon.tech/overcommit`` annotation for ``spec.overcommit`` (:func:`overcommit_json`;
  the scheduler plugin discounts the pod's usage by it), kept in step
  (:func:`metadata_drift`): added, changed, and removed when the VM drops them, by the
  pod's record of what was copied (:data:`ANNOTATION_COPIED`); keys the VM never had are
  left to whoever wrote them.

Nothing here does I/O. Why none of these writes can put an older size back:
docs/neonvm-compat.md, "The autoscaler's view".
"""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException

from neonvm.api import times
from neonvm.api.millicpu import MilliCPU
from neonvm.api.quantity import QuantityError, format_bytes, parse_bytes
from neonvm.api.types import Revision, RevisionWithTime, VirtualMachine, VirtualMachineStatus
from neonvm.kube import api_error_message

if TYPE_CHECKING:
    from neonvm.controller.cluster import Cluster

AUTOSCALING_PREFIX = "autoscaling.neon.tech/"
"""NeonVM's autoscaler stack's labels and annotations (the only ones kept in step before
:data:`ANNOTATION_COPIED` existed)."""
CONTROLLER_PREFIX = "vm.neon.tech/"
"""This controller's own labels and annotations: never copied from a VM, never synced."""
LABEL_APP_NAME = "app.kubernetes.io/name"
"""NeonVM's runner-pod label (always ``NeonVM``; a VM label of this key is not copied)."""
ANNOTATION_DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
NOT_COPIED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",
                          ANNOTATION_DEFAULT_CONTAINER)
"""VM annotations never copied to the runner pod: kubectl's record of the VM (as NeonVM),
and the one the controller sets itself (the runner container's name wins, as in NeonVM)."""
ANNOTATION_COPIED = "vm.neon.tech/copied-metadata"
"""The runner pod's record of the keys copied from the VM, ``{"labels": [..],
"annotations": [..]}``: what the sync may remove when the VM drops them. A key the pod
has that is not in it is someone else's and is never touched."""
ANNOTATION_OVERCOMMIT = "vm.neon.tech/overcommit"
"""NeonVM's runner pod annotation: ``spec.overcommit`` as JSON (``{"cpu":"2"}``), present
only when the spec has it; NeonVM's scheduler plugin (``pkg/plugin``) reads it."""


def overcommit_json(vm: VirtualMachine) -> str | None:
    """:data:`ANNOTATION_OVERCOMMIT` for ``vm`` (None without ``spec.overcommit``): the
    factors set, as NeonVM's controller marshals them (each a canonical quantity:
    ``1.5`` is ``"1500m"``)."""
    overcommit = vm.spec.overcommit
    if overcommit is None:
        return None
    factors = {k: _canonical_quantity(v) for k, v in (("cpu", overcommit.cpu),
                                                      ("memory", overcommit.memory))
               if v is not None}
    return json.dumps(factors, separators=(",", ":"))


def _canonical_quantity(text: str) -> str:
    """A plain decimal quantity as Kubernetes prints it (``1.5`` and ``1500m`` are
    ``"1500m"``, ``2.0`` is ``"2"``); anything else (a suffix, an exponent, finer than a
    milli) as written."""
    written = str(text).strip()
    milli = written.endswith("m")
    try:
        value = Decimal(written[:-1] if milli else written)
    except InvalidOperation:
        return written
    if not value.is_finite() or "e" in written.lower():
        return written
    value = value / 1000 if milli else value
    if value == value.to_integral_value():
        return str(int(value))
    thousandths = value * 1000
    if thousandths == thousandths.to_integral_value():
        return f"{int(thousandths)}m"
    return written


def landed_cpus(vm: VirtualMachine, vcpus: int,
                plan_generation: int | None = None) -> MilliCPU:
    """``status.cpus`` for a guest with ``vcpus`` whole vCPUs: the spec's ``cpus.use`` when
    it rounds up to them (a fractional ``250m`` is one vCPU, as NeonVM reports it), else
    the whole vCPUs. Committing a plan made for ``plan_generation``, a spec that moved
    since gives the whole vCPUs too: its ``use`` may not be the fraction the plan's pod
    annotations carry, and status then differing from the spec starts the plan that
    writes them (docs/protocol.md, "Live scaling")."""
    use = vm.spec.guest.cpus.current
    if plan_generation is not None and plan_generation != vm.generation:
        return MilliCPU(vcpus * 1000)
    return use if use.rounded_up() == vcpus else MilliCPU(vcpus * 1000)


CPU_LIMIT_FACTOR = 4
"""NeonVM's ``cpuLimitOvercommitFactor``: QEMU may use this many times ``cpus.use`` of CPU
time (its runner's cgroup quota; here also the runner container's CPU limit)."""


def cpu_limit(vm: VirtualMachine) -> MilliCPU:
    """The runner container's CPU limit derived from the guest: NeonVM's quota rule,
    :data:`CPU_LIMIT_FACTOR` x ``cpus.use``, never above ``cpus.max`` (the limit a pod
    had before) nor below ``use`` (the request). Set at build and moved by the same
    in-place resize as the request, so the kubelet's cgroup enforces the fraction where
    the runner cannot write its own (docs/neonvm-compat.md, "The autoscaler's view")."""
    cpus = vm.spec.guest.cpus
    use = cpus.current
    return MilliCPU(max(int(use), min(int(use) * CPU_LIMIT_FACTOR, int(cpus.max))))


def resources_json(vm: VirtualMachine, cpus: MilliCPU, memory_slots: int) -> str:
    """NeonVM's ``vm.neon.tech/resources`` annotation: the spec's bounds with ``use`` at
    the size the guest has (``cpus``, ``memory_slots``); the same JSON as at build."""
    guest = vm.spec.guest
    size = _slot_bytes(vm)
    return json.dumps({
        "cpus": {"min": guest.cpus.min.to_json(), "max": guest.cpus.max.to_json(),
                 "use": cpus.to_json()},
        "memorySlots": {"min": guest.memory_slots.min, "max": guest.memory_slots.max,
                        "use": memory_slots},
        "memorySlotSize": format_bytes(size) if size else str(guest.memory_slot_size),
    }, separators=(",", ":"))


def usage_json(cpus: MilliCPU, memory_bytes: int) -> str:
    """NeonVM's ``vm.neon.tech/usage`` annotation: ``{"cpu", "memory"}``."""
    return json.dumps({"cpu": str(cpus), "memory": format_bytes(memory_bytes)},
                      separators=(",", ":"))


def at_spec_size(vm: VirtualMachine, status: VirtualMachineStatus) -> bool:
    """Whether ``status`` reports the size the spec asks for: ``cpus.use`` exactly (the
    fraction too: a fraction reaches status only with the plan that annotates the pod
    with it) and ``memorySlots.use`` slots."""
    guest = vm.spec.guest
    size = _slot_bytes(vm)
    if status.cpus is None or status.memory_size is None or not size:
        return False
    try:
        memory = parse_bytes(status.memory_size)
    except QuantityError:
        return False
    return (status.cpus == guest.cpus.current
            and memory == size * guest.memory_slots.current)


def settle(new: VirtualMachineStatus, vm: VirtualMachine,
           now: dt.datetime | None = None) -> bool:
    """:func:`propagate_revision`; True when it changed ``new``. (A ``cpus.use`` changed
    within the guest's whole vCPUs is not copied into status here: it is a plan's, so
    that the pod's annotations follow it; docs/protocol.md, "Live scaling".)"""
    return propagate_revision(new, vm, now)


def propagate_revision(new: VirtualMachineStatus, vm: VirtualMachine,
                       now: dt.datetime | None = None) -> bool:
    """Set ``new.currentRevision`` to ``spec.targetRevision`` stamped ``now`` (NeonVM's
    ``propagateRevision``: the agent measures its request's latency from this stamp)
    when ``new`` says the VM runs at the spec's size with no plan recorded and the
    revision differs from the current one. True when it changed ``new``.

    Derived from the status being written only (the fresh copy's spec, and the size that
    status reports): a revision is never recorded for a size the guest does not have."""
    target = vm.spec.target_revision
    if target is None or new.phase != "Running" or new.pending_scale is not None:
        return False
    current = new.current_revision
    if current is not None and current.revision == target.revision:
        return False
    if not at_spec_size(vm, new):
        return False
    stamp = times.format_time(now or dt.datetime.now(dt.UTC))
    new.current_revision = RevisionWithTime(
        revision=Revision(value=target.revision.value, flags=target.revision.flags),
        updated_at=stamp)
    return True


def copied_label(key: str) -> bool:
    """Whether a VM label of this key is copied to (and kept on) its runner pod: all but
    this controller's own (``vm.neon.tech/``: the pod informer's selector and the fence
    key on them) and :data:`LABEL_APP_NAME`, which is always ``NeonVM`` on a runner pod."""
    return not key.startswith(CONTROLLER_PREFIX) and key != LABEL_APP_NAME


def copied_annotation(key: str) -> bool:
    """Whether a VM annotation of this key is copied to (and kept on) its runner pod: all
    but this controller's own (``vm.neon.tech/``) and :data:`NOT_COPIED_ANNOTATIONS`."""
    return not key.startswith(CONTROLLER_PREFIX) and key not in NOT_COPIED_ANNOTATIONS


_COPIED = {"labels": copied_label, "annotations": copied_annotation}


def synced_annotation(key: str) -> bool:
    """Whether a pod annotation is one :func:`metadata_drift` reads (the informer's slim
    pod must keep these, or a cached look sees drift that is not there): any the VM may
    have copied, :data:`ANNOTATION_COPIED` and :data:`ANNOTATION_OVERCOMMIT`."""
    return key in (ANNOTATION_COPIED, ANNOTATION_OVERCOMMIT) or copied_annotation(key)


def copied_metadata(vm: VirtualMachine) -> dict[str, dict[str, str]]:
    """The VM's labels and annotations its runner pod carries (:func:`copied_label`,
    :func:`copied_annotation`), at build and kept in step after."""
    return {"labels": {k: str(v) for k, v in (vm.labels or {}).items() if copied_label(k)},
            "annotations": {k: str(v) for k, v in (vm.annotations or {}).items()
                            if copied_annotation(k)}}


def copied_record(copied: dict[str, dict[str, str]]) -> str | None:
    """:data:`ANNOTATION_COPIED` for these copied labels and annotations: their keys,
    sorted, as JSON (None when there are none: the pod then needs no record)."""
    if not any(copied.values()):
        return None
    return json.dumps({field: sorted(copied[field]) for field in ("labels", "annotations")},
                      separators=(",", ":"))


def recorded_keys(labels: dict[str, str] | None,
                  annotations: dict[str, str] | None) -> dict[str, frozenset[str]]:
    """The keys a pod's :data:`ANNOTATION_COPIED` says were copied from the VM, the
    controller's own left out whatever it says. A pod without a readable record (built
    before it existed) is taken to have copied its ``autoscaling.neon.tech/`` keys, the
    only ones kept in step then."""
    raw = (annotations or {}).get(ANNOTATION_COPIED)
    record: Any = None
    if raw is not None:
        try:
            record = json.loads(str(raw))
        except (ValueError, RecursionError):  # anyone who may patch the pod may write it
            record = None
    if not isinstance(record, dict):
        return {field: frozenset(k for k in (values or {})
                                 if k.startswith(AUTOSCALING_PREFIX) and _COPIED[field](k))
                for field, values in (("labels", labels), ("annotations", annotations))}
    return {field: frozenset(k for k in _key_list(record.get(field)) if _COPIED[field](k))
            for field in ("labels", "annotations")}


def _key_list(value: Any) -> list[str]:
    """The strings of a record's list of keys; anything else in the record names none."""
    return [k for k in value if isinstance(k, str)] if isinstance(value, list) else []


def wanted_metadata(vm: VirtualMachine) -> dict[str, dict[str, str]]:
    """The synced labels and annotations the VM's runner pod should carry: the VM's copied
    ones (:func:`copied_metadata`), their record (:data:`ANNOTATION_COPIED`) and
    :data:`ANNOTATION_OVERCOMMIT` from the spec (never from a VM annotation of that name)."""
    wanted = copied_metadata(vm)
    record = copied_record(wanted)
    annotations = wanted["annotations"]
    if record is not None:
        annotations[ANNOTATION_COPIED] = record
    overcommit = overcommit_json(vm)
    if overcommit is not None:
        annotations[ANNOTATION_OVERCOMMIT] = overcommit
    return wanted


def metadata_drift(vm: VirtualMachine, pod_meta: dict[str, Any]) -> dict[str, Any] | None:
    """A JSON merge patch of the pod's ``metadata`` that makes what it carries of the VM
    (:func:`wanted_metadata`) the VM's: keys added or changed, and keys its record says
    were copied that the VM no longer has removed (None values). Labels and annotations
    the VM never had are left alone, whoever wrote them; None when nothing differs."""
    labels, annotations = pod_meta.get("labels") or {}, pod_meta.get("annotations") or {}
    recorded = recorded_keys(labels, annotations)
    patch: dict[str, Any] = {}
    for field, want in wanted_metadata(vm).items():
        have = labels if field == "labels" else annotations
        change: dict[str, str | None] = {k: v for k, v in want.items() if have.get(k) != v}
        gone = set(recorded[field])
        if field == "annotations":
            gone |= {ANNOTATION_COPIED, ANNOTATION_OVERCOMMIT}
        change.update({k: None for k in gone if k in have and k not in want})
        if change:
            patch[field] = change
    return patch or None


AutoscalingMeta = tuple[tuple[str, str, str | None], ...]
"""``(field, key, value)`` of the synced labels and annotations, sorted (None: absent)."""


def autoscaling_meta(labels: dict[str, str] | None,
                     annotations: dict[str, str] | None) -> AutoscalingMeta:
    """What a pod carries of its VM as one comparable value: the keys its record names
    (:func:`recorded_keys`) with their values (None: absent), :data:`ANNOTATION_COPIED`
    and :data:`ANNOTATION_OVERCOMMIT`. Equal to :func:`vm_autoscaling_meta` exactly when
    :func:`metadata_drift` finds nothing to patch."""
    labels, annotations = labels or {}, annotations or {}
    recorded = recorded_keys(labels, annotations)
    entries: list[tuple[str, str, str | None]] = []
    for field, values in (("labels", labels), ("annotations", annotations)):
        keys = set(recorded[field])
        if field == "annotations":
            keys |= {k for k in (ANNOTATION_COPIED, ANNOTATION_OVERCOMMIT) if k in values}
        entries += [(field, k, None if values.get(k) is None else str(values[k]))
                    for k in keys]
    return tuple(sorted(entries, key=lambda e: (e[0], e[1])))


def vm_autoscaling_meta(vm: VirtualMachine) -> AutoscalingMeta:
    """What the VM's runner pod should carry (:func:`wanted_metadata`)."""
    wanted = wanted_metadata(vm)
    return tuple(sorted(((field, k, v) for field, values in wanted.items()
                         for k, v in values.items()), key=lambda e: (e[0], e[1])))


class Invalid(str):
    """The outcome "invalid" (a 422), with the API server's message as ``detail``."""

    detail: str

    def __new__(cls, detail: str) -> Invalid:
        obj = super().__new__(cls, "invalid")
        obj.detail = detail
        return obj


def sync_pod_metadata(cluster: Cluster, vm: VirtualMachine, pod: dict[str, Any] | None,
                      uid: str, log: Any) -> str:
    """Perform ``SyncPodMetadata``: a merge patch of the labels and annotations the pod
    carries of the VM to the VM's (:func:`metadata_drift`), with the uid and
    resourceVersion of the pod as observed. "done"; "gone" (the pod observed is not
    ``uid``, or is gone); "conflict" (a 409: the pod changed since; observed again);
    :class:`Invalid` (a 422, such as metadata over the API server's size limit: patching
    again cannot help, so the reconcile ends stuck, Degraded, with the stuck backoff;
    docs/security.md)."""
    meta = (pod or {}).get("metadata") or {}
    if meta.get("uid") != uid or not meta.get("resourceVersion"):
        return "gone"
    patch = metadata_drift(vm, meta)
    if patch is None:
        return "done"
    try:
        cluster.patch_pod_metadata(vm.namespace, str(meta.get("name")), uid=uid,
                                   resource_version=str(meta["resourceVersion"]),
                                   metadata=patch)
    except ApiException as exc:
        if exc.status == 422:
            message = api_error_message(exc)
            log.warning("{pod}: the VM's labels and annotations refused (422): {msg}",
                        pod=meta.get("name"), msg=message[:300])
            return Invalid(f"the API server refuses the VM's labels and annotations on the "
                           f"runner pod (422: {message})")
        if exc.status in (404, 409):
            log.info("{pod}: the VM's labels and annotations not synced ({s}): "
                     "observing again", pod=meta.get("name"), s=exc.status)
            return "gone" if exc.status == 404 else "conflict"
        raise
    log.info("{pod}: labels and annotations synced from the VM ({keys})",
             pod=meta.get("name"), keys=", ".join(sorted(
                 k for change in patch.values() for k in change)))
    return "done"


def _slot_bytes(vm: VirtualMachine) -> int | None:
    try:
        return parse_bytes(vm.spec.guest.memory_slot_size)
    except QuantityError:
        return None
