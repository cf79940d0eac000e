"""Self-fencing on the controller's side: which pods are surely dead, and what decide does
with them (neonvm/controller/fencing.py, decide.ForceDeleteDeadPod; docs/protocol.md,
"Self-fencing").

Pure logic over hand-built observations, raw pods and a fake clock: no servers. The
real-server run (a simulated node powered off) is in tests/test_local_cluster.py."""

from __future__ import annotations

import dataclasses
from typing import Any
from unittest import mock

import pytest

from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION
from neonvm.api.types import (
    FINALIZER,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import podspec
from neonvm.controller.fencing import SelfFencing, candidate, node_unreachable
from neonvm.controller.informer import project_pod
from neonvm.controller.reasons import WAITING_FOR_OLD_POD
from neonvm.controller.rights import RightsLedger
from neonvm.controller.scaling import scalable
from tests.support import Clock, CountingAuthority
from tests.support.fake_cluster import FakeCluster

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
LEASE = act.Fence(epoch=3, token=40)
D, RHO, EPS = 3.0, 0.05, 2.0
BOUND = D * (1 + RHO) + EPS


def vm(**status: Any) -> VirtualMachine:
    return VirtualMachine(name="vm", namespace="ns", uid=UID, resource_version="1",
                          generation=1, spec=VirtualMachineSpec(restart_policy="Always"),
                          status=VirtualMachineStatus(**status), finalizers=[FINALIZER])


def view(name: str, *, gated: bool = False, terminating: bool = False,
         phase: str = "Running") -> act.PodView:
    return act.PodView(name=name, uid=f"uid-{name}", owner_uid=UID, gated=gated,
                     terminating=terminating, phase=phase, node="n1", fence=(3, 40))


def observation(*pods: act.PodView, direct: bool = True, dead: tuple[str, ...] = (),
                recheck: float | None = None,
                status: dict[str, Any] | None = None) -> act.Observation:
    return act.Observation(vm=vm(**(status or {})), pods=pods, lease=LEASE, direct=direct,
                         dead_pods=frozenset(dead), fence_recheck=recheck)


RUNNING: dict[str, Any] = {"pod_name": "old", "pod_uid": "uid-old", "phase": "Running",
                           "node": "n1"}


# ---- decide ------------------------------------------------------------------------------


def test_a_committed_pod_that_self_fenced_is_force_deleted_from_a_direct_read_only() -> None:
    old = view("old")
    fenced = d.decide(observation(old, dead=("uid-old",), status=RUNNING))
    assert isinstance(fenced, act.ForceDeleteDeadPod)
    assert (fenced.name, fenced.uid) == ("old", "uid-old")
    assert isinstance(d.decide(observation(old, direct=False, dead=("uid-old",), status=RUNNING)),
                      act.ObserveDirect)


def test_the_old_pod_a_gated_replacement_waits_for_is_force_deleted_once_dead() -> None:
    old, new = view("old", terminating=True), view("new", gated=True, phase="Pending")
    status: dict[str, Any] = {"pod_name": "new", "pod_uid": "uid-new"}
    waiting = d.decide(observation(old, new, status=status))
    assert isinstance(waiting, act.Wait) and waiting.condition == WAITING_FOR_OLD_POD
    fenced = d.decide(observation(old, new, dead=("uid-old",), status=status))
    assert isinstance(fenced, act.ForceDeleteDeadPod) and fenced.uid == "uid-old"


def test_a_deleted_vms_pod_on_a_lost_node_is_force_deleted_once_dead() -> None:
    """Else it would hold the VM's finalizer until the node is marked out of service."""
    old = view("old", terminating=True)
    deleting = dataclasses.replace(observation(old, status=RUNNING), vm=dataclasses.replace(
        vm(**RUNNING), deletion_timestamp="2026-01-01T00:00:00Z"))
    assert isinstance(d.decide(deleting), act.Wait)
    fenced = d.decide(dataclasses.replace(deleting, dead_pods=frozenset({"uid-old"})))
    assert isinstance(fenced, act.ForceDeleteDeadPod) and fenced.uid == "uid-old"


def test_without_a_dead_pod_nothing_changes_but_an_unreachable_pods_recheck() -> None:
    old = view("old")
    assert isinstance(d.decide(observation(old, status=RUNNING)), act.Done)
    waiting = d.decide(observation(old, recheck=4.0, status=RUNNING))
    assert isinstance(waiting, act.Wait) and waiting.seconds == 4.0
    assert waiting.condition is None


def test_a_dead_uid_that_is_not_the_vms_pod_is_ignored() -> None:
    """Only the committed pod and the old pods its gated replacement waits for."""
    assert isinstance(d.decide(observation(view("old"), dead=("uid-else",), status=RUNNING)),
                      act.Done)


# ---- which pods are looked at, and when a node is unreachable ---------------------------


def raw_pod(name: str = "old", *, annotated: bool = True, ready: str | None = "False",
            phase: str = "Running", terminating: bool = False,
            node: str | None = "n1", runner_env: bool = True) -> dict[str, Any]:
    """A pod as read directly; ``runner_env``: its runner container has the self-fencing
    environment (the rights URL and the right), as a pod the controller built does."""
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                            "labels": {"vm.neon.tech/name": "vm"}}
    if annotated:
        meta["annotations"] = {RIGHT_SECONDS_ANNOTATION: str(D)}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": [
        {"type": "PodScheduled", "status": "True"}]}
    if ready is not None:
        status["conditions"].append({"type": "Ready", "status": ready, "reason": "x"})
    spec: dict[str, Any] = {"nodeName": node} if node else {}
    if runner_env:
        spec["containers"] = [{"name": "neonvm-runner", "env": [
            {"name": "NEONVM_RIGHTS_URL", "value": "http://rights.neonvm-system.svc:8082"},
            {"name": "NEONVM_RIGHT_SECONDS", "value": str(D)}]}]
    return {"metadata": meta, "spec": spec, "status": status}


@pytest.mark.parametrize(("pod", "looked_at"), [
    (raw_pod(), True),
    (raw_pod(ready="True"), False),
    (raw_pod(ready="True", terminating=True), True),
    (raw_pod(phase="Unknown", ready=None), True),
    (raw_pod(phase="Pending"), False),
    (raw_pod(annotated=False), False),
    (raw_pod(node=None), False),
])
def test_only_self_fencing_pods_that_are_not_ready_or_terminating_are_looked_at(
        pod: dict[str, Any], looked_at: bool) -> None:
    assert (candidate(pod) is not None) == looked_at
    assert (candidate(project_pod(pod)) is not None) == looked_at, "the cache keeps it"


@pytest.mark.parametrize(("node", "unreachable"), [
    (None, True),
    ({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, False),
    ({"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}, True),
    ({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}, True),
    ({"spec": {"taints": [{"key": "node.kubernetes.io/unreachable"}]},
      "status": {"conditions": [{"type": "Ready", "status": "True"}]}}, True),
])
def test_a_node_is_unreachable_when_gone_not_ready_or_tainted(
        node: dict[str, Any] | None, unreachable: bool) -> None:
    assert node_unreachable(node) == unreachable


def fencing(nodes: dict[str, dict[str, Any] | None]) -> tuple[SelfFencing, Clock, list[str]]:
    clock = Clock(100.0)
    ledger = RightsLedger(clock, rho=RHO, epsilon=EPS)
    ledger.begin_term(lambda: True)
    reads: list[str] = []

    def read(name: str) -> dict[str, Any] | None:
        reads.append(name)
        return nodes.get(name)

    return SelfFencing(ledger, read, clock=clock), clock, reads


NOT_READY = {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
READY = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_pod_on_an_unreachable_node_is_dead_only_after_the_bound_and_then_condemned() -> None:
    fence, clock, _ = fencing({"n1": NOT_READY})
    pods = {"old": raw_pod()}
    before = fence.observe(observation(status=RUNNING), pods)
    assert before.dead_pods == frozenset()
    assert before.fence_recheck == pytest.approx(BOUND)
    clock.now += BOUND
    after = fence.observe(observation(status=RUNNING), pods)
    assert after.dead_pods == {"uid-old"} and fence.ledger.is_condemned("uid-old")
    assert fence.ledger.grant("uid-old", D) == "Condemned"


def test_a_pod_on_a_ready_node_or_without_the_annotation_is_never_condemned() -> None:
    fence, clock, reads = fencing({"n1": READY, "n2": NOT_READY})
    clock.now += 10 * BOUND
    pods = {"a": raw_pod("a"), "b": raw_pod("b", annotated=False, node="n2"),
            "c": raw_pod("c", ready="True", node="n2")}
    seen = fence.observe(observation(status=RUNNING), pods)
    assert seen.dead_pods == frozenset() and seen.fence_recheck is None
    assert reads == ["n1"]  # b and c are not looked at: no Node read for them
    assert not fence.ledger.is_condemned("uid-a")


def test_a_pod_condemned_in_this_term_stays_dead_when_its_node_comes_back() -> None:
    """Its DELETE missed (409) and the node is Ready again: the pod is still reported
    dead, so the DELETE is sent again; else a fresh runner, refused for ever, would wait
    for ever and its VM would never be replaced."""
    nodes: dict[str, dict[str, Any] | None] = {"n1": NOT_READY}
    fence, clock, _ = fencing(nodes)
    pods = {"old": raw_pod()}
    clock.now += BOUND
    assert fence.observe(observation(status=RUNNING), pods).dead_pods == {"uid-old"}
    nodes["n1"] = READY
    clock.now += 5  # past the Node read's reuse
    ready_pod = {"old": raw_pod(ready="True")}
    for seen in (pods, ready_pod):
        again = fence.observe(observation(view("old"), status=RUNNING), seen)
        assert again.dead_pods == {"uid-old"}
        assert isinstance(d.decide(again), act.ForceDeleteDeadPod)
    # A new term forgets the mark: the node is reachable, so the pod is not dead.
    fence.ledger.begin_term(lambda: True)
    assert fence.observe(observation(view("old"), status=RUNNING), pods).dead_pods \
        == frozenset()


def test_the_replacement_of_a_self_fenced_pod_grows_no_restart_streak() -> None:
    """The node was lost, not the guest: the restart after the force-delete keeps
    ``restartStreak`` (so no backoff grows), while a pod that is simply gone grows it
    (neonvm/controller/restarts.py)."""
    from neonvm.controller import mutations, restarts

    fence, clock, _ = fencing({"n1": NOT_READY})
    clock.now += BOUND
    status = {**RUNNING, "restart_streak": 3, "restart_count": 5,
              "last_restart_time": "2026-01-01T00:00:00.000000Z"}
    assert fence.observe(observation(status=status), {"old": raw_pod()}).dead_pods \
        == {"uid-old"}
    # Force-deleted: the next direct read has no pod.
    seen = fence.observe(dataclasses.replace(
        observation(status=status), now=clock_time(60)), {})
    restart = d.decide(seen)
    assert isinstance(restart, act.Restart) and restart.self_fenced
    after = mutations.restart(restart, LEASE)(vm(**status))
    assert after is not None
    assert (after.restart_count, after.restart_streak) == (6, 3)

    crashed = d.decide(dataclasses.replace(observation(status=status), now=clock_time(60)))
    assert isinstance(crashed, act.Restart) and not crashed.self_fenced
    after = mutations.restart(crashed, LEASE)(vm(**status))
    assert after is not None and after.restart_streak == 4
    assert restarts.restart_backoff(after.restart_streak) > restarts.restart_backoff(3)


def test_a_self_fenced_restart_after_a_quiet_hour_starts_a_new_streak() -> None:
    """The ten-minute quiet window applies before a self-fenced restart keeps the streak:
    a VM that crash-looped long ago (streak 8) and then ran for an hour is replaced at once
    when its node is lost, as when its pod is simply gone (neonvm/controller/restarts.py).
    The old code kept streak 8 with ``lastRestartTime`` now: 60 s of backoff."""
    from neonvm.controller import mutations, restarts

    fence, clock, _ = fencing({"n1": NOT_READY})
    clock.now += BOUND
    status = {**RUNNING, "restart_streak": 8, "restart_count": 9,
              "last_restart_time": "2026-01-01T00:00:00.000000Z"}
    assert fence.observe(observation(status=status), {"old": raw_pod()}).dead_pods \
        == {"uid-old"}
    waits = []
    for seen in (fence.observe(dataclasses.replace(observation(status=status),
                                                   now=clock_time(3600)), {}),
                 dataclasses.replace(observation(status=status), now=clock_time(3600))):
        restart = d.decide(seen)
        assert isinstance(restart, act.Restart)
        after = mutations.restart(restart, LEASE)(vm(**status))
        assert after is not None
        waits.append((restart.self_fenced, after.restart_streak, restarts.backoff_remaining(
            vm(**{**status, "restart_streak": after.restart_streak,
                  "last_restart_time": after.last_restart_time}), clock_time(3600))))
    assert waits == [(True, 1, 0.0), (False, 1, 0.0)]


def clock_time(seconds: float) -> Any:
    """``seconds`` after ``status.lastRestartTime`` of the test above."""
    import datetime as dt

    return dt.datetime(2026, 1, 1, tzinfo=dt.UTC) + dt.timedelta(seconds=seconds)


def test_a_node_read_is_reused_for_a_moment() -> None:
    fence, clock, reads = fencing({"n1": NOT_READY})
    fence.observe(observation(status=RUNNING), {"old": raw_pod()})
    fence.observe(observation(status=RUNNING), {"old": raw_pod()})
    assert reads == ["n1"]
    clock.now += 5
    fence.observe(observation(status=RUNNING), {"old": raw_pod()})
    assert reads == ["n1", "n1"]


# ---- the pod it builds -------------------------------------------------------------------


def scalable_vm(token: str | None = "neonvm-scaling-x") -> VirtualMachine:
    v = vm(scaling_token_secret=token, scaling_token_secret_uid="s-uid" if token else None)
    guest = dataclasses.replace(v.spec.guest, cpus=dataclasses.replace(
        v.spec.guest.cpus, max=type(v.spec.guest.cpus.max).parse("2")))
    return dataclasses.replace(v, spec=dataclasses.replace(v.spec, guest=guest))


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(("seconds", "url", "token", "fences"), [
    (30.0, "http://rights:8082", "neonvm-scaling-x", True),
    (0.0, "http://rights:8082", "neonvm-scaling-x", False),
    (30.0, None, "neonvm-scaling-x", False),
    (30.0, "http://rights:8082", None, False),
])
def test_a_pod_self_fences_only_when_the_controller_says_so_and_it_has_a_token(
        seconds: float, url: str | None, token: str | None, fences: bool) -> None:
    v = scalable_vm(token)
    assert scalable(v)
    plan = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
    pod = podspec.runner_pod(v, plan, podspec.PodDefaults(right_seconds=seconds,
                                                          rights_url=url))
    annotations = pod["metadata"]["annotations"]
    assert (RIGHT_SECONDS_ANNOTATION in annotations) == fences
    if fences:
        assert annotations[RIGHT_SECONDS_ANNOTATION] == "30"
        assert env(pod)["NEONVM_RIGHTS_URL"] == url
        assert env(pod)["NEONVM_RIGHT_SECONDS"] == "30"
    else:
        assert "NEONVM_RIGHTS_URL" not in env(pod)


def test_a_vm_with_a_runner_image_of_its_own_does_not_self_fence() -> None:
    """Its runner may not kill its guest; only the controller's own image is trusted to."""
    v = scalable_vm()
    plan = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
    on = podspec.PodDefaults(right_seconds=30.0, rights_url="http://rights:8082")
    own = dataclasses.replace(v, spec=dataclasses.replace(v.spec, runner_image="mine:1"))
    assert RIGHT_SECONDS_ANNOTATION not in podspec.runner_pod(own, plan, on)["metadata"][
        "annotations"]
    same = dataclasses.replace(v, spec=dataclasses.replace(v.spec,
                                                           runner_image=on.runner_image))
    assert RIGHT_SECONDS_ANNOTATION in podspec.runner_pod(same, plan, on)["metadata"][
        "annotations"]


# ---- the force-delete --------------------------------------------------------------------


class Events:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, str]] = []

    def record(self, vm: Any, reason: str, message: str, warning: bool = False) -> None:
        self.recorded.append((reason, message))


def with_old_pod(uid: str = "uid-old") -> FakeCluster:
    """A cluster holding the VM's pod ``old`` (of ``uid``)."""
    fake = FakeCluster()
    pod = raw_pod()
    pod["metadata"]["uid"] = uid
    fake.add_pod(pod)
    return fake


def perform(fake: FakeCluster, authority: CountingAuthority | None = None,
            events: Events | None = None, condemned: bool = True) -> str:
    from loguru import logger

    from neonvm.controller.fencing import force_delete_dead_pod

    fence, clock, _ = fencing({})
    if condemned:
        clock.now += BOUND
        assert fence.ledger.condemn("uid-old", D) == 0.0
    action = act.ForceDeleteDeadPod(name="old", uid="uid-old", reason="dead")
    check = (authority or CountingAuthority()).check
    return force_delete_dead_pod(fence, fake, events or Events(), action, vm(), check, logger)


def test_the_force_delete_reads_then_checks_then_deletes_with_uid_and_version() -> None:
    fake, authority, events = with_old_pod(), CountingAuthority(), Events()
    read = fake.pod("ns", "old")
    assert read is not None
    checks_by_the_delete: list[int] = []
    fake.race("delete_pod", lambda _: checks_by_the_delete.append(authority.checks))
    with mock.patch.object(fake, "delete_pod", wraps=fake.delete_pod) as delete:
        assert perform(fake, authority, events) == "done"
    assert fake.calls == [("get_pod", "old"), ("delete_pod", "old")]
    assert checks_by_the_delete == [1]  # the authority was checked after the read
    assert delete.call_args.kwargs == {
        "uid": "uid-old", "resource_version": read["metadata"]["resourceVersion"],
        "grace_period_seconds": 0}
    assert fake.pod("ns", "old") is None
    assert [reason for reason, _ in events.recorded] == ["SelfFenced"]


def _bump(fake: FakeCluster) -> None:
    """Another writer's change to the pod (a next term's first grant marks it)."""
    fake.pods[("ns", "old")]["metadata"]["resourceVersion"] = fake.next_rv()


def _remove(fake: FakeCluster) -> None:
    del fake.pods[("ns", "old")]


@pytest.mark.parametrize(("uid", "present", "race", "outcome"), [
    ("uid-old", False, None, "gone"),
    ("another", True, None, "gone"),             # the name holds another pod now
    ("uid-old", True, _bump, "conflict"),        # written between the read and the DELETE
    ("uid-old", True, _remove, "gone"),          # gone between them
], ids=["absent", "another-uid", "written-since-read", "deleted-since-read"])
def test_a_force_delete_that_cannot_land_says_why_and_records_no_event(
        uid: str, present: bool, race: Any, outcome: str) -> None:
    fake, events = with_old_pod(uid), Events()
    if not present:
        fake.pods.clear()
    if race is not None:
        fake.race("delete_pod", race)
    assert perform(fake, events=events) == outcome
    assert events.recorded == []
    if race is _bump:
        assert fake.pod("ns", "old") is not None  # the DELETE did not land


def test_a_pod_the_ledger_did_not_condemn_is_never_force_deleted() -> None:
    fake = with_old_pod()
    assert perform(fake, condemned=False) == "not_condemned"
    assert fake.calls == []


def test_a_cached_observation_reports_a_dead_pod_but_only_a_direct_one_condemns_it() -> None:
    fence, clock, _ = fencing({"n1": NOT_READY})
    clock.now += BOUND
    cached = fence.observe(observation(direct=False, status=RUNNING), {"old": raw_pod()})
    assert cached.dead_pods == {"uid-old"} and not fence.ledger.is_condemned("uid-old")
    assert isinstance(d.decide(dataclasses.replace(cached, pods=(view("old"),))),
                      act.ObserveDirect)
    fence.observe(observation(status=RUNNING), {"old": raw_pod()})
    assert fence.ledger.is_condemned("uid-old")


def test_the_runners_own_right_counts_when_the_annotation_says_less() -> None:
    """The annotation can be patched; the runner's flag is in the pod's immutable spec."""
    fence, clock, _ = fencing({"n1": NOT_READY})
    pod = raw_pod()
    pod["spec"]["containers"][0]["env"][1]["value"] = str(2 * D)
    clock.now += BOUND
    seen = fence.observe(observation(status=RUNNING), {"old": pod})
    assert seen.dead_pods == frozenset()
    assert seen.fence_recheck == pytest.approx(D * (1 + RHO))
    clock.now += D * (1 + RHO)
    assert fence.observe(observation(status=RUNNING), {"old": pod}).dead_pods == {"uid-old"}


@pytest.mark.parametrize("env", [[], [{"name": "NEONVM_RIGHT_SECONDS", "value": "1"}], [
    {"name": "NEONVM_RIGHTS_URL", "value": ""}, {"name": "NEONVM_RIGHT_SECONDS", "value": "1"}]],
    ids=["no-env", "no-url", "empty-url"])
def test_an_annotated_pod_whose_runner_does_not_self_fence_is_never_condemned(
        env: list[dict[str, str]]) -> None:
    """Whoever may patch pods may add the annotation to a pod whose runner keeps its guest
    without a right (a runner image of the owner's choice, self-fencing off): only the
    pod's immutable spec says a runner self-fences, so such a pod is never force-deleted
    (docs/security.md, "Rights endpoint")."""
    fence, clock, _ = fencing({"n1": NOT_READY})
    pod = raw_pod()
    pod["spec"]["containers"] = [{"name": "neonvm-runner", "env": env}]
    for _ in range(3):
        clock.now += 10 * BOUND
        seen = fence.observe(observation(status=RUNNING), {"old": pod})
        assert seen.dead_pods == frozenset() and not fence.ledger.is_condemned("uid-old")
    assert not isinstance(d.decide(seen), act.ForceDeleteDeadPod)


NO_EVICTION = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                "effect": "NoExecute"},
               {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                "effect": "NoExecute"}]


@pytest.mark.parametrize(("seconds", "own", "expected"), [
    # Self-fencing: no eviction 300 s after a node stops reporting (a crashed kubelet's
    # runner still renews: its VM must not restart); the leader replaces a dead one.
    (30.0, None, NO_EVICTION),
    (30.0, [{"key": "dedicated", "operator": "Equal", "value": "vm", "effect": "NoSchedule"}],
     [{"key": "dedicated", "operator": "Equal", "value": "vm", "effect": "NoSchedule"},
      *NO_EVICTION]),
    # The VM's own toleration of a key wins (here: evicted after 60 s).
    (30.0, [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
             "effect": "NoExecute", "tolerationSeconds": 60}],
     [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
       "effect": "NoExecute", "tolerationSeconds": 60}, NO_EVICTION[1]]),
    # Not self-fencing: the VM's tolerations alone (Kubernetes adds its 300 s ones).
    (0.0, None, None),
])
def test_a_self_fencing_pod_is_not_evicted_from_a_node_that_stops_reporting(
        seconds: float, own: list[dict[str, Any]] | None,
        expected: list[dict[str, Any]] | None) -> None:
    v = scalable_vm()
    v = dataclasses.replace(v, spec=dataclasses.replace(v.spec, tolerations=own))
    plan = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
    pod = podspec.runner_pod(v, plan, podspec.PodDefaults(right_seconds=seconds,
                                                          rights_url="http://rights:8082"))
    assert pod["spec"].get("tolerations") == expected


def test_a_vm_that_cannot_scale_self_fences_with_a_token_of_its_own() -> None:
    """The token is the runner's bearer: a self-fencing VM gets one, scalable or not."""
    v = vm(scaling_token_secret="neonvm-scaling-x", scaling_token_secret_uid="s-uid")
    assert not scalable(v)
    plan = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
    on = podspec.PodDefaults(right_seconds=30.0, rights_url="http://rights:8082")
    assert podspec.fencing_eligible(v, on)
    pod = podspec.runner_pod(v, plan, on)
    assert pod["metadata"]["annotations"][RIGHT_SECONDS_ANNOTATION] == "30"
    assert env(pod)["NEONVM_SCALING_TOKEN_FILE"] == f"{podspec.SCALING_DIR}/token"
    assert "NEONVM_SCALING_FENCE_FLOOR" not in env(pod), "it still cannot scale"
    off = podspec.runner_pod(v, plan, podspec.PodDefaults())
    assert "NEONVM_SCALING_TOKEN_FILE" not in env(off)
    assert RIGHT_SECONDS_ANNOTATION not in off["metadata"]["annotations"]


@pytest.mark.parametrize(("right_seconds", "rights_url", "on"), [
    (0.0, None, False), (30.0, None, False), (0.0, "http://rights.ns.svc:8082", False),
    (30.0, "http://rights.ns.svc:8082", True)])
def test_a_replica_looks_for_dead_pods_only_with_self_fencing_on(
        right_seconds: float, rights_url: str | None, on: bool) -> None:
    """Off (no right or no rights URL), a replica condemns nothing: an annotation a
    tenant adds cannot make it force-delete a pod (docs/security.md, "Rights endpoint")."""
    from kubernetes import client

    from neonvm.controller.events import EventRecorder
    from neonvm.controller.manager import ControllerConfig, ControllerProcess
    from neonvm.controller.reconciler import ReconcilerConfig
    from neonvm.leader.election import ElectionConfig
    from neonvm.leader.etcd import EtcdConfig

    defaults = podspec.PodDefaults(right_seconds=right_seconds, rights_url=rights_url)
    process = ControllerProcess(
        client.ApiClient(), EtcdConfig(endpoints=("http://127.0.0.1:1",)),
        ElectionConfig(namespace="ns", name="fencing"),
        ControllerConfig(reconciler=ReconcilerConfig(pod_defaults=defaults)),
        events=EventRecorder(None))
    assert (process.fencing is not None) == on
