"""Every VM name the CRD admits yields a runner pod the API server accepts: the pod's name
and labels, and the label selector of every direct pod list, stay within Kubernetes' limits
(a name is used as a label value, so a name over 63 characters must still give valid labels;
docs/architecture.md). Pure: no servers."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api.crd import virtualmachine_crd
from neonvm.api.types import (
    FINALIZER,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import decide as d
from neonvm.controller import podspec
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.observe import DirectReader

pytestmark = pytest.mark.unit

UID = "0123456789abcdef"
NS = "ns"

LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _longest_admitted_name() -> int:
    """The longest metadata.name the CRD admits (253 unless it says otherwise)."""
    schema = virtualmachine_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    limit = 253
    meta = schema.get("properties", {}).get("metadata", {})
    limit = min(limit, meta.get("properties", {}).get("name", {}).get("maxLength", limit))
    for rule in schema.get("x-kubernetes-validations", []) or []:
        m = re.search(r"metadata\.name\.size\(\)\s*<(=?)\s*(\d+)", rule.get("rule", ""))
        if m:
            limit = min(limit, int(m.group(2)) - (0 if m.group(1) else 1))
    return limit


def test_every_vm_name_the_crd_admits_yields_valid_pod_labels_and_selectors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = "v" * _longest_admitted_name()
    vm = VirtualMachine(name=name, namespace=NS, uid=UID, resource_version="1", generation=1,
                        spec=VirtualMachineSpec(), status=VirtualMachineStatus(),
                        finalizers=[FINALIZER])
    plan = PendingPod(name=d.plan_name(vm, 1), plan_seq=1, token=1, epoch=1, generation=1)
    pod = podspec.runner_pod(vm, plan)
    assert len(pod["metadata"]["name"]) <= 253, (
        f"runner pod name has {len(pod['metadata']['name'])} chars (> 253): refused (422)")
    for key, value in pod["metadata"]["labels"].items():
        assert len(value) <= 63 and LABEL_VALUE.match(value), (
            f"runner pod label {key}={value[:20]}... ({len(value)} chars) is not a valid "
            f"label value: the API server refuses the pod (422)")

    selectors: list[str] = []

    def list_pods(api: Any, method: str, path: str, query: Any = None,
                  **kw: Any) -> dict[str, Any]:
        selectors.append(dict(query or []).get("labelSelector", ""))
        return {"items": []}

    reader = DirectReader(KubeCluster(client.ApiClient()))
    monkeypatch.setattr(kube, "request", list_pods)
    reader.list_pods(NS, name)
    for req in selectors[0].split(","):
        _key, _eq, value = req.partition("=")
        assert len(value) <= 63 and LABEL_VALUE.match(value), (
            f"the direct pod list uses selector value of {len(value)} chars: the API server "
            f"answers 400, so no direct observation (create, ungate, delete, finalize) is "
            f"ever possible and a deleted VM is stuck terminating")
