"""The term's resync: which VMs a metadata-only list of the VMs and pods shows to differ
from the caches (docs/reconciler.md, "Progress without events")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from neonvm.api import types
from neonvm.controller.informer import Obj


def pod_vm_key(meta: dict[str, Any], key: str) -> str | None:
    """The VM key a runner pod belongs to (its VM-name label), or None."""
    vm_name = (meta.get("labels") or {}).get(types.LABEL_VM_NAME)
    return f"{meta.get('namespace', '')}/{vm_name}" if vm_name else None


def differing(listed: Iterable[Obj], store: Any,
               owner: Callable[[dict[str, Any], str], str | None]) -> set[str]:
    """VM keys (``owner(metadata, key)``) of the listed objects whose uid or
    resourceVersion differ from the store's, of the listed objects the store lacks, and
    of the stored objects the list lacks."""
    unseen = set(store.all_keys())
    keys: set[str] = set()
    for item in listed:
        meta = item.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        unseen.discard(key)
        cached = store.get(key)
        cached_meta = (cached or {}).get("metadata") or {}
        if (cached is None or cached_meta.get("uid") != meta.get("uid")
                or cached_meta.get("resourceVersion") != meta.get("resourceVersion")):
            vm_key = owner(meta, key)
            if vm_key:
                keys.add(vm_key)
            if cached is not None:
                old_key = owner(cached_meta, key)
                if old_key:
                    keys.add(old_key)
    for key in unseen:
        cached = store.get(key)
        if cached is not None:
            vm_key = owner(cached.get("metadata") or {}, key)
            if vm_key:
                keys.add(vm_key)
    return keys
