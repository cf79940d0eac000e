"""The leader's sweeps: remove what no VM owns any more.

* **Locks**: the etcd lock of a VM that no longer exists (its uid is in no direct list of
  VMs) is deleted (:meth:`~neonvm.leader.lock.LockManager.sweep`; the handler releases a
  gone VM's lock itself, the sweep catches what a crash or a missed event left behind).
* **Orphan pods**: a runner pod whose VM (by the ``vm.neon.tech/uid`` label, or the VM
  owner reference) is in no direct list of VMs is deleted with a uid precondition, once
  it has been seen orphaned for ``orphan_grace_seconds`` (the garbage collector normally
  removes it first). Pods are listed before VMs, so a pod whose VM exists is never taken
  for an orphan by the later list.

Both lists are direct (quorum), paginated (``limit``/``continue``, :func:`iter_items`) and
metadata-only (``PartialObjectMetadataList``): the sweeps need names, uids, labels and
owners, never a spec or a status.

A sweep that fails (a list refused, the API server away) is logged and tried again at the
next period; it never ends the term. The term runs :meth:`Sweeps.run` every
``sweep_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.controller.metrics import ControllerMetrics
from neonvm.kube import (
    LIST_PAGE_BYTES,
    PageTooLarge,
    TooDeep,
    list_items,
    read_page,
    release_stream,
    short_error,
)
from neonvm.leader.lock import LockManager

Lister = Callable[..., Any]
"""A kubernetes client list call (``list_namespaced_pod`` and the like, keywords bound)."""
PodDeleter = Callable[[str, str, str], object]
"""Deletes a pod (namespace, name) on the precondition that its uid is still the one
given; raises ApiException (404 gone, 409 another pod by that name now)."""


PAGE = 500
"""Items per page of the sweeps' and the resync's lists (``limit``/``continue``), at
most: a page above :data:`~neonvm.kube.LIST_PAGE_BYTES` of raw JSON is asked for again
with fewer (:func:`iter_items`)."""
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
"""Accept header asking the API server for a list of the objects' metadata alone."""


def iter_items(lister: Lister, *, metadata_only: bool = False,
               limit: int = PAGE) -> Iterator[dict[str, Any]]:
    """Every item of a direct list, as plain dicts (no model objects), page by page.

    ``metadata_only`` asks for ``PartialObjectMetadataList``: each item is then just
    ``apiVersion``, ``kind`` and ``metadata`` (names, uids, labels, owners,
    resourceVersion), a fraction of a pod or a VM. The pages are one consistent snapshot
    (the API server's ``continue`` contract); a token that expired (410) ends the
    iteration with the error, and the caller's next period starts a new list.

    Memory is bounded by bytes, not by the item count: a page whose raw JSON is above
    :data:`~neonvm.kube.LIST_PAGE_BYTES` is dropped unread and the same page (same
    ``continue`` token) asked for with a quarter of the ``limit``, down to one item (each
    next page asks for what the budget holds at the last page's sizes, at most
    ``limit``); a single item above it fails the list
    (:class:`~neonvm.kube.PageTooLarge`). Items are decoded one at a time
    (:func:`neonvm.kube.list_items`), and EVERY item is decoded and yielded, however
    large: the sweeps must see every live VM's uid (a missed one would make its pods look
    orphaned), so nothing is ever skipped here (docs/security.md, "Exhaustion").

    An item nested too deep for ``json.loads`` (a VM with thousands of levels in a
    free-form field: its ``managedFields`` mirror them) is read with those levels dropped
    (:func:`neonvm.kube.decode_json`) when only metadata was asked for, since nothing but
    ``managedFields`` can nest there; a full list raises :class:`~neonvm.kube.TooDeep`.
    """
    token: str | None = None
    headers = {"Accept": METADATA_LIST} if metadata_only else None
    most = limit
    while True:
        kwargs: dict[str, Any] = {"limit": limit}
        if token:
            kwargs["_continue"] = token
        if headers is not None:
            kwargs["_headers"] = headers
        resp = lister(_preload_content=False, _request_timeout=30, **kwargs)
        try:
            data = read_page(resp, LIST_PAGE_BYTES)
        finally:
            release_stream(resp)
        if data is None:  # above the byte budget: the same page, fewer items
            if limit == 1:
                raise PageTooLarge(f"one object's JSON is above {LIST_PAGE_BYTES:,} bytes")
            limit = max(1, limit // 4)
            continue
        text = data.decode("utf-8")
        page_bytes = len(data)
        del data
        meta: dict[str, Any] = {}
        count = 0
        for entry in list_items(text, None, meta):
            count += 1
            if entry.lossy and not metadata_only:
                raise TooDeep("a list item is nested too deep to decode")
            yield entry.obj
        del text
        # The next page: as many items as the budget holds at this page's sizes.
        limit = max(1, min(most, int(LIST_PAGE_BYTES * count / max(1, page_bytes)) or 1))
        token = meta.get("continue") or None
        if not token:
            return


def live_vm_uids(list_vms: Lister) -> set[str]:
    """The uid of every VM, from a direct metadata-only list."""
    return {str((i.get("metadata") or {}).get("uid"))
            for i in iter_items(list_vms, metadata_only=True)}


class Sweeps:
    """The lock sweep and the orphan-pod sweep of one term."""

    def __init__(self, *, delete_pod: PodDeleter, list_vms: Lister, list_pods: Lister,
                 locks: Callable[[], LockManager], metrics: ControllerMetrics, log: Any,
                 orphan_grace_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._delete_pod = delete_pod
        self._list_vms = list_vms
        self._list_pods = list_pods
        self._locks = locks
        self._metrics = metrics
        self._log = log
        self._grace = orphan_grace_seconds
        self._clock = clock
        self._orphans_seen: dict[str, float] = {}
        """Pod uid -> clock time it was first seen orphaned (pods still orphaned only)."""

    def run(self) -> None:
        """Both sweeps, on one list of pods and one list of VMs; a failure is logged, and
        the next period tries again."""
        try:
            # Pods first; then the lock sweep reads the locks and only then lists the VMs
            # (its rule); the orphan sweep reuses that VM list, which is still later than
            # its pod list (its rule). One VM list per run instead of two.
            pods = self._pod_candidates()
            listed: list[set[str]] = []

            def vm_uids() -> set[str]:
                if not listed:
                    listed.append(live_vm_uids(self._list_vms))
                return listed[0]

            swept = self._locks().sweep(vm_uids)
            if swept:
                self._metrics.swept.labels(kind="lock").inc(len(swept))
            self._delete_orphans(pods, vm_uids())
        except Exception as exc:
            self._log.warning("sweep failed: {err}", err=short_error(exc))

    def orphan_pods(self) -> None:
        """Delete runner pods whose VM is gone, after the grace period."""
        # Pods first, then VMs: a pod whose VM exists is never missed by the later list.
        pods = self._pod_candidates()
        self._delete_orphans(pods, live_vm_uids(self._list_vms))

    def _pod_candidates(self) -> list[tuple[str, str, str, str]]:
        # Each page is cut down to the few fields the sweep reads as it arrives: a
        # metadata-only pod still carries its managedFields (docs/benchmarks.md), so
        # holding the whole list would be the largest allocation the leader makes.
        return [candidate for item in iter_items(self._list_pods, metadata_only=True)
                if (candidate := _orphan_candidate(item)) is not None]

    def _delete_orphans(self, pods: list[tuple[str, str, str, str]], uids: set[str]) -> None:
        now = self._clock()
        seen: dict[str, float] = {}
        for namespace, name, pod_uid, owner in pods:
            if owner in uids:
                continue
            first = self._orphans_seen.get(pod_uid, now)
            seen[pod_uid] = first
            if now - first < self._grace:
                continue
            try:
                self._delete_pod(namespace, name, pod_uid)
            except ApiException as exc:
                if exc.status not in (404, 409):
                    raise
                continue
            self._metrics.swept.labels(kind="pod").inc()
            self._log.bind(vm=f"{namespace}/{owner}").info(
                "deleted runner pod {pod}: its VM no longer exists", pod=name)
        self._orphans_seen = seen


def _orphan_candidate(item: dict[str, Any]) -> tuple[str, str, str, str] | None:
    """``(namespace, name, uid, owner VM uid)`` of a listed runner pod that is not being
    deleted; None for a pod with no owner or one already going."""
    meta = item.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(types.LABEL_VM_UID) or next(
        (r.get("uid") for r in meta.get("ownerReferences") or []
         if r.get("kind") == types.KIND), None)
    if owner is None or meta.get("deletionTimestamp"):
        return None
    return str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid")), str(owner)
