"""The scenarios the CI and deep runs explore: initial states, models and fault budgets.

A scenario starts either from a freshly created VM or from a *steady* VM: the state the
fault-free protocol reaches by itself from a fresh VM (computed by running the shipped
code, not written by hand), with the caches' history of the way there kept, so that
stale reads can return the versions before the plan, before the commit, and so on.
"""

from __future__ import annotations

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
    """Run the leader and the cluster, fault-free, until the VM has converged."""
    actors = Actors(cfg)
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


def ci_scenarios(breakages: frozenset[str] = frozenset()) -> list[Scenario]:
    """The CI set: a few minutes on two shared cores for the shipped code."""
    locked = Config(history=2, locks=True, breakages=breakages)
    lockless = Config(history=2, locks=False, breakages=breakages)
    return [
        Scenario(
            "seed-pod-deleted",
            "the seed's trigger: a running VM's pod is deleted by the user; one failover, "
            "one crash, one conflict, one lost watch event",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                pod_delete=1, failover=1, crash=1, conflict=1, dropped_event=1)),
        ),
        Scenario(
            "lockless-pod-deleted",
            "lease and lock off: two leaders with the same epoch and stale caches race "
            "after the user deletes the pod; one conflict, one lost watch event",
            lockless,
            with_adversaries(_steady(lockless, 2), lockless, leaders=1, budget=Budget(
                pod_delete=1, conflict=1, dropped_event=1)),
        ),
        Scenario(
            "create",
            "a new VM: a deposed leader (older epoch) races the leader from the start; "
            "one crash, one lock expiry, one conflict",
            locked,
            with_adversaries(_fresh(locked, 2), locked, zombies=1, budget=Budget(
                crash=1, lock_expiry=1, conflict=1)),
        ),
        Scenario(
            "vm-deleted",
            "a running VM is deleted; a failover, a crash, a lock expiry and a conflict "
            "on the way",
            locked,
            with_adversaries(_steady(locked, 2), locked, budget=Budget(
                vm_delete=1, failover=1, crash=1, lock_expiry=1, conflict=1)),
        ),
    ]


def deep_scenarios(breakages: frozenset[str] = frozenset()) -> list[Scenario]:
    """More of everything: three replicas, longer caches, more faults, every policy."""
    locked = Config(history=3, locks=True, breakages=breakages)
    lockless = Config(history=3, locks=False, breakages=breakages)
    return [
        Scenario(
            "deep-seed-pod-deleted",
            "three replicas; the pod is deleted twice; two failovers, a crash, two "
            "conflicts, a lost event, a lock expiry",
            locked,
            with_adversaries(_steady(locked, 3), locked, budget=Budget(
                pod_delete=2, failover=2, crash=1, conflict=2, dropped_event=1,
                lock_expiry=1)),
        ),
        Scenario(
            "deep-lockless",
            "lease and lock off: three leaders race; the pod is deleted twice and the "
            "guest may exit; two conflicts, a lost event",
            lockless,
            with_adversaries(_steady(lockless, 3), lockless, leaders=2, budget=Budget(
                pod_delete=2, pod_finish=1, conflict=2, dropped_event=1)),
        ),
        Scenario(
            "deep-create",
            "a new VM with two deposed leaders; a crash, a lock expiry, two conflicts, a "
            "pod deletion, a spec edit, the VM deleted",
            locked,
            with_adversaries(_fresh(locked, 3), locked, zombies=2, budget=Budget(
                crash=1, lock_expiry=1, conflict=2, pod_delete=1, spec_edit=1,
                vm_delete=1)),
        ),
        Scenario(
            "deep-never",
            "restartPolicy Never: the guest exits or its pod is deleted; failover, crash, "
            "conflict, lost event",
            locked,
            with_adversaries(_steady(locked, 2, "Never"), locked, budget=Budget(
                pod_finish=1, pod_delete=1, failover=1, crash=1, conflict=1,
                dropped_event=1)),
        ),
    ]
