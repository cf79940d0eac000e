"""The autoscaler's view after a live scale: what NeonVM's autoscaler-agent and scheduler
plugin read (the pod's resources and usage annotations, status.cpus, currentRevision, the
Available condition) follows every scale that lands. docs/neonvm-compat.md, "The
autoscaler's view"."""

from __future__ import annotations

import datetime as dt
import http.server
import json
import threading
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import times, types
from neonvm.api.millicpu import MilliCPU
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view as av
from neonvm.controller import decide as d
from neonvm.controller.podspec import ANNOTATION_RESOURCES, ANNOTATION_USAGE
from tests.support import shipped_reconciler
from tests.support.autoscaler_view import AGENT_STAMP, vm_of
from tests.support.harness import create_vm, get_vm, runner_pods
from tests.support.reconcile import NOWHERE, settle

GIB = 1 << 30


# ---- pure derivations -------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("use", "vcpus", "expected"), [
    ("250m", 1, MilliCPU(250)),    # fractional: what was asked for, not the vCPU plugged
    ("1500m", 2, MilliCPU(1500)),
    (2, 2, MilliCPU(2000)),
    ("250m", 2, MilliCPU(2000)),   # the spec moved on: the whole vCPUs the guest has
    (1, 2, MilliCPU(2000)),
])
def test_status_cpus_is_the_fractional_use_the_whole_vcpus_round_up_to(
        use: object, vcpus: int, expected: MilliCPU) -> None:
    vm = vm_of({"min": "250m", "max": 2, "use": use})
    assert av.landed_cpus(vm, vcpus) == expected


@pytest.mark.unit
def test_the_resources_annotation_is_neonvms_json_with_use_at_the_landed_size() -> None:
    vm = vm_of({"min": "250m", "max": 2, "use": "1500m"}, slots=2)
    assert json.loads(av.resources_json(vm, MilliCPU(1500), 2)) == {
        "cpus": {"min": "250m", "max": 2, "use": "1500m"},
        "memorySlots": {"min": 1, "max": 2, "use": 2}, "memorySlotSize": "1Gi"}
    assert json.loads(av.usage_json(MilliCPU(250), GIB)) == {"cpu": "250m", "memory": "1Gi"}


NOW = dt.datetime(2026, 12, 5, 5, 30, 0, tzinfo=dt.UTC)


@pytest.mark.unit
@pytest.mark.parametrize(("status", "stamped"), [
    # Running at the spec's size (1 vCPU for 250m, 1 slot): stamped now.
    ({"phase": "Running", "cpus": "250m", "memorySize": "1Gi"}, True),
    # Not yet at the spec's size: a plan is still to come.
    ({"phase": "Running", "cpus": 2, "memorySize": "1Gi"}, False),
    ({"phase": "Running", "cpus": "250m", "memorySize": "2Gi"}, False),
    # A plan recorded, or not running: not landed.
    ({"phase": "Scaling", "cpus": "250m", "memorySize": "1Gi",
      "pendingScale": {"cpus": 1, "memorySlots": 1, "seq": 1, "epoch": 1, "token": 1,
                       "podName": "p", "podUID": "pu", "generation": 1}}, False),
    ({"phase": "Pending", "cpus": "250m", "memorySize": "1Gi"}, False),
    # Already the current revision: its stamp stays.
    ({"phase": "Running", "cpus": "250m", "memorySize": "1Gi",
      "currentRevision": {"revision": {"value": 7, "flags": 0},
                          "updatedAt": "2021-01-01T00:00:00Z"}}, False),
])
def test_current_revision_is_stamped_when_the_vm_runs_at_the_spec_size(
        status: dict[str, Any], stamped: bool) -> None:
    vm = vm_of({"min": "250m", "max": 2, "use": "250m"}, revision=7, status=status)
    new = vm.status
    before = new.current_revision
    assert av.propagate_revision(new, vm, NOW) is stamped
    if stamped:
        assert new.current_revision is not None
        assert new.current_revision.revision == types.Revision(value=7, flags=0)
        assert new.current_revision.updated_at == "2026-12-05T05:30:00Z"  # not AGENT_STAMP
    else:
        assert new.current_revision == before


@pytest.mark.unit
@pytest.mark.parametrize(("status_cpus", "use", "plans"), [
    ("500m", "750m", True),    # within the guest's one vCPU: a plan all the same
    (1, "750m", True),         # status recorded whole vCPUs (an older plan): the same
    ("1500m", "1750m", True),
    ("750m", "750m", False),   # status says the spec's fraction already
    (2, 2, False),
])
def test_a_cpus_use_changed_within_the_guests_vcpus_starts_a_plan_of_the_same_vcpus(
        status_cpus: object, use: str, plans: bool) -> None:
    """The pod's resources and usage annotations are written by a plan's fenced write only:
    a fraction that moved within the same whole vCPUs gets a plan (the runner keeps its
    vCPUs), so the scheduler plugin and the runner's quota see it."""
    vm = vm_of({"min": "250m", "max": 2, "use": use}, status={
        "phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
        "podIP": "10.0.0.1", "cpus": status_cpus, "memorySize": "1Gi", "scaleSeq": 3})
    pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                      phase="Running", node="n1", ip="10.0.0.1")
    action = d.decide(act.Observation(vm=vm, pods=(pod,), lease=act.Fence(epoch=1, token=1),
                                      direct=True))
    if plans:
        assert isinstance(action, act.PlanScale), action
        vcpus = MilliCPU.parse(use).rounded_up()
        assert (action.plan.cpus, action.plan.memory_slots, action.plan.seq) == (vcpus, 1, 4)
    else:
        assert isinstance(action, act.Done), action


@pytest.mark.unit
@pytest.mark.parametrize(("generation", "expected"), [
    (1, MilliCPU(750)),    # the spec the plan was made for: its fraction
    (2, MilliCPU(1000)),   # the spec moved since: whole vCPUs, and the next plan follows
])
def test_a_committed_plan_writes_the_fraction_of_the_spec_it_was_made_for(
        generation: int, expected: MilliCPU) -> None:
    from neonvm.controller.action_table import status_mutation

    vm = vm_of({"min": "250m", "max": 2, "use": "750m"}, status={
        "phase": "Scaling", "podName": "p", "podUID": "pu", "scaleSeq": 4, "cpus": "500m",
        "memorySize": "1Gi", "pendingScale": {
            "cpus": 1, "memorySlots": 1, "seq": 4, "epoch": 1, "token": 1, "podName": "p",
            "podUID": "pu", "generation": 1}})
    vm.generation = generation
    new = status_mutation(act.CommitScale(seq=4, vcpus=1, memory_bytes=GIB),
                          act.Fence(epoch=1, token=1))(vm)
    assert new is not None and new.cpus == expected
    assert not av.at_spec_size(vm, new) or expected == MilliCPU(750)


@pytest.mark.unit
def test_no_target_revision_leaves_current_revision_alone() -> None:
    vm = vm_of({"min": 1, "max": 2, "use": 1},
               status={"phase": "Running", "cpus": 1, "memorySize": "1Gi"})
    assert not av.propagate_revision(vm.status, vm, NOW)
    assert vm.status.current_revision is None


@pytest.mark.unit
def test_the_autoscaling_metadata_drift_is_a_merge_patch_of_the_vms_keys_only() -> None:
    vm = vm_of({"min": 1, "max": 2, "use": 1})
    vm.labels = {"autoscaling.neon.tech/enabled": "true", "team": "a"}
    vm.annotations = {"autoscaling.neon.tech/bounds": '{"min":1}'}
    pod = {"labels": {"autoscaling.neon.tech/enabled": "false",
                      "autoscaling.neon.tech/gone": "x", "team": "b"},
           "annotations": {"other": "1"}}
    assert av.metadata_drift(vm, pod) == {
        "labels": {"autoscaling.neon.tech/enabled": "true", "autoscaling.neon.tech/gone": None},
        "annotations": {"autoscaling.neon.tech/bounds": '{"min":1}'}}
    synced = {"labels": {"autoscaling.neon.tech/enabled": "true", "team": "b"},
              "annotations": {"autoscaling.neon.tech/bounds": '{"min":1}'}}
    assert av.metadata_drift(vm, synced) is None


@pytest.mark.unit
def test_available_is_true_while_the_vm_runs_on_its_pod() -> None:
    from neonvm.controller.conditions import desired_conditions
    from neonvm.controller.observe import Snapshot

    vm = vm_of({"min": 1, "max": 2, "use": 1},
               status={"phase": "Running", "podName": "p", "podUID": "pu",
                       "cpus": 1, "memorySize": "1Gi"})
    running = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                        phase="Running", node="n1", ip="10.0.0.1")
    for pods, status in (((running,), "True"), ((), "False")):
        obs = act.Observation(vm=vm, pods=pods, lease=act.Fence(epoch=1, token=1), direct=True)
        updates = {u.type: u for u in desired_conditions(Snapshot(obs=obs, record=None),
                                                         act.Done())}
        assert updates["Available"].status == status and "Ready" not in updates


# ---- real server --------------------------------------------------------------------------


class ApplyingRunner:
    """Stands in for a runner that takes every size it is asked for (a real runner does so
    in tests/test_runner_scaling.py; booting a guest here would add nothing the
    controller reads): ``PUT /scale`` records the size and fence and answers 200, ``GET
    /scale`` reports them."""

    def __init__(self) -> None:
        self.size: dict[str, Any] = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}
        self.fence: dict[str, int] = {"epoch": 0, "token": 0, "seq": 0}
        self.pod_uid: str | None = None
        self.puts: list[dict[str, Any]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _report(self) -> dict[str, Any]:
                return {"mode": "QmpScaling", "lastApplied": {"fence": outer.fence},
                        "qemu": outer.size, "podUid": outer.pod_uid, "pendingRemovals": []}

            def do_GET(self) -> None:
                self._answer(self._report())

            def do_PUT(self) -> None:
                asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.puts.append(asked)
                outer.fence = asked["fence"]
                outer.size = {"vcpus": asked["cpus"], "memorySlots": asked["memorySlots"],
                              "memoryBytes": asked["memorySlots"] * GIB}
                self._answer(self._report())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_patch(api: client.ApiClient, namespace: str, name: str, cpu: str, slots: int,
                revision: int) -> None:
    """What NeonVM's autoscaler-agent sends (pkg/agent, doNeonVMRequest): a JSON patch
    replacing cpus.use (a quantity), memorySlots.use and targetRevision (stamped by the
    agent's clock)."""
    kube.request(api, "PATCH", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/"
                 f"{types.PLURAL}/{name}", [
                     {"op": "replace", "path": "/spec/guest/cpus/use", "value": cpu},
                     {"op": "replace", "path": "/spec/guest/memorySlots/use", "value": slots},
                     {"op": "replace", "path": "/spec/targetRevision", "value": {
                         "revision": {"value": revision, "flags": 0},
                         "updatedAt": AGENT_STAMP}}],
                 content_type="application/json-patch+json")


def condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in [*(status.get("conditions") or []),
                            *(status.get("extraConditions") or [])]
                if c["type"] == type_)


@pytest.mark.cluster
def test_a_scale_the_autoscaler_agent_asks_for_shows_in_the_pod_and_status_it_reads(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    from neonvm.controller.scaling import RunnerScaling

    runner = ApplyingRunner()
    try:
        create_vm(api, namespace, "agent", spec={
            "nodeSelector": NOWHERE,
            "guest": {"cpus": {"min": "250m", "max": 2, "use": "250m"},
                      "memorySlots": {"min": 1, "max": 2, "use": 1},
                      "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
        key = f"{namespace}/agent"
        reconciler = shipped_reconciler(controller_api, scaling=RunnerScaling(
            controller_api, address=lambda vm, pod: f"http://127.0.0.1:{runner.port}"))
        settle(reconciler, key)
        (pod,) = runner_pods(api, namespace, "agent")
        runner.pod_uid = pod.metadata.uid
        client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
        settle(reconciler, key)
        raw = get_vm(api, namespace, "agent")
        assert raw is not None
        assert (raw["status"]["phase"], raw["status"]["cpus"]) == ("Running", "250m")
        assert condition(raw["status"], "Available")["status"] == "True"

        before = dt.datetime.now(dt.UTC).replace(microsecond=0)
        agent_patch(api, namespace, "agent", "1500m", 2, revision=7)
        assert isinstance(settle(reconciler, key).action, act.Done)

        assert [(p["cpus"], p["memorySlots"]) for p in runner.puts] == [(2, 2)]
        (after,) = runner_pods(api, namespace, "agent")
        assert after.metadata.uid == pod.metadata.uid  # the same pod, scaled live
        annotations = after.metadata.annotations
        assert json.loads(annotations[ANNOTATION_RESOURCES]) == {
            "cpus": {"min": "250m", "max": 2, "use": "1500m"},
            "memorySlots": {"min": 1, "max": 2, "use": 2}, "memorySlotSize": "1Gi"}
        assert json.loads(annotations[ANNOTATION_USAGE]) == {"cpu": "1500m", "memory": "2Gi"}
        raw = get_vm(api, namespace, "agent")
        assert raw is not None
        status = raw["status"]
        assert (status["phase"], status["cpus"], status["memorySize"]) == (
            "Running", "1500m", "2Gi")
        current = status["currentRevision"]
        assert current["revision"] == {"value": 7, "flags": 0}
        assert current["updatedAt"] != AGENT_STAMP
        stamp = times.parse(current["updatedAt"])
        assert stamp is not None and stamp >= before  # stamped when it landed
        assert condition(status, "Available")["status"] == "True"

        # Within the guest's whole vCPUs (1500m -> 1750m: still 2): a plan of the same
        # size (the runner keeps its vCPUs), whose fenced write moves the annotations the
        # scheduler plugin and the runner's CPU quota read; then status and the revision.
        agent_patch(api, namespace, "agent", "1750m", 2, revision=9)
        assert isinstance(settle(reconciler, key).action, act.Done)
        (after,) = runner_pods(api, namespace, "agent")
        assert after.metadata.uid == pod.metadata.uid
        annotations = after.metadata.annotations
        assert json.loads(annotations[ANNOTATION_RESOURCES])["cpus"]["use"] == "1750m"
        assert json.loads(annotations[ANNOTATION_USAGE]) == {"cpu": "1750m", "memory": "2Gi"}
        assert [(p["cpus"], p["memorySlots"]) for p in runner.puts] == [(2, 2), (2, 2)]
        raw = get_vm(api, namespace, "agent")
        assert raw is not None
        assert (raw["status"]["cpus"], raw["status"]["memorySize"]) == ("1750m", "2Gi")
        assert raw["status"]["currentRevision"]["revision"] == {"value": 9, "flags": 0}

        # And back down to a fractional size: 250m, one slot.
        agent_patch(api, namespace, "agent", "250m", 1, revision=8)
        assert isinstance(settle(reconciler, key).action, act.Done)
        (after,) = runner_pods(api, namespace, "agent")
        assert after.metadata.uid == pod.metadata.uid
        assert json.loads(after.metadata.annotations[ANNOTATION_RESOURCES])["cpus"][
            "use"] == "250m"
        raw = get_vm(api, namespace, "agent")
        assert raw is not None
        assert (raw["status"]["cpus"], raw["status"]["memorySize"]) == ("250m", "1Gi")
        assert raw["status"]["currentRevision"]["revision"] == {"value": 8, "flags": 0}
    finally:
        runner.close()


@pytest.mark.unit
def test_a_running_pod_whose_autoscaling_metadata_is_not_the_vms_is_synced() -> None:
    vm = vm_of({"min": 1, "max": 2, "use": 1},
               status={"phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
                       "podIP": "10.0.0.1", "cpus": 1, "memorySize": "1Gi"})
    vm.labels = {"autoscaling.neon.tech/enabled": "true"}
    lease = act.Fence(epoch=1, token=1)

    def decide_with(pod_labels: dict[str, str]) -> act.Action:
        pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                        phase="Running", node="n1", ip="10.0.0.1",
                        autoscaling=av.autoscaling_meta(pod_labels, {}))
        return d.decide(act.Observation(vm=vm, pods=(pod,), lease=lease, direct=True))

    action = decide_with({"autoscaling.neon.tech/enabled": "false", "team": "a"})
    assert isinstance(action, act.SyncPodMetadata) and (action.name, action.uid) == ("p", "pu")
    assert isinstance(decide_with({"autoscaling.neon.tech/enabled": "true"}), act.Done)


@pytest.mark.cluster
def test_the_vms_autoscaling_labels_and_annotations_are_kept_on_its_running_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "meta", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                  "memorySlots": {"min": 1, "max": 1, "use": 1},
                  "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
    path = (f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}/"
            "meta")
    kube.request(api, "PATCH", path, {"metadata": {
        "labels": {"autoscaling.neon.tech/enabled": "true", "autoscaling.neon.tech/gone": "1"}}},
        content_type="application/merge-patch+json")
    key = f"{namespace}/meta"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    (pod,) = runner_pods(api, namespace, "meta")
    assert pod.metadata.labels["autoscaling.neon.tech/enabled"] == "true"  # copied at build
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    settle(reconciler, key)

    # The autoscaler (or the user) changes the VM's labels and annotations afterwards.
    kube.request(api, "PATCH", path, {"metadata": {
        "labels": {"autoscaling.neon.tech/enabled": "false", "autoscaling.neon.tech/gone": None,
                   "team": "b"},
        "annotations": {"autoscaling.neon.tech/bounds": '{"min":{"cpu":1}}'}}},
        content_type="application/merge-patch+json")
    assert isinstance(settle(reconciler, key).action, act.Done)
    (after,) = runner_pods(api, namespace, "meta")
    assert after.metadata.uid == pod.metadata.uid
    labels, annotations = after.metadata.labels, after.metadata.annotations
    assert labels["autoscaling.neon.tech/enabled"] == "false"
    assert "autoscaling.neon.tech/gone" not in labels
    assert "team" not in labels  # only autoscaling.neon.tech/ is kept in sync
    assert annotations["autoscaling.neon.tech/bounds"] == '{"min":{"cpu":1}}'


@pytest.mark.unit
def test_a_size_adopted_after_a_drop_is_whole_vcpus_and_the_next_plan_writes_the_fraction(
        ) -> None:
    """No plan annotated the pod with the spec's fraction when a size is adopted (a PUT
    that landed after its plan was dropped): status says the whole vCPUs, so it differs
    from the spec and the plan that follows writes the fraction to the pod and status."""
    from neonvm.controller.action_table import status_mutation

    vm = vm_of({"min": "250m", "max": 2, "use": "1500m"}, slots=2,
               status={"phase": "Running", "podName": "p", "podUID": "pu", "scaleSeq": 1,
                       "cpus": 1, "memorySize": "1Gi", "node": "n1", "podIP": "10.0.0.1"})
    adopted = status_mutation(act.CommitScale(seq=1, vcpus=2, memory_bytes=2 * GIB, adopt=True,
                                            pod_uid="pu"), act.Fence(epoch=1, token=1))(vm)
    assert adopted is not None
    assert (adopted.cpus, adopted.memory_size) == (MilliCPU(2000), "2Gi")
    vm.status = adopted
    pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                      phase="Running", node="n1", ip="10.0.0.1")
    action = d.decide(act.Observation(vm=vm, pods=(pod,), lease=act.Fence(epoch=1, token=1),
                                      direct=True))
    assert isinstance(action, act.PlanScale), action
    assert (action.plan.cpus, action.plan.memory_slots, action.plan.seq) == (2, 2, 2)
