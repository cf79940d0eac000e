"""A finished leader term is freed when it ends: nothing the process keeps holds on to
it, and its memory does not wait for the cyclic collector.

A replica that loses its Lease and leads again builds a new
:class:`~neonvm.controller.manager.LeaderTerm` (informers and their caches, the work
queue, the reconciler, the handler, the sweeps). The finished one must be gone before
that, or an in-process term change holds two fleets' worth of term memory at once
(docs/reconciler.md, "What a leader term guarantees"). Here a whole
:class:`~neonvm.controller.manager.ControllerProcess`, composed as ``neonvm controller
run`` composes it (its health server and rights server, the metrics registry both
serve), leads against the real API server and etcd, has its Lease deleted under it
(deposed, as by another holder), leads again under a new epoch, and the first term and
its big parts are checked with weak references, with the automatic collector off, at
the moment the second term has started. The collection runs when the next term starts,
before it builds anything; none runs after a term ends, so no Lease's release and no
exit waits on it.
"""

from __future__ import annotations

import gc
import http.client
import json
import threading
import time
import types as pytypes
import urllib.error
import urllib.request
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from neonvm.controller import manager
from neonvm.controller.config import ControllerConfig
from neonvm.controller.manager import INFORMER_END_GRACE, ControllerProcess, LeaderTerm
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.rights import RightsServer, RightsService, TokenCache, api_mark_pod
from neonvm.dev.cluster import LocalCluster
from neonvm.leader.election import ElectionConfig, Leadership
from neonvm.leader.health import HealthServer
from tests.support import wait_for
from tests.support.harness import create_vm

VMS = ("a", "b", "c")
LEASE = "term-release"


@dataclass
class Replica:
    """One replica in this process, with what ``neonvm controller run`` puts around it."""

    process: ControllerProcess
    health: HealthServer
    rights: RightsServer

    def term(self, not_epoch: int | None = None) -> LeaderTerm | None:
        """The leading term once its caches hold every VM and a pod of each (not the
        term of epoch ``not_epoch``)."""
        term = self.process.term
        if term is None or term.leadership.epoch == not_epoch:
            return None
        caches = term.synced_caches()
        if caches is None:
            return None
        vms, pods = caches
        if len(vms.all_keys()) < len(VMS) or len(pods.all_keys()) < len(VMS):
            return None
        return term

    def scrape(self) -> None:
        """What a kubelet and Prometheus ask: /readyz and /metrics (they read the term)."""
        for path in ("/readyz", "/metrics"):
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.health.port}{path}", timeout=10) as resp:
                    resp.read()
            except urllib.error.HTTPError as err:
                err.read()

    def ask_right(self, namespace: str, pod_uid: str) -> int:
        """One ask for VM ``a``'s pod, answered from the term's caches: found there, and
        refused as a pod that does not self-fence (403; 503 if no term answered)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.rights.port, timeout=10)
        try:
            conn.request("POST", "/v1/rights", json.dumps(
                {"namespace": namespace, "vm": "a", "podUID": pod_uid}),
                {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()


@pytest.fixture
def replica(cluster: LocalCluster, controller_api: client.ApiClient,
            namespace: str) -> Iterator[Replica]:
    metrics = ControllerMetrics()
    process = ControllerProcess(
        controller_api, cluster.locks_etcd_config(f"/t-{uuid.uuid4().hex[:8]}"),
        ElectionConfig(namespace=namespace, name=LEASE, lease_duration=4,
                       renew_deadline=2.5, retry_period=0.5),
        ControllerConfig(workers=2, watch_namespace=namespace), metrics=metrics)
    health = HealthServer(0, metrics.registry, host="127.0.0.1")
    process.register_health(health)
    rights = RightsServer(RightsService(process.rights, process.rights_caches,
                                        TokenCache(controller_api),
                                        api_mark_pod(controller_api, process.term_epoch),
                                        registry=metrics.registry),
                          "127.0.0.1", 0, workers=2)
    health.start()
    rights.start()
    stop = threading.Event()
    runner = threading.Thread(target=process.run, args=(stop,), daemon=True)
    runner.start()
    try:
        yield Replica(process, health, rights)
    finally:
        stop.set()
        runner.join(30)
        rights.stop()
        health.stop()


def holders(obj: object, depth: int = 4) -> str:
    """Who refers to ``obj``, ``depth`` levels up (frames of this test and the lists
    made here left out): the diagnosis a failure prints."""
    lines: list[str] = []
    own = {id(lines)}
    seen: set[int] = set()

    def describe(x: object) -> str:
        if isinstance(x, dict):
            return f"dict(keys {sorted(map(str, x))[:6]})"
        if isinstance(x, pytypes.MethodType):
            return f"bound method {x.__func__.__qualname__}"
        if isinstance(x, pytypes.FunctionType):
            return f"function {x.__qualname__}"
        if isinstance(x, pytypes.CellType):
            return "closure cell"
        return type(x).__qualname__

    def walk(x: object, level: int, stack: list[int]) -> None:
        if level == depth:
            return
        stack.append(id(x))
        referrers = [r for r in gc.get_referrers(x)
                     if id(r) not in own and id(r) not in stack
                     and not isinstance(r, pytypes.FrameType)][:8]
        own.add(id(referrers))
        for r in referrers:
            lines.append("  " * level + "<- " + describe(r))
            if id(r) not in seen:
                seen.add(id(r))
                walk(r, level + 1, stack)
        stack.pop()

    walk(obj, 0, [])
    return "\n".join(lines) or "(no referrers outside this test)"


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    """The cyclic collector runs only when called: what frees a finished term is then
    the code's own doing, not a collection that happened to run."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def leading(replica: Replica, not_epoch: int | None = None) -> LeaderTerm:
    term = wait_for(lambda: replica.term(not_epoch), 60,
                    what="a term (of a new epoch) with every VM and a pod of each cached")
    assert term is not None
    return term


def started(replica: Replica, not_epoch: int) -> LeaderTerm:
    """The process's term once one of another epoch than ``not_epoch`` has started."""

    def new_term() -> LeaderTerm | None:
        term = replica.process.term
        return term if term is not None and term.leadership.epoch != not_epoch else None

    term = wait_for(new_term, 60, 0.01, what="a term of a new epoch started")
    assert term is not None
    return term


@pytest.mark.cluster
def test_a_term_lost_with_its_lease_is_freed_before_the_next_term_leads(
        api: client.ApiClient, namespace: str, replica: Replica,
        no_automatic_collection: None) -> None:
    for name in VMS:
        create_vm(api, namespace, name)
    first = leading(replica)
    epoch = first.leadership.epoch
    pod = first.pod_store.by_index(f"{namespace}/a")[0]
    # Everything a term hands out while it leads: probes, metrics, a rights ask.
    replica.scrape()
    assert replica.ask_right(namespace, pod["metadata"]["uid"]) == 403
    parts: dict[str, weakref.ref[Any]] = {
        "the term": weakref.ref(first), "its VM cache": weakref.ref(first.vm_store),
        "its pod cache": weakref.ref(first.pod_store),
        "its reconciler": weakref.ref(first.reconciler),
        "its work queue": weakref.ref(first.queue), "its handler": weakref.ref(first.handler),
        **{f"its {i.name} informer": weakref.ref(i) for i in first.informers}}
    del first, pod

    client.CoordinationV1Api(api).delete_namespaced_lease(LEASE, namespace)  # deposed
    second = started(replica, not_epoch=epoch)
    # The second term has just started: the first must be freed already (the collection
    # runs before the second is built, so not alongside its lists).
    left_by_its_end = [name for name, ref in parts.items() if ref() is not None]
    assert second.leadership.epoch > epoch
    del second
    leading(replica, not_epoch=epoch)
    replica.scrape()

    gc.collect()
    held = [name for name, ref in parts.items() if ref() is not None]
    term = parts["the term"]()
    assert not held, (f"still reachable while the next term leads: {', '.join(held)}\n"
                      + (holders(term) if term is not None else ""))
    assert not left_by_its_end, (
        "freed late: only a full collection freed the finished term's "
        f"{', '.join(left_by_its_end)} (cyclic garbage left to the collector)")


# ---- when the collection runs --------------------------------------------------------------


class Recorded:
    """A :class:`ControllerProcess` whose terms are fakes, recording in :attr:`events`
    what runs in its ``on_started`` (collections, informer waits, terms built and run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        self.terms: list[Any] = []  # each fake term stays alive: its informers can be waited
        self.stop = threading.Event()
        self.ends = "deposed"
        self.process = ControllerProcess.__new__(ControllerProcess)  # no cluster behind it
        self.process._stop = self.stop
        self.process._term = None
        self.process._finished = None
        recorded = self

        class Term:
            def __init__(self, _process: ControllerProcess, leadership: Leadership) -> None:
                self.leadership = leadership
                self.epoch = leadership.epoch
                recorded.terms.append(self)
                recorded.events.append(f"term {self.epoch} built")

            def run(self) -> None:
                recorded.events.append(f"term {self.epoch} runs")
                recorded.end(self.leadership)

            def await_informers(self, timeout: float) -> None:
                assert 0.0 <= timeout <= INFORMER_END_GRACE
                recorded.events.append(f"term {self.epoch}'s informers waited for")

        def collect(*_: int) -> int:
            recorded.events.append("collection")
            return 0

        monkeypatch.setattr(manager, "LeaderTerm", Term)
        monkeypatch.setattr(gc, "collect", collect)

    def lead(self, epoch: int, ends: str = "deposed") -> None:
        """One term through ``on_started``; while it runs, it ends as ``ends`` says."""
        self.ends = ends
        self.process._lead_and_free(
            Leadership(epoch=epoch, identity="me", valid_until=time.monotonic() + 3600))

    def end(self, leadership: Leadership) -> None:
        if self.ends == "steps down":
            leadership.step_down()  # the sync deadline: Leadership.step_down
        elif self.ends == "the process stops":
            self.stop.set()
        leadership.lost.set()  # deposed, refused, a step-down asked on the Lease: only this


ENDS = ["deposed", "steps down", "the process stops"]


@pytest.mark.unit
@pytest.mark.parametrize("ends", ENDS)
def test_nothing_is_collected_when_a_term_ends(monkeypatch: pytest.MonkeyPatch,
                                                ends: str) -> None:
    """So the Lease's release (a step-down, a refusal, a stop) and the exit never wait."""
    recorded = Recorded(monkeypatch)
    recorded.lead(1)
    recorded.lead(2, ends)
    assert recorded.events[-2:] == ["term 2 built", "term 2 runs"]  # and nothing after


@pytest.mark.unit
@pytest.mark.parametrize("ends", ENDS[:2])
def test_the_next_term_frees_the_last_one_before_it_builds_anything(
        monkeypatch: pytest.MonkeyPatch, ends: str) -> None:
    recorded = Recorded(monkeypatch)
    recorded.lead(1, ends)
    recorded.lead(2)
    assert recorded.events == [
        "term 1 built", "term 1 runs",
        "term 1's informers waited for", "collection",  # at the start of term 2
        "term 2 built", "term 2 runs"]


@pytest.mark.unit
def test_a_first_term_a_term_already_over_and_a_stopping_process_collect_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = Recorded(monkeypatch)
    recorded.lead(1)
    assert recorded.events == ["term 1 built", "term 1 runs"]  # nothing led before it
    over = Leadership(epoch=2, identity="me", valid_until=time.monotonic() + 3600)
    over.lost.set()  # ended before its work started (its term returns at once)
    recorded.process._lead_and_free(over)
    recorded.stop.set()  # SIGTERM
    recorded.lead(3)
    assert "collection" not in recorded.events
