"""The seed's scenario, many times over, with the leader killed at random moments.

The bug report (``seeds/000_*``): after a runner pod was deleted, the controller created
*two* replacements. Here the scenario runs ``VMS`` x ``ROUNDS`` times (50 by default),
concurrently over several VMs, against the real API server, the locks' etcd and
simulated nodes, with three controller replicas as separate processes. In every round
each VM's runner pod is deleted at a random moment, and the leader is killed (SIGKILL) at
a random moment of the same round, then restarted as a standby. The moments come from a
seeded generator; the seed is printed (``NEONVM_SEED_SCENARIO_SEED`` replays it).

What each repetition must show:

* exactly one replacement: the VM's pods, as seen by a pod watch, gain exactly one new
  name per deletion (over the run: distinct names == ``restartCount`` + 1);
* ``restartCount`` up by exactly one per deletion, ``planSeq`` up by exactly one (no
  plan started twice);
* never two live runner pods for one VM (strict form: not gated and not gone), checked
  by an independent poller (``checker``) for the whole run and, at every revision, by
  the watch (:class:`~neonvm.drills.observer.PodWatchChecker`), which also fails on the
  deletion of a running pod that nobody asked for (lost work).

Pods shut down with a 1 s grace period and the replicas use short leases (the
``replicas`` fixture of ``tests/test_reconcile_failover.py``), so the run fits a CI
budget: about two to four minutes on two shared cores.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.dev.cluster import LocalCluster
from neonvm.drills.observer import PodWatchChecker
from neonvm.invariant import InvariantChecker
from tests.support import wait_for
from tests.support.failover import leader_of, only_pod, vm_status
from tests.support.harness import Replicas, converged, create_vm

pytestmark = [pytest.mark.cluster, pytest.mark.nodes]

VMS = int(os.environ.get("NEONVM_SEED_VMS", "10"))
ROUNDS = int(os.environ.get("NEONVM_SEED_ROUNDS", "5"))
DELETE_SPREAD = 1.5
"""Each VM's pod is deleted at a random moment in [0, DELETE_SPREAD] s into the round."""
KILL_SPREAD = DELETE_SPREAD + 1.0
"""The leader is killed at a random moment in [0, KILL_SPREAD] s into the round: before,
between or after the deletions, while replacements are planned, created or gated."""
GRACE = {"terminationGracePeriodSeconds": 1}


@dataclass
class PodNames:
    """Every runner pod name each VM ever had, from the watch's events."""

    by_vm: dict[str, set[str]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def on_event(self, _kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        vm = (meta.get("labels") or {}).get(types.LABEL_VM_NAME)
        if vm:
            with self._lock:
                self.by_vm.setdefault(vm, set()).add(str(meta.get("name")))

    def of(self, vm: str) -> set[str]:
        with self._lock:
            return set(self.by_vm.get(vm, set()))


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("NEONVM_SEED_SCENARIO_SEED")
                or random.SystemRandom().randrange(2**32))
    print(f"\nseed scenario: seed={value} (replay: NEONVM_SEED_SCENARIO_SEED={value})")
    return value


@pytest.fixture
def pod_names(api: client.ApiClient, namespace: str) -> Iterator[tuple[PodNames,
                                                                       PodWatchChecker]]:
    names = PodNames()
    watch = PodWatchChecker(api, namespace, on_event=names.on_event).start()
    wait_for(watch.synced.is_set, 30, what="the pod watch's first list")
    try:
        yield names, watch
    finally:
        watch.stop()


@dataclass
class Round:
    """One round's random schedule: when each VM's pod is deleted, when the leader dies."""

    deletions: dict[str, float]
    kill_at: float

    @classmethod
    def draw(cls, rng: random.Random, vms: list[str]) -> Round:
        return cls(deletions={vm: rng.uniform(0, DELETE_SPREAD) for vm in vms},
                   kill_at=rng.uniform(0, KILL_SPREAD))


def play(schedule: Round, delete: Any, kill: Any) -> None:
    """Run the schedule's faults at their moments. The pauses place faults in time; they
    do not synchronise with anything (every outcome is waited for as a condition)."""
    events = sorted([(at, "delete", vm) for vm, at in schedule.deletions.items()]
                    + [(schedule.kill_at, "kill", "")])
    start = time.monotonic()
    for at, kind, vm in events:
        time.sleep(max(0.0, start + at - time.monotonic()))
        if kind == "delete":
            delete(vm)
        else:
            kill()


def test_every_deleted_runner_pod_gets_exactly_one_replacement_while_leaders_die(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, seed: int,
        replicas: Replicas, checker: InvariantChecker,
        pod_names: tuple[PodNames, PodWatchChecker]) -> None:
    if not cluster.spec.nodes:
        pytest.skip("needs simulated nodes: pods must run and shut down gracefully")
    names, watch = pod_names
    rng = random.Random(seed)
    context = f"(seed {seed})"
    began = time.monotonic()
    for name in ("r1", "r2", "r3"):
        replicas.start(name)
    leader_of(replicas)
    vms = [f"seed-{i:02d}" for i in range(VMS)]
    for vm in vms:
        create_vm(api, namespace, vm, spec=GRACE)
    wait_for(lambda: converged(api, namespace, vms), 180, what=f"first pods {context}")
    core = client.CoreV1Api(api)
    restarts = 0
    # Per round, how many VMs had their pod deleted before the kill (their replacement
    # in flight, or just done); the others were deleted during or after the failover.
    deleted_before_kill: list[int] = []

    for round_ in range(1, ROUNDS + 1):
        leader_of(replicas)
        before = {vm: vm_status(api, namespace, vm) for vm in vms}
        old = {vm: only_pod(api, namespace, vm) for vm in vms}
        seen_before = {vm: names.of(vm) for vm in vms}
        schedule = Round.draw(rng, vms)

        def delete(vm: str, old: dict[str, str] = old) -> None:
            watch.expect_pod_deletion(old[vm])
            core.delete_namespaced_pod(old[vm], namespace)

        def kill(round_: int = round_) -> None:
            victim = leader_of(replicas)
            victim.kill()
            replicas.start(f"{victim.name.split('.')[0]}.{round_}")  # back, as a standby

        play(schedule, delete, kill)
        deleted_before_kill.append(sum(at < schedule.kill_at for at in schedule.deletions.values()))
        wait_for(lambda old=old: converged(api, namespace, vms)  # type: ignore[misc]
                 and all(only_pod(api, namespace, vm) != old[vm] for vm in vms),
                 240, what=f"round {round_} converged {context}")

        for vm in vms:
            status = vm_status(api, namespace, vm)
            new = only_pod(api, namespace, vm)
            where = f"{vm}, round {round_} {context}"
            wait_for(lambda vm=vm, new=new: new in names.of(vm), 30,  # type: ignore[misc]
                     what=f"the watch to see {new}")
            assert status["podName"] == new != old[vm], where
            assert status["restartCount"] == before[vm]["restartCount"] + 1, \
                f"{where}: one deletion, one restart"
            assert status["planSeq"] == before[vm]["planSeq"] + 1, \
                f"{where}: exactly one new plan"
            assert names.of(vm) - seen_before[vm] == {new}, \
                f"{where}: exactly one replacement pod name"
            restarts += 1
        assert checker.report.strict == [], f"two live pods at once {context}"
        assert watch.report.strict == [], f"two live pods at some revision {context}"

    elapsed = time.monotonic() - began
    report = watch.stop()
    for vm in vms:
        status = vm_status(api, namespace, vm)
        assert status["restartCount"] == ROUNDS
        assert len(names.of(vm)) == status["restartCount"] + 1, \
            f"{vm}: pod names {sorted(names.of(vm))} {context}"
    assert restarts == VMS * ROUNDS
    assert report.gaps == 0, "the pod watch broke: the name count could miss a pod"
    assert report.strict == [] and report.loose == []
    assert report.unexpected_deletions == [], "a running pod was deleted unasked (lost work)"
    assert checker.report.loose == []
    print(f"seed scenario: {restarts} repetitions ({VMS} VMs x {ROUNDS} rounds), "
          f"{ROUNDS} leaders killed, VMs deleted before the kill per round {deleted_before_kill}, "
          f"{elapsed:.0f}s, {checker.report.samples} polls + {report.events} watch events, "
          f"violations strict={len(checker.report.strict) + len(report.strict)} "
          f"loose={len(checker.report.loose) + len(report.loose)}, seed={seed}")
