"""The runner pod as NeonVM's tools read it: the ``app.kubernetes.io/name: NeonVM`` label
(NeonVM's e2e suite selects runner pods by it) and the ``vm.neon.tech/overcommit``
annotation (NeonVM's scheduler plugin discounts the pod's usage by it), kept in step with
``spec.overcommit`` on the running pod. docs/neonvm-compat.md, "Runner pods".
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import compat, types
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view as av
from neonvm.controller import decide as d
from neonvm.controller.podspec import runner_pod
from tests.support import shipped_reconciler
from tests.support.autoscaler_view import vm_of
from tests.support.harness import create_vm, runner_pods, vm_manifest
from tests.support.reconcile import NOWHERE, settle


def built(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
          **spec: Any) -> dict[str, Any]:
    manifest = vm_manifest("p", spec=spec)
    manifest["metadata"].update(namespace="n", uid="u-1", resourceVersion="1",
                                labels=labels or {}, annotations=annotations or {})
    return runner_pod(types.VirtualMachine.from_object(manifest),
                      types.PendingPod(name="p-1", plan_seq=1))


# ---- the label ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_runner_pod_carries_neonvms_app_name_label_over_the_vms_own() -> None:
    labels = built()["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "NeonVM"
    assert labels["vm.neon.tech/name"] == "p"
    # As NeonVM's labelsForVirtualMachine: the VM's labels first, then its own on top.
    labels = built(labels={"app.kubernetes.io/name": "mine", "team": "a"})["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "NeonVM" and labels["team"] == "a"


# ---- the overcommit annotation -------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("overcommit", "annotation"), [
    ({"cpu": "2"}, '{"cpu":"2"}'),
    ({"cpu": "1.5", "memory": "1250m"}, '{"cpu":"1500m","memory":"1250m"}'),
    ({"memory": "2.0"}, '{"memory":"2"}'),
    ({"cpu": "1e3"}, '{"cpu":"1e3"}'),  # not plain decimal: as written
    ({}, "{}"),
])
def test_spec_overcommit_is_on_the_pod_as_neonvm_marshals_it(
        overcommit: dict[str, str], annotation: str) -> None:
    annotations = built(overcommit=overcommit)["metadata"]["annotations"]
    assert annotations[av.ANNOTATION_OVERCOMMIT] == annotation


@pytest.mark.unit
def test_no_overcommit_no_annotation_and_a_vms_own_annotation_of_that_name_is_not_copied(
) -> None:
    assert av.ANNOTATION_OVERCOMMIT not in built()["metadata"]["annotations"]
    forged = built(annotations={av.ANNOTATION_OVERCOMMIT: '{"cpu":"100"}'})
    assert av.ANNOTATION_OVERCOMMIT not in forged["metadata"]["annotations"]


@pytest.mark.unit
def test_overcommit_is_no_longer_reported_as_not_implemented() -> None:
    spec = types.VirtualMachine.from_object(vm_manifest("p", spec={
        "overcommit": {"cpu": "2"}, "enableSSH": False})).spec
    assert "spec.overcommit" not in compat.unimplemented_fields(spec)


@pytest.mark.unit
def test_the_overcommit_annotation_drifts_with_the_spec_and_a_forged_one_is_removed() -> None:
    manifest = vm_manifest("p", spec={"overcommit": {"cpu": "2"}})
    manifest["metadata"]["annotations"] = {av.ANNOTATION_OVERCOMMIT: '{"cpu":"100"}'}
    vm = types.VirtualMachine.from_object(manifest)
    assert av.metadata_drift(vm, {"annotations": {}}) == {
        "annotations": {av.ANNOTATION_OVERCOMMIT: '{"cpu":"2"}'}}
    assert av.metadata_drift(vm, {"annotations": {av.ANNOTATION_OVERCOMMIT: '{"cpu":"2"}'}}
                             ) is None
    vm.spec.overcommit = None
    assert av.metadata_drift(vm, {"annotations": {av.ANNOTATION_OVERCOMMIT: '{"cpu":"2"}'}}
                             ) == {"annotations": {av.ANNOTATION_OVERCOMMIT: None}}
    # The decision sees it too: a running pod without it gets SyncPodMetadata.
    running = vm_of({"min": 1, "max": 2, "use": 1}, status={
        "phase": "Running", "podName": "p", "podUID": "pu", "node": "n1",
        "podIP": "10.0.0.1", "cpus": 1, "memorySize": "1Gi"})
    running.spec.overcommit = types.OvercommitSettings(cpu="2")
    pod = act.PodView(name="p", uid="pu", owner_uid="u", gated=False, terminating=False,
                    phase="Running", node="n1", ip="10.0.0.1",
                    autoscaling=av.autoscaling_meta({}, {}))
    action = d.decide(act.Observation(vm=running, pods=(pod,), lease=act.Fence(epoch=1, token=1),
                                    direct=True))
    assert isinstance(action, act.SyncPodMetadata)


@pytest.mark.cluster
def test_a_changed_overcommit_reaches_the_running_pod_without_a_restart(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "oc", spec={
        "nodeSelector": NOWHERE, "overcommit": {"cpu": "1.5"},
        "guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                  "memorySlots": {"min": 1, "max": 1, "use": 1},
                  "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
    key = f"{namespace}/oc"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key)
    (pod,) = runner_pods(api, namespace, "oc")
    assert pod.metadata.annotations[av.ANNOTATION_OVERCOMMIT] == '{"cpu":"1500m"}'
    assert pod.metadata.labels["app.kubernetes.io/name"] == "NeonVM"
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    settle(reconciler, key)

    path = f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/{types.PLURAL}/oc"
    for overcommit, expected in (({"cpu": "2", "memory": "1.25"}, '{"cpu":"2","memory":"1250m"}'),
                                 (None, None)):
        kube.request(api, "PATCH", path, {"spec": {"overcommit": overcommit}},
                     content_type="application/merge-patch+json")
        assert isinstance(settle(reconciler, key).action, act.Done)
        (after,) = runner_pods(api, namespace, "oc")
        assert after.metadata.uid == pod.metadata.uid
        assert (after.metadata.annotations or {}).get(av.ANNOTATION_OVERCOMMIT) == expected
        assert json.loads(after.metadata.annotations["vm.neon.tech/resources"])["cpus"]


@pytest.mark.unit
def test_the_informers_slim_pod_keeps_the_overcommit_annotation_so_a_cached_look_sees_no_drift(
) -> None:
    from neonvm.controller.informer import project_pod
    from neonvm.controller.observe import pod_view

    pod = built(overcommit={"cpu": "2"})
    pod["metadata"].update(uid="pu", resourceVersion="5")
    slim = project_pod(pod)
    assert slim["metadata"]["annotations"][av.ANNOTATION_OVERCOMMIT] == '{"cpu":"2"}'
    vm = types.VirtualMachine.from_object({**vm_manifest("p", spec={"overcommit": {"cpu": "2"}}),
                                           "metadata": {"name": "p", "uid": "u-1"}})
    assert pod_view(slim).autoscaling == av.vm_autoscaling_meta(vm)

