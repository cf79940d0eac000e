"""The autoscaler's view after a live scale: what NeonVM's autoscaler-agent and scheduler
plugin read (the pod's resources and usage annotations, status.cpus, currentRevision, the
Available condition) follows every scale that lands. docs/neonvm-compat.md, "The
autoscaler's view"."""

from __future__ import annotations

import datetime as dt
import json
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
from tests.support.autoscaler_view import AGENT_STAMP, ApplyingRunner, agent_patch, vm_of
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


# ---- the VM's labels and annotations on its pod ------------------------------------------------

COPIED = "vm.neon.tech/copied-metadata"
NEVER_TOUCHED = ("vm.neon.tech/name", "vm.neon.tech/uid", "app.kubernetes.io/name")
"""The pod labels a tenant's VM label can never change: the pod informer's selector
(``vm.neon.tech/name``), the fence's (``vm.neon.tech/uid``) and NeonVM's
``app.kubernetes.io/name: NeonVM``, on which every selector of the chart differs."""


def record(labels: list[str], annotations: list[str]) -> str:
    return json.dumps({"labels": labels, "annotations": annotations}, separators=(",", ":"))


def _pod(labels: dict[str, str], annotations: dict[str, str]) -> dict[str, Any]:
    """A runner pod's metadata: the controller's own keys, then ``labels``/``annotations``."""
    return {"labels": {"vm.neon.tech/name": "v", "vm.neon.tech/uid": "u",
                       "app.kubernetes.io/name": "NeonVM", **labels},
            "annotations": {"kubectl.kubernetes.io/default-container": "neonvm-runner",
                            "vm.neon.tech/fence-token": "1", **annotations}}


# (VM labels, VM annotations, pod labels, pod annotations) -> the patch's labels, annotations
METADATA_SYNC = {
    "in step: nothing to patch": (
        {"team": "a"}, {"note": "x"},
        {"team": "a"}, {"note": "x", COPIED: record(["team"], ["note"])},
        None, None),
    "a label added to the VM is added, with the record": (
        {"team": "a", "tier": "gold"}, {},
        {"team": "a"}, {COPIED: record(["team"], [])},
        {"tier": "gold"}, {COPIED: record(["team", "tier"], [])}),
    "a label changed on the VM is changed": (
        {"team": "b"}, {}, {"team": "a"}, {COPIED: record(["team"], [])},
        {"team": "b"}, None),
    "a label and an annotation the VM dropped are removed, and the record with them": (
        {}, {}, {"team": "a"}, {"note": "x", COPIED: record(["team"], ["note"])},
        {"team": None}, {"note": None, COPIED: None}),
    "a label someone else set on the pod, not the VM's, is left alone": (
        {"team": "a"}, {}, {"team": "a", "istio": "on"},
        {"cni.example/status": "up", COPIED: record(["team"], [])},
        None, None),
    "a VM label someone else changed on the pod is the VM's again (as NeonVM)": (
        {"team": "a"}, {}, {"team": "z"}, {COPIED: record(["team"], [])},
        {"team": "a"}, None),
    "the controller's labels win over VM labels of their keys": (
        {"app.kubernetes.io/name": "neonvm-controller", "vm.neon.tech/name": "other",
         "vm.neon.tech/uid": "x", "app.kubernetes.io/instance": "neonvm"}, {},
        {}, {},
        {"app.kubernetes.io/instance": "neonvm"},
        {COPIED: record(["app.kubernetes.io/instance"], [])}),
    "a forged record cannot remove the controller's labels": (
        {}, {}, {}, {COPIED: record(list(NEVER_TOUCHED), ["vm.neon.tech/fence-token"])},
        None, {COPIED: None}),
    "kubectl's and the controller's annotations are never copied": (
        {}, {"kubectl.kubernetes.io/last-applied-configuration": "{}",
             "kubectl.kubernetes.io/default-container": "sidecar",
             "vm.neon.tech/fence-token": "99", av.ANNOTATION_OVERCOMMIT: '{"cpu":"9"}'},
        {}, {}, None, None),
    "a record of the wrong shape names no key, and is written again": (
        {"team": "a"}, {}, {"team": "a"}, {COPIED: '{"labels": 1, "annotations": {"x": 1}}'},
        None, {COPIED: record(["team"], [])}),
    "a record nested too deep to read is written again": (
        {"team": "a"}, {}, {"team": "a"}, {COPIED: "[" * 100_000 + "]" * 100_000},
        None, {COPIED: record(["team"], [])}),
    "a pod built before the record: its autoscaling.neon.tech/ keys were the copied ones": (
        {"autoscaling.neon.tech/enabled": "true"}, {},
        {"autoscaling.neon.tech/enabled": "false", "autoscaling.neon.tech/gone": "x",
         "team": "b"}, {},
        {"autoscaling.neon.tech/enabled": "true", "autoscaling.neon.tech/gone": None},
        {COPIED: record(["autoscaling.neon.tech/enabled"], [])}),
}


@pytest.mark.unit
@pytest.mark.parametrize(("vm_labels", "vm_annotations", "pod_labels", "pod_annotations",
                          "labels_patch", "annotations_patch"),
                         list(METADATA_SYNC.values()), ids=list(METADATA_SYNC))
def test_the_pod_carries_the_vms_labels_and_annotations_and_nothing_it_did_not_copy(
        vm_labels: dict[str, str], vm_annotations: dict[str, str],
        pod_labels: dict[str, str], pod_annotations: dict[str, str],
        labels_patch: dict[str, Any] | None, annotations_patch: dict[str, Any] | None) -> None:
    vm = vm_of({"min": 1, "max": 2, "use": 1})
    vm.labels, vm.annotations = dict(vm_labels), dict(vm_annotations)
    pod = _pod(pod_labels, pod_annotations)
    expected = {k: v for k, v in (("labels", labels_patch),
                                  ("annotations", annotations_patch)) if v is not None}
    patch = av.metadata_drift(vm, pod)
    assert patch == (expected or None)
    # decide sees drift exactly when the performer has something to patch.
    in_step = av.autoscaling_meta(pod["labels"], pod["annotations"]) == \
        av.vm_autoscaling_meta(vm)
    assert in_step == (patch is None)
    for key in NEVER_TOUCHED:
        assert key not in (patch or {}).get("labels", {})
    # One patch is enough: applied, it leaves nothing to do, and the keys not the VM's.
    for field, change in (patch or {}).items():
        for k, v in change.items():
            if v is None:
                pod[field].pop(k, None)
            else:
                pod[field][k] = v
    assert av.metadata_drift(vm, pod) is None
    assert av.autoscaling_meta(pod["labels"], pod["annotations"]) == av.vm_autoscaling_meta(vm)
    others = {k: v for k, v in pod_labels.items() if k not in (patch or {}).get("labels", {})}
    assert others.items() <= pod["labels"].items()


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
@pytest.mark.parametrize(("pod_labels", "pod_annotations", "synced"), [
    ({"autoscaling.neon.tech/enabled": "true", "team": "a"},
     {COPIED: record(["autoscaling.neon.tech/enabled", "team"], [])}, True),
    # Someone else's label: not the VM's, nothing to do.
    ({"autoscaling.neon.tech/enabled": "true", "team": "a", "istio": "on"},
     {COPIED: record(["autoscaling.neon.tech/enabled", "team"], [])}, True),
    ({"autoscaling.neon.tech/enabled": "false", "team": "a"},
     {COPIED: record(["autoscaling.neon.tech/enabled", "team"], [])}, False),
    # A label the VM has that is not on the pod (any label, not only autoscaling's).
    ({"autoscaling.neon.tech/enabled": "true"},
     {COPIED: record(["autoscaling.neon.tech/enabled"], [])}, False),
    # A label the VM dropped, still on the pod.
    ({"autoscaling.neon.tech/enabled": "true", "team": "a", "old": "1"},
     {COPIED: record(["autoscaling.neon.tech/enabled", "old", "team"], [])}, False),
    # Built before the record: written once.
    ({"autoscaling.neon.tech/enabled": "true", "team": "a"}, {}, False),
])
def test_a_running_pod_that_does_not_carry_the_vms_labels_is_synced(
        pod_labels: dict[str, str], pod_annotations: dict[str, str], synced: bool) -> None:
    vm = vm_of({"min": 1, "max": 2, "use": 1},
               status={"phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
                       "podIP": "10.0.0.1", "cpus": 1, "memorySize": "1Gi"})
    vm.labels = {"autoscaling.neon.tech/enabled": "true", "team": "a"}
    meta = _pod(pod_labels, pod_annotations)
    pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                      phase="Running", node="n1", ip="10.0.0.1",
                      autoscaling=av.autoscaling_meta(meta["labels"], meta["annotations"]))
    action = d.decide(act.Observation(vm=vm, pods=(pod,), lease=act.Fence(epoch=1, token=1),
                                      direct=True))
    if synced:
        assert isinstance(action, act.Done), action
    else:
        assert isinstance(action, act.SyncPodMetadata) and (action.name, action.uid) == \
            ("p", "pu")


@pytest.mark.unit
def test_the_slim_cached_pod_sees_the_same_labels_and_annotations_as_the_full_one() -> None:
    from neonvm.controller.informer import project_pod
    from neonvm.controller.observe import pod_view
    from neonvm.controller.podspec import runner_pod

    vm = vm_of({"min": 1, "max": 2, "use": 1})
    vm.labels = {"team": "a", "autoscaling.neon.tech/enabled": "true"}
    vm.annotations = {"note": "x" * 300}
    pod = runner_pod(vm, types.PendingPod(name="p", plan_seq=1, token=1, epoch=1,
                                          generation=1))
    pod["metadata"].update(uid="pu", resourceVersion="5")
    assert pod["metadata"]["annotations"][COPIED] == record(
        ["autoscaling.neon.tech/enabled", "team"], ["note"])
    assert pod_view(pod).autoscaling == av.vm_autoscaling_meta(vm)
    pod["metadata"]["annotations"]["note"] = "changed by someone"
    slim = project_pod(json.loads(json.dumps(pod)))
    assert pod_view(slim).autoscaling == pod_view(pod).autoscaling != av.vm_autoscaling_meta(vm)
    assert av.ANNOTATION_OVERCOMMIT not in slim["metadata"]["annotations"]
    assert "vm.neon.tech/spec" not in slim["metadata"]["annotations"]
    assert f"{types.GROUP}/" == av.CONTROLLER_PREFIX


@pytest.mark.cluster
def test_the_vms_labels_and_annotations_are_kept_on_its_running_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "meta", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                  "memorySlots": {"min": 1, "max": 1, "use": 1},
                  "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
    path = (f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}/"
            "meta")
    kube.request(api, "PATCH", path, {"metadata": {
        "labels": {"autoscaling.neon.tech/enabled": "true", "autoscaling.neon.tech/gone": "1",
                   "team": "a", "app.kubernetes.io/name": "neonvm-controller"},
        "annotations": {"note": "x"}}},
        content_type="application/merge-patch+json")
    key = f"{namespace}/meta"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    (pod,) = runner_pods(api, namespace, "meta")
    assert pod.metadata.labels["autoscaling.neon.tech/enabled"] == "true"  # copied at build
    assert pod.metadata.labels["team"] == "a"
    core = client.CoreV1Api(api)
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    # Another writer's label and annotation on the pod, which the VM does not have.
    core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {
        "labels": {"other-writer": "1"}, "annotations": {"cni.example/status": "up"}}})
    settle(reconciler, key)

    # The autoscaler (or the user) changes the VM's labels and annotations afterwards.
    kube.request(api, "PATCH", path, {"metadata": {
        "labels": {"autoscaling.neon.tech/enabled": "false", "autoscaling.neon.tech/gone": None,
                   "team": "b", "tier": "gold", "vm.neon.tech/name": "other"},
        "annotations": {"autoscaling.neon.tech/bounds": '{"min":{"cpu":1}}', "note": None}}},
        content_type="application/merge-patch+json")
    assert isinstance(settle(reconciler, key).action, act.Done)
    (after,) = runner_pods(api, namespace, "meta")
    assert after.metadata.uid == pod.metadata.uid
    labels, annotations = after.metadata.labels, after.metadata.annotations
    assert labels["autoscaling.neon.tech/enabled"] == "false"
    assert (labels["team"], labels["tier"]) == ("b", "gold")
    assert "autoscaling.neon.tech/gone" not in labels
    assert annotations["autoscaling.neon.tech/bounds"] == '{"min":{"cpu":1}}'
    assert "note" not in annotations
    # The controller's own labels are not the VM's to change; another writer's stay.
    assert (labels["vm.neon.tech/name"], labels["app.kubernetes.io/name"]) == ("meta", "NeonVM")
    assert labels["other-writer"] == "1"
    assert annotations["cni.example/status"] == "up"
    # And nothing is left to fight over: the next turn writes nothing.
    assert isinstance(settle(reconciler, key).action, act.Done)
    (again,) = runner_pods(api, namespace, "meta")
    assert again.metadata.resource_version == after.metadata.resource_version


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
