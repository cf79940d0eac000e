"""Events off the critical path, against the real API server: written by a background
thread from a bounded queue, repeats folded into one Event (count bumped), the queue
flushed on close, and a full queue dropping (and counting) rather than blocking."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kubernetes import client

from neonvm.api.types import VirtualMachine, VirtualMachineSpec, VirtualMachineStatus
from neonvm.controller.events import AGGREGATE_SECONDS, EventRecorder, PendingEvent
from neonvm.controller.metrics import ControllerMetrics

pytestmark = pytest.mark.cluster


def a_vm(namespace: str, name: str = "vm") -> VirtualMachine:
    return VirtualMachine(name=name, namespace=namespace, uid=f"uid-{name}",
                          resource_version="1", generation=1, spec=VirtualMachineSpec(),
                          status=VirtualMachineStatus())


def events_of(api: client.ApiClient, namespace: str, name: str) -> list[Any]:
    return list(client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items)


def test_repeats_become_one_event_with_a_count_and_close_flushes_the_queue(
        api: client.ApiClient, namespace: str) -> None:
    metrics = ControllerMetrics()
    recorder = EventRecorder(api, "test", background=True,
                             dropped=metrics.events_dropped,
                             aggregated=metrics.events_aggregated)
    vm = a_vm(namespace)
    for _ in range(3):
        recorder.record(vm, "CreateRefused", "refused: quota", warning=True)
    recorder.record(vm, "CreateRefused", "refused: something else", warning=True)
    recorder.record(vm, "Created", "runner pod x created (gated)")
    recorder.close()  # graceful shutdown: what is queued is written first
    events = events_of(api, namespace, "vm")
    seen = sorted((e.reason, e.message, e.type, e.count) for e in events)
    assert seen == [
        ("CreateRefused", "refused: quota", "Warning", 3),
        ("CreateRefused", "refused: something else", "Warning", 1),
        ("Created", "runner pod x created (gated)", "Normal", 1),
    ], seen
    quota = next(e for e in events if e.message == "refused: quota")
    assert quota.last_timestamp >= quota.first_timestamp
    assert metrics.events_aggregated._value.get() == 2
    assert metrics.events_dropped._value.get() == 0


def test_an_aggregated_event_deleted_meanwhile_is_created_again(
        api: client.ApiClient, namespace: str) -> None:
    recorder = EventRecorder(api, "test")  # synchronous: written in the caller's thread
    vm = a_vm(namespace, "again")
    recorder.record(vm, "Deleted", "runner pod y: gone")
    (first,) = events_of(api, namespace, "again")
    client.CoreV1Api(api).delete_namespaced_event(first.metadata.name, namespace)
    recorder.record(vm, "Deleted", "runner pod y: gone")
    (second,) = events_of(api, namespace, "again")
    assert second.metadata.name != first.metadata.name and second.count == 1


def test_events_that_can_no_longer_aggregate_are_forgotten_at_the_next_write(
        api: client.ApiClient, namespace: str) -> None:
    """Churn names a new pod in every message: what can no longer be bumped is dropped,
    not kept until the count bound (the soak's leader memory, docs/benchmarks.md)."""
    now = [0.0]
    recorder = EventRecorder(api, "test", clock=lambda: now[0])
    for i in range(3):
        recorder.record(a_vm(namespace, f"old-{i}"), "Created", f"runner pod old-{i} created")
    now[0] = AGGREGATE_SECONDS / 2
    fresh = a_vm(namespace, "fresh")
    recorder.record(fresh, "Created", "runner pod fresh-a created")
    assert recorder.remembered() == 4
    now[0] = AGGREGATE_SECONDS + 1  # the three old ones are past the window, fresh is not
    recorder.record(fresh, "Created", "runner pod fresh-a created")
    assert recorder.remembered() == 1
    (bumped,) = events_of(api, namespace, "fresh")
    assert bumped.count == 2


def test_a_full_queue_drops_and_counts_instead_of_blocking_the_worker(
        api: client.ApiClient, namespace: str) -> None:
    metrics = ControllerMetrics()
    recorder = EventRecorder(api, "test", background=True, queue_size=1,
                             dropped=metrics.events_dropped)
    writing = threading.Event()
    release = threading.Event()
    real_write = recorder.write

    def slow_write(event: PendingEvent) -> None:
        writing.set()
        release.wait(30)  # an API server that answers slowly
        real_write(event)

    recorder.write = slow_write  # type: ignore[method-assign]
    vm = a_vm(namespace, "busy")
    recorder.record(vm, "Planned", "one")
    assert writing.wait(10)
    recorder.record(vm, "Planned", "two")  # waits in the queue
    recorder.record(vm, "Planned", "three")  # no room: dropped, and record returns
    assert metrics.events_dropped._value.get() == 1
    release.set()
    recorder.close()
    assert sorted(e.message for e in events_of(api, namespace, "busy")) == ["one", "two"]
