"""List+watch caches of VirtualMachines and runner pods.

An :class:`Informer` lists a resource, then watches it from the list's resourceVersion,
keeping a :class:`Store` up to date and calling a handler for every change. It
reconnects after errors from the last resourceVersion it saw, and re-lists (diffing
against the store, so deletions missed meanwhile are reported) when the server answers
410 Gone, and also every ``relist_seconds`` if asked to (a watch that silently missed
events is healed by the next re-list). Bookmarks are requested so that quiet watches
still advance.

An object it cannot decode (JSON nested deeper than Python's decoder recurses: the API
server keeps such a spec in a field that preserves unknown fields) is *undecodable*: it is
left out of the store (as if deleted) and reported once per version (``on_undecodable``),
and the watch goes on past it; every other object of the same page or stream is cached
as usual (:func:`neonvm.kube.decode_json`). A 410 Gone answered on the watch request
itself re-lists, as one carried by an ERROR event does; a watch left before its end
closes its connection (:func:`neonvm.kube.release_stream`). docs/reconciler.md,
"Progress without events".

What the cache guarantees: nothing about freshness. It may lag the server arbitrarily
(and a wrapper composed in through :mod:`neonvm.controller.wiring` may, on purpose, make
it answer with older versions or miss updates entirely).
The controller therefore uses it only to *start* decisions and to notice changes; the
reads that guard dangerous actions are direct (see :mod:`neonvm.controller.observe`),
and VMs in the middle of a plan are requeued and re-read directly on a timer, so a lost
event never stalls one.
"""

from __future__ import annotations

import contextlib
import json
import marshal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from loguru import logger

from neonvm.api import types
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION
from neonvm.controller.autoscaler_view import synced_annotation
from neonvm.controller.podspec import ANNOTATION_BUILT_SIZE, ANNOTATION_RESOURCES, RUNNER_CONTAINER
from neonvm.controller.reasons import TOO_LARGE_KEY
from neonvm.kube import (
    LIST_PAGE_BYTES,
    PRUNE_DEPTH,
    PageTooLarge,
    decode_json,
    list_items,
    oversized_event,
    pruned,
    read_page,
    release_stream,
    short_error,
)

Obj = dict[str, Any]

MAX_CACHED_VM_BYTES = 256 * 1024
"""The largest VM (its JSON) the VM informer caches whole. The CRD admits a spec of about
1.5 MiB (etcd's request limit; ``spec.affinity`` and ``spec.extraInitContainers`` keep
unknown fields), and every replica caches every VM: a larger one is cached as a *stub*
(:func:`too_large`) and reported (docs/security.md, "Exhaustion"). NeonVM's VMs take a
few KiB."""


def too_large(obj: Obj | None) -> int | None:
    """The JSON length of the object ``obj`` is a stub of (:data:`TOO_LARGE_KEY`); None
    for a whole object. A stub's spec is not there: nothing may be decided from it
    but what its metadata and status say (the reconciler reads such a VM directly and
    leaves it alone, docs/reconciler.md, "A VM too large to cache")."""
    size = (obj or {}).get(TOO_LARGE_KEY)
    return int(size) if isinstance(size, int) else None
RELIST_PAGE_BYTES = LIST_PAGE_BYTES
"""The most raw bytes of JSON one list page may carry: a page above it is dropped unread
and asked for again with a quarter of the ``limit`` (down to one object). Each page's
``limit`` is also set from the previous page's bytes per object (at most the informer's
``relist_page``), so that few pages are dropped. The items are decoded one at a time
(:func:`neonvm.kube.list_items`) and one above ``max_object_bytes`` is not decoded at
all, so a page costs its raw text plus one decoded object whatever the JSON's shape."""
FIRST_PAGE = 16
"""The first page's ``limit``, before any object's size is known."""
OVERSIZED_REPORT_SECONDS = 60.0
"""An oversized object is reported (log line, Event) at most this often, however often
it is rewritten."""
Handler = Callable[[str, Obj | None, Obj | None], None]
"""Called with (key, old, new) for each change; new is None for a deletion."""
Lister = Callable[..., Any]
"""A kubernetes list function accepting watch/resource_version/_preload_content kwargs."""
EventFilter = Callable[[str, Obj], bool]
"""Called with (type, object) for each watch event before the store sees it; False
ignores the event entirely (the watch's resourceVersion still advances)."""


@dataclass(frozen=True)
class Undecodable:
    """An object the informer could not decode: what could be read of its metadata."""

    key: str
    """``namespace/name``."""
    metadata: Obj
    """Its ``metadata`` with every part nested too deep replaced (name, namespace, uid and
    resourceVersion are there when the server sent them)."""
    reason: str
    """One line for a log or an Event."""


UndecodableHandler = Callable[[Undecodable], None]
"""Called once per undecodable object version (relists do not repeat it)."""


def object_key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def object_uid(obj: Obj | None) -> str | None:
    """The object's ``metadata.uid``; None for no object or no uid."""
    return str(((obj or {}).get("metadata") or {}).get("uid") or "") or None


class Gone(Exception):
    """The watch's resourceVersion is too old (410): re-list."""


def _same(obj: Any) -> Any:
    return obj


class Unread:
    """:meth:`Store._set_locked`'s default: the caller has not read the stored object."""


UNREAD = Unread()


class Store:
    """Objects by ``namespace/name`` and an optional secondary index.

    Only the current version of each object is kept. Every change goes through
    :meth:`_set_locked` (under the lock), the one place a subclass may watch changes.

    ``compact=True`` (the controller's caches) keeps each object serialized
    (``marshal``: the JSON types only, and the fastest codec the standard library has)
    and hands out a fresh copy on every read. A decoded Kubernetes object takes about ten
    times its JSON size as Python dicts and strings (the benchmarks' converged VM about
    7 KiB, a pod projection about 3.5 KiB); serialized it takes about its JSON size. A
    read costs a few microseconds of decoding, and no caller can change the cache
    through what it got.
    """

    def __init__(self, index: Callable[[Obj], str | None] | None = None,
                 compact: bool = False) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._index_fn = index
        self._index: dict[str, set[str]] = {}
        self._pack: Callable[[Obj], Any] = marshal.dumps if compact else _same
        self._unpack: Callable[[Any], Obj] = marshal.loads if compact else _same

    def _load(self, stored: Any) -> Obj | None:
        return None if stored is None else self._unpack(stored)

    def get(self, key: str) -> Obj | None:
        with self._lock:
            stored = self._items.get(key)
        return self._load(stored)

    def all_keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def values(self) -> list[Obj]:
        with self._lock:
            stored = list(self._items.values())
        return [self._unpack(s) for s in stored]  # decoded outside the lock

    def by_index(self, value: str) -> list[Obj]:
        with self._lock:
            stored = [self._items[k] for k in sorted(self._index.get(value, ()))]
        return [self._unpack(s) for s in stored]

    def _index_of(self, obj: Obj | None) -> str | None:
        return self._index_fn(obj) if (self._index_fn and obj is not None) else None

    def _set_locked(self, key: str, new: Obj | None,
                    old: Obj | Unread | None = UNREAD) -> tuple[str, Obj | None, Obj | None]:
        """``old``: the stored object as the caller already decoded it (not decoded twice)."""
        if isinstance(old, Unread):
            old = self._load(self._items.get(key))
        old_index = self._index_of(old)
        if old_index is not None:
            keys = self._index.get(old_index)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[old_index]  # no empty member sets left behind
        if new is None:
            self._items.pop(key, None)
        else:
            self._items[key] = self._pack(new)
            new_index = self._index_of(new)
            if new_index is not None:
                self._index.setdefault(new_index, set()).add(key)
        return key, old, new

    def apply(self, event_type: str, obj: Obj) -> tuple[str, Obj | None, Obj | None]:
        with self._lock:
            key = object_key(obj)
            return self._set_locked(key, None if event_type == "DELETED" else obj)

    def discard(self, key: str, uid: str) -> bool:
        """Drop ``key`` if the cached object is still the one with ``uid``; True if dropped.

        For a deletion the watch missed, found by a direct read: uids are never reused,
        so a cached object with that uid can only be stale, while a re-created object of
        the same name (a new uid) that the watch has already delivered is kept.
        """
        with self._lock:
            if object_uid(self._load(self._items.get(key))) != uid:
                return False
            self._set_locked(key, None)
            return True

    def put(self, obj: Obj) -> tuple[str, Obj | None, Obj | None] | None:
        """Store ``obj`` (a re-list's item) unless the same version is there; the change,
        or None if there was none."""
        with self._lock:
            key = object_key(obj)
            old = self._load(self._items.get(key))
            if old is not None and _rv(old) == _rv(obj):
                return None
            return self._set_locked(key, obj, old)

    def drop_except(self, keep: set[str]) -> list[tuple[str, Obj | None, Obj | None]]:
        """Remove every object whose key is not in ``keep`` (a re-list's end: what it did
        not list is gone); the deletions."""
        with self._lock:
            return [self._set_locked(key, None) for key in list(self._items)
                    if key not in keep]

    def replace(self, objs: list[Obj]) -> list[tuple[str, Obj | None, Obj | None]]:
        """Replace everything with a fresh list; return the changes (deletions included)."""
        fresh = {object_key(o): o for o in objs}
        changes = []
        with self._lock:
            for key in list(self._items):
                if key not in fresh:
                    changes.append(self._set_locked(key, None))
            for key, obj in fresh.items():
                old = self._load(self._items.get(key))
                if old is None or _rv(old) != _rv(obj):
                    changes.append(self._set_locked(key, obj, old))
        return changes


def strip_managed_fields(obj: Obj) -> Obj:
    """Drop ``metadata.managedFields`` before caching (as controller-runtime's
    ``TransformStripManagedFields``): nothing the controller decides reads them, and they
    are a large share of every cached object. A PUT of an object without them keeps the
    server's copy (an omitted field list is never taken as "clear them").
    """
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


POD_ANNOTATIONS = (types.ANNOTATION_EPOCH, types.ANNOTATION_TOKEN, types.ANNOTATION_PLAN_SEQ,
                   ANNOTATION_BUILT_SIZE, RIGHT_SECONDS_ANNOTATION,
                   types.ANNOTATION_SCALE_FENCE, ANNOTATION_RESOURCES,
                   types.ANNOTATION_RESIZE_REFUSED)
"""The pod annotations the controller reads from its cache (the fence and plan, the
size the pod was built with, which a pod's commit records, the scaling plan its size
annotations carry, which a scaling plan's commit checks, the size they carry and the
plan whose resize was refused, which say whether the pod is behind the spec); the ones
kept as the VM's
(``SyncPodMetadata``: the VM's copied keys, their record and ``vm.neon.tech/overcommit``)
are kept too."""
RUNNER_PORT_NAME = "runner"
"""The runner's container port name (``acceleration.RUNNER_PORT_NAME``; a test keeps the
two equal)."""


def project_pod(pod: Obj) -> Obj:
    """The part of a runner pod the controller reads from its cache, and nothing else.

    What reads cached pods: :func:`~neonvm.controller.observe.pod_view` (name, uid,
    controller owner reference, scheduling gates, deletionTimestamp, phase, node, pod
    IP, fence and size annotations, the runner container's CPU request, the QoS class),
    ``acceleration.runner_port`` (the container port named ``runner``),
    :func:`~neonvm.controller.observe.pod_index` (namespace and the VM-name label),
    :func:`~neonvm.controller.scan.looks_mid_plan` (scheduling gates) and this module
    (namespace, name, uid, resourceVersion). Everything that acts on a pod reads it
    directly, in full. Dropped: the containers (all but the runner's named port and
    CPU request), volumes, probes, environment and the large ``vm.neon.tech/spec``
    annotation, conditions, container statuses and managedFields: a cached pod shrinks
    from kilobytes to a few hundred bytes. A field that a cached decision starts to read
    must be added here (the tests compare decisions on projected and full pods).
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    slim_meta: Obj = {k: meta[k] for k in
                      ("name", "namespace", "uid", "resourceVersion", "labels",
                       "deletionTimestamp") if meta.get(k) is not None}
    annotations = meta.get("annotations") or {}
    kept = {k: v for k, v in annotations.items()
            if k in POD_ANNOTATIONS or synced_annotation(k)}
    if ANNOTATION_RESOURCES in kept:
        kept[ANNOTATION_RESOURCES] = _uses_only(kept[ANNOTATION_RESOURCES])
        if kept[ANNOTATION_RESOURCES] is None:
            del kept[ANNOTATION_RESOURCES]
    if kept:
        slim_meta["annotations"] = kept
    owners = [{k: ref[k] for k in ("apiVersion", "kind", "name", "uid", "controller")
               if k in ref} for ref in meta.get("ownerReferences") or []]
    if owners:
        slim_meta["ownerReferences"] = owners
    slim: Obj = {"metadata": slim_meta}
    slim_spec: Obj = {k: spec[k] for k in ("schedulingGates", "nodeName") if spec.get(k)}
    # The runner's named container port (acceleration.runner_port reads it) and the
    # runner container's CPU request (observe.runner_cpu_request).
    containers = []
    for c in spec.get("containers") or []:
        kept_c: Obj = {"name": c.get("name")}
        if ports := [p for p in c.get("ports") or [] if p.get("name") == RUNNER_PORT_NAME]:
            kept_c["ports"] = ports
        cpu = ((c.get("resources") or {}).get("requests") or {}).get("cpu")
        if c.get("name") == RUNNER_CONTAINER and cpu is not None:
            kept_c["resources"] = {"requests": {"cpu": cpu}}
        if len(kept_c) > 1:
            containers.append(kept_c)
    if containers:
        slim_spec["containers"] = containers
    if slim_spec:
        slim["spec"] = slim_spec
    slim_status: Obj = {k: status[k] for k in ("phase", "podIP", "qosClass") if status.get(k)}
    # Self-fencing looks at the node of a pod that is not ready (controller/fencing.py).
    ready = [{"type": "Ready", "status": c.get("status")}
             for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    if ready:
        slim_status["conditions"] = ready
    if slim_status:
        slim["status"] = slim_status
    return slim


def _uses_only(text: object) -> str | None:
    """The resources annotation with only what is read of it (``cpus.use``,
    ``memorySlots.use``: ``observe.annotated_size``); None when it is not that JSON."""
    try:
        doc = json.loads(str(text))
        uses = {"cpus": {"use": doc["cpus"]["use"]},
                "memorySlots": {"use": doc["memorySlots"]["use"]}}
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    return json.dumps(uses, separators=(",", ":"))


def _rv(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


class Informer:
    """Keeps a :class:`Store` in step with the API server by list+watch, in a thread."""

    def __init__(self, name: str, lister: Lister, store: Store, handler: Handler,
                 *, accept: EventFilter | None = None, watch_timeout: int = 60,
                 retry_backoff: float = 0.5, max_backoff: float = 10.0,
                 on_relist: Callable[[str], None] | None = None,
                 relist_seconds: float | None = None,
                 transform: Callable[[Obj], Obj] | None = strip_managed_fields,
                 relist_page: int = 500,
                 on_undecodable: UndecodableHandler | None = None,
                 max_object_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_object_bytes``: an object whose JSON is larger is left out of the store
        and reported like an undecodable one (None: no bound; the VM informer's is
        :data:`MAX_CACHED_VM_BYTES`)."""
        self.name = name
        self._on_undecodable = on_undecodable
        self._undecodable: dict[str, str] = {}
        """Undecodable or oversized objects already reported: key to resourceVersion."""
        self._oversized_at: dict[str, float] = {}
        """Oversized objects: key to when (``clock``) it was last reported."""
        self._clock = clock
        self._relist_page = relist_page
        self._page_limit = min(relist_page, FIRST_PAGE)
        """The next list page's ``limit``: it starts small and follows the objects'
        size (:data:`RELIST_PAGE_BYTES`)."""
        self._max_object_bytes = max_object_bytes
        self._transform = transform
        self.store = store
        self._lister = lister
        self._handler = handler
        self._accept = accept
        self._watch_timeout = watch_timeout
        self._retry_backoff = retry_backoff
        self._max_backoff = max_backoff
        self._on_relist = on_relist
        self._relist_seconds = relist_seconds
        self._stop = threading.Event()
        self.synced = threading.Event()
        """Set after the first successful list."""
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._log = logger.bind(informer=name)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.name}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        resp = self._response
        if resp is not None:
            # Best effort: otherwise the thread ends at the watch's server-side timeout.
            with contextlib.suppress(Exception):
                resp.shutdown()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        rv: str | None = None
        failures = 0
        listed_at = 0.0
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                    listed_at = time.monotonic()
                    self.synced.set()
                rv = self._watch(rv)
                failures = 0
                if (self._relist_seconds is not None
                        and time.monotonic() - listed_at >= self._relist_seconds):
                    rv = None  # periodic re-list: heals missed (or dropped) events
            except Gone:
                self._log.info("watch expired (410 Gone): re-listing")
                rv = None
            except Exception as exc:  # reconnect after any failure
                if self._stop.is_set():
                    break
                failures += 1
                delay = min(self._max_backoff, self._retry_backoff * 2 ** min(failures, 6))
                self._log.warning("list/watch failed ({err}); retrying in {delay:.1f}s",
                                  err=short_error(exc), delay=delay)
                self._stop.wait(delay)

    def _relist(self) -> str:
        """List everything (paginated), replacing the store key by key; the list's
        resourceVersion.

        One page (at most ``relist_page`` items and :data:`RELIST_PAGE_BYTES` of raw
        JSON) is read at a time, and its items decoded one by one (one above
        ``max_object_bytes`` is not decoded: it is reported by its name, namespace and
        uid); each goes into the store as soon as it is transformed, so a re-list never
        holds the whole list, nor a second copy of the store, nor a whole page decoded:
        at the end, what the list did not show is removed.
        Readers meanwhile see each object either in its old or its new version. The
        handler hears of every change as it is applied.
        """
        rv = ""
        token: str | None = None
        seen: set[str] = set()
        changes = 0
        while True:
            limit = self._page_limit
            kwargs: dict[str, Any] = {"limit": limit}
            if token:
                kwargs["_continue"] = token
            try:
                resp = self._lister(_preload_content=False, _request_timeout=30, **kwargs)
            except ApiException as exc:
                if exc.status == 410:  # the continue token expired: list again
                    raise Gone() from exc
                raise
            try:
                data = read_page(resp, RELIST_PAGE_BYTES)
            finally:
                release_stream(resp)
            if data is None:  # above the byte budget: the same page, fewer objects
                if limit == 1:
                    raise PageTooLarge(f"one object's JSON is above {RELIST_PAGE_BYTES:,} bytes")
                self._page_limit = max(1, limit // 4)
                continue
            text = data.decode("utf-8")
            page_bytes = len(data)
            del data
            meta: Obj = {}
            count = 0
            for entry in list_items(text, self._max_object_bytes, meta):
                count += 1
                item = entry.obj
                item.setdefault("metadata", {})
                if entry.oversized:
                    item = self._stub(item, entry.size)
                    seen.add(object_key(item))
                    change = self.store.put(item)
                    if change is not None:
                        changes += 1
                        self._handler(*change)
                    continue
                if entry.lossy and pruned(item):
                    self._skip(item)  # as above
                    continue
                self._undecodable.pop(object_key(item), None)
                if self._transform is not None:
                    item = self._transform(item)
                seen.add(object_key(item))
                change = self.store.put(item)
                if change is not None:
                    changes += 1
                    self._handler(*change)
            del text
            if not rv:
                rv = str(meta.get("resourceVersion", ""))
            token = meta.get("continue") or None
            self._page_limit = max(1, min(self._relist_page, int(
                RELIST_PAGE_BYTES * count / max(1, page_bytes)) or 1))
            if not token:
                break
        for change in self.store.drop_except(seen):
            changes += 1
            self._handler(*change)
        self._log.debug("listed {n} objects at resourceVersion {rv} ({c} changes)",
                        n=len(seen), rv=rv, c=changes)
        if self._on_relist is not None:
            self._on_relist(self.name)
        return rv

    def _too_large(self, size: int) -> str:
        return (f"its JSON is {size:,} bytes, more than the {self._max_object_bytes:,} "
                "a cached object may take (docs/security.md, \"Exhaustion\"): cached "
                "without its spec, and left alone until it is smaller")

    def _stub(self, head: Obj, size: int) -> Obj:
        """The stub cached for an oversized object (``head``: what
        :func:`neonvm.kube.object_head` read of it), reported as :meth:`_skip` does."""
        self._skip(head, self._too_large(size), drop=False)
        return {**head, TOO_LARGE_KEY: size}

    def _skip(self, obj: Obj, why: str | None = None, drop: bool = True) -> None:
        """Leave an undecodable object out of the store (a cached older version is
        removed, and the handler told so; ``drop`` False: the caller stores a stub);
        report it once per version, an oversized one (``why``) at most once per
        :data:`OVERSIZED_REPORT_SECONDS` (its report names no resourceVersion, so that
        repeated Events aggregate)."""
        key = object_key(obj)
        meta = obj.get("metadata") or {}
        if drop and self.store.get(key) is not None:
            self._handler(*self.store.apply("DELETED", obj))
        rv = str(meta.get("resourceVersion") or "")
        if why is None:
            if self._undecodable.get(key) == rv:
                return
            self._undecodable[key] = rv
            reason = (f"{key} (uid {meta.get('uid')}, resourceVersion {rv}) is nested more "
                      f"than {PRUNE_DEPTH} levels deep and cannot be decoded: not cached, "
                      "not reconciled until it changes")
        else:
            now = self._clock()
            last = self._oversized_at.get(key)
            self._undecodable[key] = rv
            if last is not None and now - last < OVERSIZED_REPORT_SECONDS:
                return
            self._oversized_at = {k: at for k, at in self._oversized_at.items()
                                  if now - at < OVERSIZED_REPORT_SECONDS}
            self._oversized_at[key] = now
            reason = f"{key} (uid {meta.get('uid')}): {why}"
        self._log.error("{what}: {reason}", reason=reason,
                        what="skipping an object" if drop else "caching an object's head only")
        if self._on_undecodable is not None:
            self._on_undecodable(Undecodable(key, meta, reason))

    def _watch(self, rv: str) -> str:
        try:
            resp = self._lister(
                watch=True, resource_version=rv, allow_watch_bookmarks=True,
                timeout_seconds=self._watch_timeout, _preload_content=False,
                _request_timeout=(10, self._watch_timeout + 15),
            )
        except ApiException as exc:
            if exc.status == 410:  # answered on the request itself, not as an event
                raise Gone() from exc
            raise
        self._response = resp
        try:
            for event, lossy, size in _events(resp, self._max_object_bytes):
                if self._stop.is_set():
                    break
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise ApiException(status=obj.get("code") or 500,
                                       reason=str(obj.get("message")))
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = str(new_rv)
                if kind == "BOOKMARK":
                    continue
                if self._accept is not None and not self._accept(str(kind), obj):
                    continue
                if lossy and kind != "DELETED" and pruned(obj):
                    self._skip(obj)
                    continue
                if kind != "DELETED" and size:
                    self._handler(*self.store.apply(str(kind), self._stub(obj, size)))
                    continue
                if kind == "DELETED" or not lossy:
                    self._undecodable.pop(object_key(obj), None)
                if self._transform is not None:
                    obj = self._transform(obj)
                self._handler(*self.store.apply(str(kind), obj))
        except ApiException as exc:
            if exc.status == 410:
                raise Gone() from exc
            raise
        finally:
            self._response = None
            release_stream(resp)
        return rv


def _events(resp: Any, bound: int | None) -> Iterator[tuple[dict[str, Any], bool, int]]:
    """The watch's events, each with whether parts of it were dropped
    (:func:`neonvm.kube.decode_json`) and, for an object longer than ``bound``, its
    length (the event then carries only the object's head: it is not decoded,
    :func:`neonvm.kube.oversized_event`); 0 otherwise."""
    for line in iter_resp_lines(resp):
        if not line:
            continue
        if bound is not None and (head := oversized_event(line, bound)) is not None:
            yield head[0], False, head[1]
            continue
        event, lossy = decode_json(line)
        yield event, lossy, 0
