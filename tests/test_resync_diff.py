"""The resync's comparison of metadata-only lists with the caches (pure logic; the same
against real servers is tests/test_resync.py)."""

from __future__ import annotations

from typing import Any

import pytest

from neonvm.api import types
from neonvm.controller.informer import Store
from neonvm.controller.resync import differing as _differing
from neonvm.controller.resync import pod_vm_key as _pod_vm_key

pytestmark = pytest.mark.unit


def meta(name: str, rv: str, uid: str | None = None, vm: str | None = None) -> dict[str, Any]:
    m: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid or f"u-{name}",
                         "resourceVersion": rv}
    if vm:
        m["labels"] = {types.LABEL_VM_NAME: vm}
    return {"metadata": m}


def test_only_vms_that_differ_from_the_cache_are_found() -> None:
    store = Store()
    for obj in (meta("same", "1"), meta("stale", "1"), meta("recreated", "1"),
                meta("deleted", "1")):
        store.put(obj)
    listed = [meta("same", "1"), meta("stale", "2"), meta("recreated", "1", uid="new"),
              meta("added", "3")]
    assert _differing(listed, store, lambda m, key: key) == {
        "ns/stale", "ns/recreated", "ns/added", "ns/deleted"}


def test_pods_that_differ_name_their_vm() -> None:
    store = Store()
    store.put(meta("p1", "1", vm="a"))
    store.put(meta("p2", "1", vm="b"))
    store.put(meta("p3", "1", vm="c"))
    listed = [meta("p1", "1", vm="a"), meta("p2", "9", vm="b"), meta("p4", "1", vm="d"),
              meta("unlabelled", "1")]
    assert _differing(listed, store, _pod_vm_key) == {"ns/b", "ns/c", "ns/d"}
