"""Every action's outcomes, end to end through the shipped driver and handler, over fakes.

For each action the driver performs against the API server, a VM is brought (by the
shipped performers, over :class:`tests.support.fake_cluster.FakeCluster`) to the state in which
``decide``'s next answer is that action. Then one key's turn runs through the shipped
:class:`~neonvm.controller.handler.Handler` and :class:`~neonvm.controller.reconciler.
Reconciler`, with the action's call to the API server answering once:

* ``ok``: as the API server would;
* ``conflict`` (409), ``gone`` (404), ``invalid`` (422), ``unavailable`` (503): that error
  instead (nothing changes on the server), once; the call after it is answered normally;
* ``fence_lost``: the reconcile's authority (the lease, the lock, the epoch) is lost at
  the check just before the action's write, while the term goes on;
* ``fenced_out``: just before the action's call, someone writes the VM's
  ``status.fence`` ahead of ours by its token (our epoch, a higher token: what the
  locks' tokens going back leaves behind).

The table says, for each (action, answer): what the performer made of it (its step's
outcome, ``None`` when it raised), the turn's :class:`~neonvm.controller.handler.Outcome`
kind (the handler's documented contract: docs/architecture.md, "The handler's
contract"), and whether the action's effect is on the server after the turn.

Pure logic beside the real-server tests of the same paths (``test_reconcile.py``,
``test_reconcile_loops.py``, ``test_ungate_list.py``, ``test_create_errors.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from loguru import logger

from neonvm.api import types
from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller.action_table import ACTIONS
from neonvm.controller.fencing import SelfFencing
from neonvm.controller.handler import Handler, Outcome
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from neonvm.controller.rights import RightsLedger
from neonvm.controller.step import write_status
from neonvm.controller.timers import VMTimers
from neonvm.controller.update import RetryPolicy
from neonvm.controller.workqueue import WorkQueue
from tests.support import CountingAuthority, shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster, api_error

pytestmark = pytest.mark.unit

NS, NAME = "ns", "vm"
KEY = f"{NS}/{NAME}"
EXTRA = "vm-stray"
"""A pod labelled for the VM that its status does not name (DeletePod's target)."""


def vm_object(finalizers: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": NAME, "namespace": NS, "generation": 1,
                     "finalizers": finalizers},
        # No acceleration asked: nothing asks the runner for its report (no network).
        "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                 "guest": {"rootDisk": {"image": "img"}}},
        "status": {},
    }


def reconciler_over(fake: FakeCluster, steps: list[tuple[str, str]] | None = None
                    ) -> Reconciler:
    def after_step(key: str, step: str, outcome: str) -> None:
        if steps is not None:
            steps.append((step, outcome))

    return shipped_reconciler(client.ApiClient(), cluster=fake, after_step=after_step,
                              config=ReconcilerConfig(retry=RetryPolicy(initial_backoff=0.0,
                                                                max_backoff=0.0)),
                              fencing=rights_long_over())


def rights_long_over() -> SelfFencing:
    """Self-fencing on, in a term that began an hour ago (every right any term granted is
    surely over) on a cluster whose Nodes are all gone: a self-fencing pod that is not
    ready is condemned at its first direct read. Pods without
    :data:`RIGHT_SECONDS_ANNOTATION` (every other scenario's) are never looked at."""
    now = [0.0]
    ledger = RightsLedger(lambda: now[0])
    ledger.begin_term(lambda: True)
    now[0] = 3600.0
    return SelfFencing(ledger, lambda node: None, clock=lambda: now[0])


def advance(fake: FakeCluster, until: type[act.Action]) -> act.Action:
    """Perform ``decide``'s answers (from direct reads, by the shipped performers) until
    the next one is an ``until``; that one, unperformed."""
    rec = reconciler_over(fake)
    authority = StaticAuthority(epoch=1, token=5)
    for _ in range(12):
        snap = rec.observe(KEY, authority, direct=True)
        action = d.decide(snap.obs)
        if isinstance(action, until):
            return action
        assert type(action) in ACTIONS, f"stopped at {action} before {until.__name__}"
        outcome = rec._perform(KEY, action, snap, authority, logger)
        assert outcome in ("done", "replaced"), (action, outcome)
    raise AssertionError(f"never reached {until.__name__}")


def status(fake: FakeCluster) -> dict[str, Any]:
    vm = fake.vm(NS, NAME)
    return (vm or {}).get("status") or {}


def committed(fake: FakeCluster) -> dict[str, Any] | None:
    name = status(fake).get("podName")
    return fake.pod(NS, name) if name else None


def running(fake: FakeCluster) -> None:
    """The committed pod is ungated, scheduled and running."""
    advance(fake, act.Ungate)
    rec = reconciler_over(fake)
    authority = StaticAuthority(epoch=1, token=5)
    snap = rec.observe(KEY, authority, direct=True)
    action = d.decide(snap.obs)
    assert isinstance(action, act.Ungate), action
    assert rec._perform(KEY, action, snap, authority, logger) == "done"
    pod = committed(fake)
    assert pod is not None
    pod["spec"]["nodeName"] = "node-1"
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7",
                     "containerStatuses": [{"name": "neonvm-runner", "ready": True}]}
    pod["metadata"]["resourceVersion"] = fake.next_rv()


# ---- the scenarios: a world in which the next answer is the action -------------------------


@dataclass(frozen=True)
class Scenario:
    prepare: Callable[[FakeCluster], None]
    call: str
    """The call the action makes (what answers with the error)."""
    effect: Callable[[FakeCluster], bool]
    """The action's effect is on the server."""


def _add_finalizer(fake: FakeCluster) -> None:
    fake.add_vm(vm_object([]))


def _record_plan(fake: FakeCluster) -> None:
    fake.add_vm(vm_object([types.FINALIZER]))


def _create_pod(fake: FakeCluster) -> None:
    _record_plan(fake)
    advance(fake, act.CreatePod)


def _commit(fake: FakeCluster) -> None:
    _record_plan(fake)
    advance(fake, act.Commit)


def _ungate(fake: FakeCluster) -> None:
    _record_plan(fake)
    advance(fake, act.Ungate)


def _sync_status(fake: FakeCluster) -> None:
    _record_plan(fake)
    running(fake)


def _delete_pod(fake: FakeCluster) -> None:
    _sync_status(fake)
    advance(fake, act.Done)
    owner = {"apiVersion": types.API_VERSION, "kind": types.KIND, "name": NAME,
             "uid": fake.vms[(NS, NAME)]["metadata"]["uid"], "controller": True}
    fake.add_pod({"metadata": {"name": EXTRA, "namespace": NS,
                               "labels": {types.LABEL_VM_NAME: NAME},
                               "ownerReferences": [owner]},
                  "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}]}})


def _restart(fake: FakeCluster) -> None:
    _sync_status(fake)
    advance(fake, act.Done)
    del fake.pods[(NS, status(fake)["podName"])]  # deleted by a user


def _drop_plan(fake: FakeCluster) -> None:
    _record_plan(fake)
    advance(fake, act.CreatePod)
    planned = status(fake)["pendingPod"]["name"]
    # A pod planted under the planned name, labelled for the VM but not made by our
    # create (no fence annotations): it is never adopted.
    fake.add_pod({"metadata": {"name": planned, "namespace": NS,
                               "labels": {types.LABEL_VM_NAME: NAME}},
                  "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}]}})


def _remove_finalizer(fake: FakeCluster) -> None:
    raw = vm_object([types.FINALIZER])
    raw["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    fake.add_vm(raw)


def _force_delete_dead_pod(fake: FakeCluster) -> None:
    _sync_status(fake)
    advance(fake, act.Done)
    pod = committed(fake)
    assert pod is not None
    # Its runner self-fences; its node stopped answering (the node lifecycle controller
    # marks the pod not ready). The Node is gone and the right long over (above).
    pod["metadata"].setdefault("annotations", {})[RIGHT_SECONDS_ANNOTATION] = "30"
    pod["spec"]["containers"][0].setdefault("env", []).extend([  # as the controller builds it
        {"name": "NEONVM_RIGHTS_URL", "value": "http://rights.neonvm-system.svc:8082"},
        {"name": "NEONVM_RIGHT_SECONDS", "value": "30"}])
    pod["status"]["conditions"] = [{"type": "Ready", "status": "Unknown"}]
    pod["metadata"]["resourceVersion"] = fake.next_rv()


def _self_fencing_pod_gone(fake: FakeCluster) -> bool:
    return not any(RIGHT_SECONDS_ANNOTATION in (p["metadata"].get("annotations") or {})
                   for p in fake.pods.values())


AUTOSCALING_LABEL = "autoscaling.neon.tech/enabled"


def _sync_pod_metadata(fake: FakeCluster) -> None:
    _sync_status(fake)
    advance(fake, act.Done)
    vm = fake.vms[(NS, NAME)]
    vm["metadata"].setdefault("labels", {})[AUTOSCALING_LABEL] = "true"  # set afterwards
    vm["metadata"]["resourceVersion"] = fake.next_rv()


def _plan_seq(fake: FakeCluster) -> int:
    return int(status(fake).get("planSeq") or 0)


SCENARIOS: dict[type[act.Action], Scenario] = {
    act.AddFinalizer: Scenario(
        _add_finalizer, "put_main",
        lambda f: types.FINALIZER in (f.vms[(NS, NAME)]["metadata"].get("finalizers") or [])),
    act.RecordPlan: Scenario(_record_plan, "put_status", lambda f: _plan_seq(f) == 1),
    act.CreatePod: Scenario(_create_pod, "create_pod", lambda f: bool(f.pods)),
    act.Commit: Scenario(_commit, "put_status", lambda f: bool(status(f).get("podName"))),
    act.Ungate: Scenario(_ungate, "ungate_pod", lambda f: not (
        (committed(f) or {}).get("spec", {}).get("schedulingGates"))),
    act.SyncStatus: Scenario(_sync_status, "put_status",
                           lambda f: status(f).get("phase") == "Running"),
    act.DeletePod: Scenario(_delete_pod, "delete_pod", lambda f: f.pod(NS, EXTRA) is None),
    act.Restart: Scenario(_restart, "put_status",
                        lambda f: int(status(f).get("restartCount") or 0) == 1),
    act.DropPlan: Scenario(_drop_plan, "put_status", lambda f: _plan_seq(f) > 1),
    act.RemoveFinalizer: Scenario(_remove_finalizer, "put_main",
                                lambda f: f.vm(NS, NAME) is None),
    act.ForceDeleteDeadPod: Scenario(_force_delete_dead_pod, "delete_pod",
                                   _self_fencing_pod_gone),
    act.SyncPodMetadata: Scenario(_sync_pod_metadata, "patch_pod_metadata", lambda f: (
        ((committed(f) or {}).get("metadata") or {}).get("labels") or {}).get(
            AUTOSCALING_LABEL) == "true"),
}

ANSWERS = ("ok", "conflict", "gone", "invalid", "unavailable", "fence_lost", "fenced_out")
STATUS_OF = {"conflict": 409, "gone": 404, "invalid": 422, "unavailable": 503}


@dataclass(frozen=True)
class Expect:
    step: str | None
    """The performer's outcome for the action (None: it raised, no step was counted)."""
    kind: str
    """The turn's handler outcome."""
    effect: bool
    """The action's effect is on the server after the turn."""


RAISED = Expect(None, "temporary", False)
"""The error went up to the handler: retried with backoff, read directly."""

VM_WRITE = {
    "ok": Expect("done", "requeue", True),
    # The conditional update re-reads and re-applies the intent to the fresh copy.
    "conflict": Expect("done", "requeue", True),
    "gone": RAISED, "invalid": RAISED, "unavailable": RAISED, "fence_lost": RAISED,
    # The write's 409 re-reads a copy fenced ahead: the mutation refuses it (FencedOut),
    # the authority still holds, and a fence ahead by its token only ends the term.
    "fenced_out": Expect(None, "permanent", False),
}

FINALIZER_WRITE = {
    **VM_WRITE,
    # The finalizer's write to the main resource carries no fence: it lands, and the
    # next status write (the plan's) is the one fenced out.
    "fenced_out": Expect("done", "permanent", True),
}

POD_WRITE_FENCED = Expect("done", "permanent", True)
"""A pod write is guarded by the authority and its own preconditions, not by the VM's
status fence: it lands, and the next status write (after a create: the commit) is the
one fenced out."""
LAST_POD_WRITE_FENCED = Expect("done", "requeue", True)
"""The same, when no status write follows in the turn (after the ungate the VM waits for
its pod with nothing to write; after a clean-up it has converged): nothing meets the
fence, so the turn ends as after a success, and the fence is found by the VM's next
status write (``decide`` fences on the epoch alone)."""

EXPECTED: dict[type[act.Action], dict[str, Expect]] = {
    act.AddFinalizer: FINALIZER_WRITE,
    act.RecordPlan: VM_WRITE,
    act.Commit: VM_WRITE,
    act.SyncStatus: VM_WRITE,
    act.Restart: VM_WRITE,
    act.DropPlan: VM_WRITE,
    act.RemoveFinalizer: {
        **VM_WRITE,
        # Unfenced, as AddFinalizer; the VM is gone with it, so nothing is fenced out.
        "fenced_out": Expect("done", "requeue", True),
    },
    act.CreatePod: {
        "ok": Expect("done", "requeue", True),
        # The name is taken, by no pod labelled for the VM: observe again, create again.
        "conflict": Expect("exists", "requeue", True),
        # 404 (a namespace in flux) and 5xx are transient: retried with backoff.
        "gone": RAISED,
        # Refused for this generation: Degraded CreateRefused, no retry until it changes.
        "invalid": Expect("refused", "requeue", False),
        "unavailable": RAISED,
        "fence_lost": RAISED,
        "fenced_out": POD_WRITE_FENCED,
    },
    act.Ungate: {
        "ok": Expect("done", "requeue", True),
        # Any refusal of the precondition: observe again (a new list), ungate again.
        "conflict": Expect("precondition", "requeue", True),
        "gone": Expect("precondition", "requeue", True),
        "invalid": Expect("precondition", "requeue", True),
        "unavailable": RAISED,
        "fence_lost": RAISED,
        "fenced_out": LAST_POD_WRITE_FENCED,
    },
    act.DeletePod: {
        "ok": Expect("done", "requeue", True),
        # Gone or replaced: observe again; the pod is still listed, so delete again.
        "conflict": Expect("gone", "requeue", True),
        "gone": Expect("gone", "requeue", True),
        "invalid": RAISED,
        "unavailable": RAISED,
        "fence_lost": RAISED,
        "fenced_out": LAST_POD_WRITE_FENCED,
    },
    act.ForceDeleteDeadPod: {
        "ok": Expect("done", "requeue", True),
        # Changed since its read (409) or gone (404): observe again; the pod is still
        # listed and condemned, so read it and delete again.
        "conflict": Expect("conflict", "requeue", True),
        "gone": Expect("gone", "requeue", True),
        "invalid": RAISED,
        "unavailable": RAISED,
        # Lost at the check before any pod write: the pod is neither read nor deleted
        # (the performer checks once more between its read and its DELETE).
        "fence_lost": RAISED,
        # Lands; the restart that follows (the committed pod is gone) is fenced out.
        "fenced_out": POD_WRITE_FENCED,
    },
    act.SyncPodMetadata: {
        "ok": Expect("done", "requeue", True),
        # The pod changed since it was observed (409): observe again, directly; the
        # labels still differ, so patch again.
        "conflict": Expect("conflict", "requeue", True),
        # Refused (422, such as over the size limit): patching again cannot help. The
        # turn ends stuck (Degraded, the stuck backoff), not 30 patches in a row.
        "invalid": Expect("invalid", "requeue", False),
        "gone": Expect("gone", "requeue", True),
        "unavailable": RAISED,
        "fence_lost": RAISED,
        "fenced_out": LAST_POD_WRITE_FENCED,
    },
}


def _turn(fake: FakeCluster, authority: CountingAuthority,
          steps: list[tuple[str, str]], ending: bool = False) -> Outcome:
    """One key's turn through the shipped handler, read directly."""
    handler = Handler(
        queue=WorkQueue(), vms=_NoCache(), reconciler=reconciler_over(fake, steps),
        read_vm=fake.get_vm_raw,
        acquire=lambda namespace, name, uid: object(),  # type: ignore[arg-type,return-value]
        authority=lambda guard: authority, release_lock=lambda key: None,
        timers=VMTimers(), term_ending=lambda: ending, end_term=lambda: None,
        metrics=ControllerMetrics(), log=logger)
    return handler.handle(KEY, direct=True)


def _fence_ahead_by_token(fake: FakeCluster) -> None:
    vm = fake.vms[(NS, NAME)]
    vm["status"]["fence"] = {"epoch": 1, "token": 99}
    vm["metadata"]["resourceVersion"] = fake.next_rv()


class _NoCache:
    def get(self, key: str) -> dict[str, Any] | None:
        return None

    def discard(self, key: str, uid: str) -> bool:
        return False


def test_the_table_covers_every_action_the_driver_performs_against_the_api_server() -> None:
    performed = {kind for kind, row in ACTIONS.items() if row.writes != "runner"}
    scaling = {act.PlanScale, act.CommitScale, act.DropScale}
    assert set(SCENARIOS) == set(EXPECTED) == performed - scaling, (
        "an action performed against the API server needs its scenario and its row here")
    assert all(set(row) == set(ANSWERS) for row in EXPECTED.values())


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("kind", list(SCENARIOS), ids=lambda k: k.__name__)
def test_each_answer_to_each_action_ends_the_turn_as_the_contract_says(
        kind: type[act.Action], answer: str) -> None:
    scenario, expect = SCENARIOS[kind], EXPECTED[kind][answer]
    fake = FakeCluster()
    scenario.prepare(fake)
    assert not scenario.effect(fake), "the effect is there before the action"
    reconciler = reconciler_over(fake)
    snap = reconciler.observe(KEY, StaticAuthority(epoch=1, token=5), direct=True)
    obs = reconciler._fenced(snap.obs, snap)  # as the driver's loop decides
    assert isinstance(d.decide(obs), kind), d.decide(obs)

    before = fake.count(scenario.call)
    authority = CountingAuthority(token=5)
    if answer == "fence_lost":
        authority.lose_at = 2  # the reconcile's first check passes; the write's does not
    elif answer == "fenced_out":
        fake.race(scenario.call, _fence_ahead_by_token)
    elif answer != "ok":
        fake.fail(scenario.call, api_error(STATUS_OF[answer]))
    steps: list[tuple[str, str]] = []
    outcome = _turn(fake, authority, steps)

    first = steps[0] if steps else None
    assert (first[1] if first else None) == expect.step, (steps, outcome)
    if first is not None:
        assert first[0] == kind.step, steps
    assert outcome.kind == expect.kind, outcome
    if outcome.kind == "temporary":
        assert outcome.direct and outcome.bug is None, outcome
    assert scenario.effect(fake) is expect.effect, (status(fake), steps)
    if answer == "fence_lost":
        assert fake.count(scenario.call) == before, "a write after the authority was lost"
    else:
        assert fake.count(scenario.call) > before, "the action's call was never made"
        assert fake.pending_faults(scenario.call) == 0


@pytest.mark.parametrize("kind", list(SCENARIOS), ids=lambda k: k.__name__)
def test_an_authority_lost_while_the_term_ends_drops_the_key(kind: type[act.Action]) -> None:
    """The same loss as ``fence_lost`` above, while the term is ending: nothing is
    requeued (the next leader lists every VM) and nothing is written."""
    scenario = SCENARIOS[kind]
    fake = FakeCluster()
    scenario.prepare(fake)
    before = fake.count(scenario.call)
    steps: list[tuple[str, str]] = []
    outcome = _turn(fake, CountingAuthority(token=5, lose_at=2), steps, ending=True)
    assert outcome.kind == "dropped", outcome
    assert steps == [] and fake.count(scenario.call) == before
    assert not scenario.effect(fake)


class _PrunedLookCluster(FakeCluster):
    """An API server whose CRD is older than the controller: it prunes the look's fields
    (``scaleLookPodUID``, ``scaleLookSince``) from every status write."""

    def put_status(self, record: Any, status: Any) -> Any:
        pruned = dataclasses.replace(status, scale_look_pod_uid=None, scale_look_since=None)
        return super().put_status(record, pruned)


def test_a_look_field_pruned_by_an_older_crd_is_warned_about_once() -> None:
    # Review lookfix L7: Helm never upgrades crds/, so an old CRD silently drops the
    # look's record. The controller notices that the answer lacks what it wrote, and
    # says so once (nothing else changes).
    fake = _PrunedLookCluster()
    fake.add_vm(vm_object([types.FINALIZER]))
    process_warned = threading.Event()  # the process's: shared by its terms' reconcilers
    terms = [shipped_reconciler(client.ApiClient(), cluster=fake, old_crd_warned=process_warned)
             for _ in range(2)]
    authority = StaticAuthority(epoch=1, token=5)

    def asks_for_a_look(vm: types.VirtualMachine) -> types.VirtualMachineStatus:
        new = dataclasses.replace(vm.status, scale_look_pod_uid="uid-1",
                                  scale_look_since="2026-01-01T00:00:00Z",
                                  restart_count=vm.status.restart_count + 1)
        return new

    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING",
                      filter=lambda r: "CRD is older" in r["message"])
    try:
        for rec in (*terms, *terms):
            snap = rec.observe(KEY, authority, direct=True)
            assert write_status(rec.ctx, KEY, snap, asks_for_a_look, authority, logger)
    finally:
        logger.remove(sink)
    assert status(fake)["restartCount"] == 4 and "scaleLookPodUID" not in status(fake)
    assert len(warnings) == 1, warnings
    # An API server that keeps the field: no warning.
    kept = FakeCluster()
    kept.add_vm(vm_object([types.FINALIZER]))
    rec = reconciler_over(kept)
    sink = logger.add(lambda m: warnings.append(str(m)), level="WARNING",
                      filter=lambda r: "CRD is older" in r["message"])
    try:
        snap = rec.observe(KEY, authority, direct=True)
        assert write_status(rec.ctx, KEY, snap, asks_for_a_look, authority, logger)
    finally:
        logger.remove(sink)
    assert status(kept)["scaleLookPodUID"] == "uid-1" and len(warnings) == 1


def test_a_look_given_up_is_a_warning_event_and_an_ordinary_end_is_none() -> None:
    # Review lookfix L3: the write that gives the look up says so (Warning event
    # ScaleLookGivenUp with the decision's reason); the other adopts record no event.
    from neonvm.controller.reasons import LOOK_GIVEN_UP

    row = ACTIONS[act.CommitScale]
    assert row.event is not None
    vm = types.VirtualMachine.from_object(vm_object([types.FINALIZER]))
    given_up = act.CommitScale(seq=1, adopt=True, pod_uid="uid-1", ends_look=True,
                             look_recorded=True, gives_up=True, reason="no answer for an hour")
    event = row.event(given_up, vm)
    assert event is not None and (event.reason, event.warning) == (LOOK_GIVEN_UP, True)
    assert event.message == "no answer for an hour"
    ended = dataclasses.replace(given_up, gives_up=False, vcpus=1, memory_bytes=1 << 30)
    assert row.event(ended, vm) is None


def test_a_lasting_422_on_the_pods_autoscaling_metadata_ends_the_turn_stuck_and_says_so() -> None:
    """A VM whose autoscaling annotations no longer fit its pod (the API server's total
    size limit) gets a 422 on every patch: one patch per turn, then Degraded naming the
    refusal, not the step budget spent on 30 patches and 30 reads (docs/security.md)."""
    fake = FakeCluster()
    _sync_pod_metadata(fake)
    too_large = api_error(422)
    fake.fail("patch_pod_metadata", *[too_large] * 40)
    before = fake.count("patch_pod_metadata")
    steps: list[tuple[str, str]] = []
    _turn(fake, CountingAuthority(token=5), steps)
    assert steps == [(act.SyncPodMetadata.step, "invalid")]
    assert fake.count("patch_pod_metadata") == before + 1
    degraded = next(c for c in status(fake).get("conditions") or []
                    if c["type"] == "Degraded")
    assert degraded["status"] == "True"
    assert "SyncPodMetadata" in degraded["reason"] and "422" in degraded["message"]
