"""The admission fence, enforced by the real API server (a ValidatingAdmissionPolicy).

Each rule is shown both ways: the write it forbids is refused with the policy's own
message (not by RBAC), and the neighbouring write it must allow goes through. Runner pods
are created with the controller's identity: no other identity may create one. The last
tests show that kube-controller-manager's garbage collector is not fenced out: it can
still orphan and delete runner pods whose VM is gone.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.api import types
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
OTHER_GATE = "example.com/someone-elses-gate"
SAMPLE_VM = Path(__file__).resolve().parent.parent / "examples" / "vm-deploy.yaml"


def runner_pod(
    name: str,
    vm: str = "vm1",
    vm_uid: str = "00000000-0000-0000-0000-000000000001",
    gates: tuple[str, ...] = (types.SCHEDULING_GATE,),
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {types.LABEL_VM_NAME: vm, types.LABEL_VM_UID: vm_uid, "app": "runner"},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    spec: dict[str, Any] = {
        "containers": [{"name": "runner", "image": "neonvm-runner:dev"}],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
    }
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def plain_pod(name: str) -> dict[str, Any]:
    pod = runner_pod(name, gates=())
    pod["metadata"]["labels"] = {"app": "not-a-runner"}
    return pod


def assert_fenced(err: pytest.ExceptionInfo[ApiException], fragment: str) -> None:
    """Refused by the admission policy itself, with the rule's message."""
    assert err.value.status == 403, err.value.body
    message = kube.api_error_message(err.value)
    assert manifests.POLICY_NAME in message, message
    assert fragment in message, message


def gates_of(core: client.CoreV1Api, namespace: str, name: str) -> list[str]:
    pod = core.read_namespaced_pod(name, namespace)
    return [g.name for g in (pod.spec.scheduling_gates or [])]


def remove_all_gates() -> list[dict[str, Any]]:
    return [{"op": "remove", "path": "/spec/schedulingGates"}]


@pytest.mark.cluster
def test_a_runner_pod_created_without_the_gate_is_refused_even_for_the_controller(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    controller = client.CoreV1Api(controller_api)
    with pytest.raises(ApiException) as err:
        controller.create_namespaced_pod(namespace, runner_pod("r", gates=()))
    assert_fenced(err, "must be created with the scheduling gate")
    with pytest.raises(ApiException) as err:
        controller.create_namespaced_pod(namespace, runner_pod("r", gates=(OTHER_GATE,)))
    assert_fenced(err, "must be created with the scheduling gate")
    # Anyone else is refused a runner pod whatever its gates.
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(api).create_namespaced_pod(namespace, runner_pod("r", gates=()))
    assert_fenced(err, "only the neonvm controller may create a runner pod")


@pytest.mark.cluster
def test_the_controllers_gated_runner_pod_and_anyones_plain_pod_are_admitted(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    client.CoreV1Api(controller_api).create_namespaced_pod(namespace, runner_pod("r1"))
    client.CoreV1Api(api).create_namespaced_pod(namespace, plain_pod("plain"))
    core = client.CoreV1Api(api)
    assert gates_of(core, namespace, "r1") == [types.SCHEDULING_GATE]
    assert gates_of(core, namespace, "plain") == []


VM_LABEL_SETS = [
    ("both labels", {types.LABEL_VM_NAME: "vm1", types.LABEL_VM_UID: "u"}),
    ("name label", {types.LABEL_VM_NAME: "vm1"}),
    ("uid label", {types.LABEL_VM_UID: "u"}),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("what", "labels"), VM_LABEL_SETS, ids=[w for w, _ in VM_LABEL_SETS])
def test_no_one_but_the_controller_may_create_a_runner_pod_even_gated_and_owned(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
    what: str, labels: dict[str, str],
) -> None:
    """Pod names are predictable (<vm>-<uid8>-<planSeq>): a pod another identity created
    under the next plan's name would be what the controller's create runs into. The
    cluster admin is refused too (it is not the controller's identity)."""
    vm = create_vm(api, namespace, "vm1")
    planted = runner_pod(f"vm1-{vm['metadata']['uid'][:8]}-2", vm_uid=vm["metadata"]["uid"],
                         owner=owner_of(vm))
    planted["metadata"]["labels"] = {**labels, "app": "runner"}
    with pytest.raises(ApiException) as err:
        client.CoreV1Api(api).create_namespaced_pod(namespace, planted)
    assert_fenced(err, "only the neonvm controller may create a runner pod")
    assert pod_or_none(client.CoreV1Api(api), namespace, planted["metadata"]["name"]) is None
    client.CoreV1Api(controller_api).create_namespaced_pod(namespace, planted)


@pytest.mark.cluster
def test_only_the_controller_may_remove_the_gate_and_the_admin_may_not(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    client.CoreV1Api(controller_api).create_namespaced_pod(namespace, runner_pod("r"))

    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod("r", namespace, remove_all_gates(), _content_type=JSON_PATCH)
    assert_fenced(err, "only the neonvm controller may remove the scheduling gate")
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "r", namespace, {"spec": {"schedulingGates": None}}, _content_type=MERGE_PATCH
        )
    assert_fenced(err, "only the neonvm controller may remove the scheduling gate")
    assert gates_of(core, namespace, "r") == [types.SCHEDULING_GATE]

    client.CoreV1Api(controller_api).patch_namespaced_pod(
        "r", namespace, remove_all_gates(), _content_type=JSON_PATCH
    )
    assert gates_of(core, namespace, "r") == []


@pytest.mark.cluster
def test_anyone_may_remove_another_systems_gate_while_ours_stays(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, runner_pod("r", gates=(types.SCHEDULING_GATE, OTHER_GATE))
    )

    core.patch_namespaced_pod(
        "r", namespace, [{"op": "remove", "path": "/spec/schedulingGates/1"}],
        _content_type=JSON_PATCH,
    )
    assert gates_of(core, namespace, "r") == [types.SCHEDULING_GATE]

    # The controller removes its own gate alone; a gate of someone else would stay.
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, runner_pod("r2", gates=(OTHER_GATE, types.SCHEDULING_GATE))
    )
    client.CoreV1Api(controller_api).patch_namespaced_pod(
        "r2", namespace, [{"op": "remove", "path": "/spec/schedulingGates/1"}],
        _content_type=JSON_PATCH,
    )
    assert gates_of(core, namespace, "r2") == [OTHER_GATE]


LABEL_CHANGES = [
    ("renamed", {types.LABEL_VM_NAME: "another-vm"}),
    ("name label removed", {types.LABEL_VM_NAME: None}),
    ("uid changed", {types.LABEL_VM_UID: "00000000-0000-0000-0000-0000000000ff"}),
    ("uid label removed", {types.LABEL_VM_UID: None}),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("change", "labels"), LABEL_CHANGES, ids=[c for c, _ in LABEL_CHANGES])
def test_the_vm_labels_of_a_runner_pod_are_immutable(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
    change: str, labels: dict[str, str | None],
) -> None:
    core = client.CoreV1Api(api)
    client.CoreV1Api(controller_api).create_namespaced_pod(namespace, runner_pod("r"))
    for who in (api, controller_api):
        with pytest.raises(ApiException) as err:
            client.CoreV1Api(who).patch_namespaced_pod(
                "r", namespace, {"metadata": {"labels": labels}}, _content_type=MERGE_PATCH
            )
        assert_fenced(err, "labels of a pod are immutable")
    # The status subresource keeps spec and owners but would take labels: fenced too.
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod_status(
            "r", namespace, {"metadata": {"labels": labels}}, _content_type=MERGE_PATCH
        )
    assert_fenced(err, "labels of a pod are immutable")
    pod = core.read_namespaced_pod("r", namespace)
    assert pod.metadata.labels[types.LABEL_VM_NAME] == "vm1"

    # Other labels and annotations of a runner pod stay writable.
    core.patch_namespaced_pod(
        "r", namespace,
        {"metadata": {"labels": {"app": "renamed"}, "annotations": {"note": "ok"}}},
        _content_type=MERGE_PATCH,
    )


@pytest.mark.cluster
def test_an_existing_pod_cannot_become_a_runner_pod(
    api: client.ApiClient, namespace: str
) -> None:
    """Gates cannot be added after creation, so a labelled-later pod would be unfenced."""
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, plain_pod("plain"))
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "plain", namespace, {"metadata": {"labels": {types.LABEL_VM_NAME: "vm1"}}},
            _content_type=MERGE_PATCH,
        )
    assert_fenced(err, "labels of a pod are immutable")
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod_status(
            "plain", namespace, {"metadata": {"labels": {types.LABEL_VM_NAME: "vm1"}}},
            _content_type=MERGE_PATCH,
        )
    assert_fenced(err, "labels of a pod are immutable")
    # Unrelated pods keep their ordinary freedom.
    core.patch_namespaced_pod(
        "plain", namespace, {"metadata": {"labels": {"tier": "x"}}}, _content_type=MERGE_PATCH
    )


def create_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm: dict[str, Any] = yaml.safe_load(SAMPLE_VM.read_text())
    vm["metadata"] = {"name": name}
    created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm
    )
    return created


def owner_of(vm: dict[str, Any], controller: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": types.API_VERSION, "kind": types.KIND, "name": vm["metadata"]["name"],
        "uid": vm["metadata"]["uid"], "controller": controller, "blockOwnerDeletion": True,
    }


@pytest.mark.cluster
def test_the_owner_references_of_a_runner_pod_are_immutable(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    vm = create_vm(api, namespace, "vm1")
    other = create_vm(api, namespace, "vm2")
    core = client.CoreV1Api(api)
    ccore = client.CoreV1Api(controller_api)
    ccore.create_namespaced_pod(
        namespace, runner_pod("r", vm_uid=vm["metadata"]["uid"], owner=owner_of(vm))
    )
    ccore.create_namespaced_pod(namespace, runner_pod("unowned"))

    changes: list[tuple[str, list[dict[str, Any]]]] = [
        ("r", [{"op": "replace", "path": "/metadata/ownerReferences/0", "value": owner_of(other)}]),
        ("r", [{"op": "remove", "path": "/metadata/ownerReferences"}]),
        ("r", [{"op": "add", "path": "/metadata/ownerReferences/-",
                "value": owner_of(other, controller=False)}]),
        ("unowned", [{"op": "add", "path": "/metadata/ownerReferences",
                      "value": [owner_of(other)]}]),
    ]
    for who in (api, controller_api):
        for pod, patch in changes:
            with pytest.raises(ApiException) as err:
                client.CoreV1Api(who).patch_namespaced_pod(
                    pod, namespace, copy.deepcopy(patch), _content_type=JSON_PATCH
                )
            assert_fenced(err, "owner references of a runner pod are immutable")
    refs = core.read_namespaced_pod("r", namespace).metadata.owner_references
    assert [r.uid for r in refs] == [vm["metadata"]["uid"]]


def pod_or_none(core: client.CoreV1Api, namespace: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


@pytest.fixture
def garbage_collector(cluster: LocalCluster) -> None:
    if cluster.spec.nodes == 0:
        pytest.skip("kube-controller-manager runs only with NEONVM_TEST_NODES > 0")


@pytest.mark.nodes
@pytest.mark.usefixtures("garbage_collector")
def test_the_garbage_collector_may_orphan_a_runner_pod(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    """Orphaning strips the owner reference: the one owner change the fence allows."""
    vm = create_vm(api, namespace, f"vm-{uuid.uuid4().hex[:6]}")
    core = client.CoreV1Api(api)
    client.CoreV1Api(controller_api).create_namespaced_pod(
        namespace, runner_pod("r", vm_uid=vm["metadata"]["uid"], owner=owner_of(vm))
    )
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm["metadata"]["name"],
        propagation_policy="Orphan",
    )
    orphaned = wait_for(
        lambda: (p := core.read_namespaced_pod("r", namespace))
        and not p.metadata.owner_references and p,
        timeout=90, what="the garbage collector to orphan the runner pod",
    )
    assert orphaned.metadata.deletion_timestamp is None
    assert orphaned.metadata.labels[types.LABEL_VM_NAME] == "vm1"


@pytest.mark.nodes
@pytest.mark.usefixtures("garbage_collector")
def test_the_garbage_collector_deletes_runner_pods_whose_vm_is_gone(
    api: client.ApiClient, controller_api: client.ApiClient, namespace: str
) -> None:
    """Both a gated and an ungated (scheduled) runner pod of a deleted VM are removed."""
    vm = create_vm(api, namespace, f"vm-{uuid.uuid4().hex[:6]}")
    core = client.CoreV1Api(api)
    for name in ("gated", "ungated"):
        client.CoreV1Api(controller_api).create_namespaced_pod(
            namespace, runner_pod(name, vm_uid=vm["metadata"]["uid"], owner=owner_of(vm))
        )
    client.CoreV1Api(controller_api).patch_namespaced_pod(
        "ungated", namespace, remove_all_gates(), _content_type=JSON_PATCH
    )
    wait_for(lambda: core.read_namespaced_pod("ungated", namespace).spec.node_name,
             timeout=60, what="the ungated pod to be scheduled")

    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm["metadata"]["name"]
    )
    for name in ("gated", "ungated"):
        wait_for(lambda name=name: pod_or_none(core, namespace, name) is None,
                 timeout=120, what=f"the garbage collector to delete runner pod {name}")
