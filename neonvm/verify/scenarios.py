"""The scenarios the CI and deep runs explore: initial states, models and fault budgets.

A scenario starts either from a freshly created VM or from a *steady* VM: the state the
fault-free protocol reaches by itself from a fresh VM (computed by running the shipped
code, not written by hand), with the caches' history of the way there kept, so that
stale reads can return the versions before the plan, before the commit, and so on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from neonvm.verify.actors import Actors, Config
from neonvm.verify.explore import Scenario
from neonvm.verify.invariants import converged
from neonvm.verify.model import (
    LEADER,
    STANDBY,
    VM,
    VM_UID,
    ZOMBIE,
    Budget,
    Status,
    Worker,
    World,
)


def fresh_world(controllers: int, restart_policy: str = "Always") -> World:
    """A VM just created; worker 0 leads with the highest epoch, the others stand by."""
    vm = VM(uid=VM_UID, generation=1, spec_v=0, restart_policy=restart_policy,
            deleting=False, finalizer=False, status=Status())
    epoch = 1
    workers = [Worker(role=LEADER, epoch=epoch, token=0, pc="idle")]
    workers += [Worker(role=STANDBY, epoch=0, token=0, pc="idle")] * (controllers - 1)
    return World(vm=vm, pods=(), vm_hist=(), pod_hist=(), lock=None, lock_rev=0,
                 epoch=epoch, workers=tuple(workers), budget=Budget(), uid_next=1)


def settle(cfg: Config, w: World, max_steps: int = 200) -> World:
    """Run the leader and the cluster, fault-free, until the VM has converged (with the
    shipped driver: breakages apply to the exploration, never to the starting state)."""
    actors = Actors(dataclasses.replace(cfg, breakages=frozenset()))
    for _ in range(max_steps):
        env = actors.environment_steps(w)
        if env:
            w = env[0][1]
            continue
        if converged(w) is None and w.workers[0].pc == "idle":
            return w
        nxt = actors.calm_leader_step(w)
        if nxt is None:
            break
        w = nxt[1]
    raise AssertionError(f"the fault-free protocol did not converge: {converged(w)}")


def with_adversaries(w: World, cfg: Config, zombies: int = 0, leaders: int = 0,
                     budget: Budget | None = None) -> World:
    """Turn standbys into deposed leaders (older epochs, stale caches) or, in lock-off
    mode, into further leaders; set the fault budget."""
    workers = list(w.workers)
    lags = (len(w.vm_hist), len(w.pod_hist))
    epoch = w.epoch
    for i in range(1, len(workers)):
        if zombies > 0:
            zombies -= 1
            epoch -= 1
            workers[i] = Worker(role=ZOMBIE, epoch=epoch, token=0, pc="idle",
                                lag_vm=lags[0], lag_pods=lags[1])
        elif leaders > 0:
            leaders -= 1
            workers[i] = Worker(role=LEADER, epoch=w.epoch, token=0, pc="idle",
                                lag_vm=lags[0], lag_pods=lags[1])
    return w._replace(workers=tuple(workers), budget=budget or Budget())


def _steady(cfg: Config, controllers: int, restart_policy: str = "Always") -> World:
    w = fresh_world(controllers, restart_policy)
    if cfg.locks:
        # The settled leader is the second term: leave room for an older epoch.
        w = w._replace(epoch=2, workers=(w.workers[0]._replace(epoch=2), *w.workers[1:]))
    return settle(cfg, w)


def _fresh(cfg: Config, controllers: int) -> World:
    w = fresh_world(controllers)
    if cfg.locks:
        w = w._replace(epoch=2, workers=(w.workers[0]._replace(epoch=2), *w.workers[1:]))
    return w


def paused_writers(cfg: Config) -> World:
    """Two deposed leaders, each paused on one write, beside a new leader.

    Reached by the model's own transitions (so reachable): c2 leads (epoch 1), records
    plan #1 and decides to create its pod from a direct read; it loses its lease with
    that create in flight. c0 leads (epoch 2), creates and commits the pod, decides to
    ungate it and takes the direct list that allows it; it loses its lease with the
    ungate patch in flight. c1 leads (epoch 3). The paused create can re-create the
    committed name after the pod is gone, and the paused patch can then land on it,
    which is what the ungate's uid/resourceVersion precondition is for.
    """
    assert cfg.locks, "the paused writers are deposed leaders: lock mode only"
    actors = Actors(dataclasses.replace(cfg, breakages=frozenset()))  # the shipped driver
    w = fresh_world(3)
    w = w._replace(
        workers=(Worker(role=STANDBY, epoch=0, token=0, pc="idle"), w.workers[1],
                 Worker(role=LEADER, epoch=1, token=0, pc="idle")),
        budget=Budget(failover=2))

    def run(i: int, done: Callable[[World], bool]) -> None:
        nonlocal w
        for _ in range(50):
            if done(w):
                return
            w = next(iter(actors.worker_steps(w, i, latest_only=True)))[1]
        raise AssertionError("paused_writers: setup did not reach its goal")

    def failover(to: int) -> None:
        nonlocal w
        w = next(t for s, t in actors.adversary_steps(w)
                 if s.kind == "failover" and s.args[1] == to)

    run(2, lambda w: w.workers[2].pc == "act" and w.workers[2].action is not None
        and w.workers[2].action[0] == "CreatePod")
    failover(0)
    run(0, lambda w: w.workers[0].pc == "patch")
    failover(1)
    return w._replace(budget=Budget())


def ci_scenarios(base: Config | None = None) -> list[Scenario]:
    """The CI set: about 650,000 states, a few minutes on two shared cores.

    ``base`` carries the model switches (breakages, driver variants); each scenario sets
    its own cache history and lock mode on top.
    """
    base = base or Config()
    locked = dataclasses.replace(base, history=2, locks=True)
    return [
        Scenario(
            "seed-pod-deleted",
            "the seed's trigger: a running VM's pod is deleted by the user; the leader "
            "loses its lease and the VM lock's etcd lease expires, at any point",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, failover=1, lock_expiry=1)),
        ),
        Scenario(
            "seed-faults",
            "the seed's setting: one controller, its pod deleted; a crash, a conflicting "
            "write and a lost watch event, at any point",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, crash=1, conflict=1, dropped_event=1)),
        ),
        lockless_pod_deleted(base, Budget(pod_delete=1, conflict=1, dropped_event=1)),
        Scenario(
            "create",
            "a new VM: a deposed leader (older epoch) races the leader from the start; "
            "a crash and a conflicting write",
            locked,
            with_adversaries(_fresh(locked, 2), locked, zombies=1, budget=Budget(
                crash=1, conflict=1)),
        ),
        Scenario(
            "vm-deleted",
            "a running VM is deleted; a failover, a lock expiry and a conflicting write "
            "on the way",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                vm_delete=1, failover=1, lock_expiry=1, conflict=1)),
        ),
        Scenario(
            "planted-pod",
            "a running VM's pod is deleted; the user plants a pod under the next plan name "
            "(or the recorded plan's, before the create), gated and owned by the VM, with "
            "no fence or an older one; a failover on the way",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, plant=1, failover=1)),
        ),
        Scenario(
            "paused-writers",
            "two deposed leaders paused on a create and on an ungate patch; the user "
            "deletes the pod (cache history 1)",
            dataclasses.replace(locked, history=1),
            paused_writers(dataclasses.replace(locked, history=1))._replace(
                budget=Budget(pod_delete=1)),
        ),
    ]


def deep_scenarios(base: Config | None = None) -> list[Scenario]:
    """More faults at once, a third replica, a longer cache history, every policy."""
    base = base or Config()
    locked = dataclasses.replace(base, history=2, locks=True)
    locked3 = dataclasses.replace(base, history=3, locks=True)
    return [
        Scenario(
            "deep-seed",
            "pod deleted; failover, lock expiry and crash, at any point",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, failover=1, lock_expiry=1, crash=1)),
        ),
        Scenario(
            "deep-seed-conflict",
            "pod deleted; failover, lock expiry and a conflicting write",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, failover=1, lock_expiry=1, conflict=1)),
        ),
        Scenario(
            "deep-three-replicas",
            "three replicas: two failovers leave two deposed leaders; pod deleted",
            locked,
            with_adversaries(_steady(locked, 3), locked, budget=Budget(
                pod_delete=1, failover=2)),
        ),
        lockless_pod_deleted(base, Budget(pod_delete=1, conflict=1, dropped_event=1),
                             history=3, name="deep-lockless"),
        Scenario(
            "deep-create",
            "a new VM with a deposed leader; crash, lock expiry, conflicting write",
            locked,
            with_adversaries(_fresh(locked, 2), locked, zombies=1, budget=Budget(
                crash=1, lock_expiry=1, conflict=1)),
        ),
        Scenario(
            "deep-vm-deleted",
            "a running VM deleted; failover, crash, lock expiry, conflicting write",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                vm_delete=1, failover=1, crash=1, lock_expiry=1, conflict=1)),
        ),
        Scenario(
            "deep-never",
            "restartPolicy Never: the guest exits or the pod is deleted; failover, "
            "conflicting write, lost event (cache history 3)",
            locked3,
            with_adversaries(_steady(locked3, 2, "Never"), locked3, budget=Budget(
                pod_finish=1, pod_delete=1, failover=1, conflict=1, dropped_event=1)),
        ),
        Scenario(
            "deep-on-failure",
            "restartPolicy OnFailure: the guest exits (either way), then its pod is "
            "deleted; crash and failover",
            locked,
            with_adversaries(_steady(locked, 2, "OnFailure"), locked, budget=Budget(
                pod_finish=1, pod_delete=1, crash=1, failover=1)),
        ),
        Scenario(
            "deep-spec-edit",
            "the user edits the spec and deletes the pod, then the VM; failover, conflict",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                spec_edit=1, pod_delete=1, vm_delete=1, failover=1, conflict=1)),
        ),
        Scenario(
            "deep-paused-writers",
            "the paused writers (cache history 2), the pod deleted twice",
            locked,
            paused_writers(locked)._replace(budget=Budget(pod_delete=2)),
        ),
    ]


def lockless_pod_deleted(base: Config | None = None, budget: Budget | None = None,
                         history: int = 2, name: str = "lockless-pod-deleted") -> Scenario:
    """Two lock-less leaders, a running VM whose pod the user deletes: the smallest
    scenario in which most breakages show (used by the tests and the replay)."""
    cfg = dataclasses.replace(base or Config(), history=history, locks=False)
    return Scenario(
        name,
        "lease and lock off: two leaders with stale caches race after the user deletes "
        "the pod",
        cfg,
        with_adversaries(_steady(cfg, 2), cfg, leaders=1,
                         budget=budget or Budget(pod_delete=1)),
    )

