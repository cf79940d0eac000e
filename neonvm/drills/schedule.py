"""The fault campaign's schedules: which faults a schedule injects, and when (pure).

A :class:`Schedule` is a pure function of ``(seed, index)`` (:func:`generate`), so a
failure is replayed with ``neonvm drill campaign --seed S --schedule N``. Every schedule
crashes the leader right after one reconcile step (the step cycles with the index, so any
``len(CRASH_STEPS)`` consecutive schedules crash after every step), gives each replica
random fault knobs (stale reads, dropped watch events, write conflicts) and draws timed
disruptions (pod deletes, leader kill / pause / TERM, broken locks, re-created VMs,
restarts of etcd, the locks' etcd and the API server). :attr:`Schedule.classes` names
which of Sieve's bug classes (intermediate, unobserved, stale states) it exercises.

Running a schedule is :mod:`neonvm.drills.campaign`'s job; nothing here touches a cluster.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

from neonvm.controller.action_table import ACTIONS
from neonvm.controller.faults import FaultConfig

SEED_ENV = "NEONVM_CAMPAIGN_SEED"
SCHEDULES_ENV = "NEONVM_CAMPAIGN_SCHEDULES"

CRASH_STEPS: tuple[str, ...] = tuple(kind.step for kind in ACTIONS)
"""Every step the driver performs, each a crash point: the ``step`` each action declares,
in the order of the driver's actions table (:data:`neonvm.controller.action_table.ACTIONS`).
Schedule ``i`` crashes after ``CRASH_STEPS[i % len(CRASH_STEPS)]``."""

FREQUENT_STEPS = frozenset({"plan", "create", "commit", "ungate", "add_finalizer", "sync"})
"""Steps every VM takes on its way to running: the crash comes after any of its first few
occurrences (the others, rarer, crash at their first or second)."""

CLUSTER_WIDE = ("restart-locks-etcd", "restart-etcd", "restart-apiserver")
DISRUPTIONS: dict[str, int] = {
    # kind -> weight in the random draw
    "delete-pods": 6,
    "kill-leader": 3,
    "pause-leader": 4,
    "term-leader": 2,
    "break-locks": 2,
    "recreate-vm": 2,
    "restart-locks-etcd": 1,
    "restart-etcd": 1,
    "restart-apiserver": 1,
}


def campaign_seed(given: int | None = None) -> int:
    """``given``, else ``$NEONVM_CAMPAIGN_SEED``, else a fresh random seed."""
    if given is not None:
        return given
    env = os.environ.get(SEED_ENV, "").strip()
    return int(env) if env else random.SystemRandom().randrange(1, 1 << 31)


@dataclass(frozen=True)
class Disruption:
    at: float
    """Seconds after the VMs were created."""
    kind: str
    count: int = 1


@dataclass(frozen=True)
class Schedule:
    seed: int
    index: int
    vms: int
    crash_step: str
    leader_faults: str
    standby_faults: str
    disruptions: tuple[Disruption, ...]

    @property
    def classes(self) -> tuple[str, ...]:
        """Which of Sieve's classes this schedule exercises."""
        leader, standby = FaultConfig.parse(self.leader_faults), FaultConfig.parse(
            self.standby_faults)
        kinds = {d.kind for d in self.disruptions}
        out = ["intermediate"]  # every schedule crashes after a step
        if leader.drop_watch_events or standby.drop_watch_events or "recreate-vm" in kinds:
            out.append("unobserved")
        if (leader.stale_reads or standby.stale_reads or leader.conflict or standby.conflict
                or kinds & {"break-locks", *CLUSTER_WIDE}):
            out.append("stale")
        return tuple(out)

    def replay(self) -> str:
        return f"neonvm drill campaign --seed {self.seed} --schedule {self.index}"

    def replay_pytest(self) -> str:
        return (f"{SEED_ENV}={self.seed} NEONVM_CAMPAIGN_ONLY={self.index} "
                f"pytest tests/test_campaign.py -k campaign")

    def describe(self) -> str:
        events = ", ".join(f"{d.kind}{'x' + str(d.count) if d.count > 1 else ''}@{d.at:.1f}s"
                           for d in self.disruptions)
        return (f"schedule {self.index} (seed {self.seed}): {self.vms} VMs; leader "
                f"[{self.leader_faults}]; standby [{self.standby_faults}]; {events}; "
                f"classes {'+'.join(self.classes)}")


def generate(seed: int, index: int) -> Schedule:
    """Schedule ``index`` of campaign ``seed`` (deterministic)."""
    rng = random.Random(f"neonvm-campaign:{seed}:{index}")
    vms = rng.randint(2, 4)
    step = CRASH_STEPS[index % len(CRASH_STEPS)]
    frequent = step in FREQUENT_STEPS
    nth = rng.randint(1, vms + 1) if frequent else rng.randint(1, 2)

    def knobs() -> list[str]:
        return [f"stale_reads={rng.choice([0, 0, 0.2, 0.5])}",
                f"drop_watch_events={rng.choice([0, 0, 0.1, 0.3])}",
                f"conflict={rng.choice([0, 0.2, 0.4])}",
                f"seed={rng.randrange(1 << 20)}"]

    leader = ",".join([f"crash_after={step}@{nth}", *knobs()])
    standby = ",".join(knobs())
    kinds = list(DISRUPTIONS)
    weights = [DISRUPTIONS[k] for k in kinds]
    disruptions = [Disruption(round(rng.uniform(0.5, 3.0), 1), "delete-pods",
                              rng.randint(1, vms))]
    for _ in range(rng.randint(1, 3)):
        kind = rng.choices(kinds, weights)[0]
        count = (vms if kind == "pause-leader"
                 else rng.randint(1, vms) if kind in ("delete-pods", "recreate-vm") else 1)
        disruptions.append(Disruption(round(rng.uniform(0.0, 10.0), 1), kind, count))
    return Schedule(seed, index, vms, step, leader, standby,
                    tuple(sorted(disruptions, key=lambda d: d.at)))
