"""A tenant's large VMs cannot exhaust a replica's memory through its caches (issue 28,
"Exhaustion"; docs/security.md). The CRD admits about 1.5 MiB per spec and every replica
caches every VM: a VM whose JSON is above the VM informer's bound is left out of the
cache and reported (like an undecodable one), in a list and in a watch; and list pages
follow the objects' size, so a page of large VMs is never decoded 500 at a time.
``benchmarks/bench_vm_cache.py`` measures the resident memory (docs/benchmarks.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from neonvm.controller.informer import (
    FIRST_PAGE,
    MAX_CACHED_VM_BYTES,
    RELIST_PAGE_BYTES,
    Informer,
    Store,
    Undecodable,
)

pytestmark = pytest.mark.unit


class _Resp:
    def __init__(self, body: dict[str, Any] | None = None, lines: list[str] = ()) -> None:
        self.data = json.dumps(body).encode() if body is not None else b""
        self.lines = lines

    def stream(self, *_: Any, **__: Any) -> Any:
        yield "\n".join(self.lines).encode() + b"\n"

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


def vm(name: str, rv: str, spec_bytes: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                         "resourceVersion": rv},
            "spec": {"affinity": {"blob": "x" * spec_bytes}}}


def informer(lister: Any, found: list[Undecodable], store: Store) -> Informer:
    return Informer("virtualmachines", lister, store, lambda *a: None,
                    on_undecodable=found.append, max_object_bytes=MAX_CACHED_VM_BYTES)


def test_a_vm_above_the_bound_is_left_out_of_a_list_and_reported_once() -> None:
    big = vm("big", "2", MAX_CACHED_VM_BYTES)
    items = [vm("small", "1", 1000), big, vm("edge", "3", MAX_CACHED_VM_BYTES - 200)]

    def lister(**kw: Any) -> _Resp:
        return _Resp({"items": items, "metadata": {"resourceVersion": "9"}})

    found: list[Undecodable] = []
    store = Store(compact=True)
    inf = informer(lister, found, store)
    inf._relist()
    inf._relist()  # the same version again: not reported twice
    assert sorted(store.all_keys()) == ["ns/edge", "ns/small"]
    assert [f.key for f in found] == ["ns/big"]
    size = len(json.dumps(big, separators=(",", ":")))
    assert f"its JSON is {size:,} bytes, more than the {MAX_CACHED_VM_BYTES:,}" in \
        found[0].reason
    assert found[0].metadata["uid"] == "u-big"


def test_a_cached_vm_that_grows_above_the_bound_in_a_watch_is_dropped() -> None:
    store = Store(compact=True)
    store.put(vm("grows", "1", 10))
    grown = vm("grows", "5", MAX_CACHED_VM_BYTES)
    changes: list[tuple[str, bool]] = []
    found: list[Undecodable] = []

    def lister(**kw: Any) -> _Resp:
        assert kw.get("watch")
        return _Resp(lines=[json.dumps({"type": "MODIFIED", "object": grown}),
                            json.dumps({"type": "ADDED", "object": vm("fine", "6", 10)})])

    inf = Informer("virtualmachines", lister, store,
                   lambda k, o, n: changes.append((k, n is None)),
                   on_undecodable=found.append, max_object_bytes=MAX_CACHED_VM_BYTES)
    assert inf._watch("1") == "6"
    assert store.all_keys() == ["ns/fine"]
    assert changes == [("ns/grows", True), ("ns/fine", False)]
    assert [f.key for f in found] == ["ns/grows"]


def test_list_pages_follow_the_size_of_the_objects() -> None:
    """The first page asks for a few; each next page for about RELIST_PAGE_BYTES of the
    objects seen, at most the informer's page and at least one."""
    one = len(json.dumps(vm("v-000", "1", 200_000)))
    n = 40
    calls: list[int] = []

    def lister(**kw: Any) -> _Resp:
        start = int(kw.get("_continue") or 0)
        end = min(n, start + kw["limit"])
        calls.append(kw["limit"])
        return _Resp({"items": [vm(f"v-{i:03}", "1", 200_000) for i in range(start, end)],
                      "metadata": {"resourceVersion": "9",
                                   **({"continue": str(end)} if end < n else {})}})

    store = Store(compact=True)
    informer(lister, [], store)._relist()
    assert len(store.all_keys()) == n
    assert calls[0] == FIRST_PAGE
    assert calls[1] == RELIST_PAGE_BYTES // (one + 2), calls
    assert sum(calls[:-1]) < n <= sum(calls)
