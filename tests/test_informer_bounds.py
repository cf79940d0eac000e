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

from neonvm.controller import informer as informer_module
from neonvm.controller.informer import (
    FIRST_PAGE,
    MAX_CACHED_VM_BYTES,
    OVERSIZED_REPORT_SECONDS,
    RELIST_PAGE_BYTES,
    Informer,
    Store,
    Undecodable,
    too_large,
)
from neonvm.controller.reasons import TOO_LARGE_KEY
from tests.support.watch_answer import Answer, compact

pytestmark = pytest.mark.unit


def vm(name: str, rv: str, spec_bytes: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                         "resourceVersion": rv},
            "spec": {"affinity": {"blob": "x" * spec_bytes}}}


def informer(lister: Any, found: list[Undecodable], store: Store) -> Informer:
    return Informer("virtualmachines", lister, store, lambda *a: None,
                    on_undecodable=found.append, max_object_bytes=MAX_CACHED_VM_BYTES)


def test_a_vm_above_the_bound_is_cached_as_a_stub_in_a_list_and_reported_once() -> None:
    """Its head only (identity, version, deletion, finalizers, a small status), never its
    spec; the stub says how large the VM is (``too_large``)."""
    big = vm("big", "2", MAX_CACHED_VM_BYTES)
    big["metadata"]["finalizers"] = ["vm.neon.tech/finalizer"]
    big["status"] = {"podName": "big-pod", "phase": "Running"}
    items = [vm("small", "1", 1000), big, vm("edge", "3", MAX_CACHED_VM_BYTES - 200)]

    def lister(**kw: Any) -> Answer:
        return Answer({"items": items, "metadata": {"resourceVersion": "9"}})

    found: list[Undecodable] = []
    store = Store(compact=True)
    inf = informer(lister, found, store)
    inf._relist()
    inf._relist()  # the same version again: not reported twice
    assert sorted(store.all_keys()) == ["ns/big", "ns/edge", "ns/small"]
    size = len(json.dumps(big, separators=(",", ":")))
    assert store.get("ns/big") == {
        "metadata": {"name": "big", "namespace": "ns", "uid": "u-big", "resourceVersion": "2",
                     "finalizers": ["vm.neon.tech/finalizer"]},
        "status": {"podName": "big-pod", "phase": "Running"}, TOO_LARGE_KEY: size}
    assert too_large(store.get("ns/big")) == size
    assert too_large(store.get("ns/edge")) is None
    assert [f.key for f in found] == ["ns/big"]
    assert f"its JSON is {size:,} bytes, more than the {MAX_CACHED_VM_BYTES:,}" in \
        found[0].reason
    assert found[0].metadata["uid"] == "u-big"


def test_a_cached_vm_that_grows_above_the_bound_in_a_watch_becomes_a_stub() -> None:
    """... and becomes whole again once it is smaller."""
    store = Store(compact=True)
    store.put(vm("grows", "1", 10))
    grown = {**vm("grows", "5", MAX_CACHED_VM_BYTES), "status": {"phase": "Running"}}
    changes: list[tuple[str, bool]] = []
    found: list[Undecodable] = []
    lines = [compact({"type": "MODIFIED", "object": grown}),
             compact({"type": "ADDED", "object": vm("fine", "6", 10)})]

    def lister(**kw: Any) -> Answer:
        assert kw.get("watch")
        return Answer(lines=lines)

    inf = Informer("virtualmachines", lister, store,
                   lambda k, o, n: changes.append((k, n is None)),
                   on_undecodable=found.append, max_object_bytes=MAX_CACHED_VM_BYTES)
    assert inf._watch("1") == "6"
    assert store.all_keys() == ["ns/grows", "ns/fine"]
    stub = store.get("ns/grows")
    assert stub is not None and "spec" not in stub and stub["status"] == {"phase": "Running"}
    assert too_large(stub) == len(compact(grown))
    assert changes == [("ns/grows", False), ("ns/fine", False)]
    assert [f.key for f in found] == ["ns/grows"]
    lines[:] = [compact({"type": "MODIFIED", "object": vm("grows", "7", 10)})]
    inf._watch("6")
    assert store.get("ns/grows") == vm("grows", "7", 10)


def test_list_pages_follow_the_size_of_the_objects() -> None:
    """The first page asks for a few; each next page for about RELIST_PAGE_BYTES of the
    objects seen, at most the informer's page and at least one."""
    one = len(json.dumps(vm("v-000", "1", 200_000)))
    n = 40
    calls: list[int] = []

    def lister(**kw: Any) -> Answer:
        start = int(kw.get("_continue") or 0)
        end = min(n, start + kw["limit"])
        calls.append(kw["limit"])
        return Answer({"items": [vm(f"v-{i:03}", "1", 200_000) for i in range(start, end)],
                      "metadata": {"resourceVersion": "9",
                                   **({"continue": str(end)} if end < n else {})}})

    store = Store(compact=True)
    informer(lister, [], store)._relist()
    assert len(store.all_keys()) == n
    assert calls[0] == FIRST_PAGE
    assert calls[1] == RELIST_PAGE_BYTES // (one + 2), calls
    assert sum(calls[:-1]) < n <= sum(calls)


# ---- the bytes read, not the objects counted (security review H1, L1) ---------------------


def test_a_page_above_the_byte_budget_is_asked_again_with_fewer_objects(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A page's limit comes from the page before it, so small VMs followed by large ones
    would bring a page of many large VMs: a page whose raw JSON is above the budget is
    dropped and the same page (same continue token) asked for with a quarter of the
    limit, down to one, before anything of it is decoded."""
    budget = 64 * 1024
    monkeypatch.setattr(informer_module, "RELIST_PAGE_BYTES", budget)
    items = [vm(f"a-{i:02}", "1", 100) for i in range(FIRST_PAGE)] + \
        [vm(f"b-{i:02}", "1", 30_000) for i in range(6)]
    calls: list[tuple[str | None, int]] = []

    def lister(**kw: Any) -> Answer:
        start = int(kw.get("_continue") or 0)
        end = min(len(items), start + kw["limit"])
        calls.append((kw.get("_continue"), kw["limit"]))
        return Answer({"items": items[start:end], "metadata": {
            "resourceVersion": "9", **({"continue": str(end)} if end < len(items) else {})}})

    store = Store(compact=True)
    informer(lister, [], store)._relist()
    assert sorted(store.all_keys()) == sorted(f"ns/{i['metadata']['name']}" for i in items)
    assert calls[0] == (None, FIRST_PAGE)
    second = calls[1][1]
    assert second > 2  # grown from the small VMs' size: too many of the large ones
    assert calls[2] == (str(FIRST_PAGE), max(1, second // 4)), calls
    served = [len(compact(items[int(c or 0):int(c or 0) + n])) for c, n in calls]
    for (token, limit), size, (next_token, next_limit) in zip(
            calls, served, calls[1:], strict=False):
        if size > budget:  # dropped: the same page again, a quarter of the objects
            assert (next_token, next_limit) == (token, max(1, limit // 4)), calls
        else:  # read: the next page
            assert next_token != token, calls
    assert served[-1] <= budget


class _DecodeSpy:
    """Records the length of every JSON text the decoder decodes (json.loads included)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.spans: list[int] = []
        original = json.JSONDecoder.raw_decode

        def raw_decode(decoder: json.JSONDecoder, s: str, idx: int = 0) -> Any:
            obj, end = original(decoder, s, idx)
            self.spans.append(end - idx)
            return obj, end

        monkeypatch.setattr(json.JSONDecoder, "raw_decode", raw_decode)


def dicts_vm(name: str, rv: str, dicts: int) -> dict[str, Any]:
    """A VM whose affinity is ``{"x": [{}, {}, ...]}``: 3 bytes of JSON a dict, about 24
    times more once decoded."""
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}",
                         "resourceVersion": rv},
            "spec": {"affinity": {"nodeAffinity": {"x": [{}] * dicts}}}}


def test_no_object_above_the_bound_is_decoded_in_a_list_or_a_watch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The items of a page are decoded one at a time, and one above the bound not at all
    (only its head is read: the stub's metadata fields, its status if small); in a watch, an event
    whose object is above the bound is measured on its raw line and not decoded."""
    big = dicts_vm("big", "2", MAX_CACHED_VM_BYTES // 3)
    page = {"items": [vm("small", "1", 1000), big, vm("edge", "3", 1000)],
            "metadata": {"resourceVersion": "9"}}
    grown = dicts_vm("big", "5", 2 * MAX_CACHED_VM_BYTES // 3)
    lines = [compact({"type": "MODIFIED", "object": grown}),
             compact({"type": "ADDED", "object": vm("fine", "6", 10)})]

    def lister(**kw: Any) -> Answer:
        return Answer(lines=lines) if kw.get("watch") else Answer(page)

    found: list[Undecodable] = []
    store = Store(compact=True)
    inf = informer(lister, found, store)
    spy = _DecodeSpy(monkeypatch)
    inf._relist()
    assert sorted(store.all_keys()) == ["ns/big", "ns/edge", "ns/small"]
    assert too_large(store.get("ns/big")) == len(compact(big))
    assert max(spy.spans) <= MAX_CACHED_VM_BYTES, sorted(spy.spans)[-3:]
    assert inf._watch("9") == "6"
    assert sorted(store.all_keys()) == ["ns/big", "ns/edge", "ns/fine", "ns/small"]
    assert too_large(store.get("ns/big")) == len(compact(grown))
    assert [f.key for f in found] == ["ns/big"]
    assert found[0].metadata == {"name": "big", "namespace": "ns", "uid": "u-big",
                                 "resourceVersion": "2"}
    assert max(spy.spans) <= MAX_CACHED_VM_BYTES, sorted(spy.spans)[-3:]


def test_an_oversized_vm_rewritten_is_reported_once_a_minute_with_no_resource_version() -> None:
    """Each write of an oversized VM would otherwise be a new Event (its message naming
    the new resourceVersion cannot be aggregated) and an ERROR line: it is reported at
    most once per OVERSIZED_REPORT_SECONDS, with a message that names no version."""
    now = [1000.0]
    events = [compact({"type": "MODIFIED", "object": vm("big", str(rv), MAX_CACHED_VM_BYTES)})
              for rv in range(5, 9)]

    def lister(**kw: Any) -> Answer:
        return Answer(lines=events)

    found: list[Undecodable] = []
    inf = Informer("virtualmachines", lister, Store(compact=True), lambda *a: None,
                   on_undecodable=found.append, max_object_bytes=MAX_CACHED_VM_BYTES,
                   clock=lambda: now[0])
    inf._watch("1")
    assert len(found) == 1
    assert "resourceVersion" not in found[0].reason and "5" not in found[0].reason.split(
        "its JSON")[0]
    now[0] += OVERSIZED_REPORT_SECONDS - 1
    inf._watch("8")
    assert len(found) == 1
    now[0] += 2
    inf._watch("8")
    assert len(found) == 2 and found[1].reason == found[0].reason
