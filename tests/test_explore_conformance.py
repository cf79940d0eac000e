"""The explorer's model driver and the shipped driver take the same actions, on the calm path.

The explorer (:mod:`neonvm.verify`) drives a re-modelled driver (``verify/actors.py``)
around the shipped ``decide`` and mutations; docs/verification.md ("Why the explorer runs
a model driver, not the shipped one") says what stands between it and the shipped
:class:`~neonvm.controller.reconciler.Reconciler`. Until then, this checks that the two
do not drift apart where both are easy to run: the shipped reconciler over an in-memory
cluster (:class:`tests.support.fake_cluster.FakeCluster`, through the driver's cluster
interface), the model driver on the model's world along the explorer's calm schedule
(the cluster first, then the leader, no faults), from a VM just created through three
user events. Both must perform the same actions in the same order. A driver change the
model does not follow (a new step on the way, another order) fails here.

Pure: no servers.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller.action_table import ACTIONS
from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.verify.actors import Actors, Config, Step
from neonvm.verify.model import World, deleted, replace_pod, write_pods, write_vm
from neonvm.verify.scenarios import fresh_world
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

NS, NAME = "ns", "vm"
KEY = f"{NS}/{NAME}"
ACTION_OF_STEP = {kind.step: kind.__name__ for kind in ACTIONS}


# ---- the model driver ------------------------------------------------------------------------


def _performed(step: Step) -> str | None:
    """The action a model step performed (a write that took effect), else None."""
    if not step.actor.startswith("c"):
        return None  # the kubelet, the garbage collector
    if step.kind == "write" and step.args[1] == "ok":
        return str(step.args[0][0])
    if step.kind == "create" and step.args[1] == "ok":
        return "CreatePod"
    if step.kind == "ungate" and step.args[2] == "ok":
        return "Ungate"
    if step.kind == "delete" and step.args[2] == "ok":
        return "DeletePod"
    return None


class ModelRun:
    """The model's world, moved along the explorer's calm schedule."""

    def __init__(self) -> None:
        self.cfg = Config()
        self.actors = Actors(self.cfg)
        self.world: World = fresh_world(1)

    def settle(self, done: Callable[[World], bool]) -> list[str]:
        """The cluster's steps first, else the leader's, until ``done`` with the leader
        idle; the actions performed on the way."""
        performed: list[str] = []
        for _ in range(300):
            env = self.actors.environment_steps(self.world)
            if env:
                self.world = env[0][1]
                continue
            if done(self.world) and self.world.workers[0].pc == "idle":
                return performed
            nxt = self.actors.calm_leader_step(self.world)
            assert nxt is not None, "the leader stopped"
            step, self.world = nxt
            name = _performed(step)
            if name is not None:
                performed.append(name)
        raise AssertionError("the model did not settle")

    def delete_pod(self) -> None:
        vm = self.world.vm
        assert vm is not None
        pod = next(p for p in self.world.pods if p.name == vm.status.pod_name)
        self.world = write_pods(self.world, replace_pod(self.world.pods, pod, deleted(pod)),
                                self.cfg.history, None)

    def delete_vm(self) -> None:
        assert self.world.vm is not None
        self.world = write_vm(self.world, self.world.vm._replace(deleting=True),
                              self.cfg.history, None)


def _model_running(w: World) -> bool:
    vm = w.vm
    return (vm is not None and vm.status.phase == "Running" and vm.status.pending is None
            and any(p.name == vm.status.pod_name and p.phase == "Running" for p in w.pods))


def _model_gone(w: World) -> bool:
    return w.vm is None and not w.pods


# ---- the shipped driver ----------------------------------------------------------------------


class ShippedRun:
    """The shipped reconciler over a fake cluster; the kubelet runs ungated pods."""

    def __init__(self) -> None:
        self.fake = FakeCluster()
        self.fake.add_vm({
            "apiVersion": types.API_VERSION, "kind": types.KIND,
            "metadata": {"name": NAME, "namespace": NS, "generation": 1, "finalizers": []},
            "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                     "guest": {"rootDisk": {"image": "img"}}},
            "status": {}})
        self.performed: list[str] = []

        def after_step(key: str, step: str, outcome: str) -> None:
            if outcome in ("done", "replaced"):
                self.performed.append(ACTION_OF_STEP[step])

        self.reconciler = shipped_reconciler(client.ApiClient(), cluster=self.fake,
                                             after_step=after_step, config=ReconcilerConfig())

    def _kubelet(self) -> bool:
        """Run every ungated pod not yet running (the model's scheduler + kubelet step)."""
        moved = False
        for pod in self.fake.pods.values():
            gated = pod.get("spec", {}).get("schedulingGates")
            if not gated and pod.get("status", {}).get("phase") != "Running":
                pod["spec"]["nodeName"] = "node-1"
                pod["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
                pod["metadata"]["resourceVersion"] = self.fake.next_rv()
                moved = True
        return moved

    def settle(self, done: Callable[[FakeCluster], bool]) -> list[str]:
        start = len(self.performed)
        for _ in range(20):
            self._kubelet()
            if done(self.fake):
                return self.performed[start:]
            self.reconciler.reconcile(KEY, StaticAuthority(epoch=1, token=1),
                                      direct_first=True)
        raise AssertionError("the shipped driver did not settle")

    def delete_pod(self) -> None:
        name = self.fake.vms[(NS, NAME)]["status"]["podName"]
        del self.fake.pods[(NS, name)]

    def delete_vm(self) -> None:
        vm = self.fake.vms[(NS, NAME)]
        vm["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        vm["metadata"]["resourceVersion"] = self.fake.next_rv()


def _shipped_running(fake: FakeCluster) -> bool:
    vm = fake.vm(NS, NAME)
    status = (vm or {}).get("status") or {}
    pod = fake.pod(NS, status.get("podName") or "")
    return (status.get("phase") == "Running" and not status.get("pendingPod")
            and pod is not None and pod["status"].get("phase") == "Running")


def _shipped_gone(fake: FakeCluster) -> bool:
    return fake.vm(NS, NAME) is None and not fake.pods


# ---- the check -------------------------------------------------------------------------------


def test_the_model_driver_takes_the_shipped_drivers_actions_on_the_calm_path() -> None:
    model, shipped = ModelRun(), ShippedRun()
    phases = [
        ("a VM is created", None, _model_running, _shipped_running,
         ["AddFinalizer", "RecordPlan", "CreatePod", "Commit", "Ungate", "SyncStatus"]),
        ("its pod is deleted", "delete_pod", _model_running, _shipped_running,
         ["Restart", "RecordPlan", "CreatePod", "Commit", "Ungate", "SyncStatus"]),
        ("the VM is deleted", "delete_vm", _model_gone, _shipped_gone,
         ["DeletePod", "RemoveFinalizer"]),
    ]
    for what, event, model_done, shipped_done, expected in phases:
        if event is not None:
            getattr(model, event)()
            getattr(shipped, event)()
        by_model = model.settle(model_done)
        by_shipped = shipped.settle(shipped_done)
        assert by_shipped == by_model, f"{what}: shipped {by_shipped}, model {by_model}"
        assert by_shipped == expected, f"{what}: {by_shipped}"
