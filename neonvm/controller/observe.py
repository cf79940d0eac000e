"""Building an :class:`~neonvm.controller.actions.Observation`, from the cache or directly.

Two sources:

* :class:`DirectReader` reads from the API server with ``resourceVersion`` unset, which
  the API server answers from etcd with a quorum read. :meth:`DirectReader.observe` lists
  the VM's pods (label ``vm.neon.tech/name=<vm>``) *first* and reads the VM *second*, so
  the VM read is at least as new as the pod list. That order is what makes the clean-up
  rule sound: a pod in the list that the (newer) VM does not reference is not referenced
  by any later version either, because pod names are never reused.
* :class:`CacheReader` answers from the informers' stores. It may be arbitrarily stale
  (and a wrapper composed in through :mod:`neonvm.controller.wiring` may make it stale on
  purpose); its observations say ``direct=False`` and
  :func:`~neonvm.controller.decide.decide` never bases a dangerous action on them.

A third kind is built, not read: after a write that took effect, the driver lays the
API server's answer (the VM as stored, or the pod as created or patched) over the
previous observation (:func:`make_snapshot` with ``from_write=True``; see
``Reconciler._seen_by_write`` and docs/protocol.md, "Observing from write responses").

A :class:`Snapshot` keeps the raw objects next to the observation: the driver's writes
need the exact resourceVersions of what the decision saw (the VM's for status and
finalizer writes, the pod's for the ungate patch).

A direct observation of a VM whose plan is recorded but whose planned pod is not there
yet (a create is due) also looks up the VM's image pull secrets, as metadata only
(``PartialObjectMetadata``: no secret data is ever received); the missing ones go into
``Observation.missing_pull_secrets``, and :func:`decide` holds the create back.

Both readers stamp the observation with their clock (``Observation.now``, wall-clock UTC
unless a test passes another), which is all the restart backoff needs; a snapshot built
without one carries ``now=None`` and has no backoff.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm.api import types
from neonvm.api.millicpu import MilliCPU, MilliCPUError
from neonvm.api.types import VirtualMachine
from neonvm.controller import autoscaler_view, podspec
from neonvm.controller.actions import Fence, Observation, PodView
from neonvm.controller.cluster import ClusterReads, VMRecord
from neonvm.controller.informer import Store
from neonvm.controller.reasons import CREATE_REFUSED, DEGRADED

Clock = Callable[[], dt.datetime]
"""Returns the current time, timezone-aware."""


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Snapshot:
    """One observation plus the raw objects behind it."""

    obs: Observation
    record: VMRecord | None
    pods: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    """Raw pods by name, as listed."""
    from_write: bool = False
    """Built from the response to our own write (the driver's
    ``Reconciler._seen_by_write``) rather than read: the VM (or the written pod) as the
    API server stored it, the other pods as the previous observation listed them.
    ``obs.direct`` is the previous observation's (docs/protocol.md, "Observing from
    write responses")."""
    vm_written: bool = False
    """The VM is the API server's answer to our own conditional write of it: the VM as
    stored at that write's revision, as good as a quorum GET then (the pods are not:
    see ``obs.direct``). A create may be decided from it (docs/protocol.md, step 6)."""


def pod_view(pod: dict[str, Any]) -> PodView:
    """What :func:`decide` needs to know of a raw pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    owner = next(
        (ref.get("uid") for ref in meta.get("ownerReferences") or []
         if ref.get("controller") and ref.get("kind") == types.KIND),
        None,
    )
    gates = spec.get("schedulingGates") or []
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        owner_uid=owner,
        gated=any(g.get("name") == types.SCHEDULING_GATE for g in gates),
        terminating=meta.get("deletionTimestamp") is not None,
        phase=status.get("phase") or "Pending",
        node=spec.get("nodeName"),
        ip=status.get("podIP"),
        fence=pod_fence(meta),
        built=podspec.built_size(meta),
        slot_bytes=podspec.built_slot_bytes(meta),
        runner_port=podspec.runner_port_of(spec),
        autoscaling=autoscaler_view.autoscaling_meta(meta.get("labels"),
                                                     meta.get("annotations")),
        scale_fence=pod_scale_fence(meta),
        annotated=annotated_size(meta),
        cpu_request=burstable_cpu_request(pod),
        resize_refused=parse_fence_triple(
            (meta.get("annotations") or {}).get(types.ANNOTATION_RESIZE_REFUSED)),
    )


def annotated_size(meta: dict[str, Any]) -> tuple[int, int] | None:
    """(``cpus.use`` in millicores, ``memorySlots.use``) of a pod's
    ``vm.neon.tech/resources`` annotation; None when absent or malformed."""
    text = (meta.get("annotations") or {}).get(podspec.ANNOTATION_RESOURCES)
    if not isinstance(text, str):
        return None
    try:
        doc = json.loads(text)
        cpus = MilliCPU.parse(doc["cpus"]["use"])
        slots = doc["memorySlots"]["use"]
    except (ValueError, TypeError, KeyError, RecursionError, MilliCPUError):
        return None
    if not isinstance(slots, int) or isinstance(slots, bool):
        return None
    return int(cpus), slots


def runner_cpu_request(pod: dict[str, Any]) -> int | None:
    """The runner container's CPU request (millicores) in a pod's spec; None: none there,
    or not a quantity read here."""
    for c in (pod.get("spec") or {}).get("containers") or []:
        if c.get("name") != podspec.RUNNER_CONTAINER:
            continue
        cpu = ((c.get("resources") or {}).get("requests") or {}).get("cpu")
        try:
            return int(MilliCPU.parse(str(cpu))) if cpu is not None else None
        except (MilliCPUError, ValueError):
            return None
    return None


def burstable_cpu_request(pod: dict[str, Any]) -> int | None:
    """:func:`runner_cpu_request` of a pod whose recorded QoS class is Burstable (a plan
    resizes no other: ``RunnerScaling._tell_once``); None for any other pod."""
    if (pod.get("status") or {}).get("qosClass") != "Burstable":
        return None
    return runner_cpu_request(pod)


def pod_scale_fence(meta: dict[str, Any]) -> tuple[int, int, int] | None:
    """(epoch, token, seq) from a pod's ``vm.neon.tech/scale-fence`` annotation; None when
    absent or malformed."""
    return parse_fence_triple((meta.get("annotations") or {}).get(
        types.ANNOTATION_SCALE_FENCE))


def parse_fence_triple(text: object) -> tuple[int, int, int] | None:
    """(epoch, token, seq) from ``epoch,token,seq``; None when absent or malformed."""
    try:
        e, t, s = (int(v) for v in str(text).split(","))
    except (TypeError, ValueError):
        return None
    return (e, t, s)


def pod_fence(meta: dict[str, Any]) -> tuple[int, int] | None:
    """(epoch, token) from a pod's fence annotations; None when absent or malformed."""
    annotations = meta.get("annotations") or {}
    try:
        return (int(annotations[types.ANNOTATION_EPOCH]),
                int(annotations[types.ANNOTATION_TOKEN]))
    except (KeyError, TypeError, ValueError):
        return None


def create_failed_generation(vm: VirtualMachine) -> int | None:
    """The generation whose pod create was refused, as recorded in the Degraded condition."""
    for cond in vm.status.conditions:
        if cond.type == DEGRADED and cond.status == "True" and cond.reason == CREATE_REFUSED:
            return cond.observed_generation
    return None


def make_snapshot(record: VMRecord | None, pods: list[dict[str, Any]], lease: Fence,
                  direct: bool, now: dt.datetime | None = None,
                  missing_pull_secrets: tuple[str, ...] = (),
                  from_write: bool = False, vm_written: bool = False) -> Snapshot:
    vm = record.vm if record is not None else None
    views = tuple(sorted((pod_view(p) for p in pods), key=lambda v: v.name))
    obs = Observation(
        vm=vm,
        pods=views,
        lease=lease,
        direct=direct,
        create_failed_generation=create_failed_generation(vm) if vm is not None else None,
        now=now,
        missing_pull_secrets=missing_pull_secrets,
    )
    return Snapshot(obs=obs, record=record,
                    pods={(p.get("metadata") or {}).get("name", ""): p for p in pods},
                    from_write=from_write, vm_written=vm_written)


class Observer(Protocol):
    """Anything that can observe one VM (``namespace/name``) for a decision."""

    def observe(self, key: str, lease: Fence) -> Snapshot: ...


def split_key(key: str) -> tuple[str, str]:
    namespace, _, name = key.partition("/")
    return namespace, name


class DirectReader:
    """Quorum reads (``resourceVersion`` unset) of VMs and their pods, through the
    cluster interface (:class:`~neonvm.controller.cluster.ClusterReads`; the shipped one
    is :class:`~neonvm.controller.cluster.KubeCluster`, built by the caller)."""

    def __init__(self, cluster: ClusterReads, clock: Clock = utc_now) -> None:
        self.cluster = cluster
        self._clock = clock
        self._warned_secrets_forbidden = False

    def now(self) -> dt.datetime:
        """This reader's clock (what it stamps its observations with)."""
        return self._clock()

    def list_pods(self, namespace: str, vm_name: str) -> list[dict[str, Any]]:
        return self.cluster.list_pods(namespace, vm_name)

    def get_vm_raw(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.cluster.get_vm_raw(namespace, name)

    def get_vm(self, namespace: str, name: str) -> VMRecord | None:
        raw = self.get_vm_raw(namespace, name)
        return VMRecord.from_raw(raw) if raw is not None else None

    def secret_metadata(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Secret as ``PartialObjectMetadata`` (None: it does not exist).

        The controller never receives secret data, even though RBAC must grant ``get``.
        """
        return self.cluster.secret_metadata(namespace, name)

    def secret_exists(self, namespace: str, name: str) -> bool | None:
        """Whether a Secret exists; None when this identity may not look (403)."""
        try:
            return self.secret_metadata(namespace, name) is not None
        except ApiException as exc:
            if exc.status == 403:
                return None
            raise

    def missing_pull_secrets(self, vm: VirtualMachine) -> tuple[str, ...]:
        """The VM's image pull secrets that do not exist (empty when it may not look:
        without RBAC ``get`` on secrets the check is skipped, with one warning)."""
        missing: list[str] = []
        for ref in vm.spec.image_pull_secrets or []:
            name = str(ref.get("name") or "")
            if not name:
                continue
            exists = self.secret_exists(vm.namespace, name)
            if exists is None:
                if not self._warned_secrets_forbidden:
                    self._warned_secrets_forbidden = True
                    logger.warning("not allowed to get secrets: image pull secrets are not "
                                   "checked before runner pods are created")
                return ()
            if not exists:
                missing.append(name)
        return tuple(missing)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.cluster.get_pod(namespace, name)

    def with_committed(self, namespace: str, pods: list[dict[str, Any]],
                       committed: str | None, uid: str | None) -> list[dict[str, Any]]:
        """The VM's pods: ``pods`` (its labelled list) plus the committed pod, read by name
        when the list misses it and joined only if it is still that uid.

        The one rule for "which pods are the VM's", shared by :meth:`observe` and the
        driver's ungate, so that the two never disagree. A pod joined this way that is
        not labelled for the VM (:func:`labelled_for`) lost its label.
        """
        listed = {(p.get("metadata") or {}).get("name") for p in pods}
        if not committed or not uid or committed in listed:
            return pods
        pod = self.get_pod(namespace, committed)
        if pod is not None and (pod.get("metadata") or {}).get("uid") == uid:
            return [*pods, pod]
        return pods

    def observe(self, key: str, lease: Fence) -> Snapshot:
        """List the VM's pods, *then* read the VM: both quorum reads, in that order.

        The committed pod (``status.podName``) may have been created and committed between
        the list and the VM read, so its absence from the list proves nothing. When it is
        missing, it is read by name *after* the VM read: only that GET's 404 (or a pod of
        another uid) lets the decision call it gone (docs/protocol.md step 4). A pod found that way
        joins the observation only if it is the committed one (same uid).
        """
        namespace, name = split_key(key)
        pods = self.list_pods(namespace, name)
        record = self.get_vm(namespace, name)
        if record is not None:
            pods = self.with_committed(namespace, pods, record.vm.status.pod_name,
                                       record.vm.status.pod_uid)
        missing: tuple[str, ...] = ()
        if record is not None and create_due(record.vm, pods):
            missing = self.missing_pull_secrets(record.vm)
        return make_snapshot(record, pods, lease, direct=True, now=self._clock(),
                             missing_pull_secrets=missing)


def create_due(vm: VirtualMachine, pods: list[dict[str, Any]]) -> bool:
    """A plan is recorded and its pod is not listed: the one moment pull secrets matter."""
    pending = vm.status.pending_pod
    if pending is None or vm.deletion_timestamp is not None or not vm.spec.image_pull_secrets:
        return False
    return all((p.get("metadata") or {}).get("name") != pending.name for p in pods)


def labelled_for(pod: dict[str, Any], vm_name: str) -> bool:
    """The pod carries the runner label naming ``vm_name`` (label-selected lists show it)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(types.LABEL_VM_NAME) == vm_name)


def pod_index(pod: dict[str, Any]) -> str | None:
    """Index a runner pod by the ``namespace/vm`` it is labelled for."""
    meta = pod.get("metadata") or {}
    vm_name = (meta.get("labels") or {}).get(types.LABEL_VM_NAME)
    if not vm_name:
        return None
    return f"{meta.get('namespace', '')}/{vm_name}"


class CacheReader:
    """Observations from the informers' stores (``direct=False``)."""

    def __init__(self, vms: Store, pods: Store, clock: Clock = utc_now) -> None:
        self._vms = vms
        self._pods = pods
        self._clock = clock

    def vm_raw(self, key: str) -> dict[str, Any] | None:
        return self._vms.get(key)

    def pods_raw(self, key: str) -> list[dict[str, Any]]:
        return self._pods.by_index(key)

    def observe(self, key: str, lease: Fence) -> Snapshot:
        raw = self.vm_raw(key)
        record = VMRecord.from_raw(raw) if raw is not None else None
        return make_snapshot(record, self.pods_raw(key), lease, direct=False,
                             now=self._clock())
