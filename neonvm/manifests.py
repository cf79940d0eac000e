"""Cluster objects generated from code: CRD, the controller's RBAC, the admission fence.

One source for the local cluster (``neonvm dev up`` applies them) and the Helm chart
(``neonvm manifests write`` renders the chart's generated files from here; a test fails
when the chart's copies drift).

The admission fence (a ValidatingAdmissionPolicy, evaluated inside the API server):

* only the controller's identity may create a pod labelled for a VM (either VM label),
  and such a pod must be created carrying the runner scheduling gate;
* only the controller's identity may remove that gate;
* a pod's VM labels (name and uid) are immutable, so a pod is a runner pod from its
  creation or never, and a runner pod's owner references are immutable (the garbage
  collector, which strips owner references when orphaning, is exempt).

What it does not cover: deletes (anyone allowed to delete pods may delete a runner pod;
deleting is always safe for the invariant), and identities it names (whoever holds the
controller's credentials may create and ungate runner pods). The controller's own check
(it adopts a pod under a planned name only if the pod carries that plan's fence
annotations) is defence in depth behind this policy, not a replacement: the fence is
shown in the VM's status, so anyone who may create runner pods can copy it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from neonvm.api import crd as crd_module
from neonvm.api import types

POLICY_NAME = "neonvm-runner-pod-fence"
CLUSTER_ROLE = "neonvm-controller"
GC_USER = "system:kube-controller-manager"
GC_SA = "system:serviceaccount:kube-system:generic-garbage-collector"


def crd() -> dict[str, Any]:
    return crd_module.virtualmachine_crd()


def controller_rules() -> list[dict[str, Any]]:
    """Exactly the verbs the controller uses on VMs, pods and events, in every namespace.

    The Lease is not here: see :func:`leader_election_rules`.
    """
    return [
        {"apiGroups": [types.GROUP], "resources": [types.PLURAL],
         "verbs": ["get", "list", "watch", "update", "patch"]},
        {"apiGroups": [types.GROUP], "resources": [f"{types.PLURAL}/status"],
         "verbs": ["get", "update", "patch"]},
        {"apiGroups": [types.GROUP], "resources": [f"{types.PLURAL}/finalizers"],
         "verbs": ["update"]},
        {"apiGroups": [""], "resources": ["pods"],
         "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"],
         "verbs": ["create", "patch"]},
        # Live scaling: in-place resize of the runner pod's CPU request.
        {"apiGroups": [""], "resources": ["pods/resize"], "verbs": ["patch"]},
    ]


def live_scaling_rules() -> list[dict[str, Any]]:
    """``get`` and ``create`` on secrets: the per-VM scaling token Secret.

    Opt-in in the chart (``rbac.liveScaling``), for the same reason as
    :func:`pull_secret_rules`: ``get`` on secrets cluster-wide would let this identity read
    any secret it can name. The controller creates ``neonvm-scaling-<vm uid>`` before a
    scalable VM's runner pod and reads it before each call to the runner. Without the
    rule the pod still starts (its token volume is optional) and the runner refuses
    scaling (401); the VM shows why. The local cluster's identity has it.
    """
    return [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]}]


def pull_secret_rules() -> list[dict[str, Any]]:
    """``get`` on secrets: lets the controller see whether a VM's image pull secrets exist.

    Opt-in in the chart (``rbac.checkImagePullSecrets``): ``get`` on secrets cluster-wide
    would let this identity read any secret it can name. The controller itself asks for
    metadata only (``PartialObjectMetadata``) and never receives secret data, but RBAC
    cannot express that. Without the rule the check is skipped and a VM naming a missing
    secret gets a pod that fails to pull a private image. The local cluster's identity has
    it, so the tests exercise the check.
    """
    return [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]


def leader_election_rules() -> list[dict[str, Any]]:
    """What the election needs on its Lease (read, create, replace by resourceVersion,
    patch: the leader's renewals are JSON patches conditional on its holder and epoch, so
    the next can go out before the last answered; and watch: standbys read the Lease as
    soon as it changes).

    Kept apart from :func:`controller_rules` because the Lease lives in one namespace: the
    chart grants these through a Role there, not cluster-wide. The local cluster's
    controller identity gets them cluster-wide, since tests campaign in fresh namespaces.
    """
    return [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "verbs": ["get", "create", "update", "patch", "watch"]},
    ]


def cluster_role() -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": CLUSTER_ROLE},
        "rules": controller_rules() + pull_secret_rules() + live_scaling_rules()
        + leader_election_rules(),
    }


def cluster_role_binding(user: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": CLUSTER_ROLE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": CLUSTER_ROLE},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }


def _cel_string(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def admission_policy(controller_users: list[str]) -> dict[str, Any]:
    """The runner-pod fence; ``controller_users`` may create runner pods and remove the gate.

    It matches ``pods/status`` as well as ``pods``: a status write keeps the spec and the
    owner references but not the labels, so without it the VM labels could be changed
    there. Every expression is total (no error on any pod), because ``failurePolicy:
    Fail`` would otherwise block unrelated pod writes, kubelets' status updates included.
    """
    label = _cel_string(types.LABEL_VM_NAME)
    vm_labels = "[" + ", ".join(
        _cel_string(k) for k in (types.LABEL_VM_NAME, types.LABEL_VM_UID)
    ) + "]"
    gate = _cel_string(types.SCHEDULING_GATE)
    allowed = "[" + ", ".join(_cel_string(u) for u in controller_users) + "]"
    gc_users = "[" + ", ".join(_cel_string(u) for u in (GC_USER, GC_SA)) + "]"

    def label_of(obj: str) -> str:
        return (f"(has({obj}.metadata.labels) && k in {obj}.metadata.labels ? "
                f"{obj}.metadata.labels[k] : '')")

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {"apiGroups": [""], "apiVersions": ["v1"],
                     "operations": ["CREATE", "UPDATE"], "resources": ["pods", "pods/status"]}
                ]
            },
            "variables": [
                {"name": "isRunner",
                 "expression": f"has(object.metadata.labels) && {label} in object.metadata.labels"},
                {"name": "hasVMLabel",
                 "expression": f"has(object.metadata.labels) && {vm_labels}.exists(k, k in "
                               f"object.metadata.labels)"},
                {"name": "wasRunner",
                 "expression": f"oldObject != null && has(oldObject.metadata.labels) && "
                               f"{label} in oldObject.metadata.labels"},
                {"name": "hasGate",
                 "expression": f"has(object.spec.schedulingGates) && "
                               f"object.spec.schedulingGates.exists(g, g.name == {gate})"},
                {"name": "hadGate",
                 "expression": f"oldObject != null && has(oldObject.spec.schedulingGates) && "
                               f"oldObject.spec.schedulingGates.exists(g, g.name == {gate})"},
            ],
            "validations": [
                {
                    # Pod names are predictable: a pod another identity planted under the
                    # next plan's name would otherwise be found by the controller's create.
                    "expression": "request.operation != 'CREATE' || !variables.hasVMLabel "
                                  f"|| request.userInfo.username in {allowed}",
                    "message": f"only the neonvm controller may create a runner pod "
                               f"(labelled {types.LABEL_VM_NAME} or {types.LABEL_VM_UID})",
                    "reason": "Forbidden",
                },
                {
                    "expression": "request.operation != 'CREATE' || !variables.isRunner "
                                  "|| variables.hasGate",
                    "message": f"a runner pod (labelled {types.LABEL_VM_NAME}) must be created "
                               f"with the scheduling gate {types.SCHEDULING_GATE}",
                    "reason": "Forbidden",
                },
                {
                    "expression": "request.operation != 'UPDATE' || !variables.hadGate "
                                  f"|| variables.hasGate || request.userInfo.username in {allowed}",
                    "message": f"only the neonvm controller may remove the scheduling gate "
                               f"{types.SCHEDULING_GATE}",
                    "reason": "Forbidden",
                },
                {
                    # Also forbids adding the label to an existing pod: a pod can only
                    # become a runner pod at creation, where the first rule applies.
                    "expression": "request.operation != 'UPDATE' || "
                                  f"{vm_labels}.all(k, {label_of('object')} == "
                                  f"{label_of('oldObject')})",
                    "message": f"the {types.LABEL_VM_NAME} and {types.LABEL_VM_UID} labels of "
                               "a pod are immutable (a pod is a runner pod from creation or "
                               "never)",
                    "reason": "Forbidden",
                },
                {
                    "expression": "request.operation != 'UPDATE' || !variables.wasRunner || "
                                  f"request.userInfo.username in {gc_users} || "
                                  "(has(object.metadata.ownerReferences) == "
                                  "has(oldObject.metadata.ownerReferences) && "
                                  "(!has(object.metadata.ownerReferences) || "
                                  "object.metadata.ownerReferences == "
                                  "oldObject.metadata.ownerReferences))",
                    "message": "the owner references of a runner pod are immutable",
                    "reason": "Forbidden",
                },
            ],
        },
    }


def admission_policy_binding() -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY_NAME},
        "spec": {"policyName": POLICY_NAME, "validationActions": ["Deny"]},
    }


def cluster_objects(controller_user: str) -> list[dict[str, Any]]:
    """Everything ``neonvm dev up`` applies, in order."""
    return [
        crd(),
        cluster_role(),
        cluster_role_binding(controller_user),
        admission_policy([controller_user]),
        admission_policy_binding(),
    ]


CHART_DIR = Path(__file__).resolve().parent.parent / "charts" / "neonvm-controller"
CHART_SA_PLACEHOLDER = "__CONTROLLER_SERVICE_ACCOUNT__"


def chart_files() -> dict[str, str]:
    """Generated chart files (relative path -> content)."""
    header = "# Generated by `neonvm manifests write` from neonvm/manifests.py; do not edit.\n"
    return {
        "crds/virtualmachines.vm.neon.tech.yaml": header + yaml.safe_dump(crd(), sort_keys=False),
        "files/controller-rules.yaml": header + yaml.safe_dump(controller_rules(), sort_keys=False),
        "files/pull-secret-rules.yaml": header
        + yaml.safe_dump(pull_secret_rules(), sort_keys=False),
        "files/live-scaling-rules.yaml": header
        + yaml.safe_dump(live_scaling_rules(), sort_keys=False),
        "files/leader-election-rules.yaml": header
        + yaml.safe_dump(leader_election_rules(), sort_keys=False),
        "files/admission-policy.yaml": header
        + yaml.safe_dump(admission_policy([CHART_SA_PLACEHOLDER]), sort_keys=False),
    }


def write_chart_files(chart_dir: Path = CHART_DIR) -> list[Path]:
    written = []
    for rel, content in chart_files().items():
        path = chart_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
