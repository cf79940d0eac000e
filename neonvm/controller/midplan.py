"""The mid-plan scan's set of VMs, kept from the informers' changes.

Every ``--plan-requeue`` seconds the leader requeues each cached VM that
:func:`~neonvm.controller.scan.looks_mid_plan` (docs/reconciler.md, "Progress without
events"). Deciding that for the whole cache at every scan decoded every cached VM and its
pods every two seconds, a large share of the leader's CPU at scale, under the GIL its
workers share (docs/benchmarks.md, "At scale"). :class:`MidPlanSet` decides it again only
for the VMs whose cached copy, or one of whose cached pods, changed since the last scan.

Guarantees:

* a scan answers exactly what :func:`~neonvm.controller.scan.mid_plan_keys` would
  answer over the caches, for every VM whose change was reported with :meth:`touch`
  before the scan began;
* a VM that left the cache without a report (``Store.discard``, the handler's eviction of
  a VM whose uid changed) leaves the set at the next scan;
* every ``full_every``-th scan (and the first) decides again for every cached VM, so a
  change that reached the cache without a report is caught up within that many scans.

Not guaranteed: anything about a change reported while a scan runs; the next scan has
it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from neonvm.controller.scan import looks_mid_plan

Obj = dict[str, Any]


class Cache(Protocol):
    def get(self, key: str) -> Obj | None: ...

    def all_keys(self) -> list[str]: ...


class MidPlanSet:
    """VM keys that look mid-plan, decided again only for the VMs that changed."""

    def __init__(self, vms: Cache, pods_of: Callable[[str], Iterable[Obj]], *,
                 full_every: int = 15) -> None:
        self._vms = vms
        self._pods_of = pods_of
        self._full_every = max(1, full_every)
        self._scans = 0
        self._mutex = threading.Lock()
        self._changed: set[str] = set()
        self._mid: set[str] = set()

    def touch(self, key: str) -> None:
        """The cached VM ``key`` or one of its cached pods changed (informer threads)."""
        with self._mutex:
            self._changed.add(key)

    def scan(self) -> list[str]:
        """The VMs that look mid-plan now (one caller at a time: the housekeeping)."""
        with self._mutex:
            changed, self._changed = self._changed, set()
        present = set(self._vms.all_keys())
        # A VM can leave the cache without a report (the handler evicts one whose uid
        # changed): keys are cheap to compare, objects are not decoded for it.
        self._mid &= present
        if self._scans % self._full_every == 0:
            changed |= present
        self._scans += 1
        for key in changed:
            raw = self._vms.get(key)
            if raw is not None and looks_mid_plan(raw, self._pods_of(key)):
                self._mid.add(key)
            else:
                self._mid.discard(key)
        return sorted(self._mid)
