"""Fault injection as wrappers around the production parts, composed in one place.

:class:`FaultWiring` is a :class:`~neonvm.controller.wiring.Wiring` (how a leader term
builds its parts) that wraps the parts each enabled knob of :mod:`neonvm.controller.faults`
needs, and only those. The command line picks it with :func:`wiring_for` when a knob is
on; with no fault the process is built from the plain parts, so "off" means "not there".
The production classes know nothing of it. Each knob owns its machinery:

* ``stale_reads``: :class:`VersionedStore` (a cache store that also keeps the last
  versions of each object and of each index value) and :class:`FaultyCacheReader` (the
  cache reader that sometimes answers from them);
* ``drop_watch_events``: an informer event filter;
* ``conflict``: :class:`FaultyWriter`, which bumps the VM (:func:`bump_resource_version`)
  before handing each write to the real writer;
* ``crash_after``: the reconciler's after-step hook, calling :meth:`Faults.after` for
  every step that took effect.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from kubernetes import client
from loguru import logger

from neonvm import kube
from neonvm.api.types import VirtualMachineStatus
from neonvm.controller.cluster import VMRecord, vm_path
from neonvm.controller.faults import FaultConfig, Faults
from neonvm.controller.informer import UNREAD, EventFilter, Obj, Store, Unread, object_key
from neonvm.controller.observe import CacheReader, Observer
from neonvm.controller.step import StepHook, Writer
from neonvm.controller.wiring import Wiring

HISTORY = 5
"""Versions kept per object (and per index value) to serve stale reads from."""
FAULT_BUMP_ANNOTATION = "vm.neon.tech/fault-bump"
"""Annotation the conflict fault writes to bump a VM's resourceVersion."""


class VersionedStore(Store):
    """A :class:`Store` that also keeps, for stale reads, the last ``depth`` versions of
    each object (None: it did not exist then) and the last ``depth`` member lists of
    each index value, recorded just before each change."""

    def __init__(self, index: Callable[[Obj], str | None] | None = None,
                 depth: int = HISTORY) -> None:
        super().__init__(index=index)
        self._depth = depth
        self._history: dict[str, deque[Obj | None]] = {}
        self._index_history: dict[str, deque[list[Obj]]] = {}

    def older(self, key: str) -> list[Obj | None]:
        """Earlier versions of ``key`` (None: it did not exist then), oldest first."""
        with self._lock:
            return list(self._history.get(key, ()))

    def older_index(self, value: str) -> list[list[Obj]]:
        """Earlier member lists of the index value, oldest first."""
        with self._lock:
            return [list(v) for v in self._index_history.get(value, ())]

    def _set_locked(self, key: str, new: Obj | None,
                    old: Obj | Unread | None = UNREAD) -> tuple[str, Obj | None, Obj | None]:
        old = self._items.get(key)  # this store is never compact: what it holds is the object
        self._history.setdefault(key, deque(maxlen=self._depth)).append(old)
        touched = {i for i in (self._index_of(old), self._index_of(new)) if i is not None}
        for value in touched:
            members = [self._items[k] for k in sorted(self._index.get(value, ()))]
            self._index_history.setdefault(value, deque(maxlen=self._depth)).append(members)
        return super()._set_locked(key, new, old)


class FaultyCacheReader(CacheReader):
    """The cache reader, answering with probability ``stale_reads`` from an older version
    of the VM or of its pod list (one of those its :class:`VersionedStore` kept)."""

    def __init__(self, vms: VersionedStore, pods: VersionedStore, faults: Faults) -> None:
        super().__init__(vms, pods)
        self._versioned_vms, self._versioned_pods = vms, pods
        self._faults = faults

    def vm_raw(self, key: str) -> dict[str, Any] | None:
        raw = super().vm_raw(key)
        if self._faults.serve_stale():
            older = self._versioned_vms.older(key)
            if older:
                raw = older[self._faults.pick(len(older))]
        return raw

    def pods_raw(self, key: str) -> list[dict[str, Any]]:
        pods = super().pods_raw(key)
        if self._faults.serve_stale():
            older = self._versioned_pods.older_index(key)
            if older:
                pods = older[self._faults.pick(len(older))]
        return pods


def bump_resource_version(api: client.ApiClient, record: VMRecord) -> None:
    """Change the VM's resourceVersion without touching spec or status (an annotation):
    what another writer racing ours looks like."""
    vm = record.vm
    # A raw merge patch: the replica loads no generated API class (see neonvm.kube).
    kube.request(api, "PATCH", vm_path(vm.namespace, vm.name),
                 body={"metadata": {"annotations": {
                     FAULT_BUMP_ANNOTATION: uuid.uuid4().hex[:8]}}},
                 content_type="application/merge-patch+json")


class FaultyWriter:
    """A :class:`~neonvm.controller.step.Writer` in front of the real one: with
    probability ``conflict`` it bumps the VM just before a write, so the write gets 409."""

    def __init__(self, inner: Writer, api: client.ApiClient, faults: Faults) -> None:
        self._inner = inner
        self._api = api
        self._faults = faults

    def _maybe_bump(self, record: VMRecord) -> None:
        if self._faults.inject_conflict():
            bump_resource_version(self._api, record)
            logger.bind(vm=record.vm.key).debug(
                "fault injection: bumped resourceVersion before a write")

    def put_status(self, record: VMRecord, status: VirtualMachineStatus) -> VMRecord:
        self._maybe_bump(record)
        return self._inner.put_status(record, status)

    def put_main(self, record: VMRecord, finalizers: list[str]) -> VMRecord:
        self._maybe_bump(record)
        return self._inner.put_main(record, finalizers)


class FaultWiring(Wiring):
    """The production parts with the wrappers of every knob that is on (and only those)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def store(self, index: Callable[[Obj], str | None] | None = None) -> Store:
        if self.faults.config.stale_reads > 0:
            return VersionedStore(index=index)
        return super().store(index)

    def event_filter(self, informer: str) -> EventFilter | None:
        if self.faults.config.drop_watch_events <= 0:
            return None
        log = logger.bind(informer=informer)

        def accept(kind: str, obj: Obj) -> bool:
            if self.faults.drop_event():
                log.debug("fault injection: dropped {kind} of {key}", kind=kind,
                          key=object_key(obj))
                return False
            return True
        return accept

    def observer(self, vms: Store, pods: Store) -> Observer:
        if (self.faults.config.stale_reads > 0 and isinstance(vms, VersionedStore)
                and isinstance(pods, VersionedStore)):
            return FaultyCacheReader(vms, pods, self.faults)
        return super().observer(vms, pods)

    def writer(self, api: client.ApiClient) -> Writer:
        inner = super().writer(api)
        if self.faults.config.conflict > 0:
            return FaultyWriter(inner, api, self.faults)
        return inner

    def after_step(self) -> StepHook | None:
        if not self.faults.config.crash_after:
            return None
        faults = self.faults

        def crash_after(key: str, step: str, outcome: str) -> None:
            if outcome == "done":
                faults.after(step, key)
        return crash_after


def wiring_for(config: FaultConfig) -> Wiring:
    """The plain :class:`Wiring` when no fault is on, else :class:`FaultWiring`."""
    if not config.enabled:
        return Wiring()
    return FaultWiring(Faults(config))
