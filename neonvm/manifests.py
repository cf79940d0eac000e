"""Cluster objects generated from code: CRD, RBAC (the controller's and users'), the fence.

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

The same policy keeps a VM's status the controller's (docs/security.md, "Tenants"): a
change to any status field but the conditions (the fence, the plans, the names the
controller puts into REST paths) is refused to everyone but the controller's identity and
the ``system:masters`` group (the break-glass of a cluster administrator, who may also
remove the binding). With ``limit_controller`` (the chart's copy) it also limits what the
controller's own identity may create: only runner pods (gated, labelled, owned by their
VM, no host namespaces, no hostPath, nothing privileged), scaling-token Secrets (named by
the token prefix, labelled and owned by their VM, type Opaque) and SSH key Secrets
(``ssh-neonvm-<vm>``, labelled and owned by that VM, type ``kubernetes.io/ssh-auth``).

What it does not cover: deletes (anyone allowed to delete pods may delete a runner pod;
deleting is always safe for the invariant), and identities it names (whoever holds the
controller's credentials may create and ungate runner pods). The controller's own check
(it adopts a pod under a planned name only if the pod carries that plan's fence
annotations) is defence in depth behind this policy, not a replacement: the fence is
shown in the VM's status, so anyone who may create runner pods can copy it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from neonvm.api import admission, types
from neonvm.api import crd as crd_module
from neonvm.api.schema import json_name
from neonvm.controller import ssh_keys

POLICY_NAME = "neonvm-runner-pod-fence"
CLUSTER_ROLE = "neonvm-controller"
USER_ROLE_PREFIX = "neonvm-virtualmachines"
"""The local cluster's user roles are ``<prefix>-edit`` and ``<prefix>-view``; the chart's
are ``<fullname>-edit`` and ``<fullname>-view``."""
OVERRIDE_GROUPS = ("system:masters",)
"""Who besides the controller may change the controller's status fields: cluster
administrators (they may remove the policy anyway), for the remedies reconciler.md
gives (e.g. removing a stuck plan)."""
STATUS_FIELDS_OPEN = ("conditions", "extraConditions")
"""Status fields anyone with ``virtualmachines/status`` write may change (other actors
may add their own condition types, as Kubernetes conventions allow; ``extraConditions``
holds the controller's condition types that NeonVM does not write). The controller reads
a few of its own (a create refused for this generation, FenceAhead, a scaling refusal):
writing them parks only that VM (docs/security.md, "VM status is the controller's")."""
GC_USER = "system:kube-controller-manager"
GC_SA = "system:serviceaccount:kube-system:generic-garbage-collector"


def crd() -> dict[str, Any]:
    return crd_module.virtualmachine_crd()


def controller_rules() -> list[dict[str, Any]]:
    """Exactly the verbs the controller uses on VMs, pods, events and the VMs' own
    Namespaces, in every namespace.

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
        # Is a VM's namespace being deleted (before its pod is replaced)? Granted by a
        # Role too: GET /api/v1/namespaces/X is a request in namespace X.
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]},
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


def ssh_key_rules() -> list[dict[str, Any]]:
    """``create`` on secrets, nothing else: each VM's SSH key Secret (``enableSSH``,
    NeonVM's default; :mod:`neonvm.controller.ssh_keys`). Create only: the controller
    never reads it back (an existing one answers 409 and is used as it is), so this rule
    lets the identity read no Secret. The chart renders it unless ``rbac.sshKeys`` is
    off, and its admission fence allows only ``ssh-neonvm-<vm>`` Secrets of type
    ``kubernetes.io/ssh-auth``, labelled for and owned by that VM. Without it a VM's pod
    starts without a key (a ``SSHKeyUnavailable`` warning event)."""
    return [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


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


def self_fencing_rules() -> list[dict[str, Any]]:
    """``get`` on nodes: self-fencing replaces a pod only when its node is unreachable
    (``neonvm/controller/fencing.py``); ``create`` on tokenreviews: the rights endpoint
    verifies a runner's projected ServiceAccount token (``TokenReviewer`` in
    ``neonvm/controller/rights.py``; no Secret rights). Both are cluster-scoped, so the
    chart grants them through a ClusterRole of its own, also when the controller watches
    one namespace. Without nodes, self-fencing pods on a dead node wait for
    out-of-service, as others do; without tokenreviews, no ask with a token is granted.
    ``get`` on the API server's issuer discovery document and JWKS: the leader verifies
    those tokens locally with its keys (``neonvm/controller/token_verify.py``); Kubernetes
    grants them to every ServiceAccount already (``system:service-account-issuer-discovery``),
    not to the local cluster's certificate identity. Without them, every token is reviewed."""
    return [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"],
             "verbs": ["create"]},
            {"nonResourceURLs": ["/.well-known/openid-configuration", "/openid/v1/jwks"],
             "verbs": ["get"]}]


def rights_endpoint_rules() -> list[dict[str, Any]]:
    """What a leader needs to point the rights Service at itself (an EndpointSlice of a
    Service without selector; ``LeaderEndpoint`` in ``neonvm/controller/rights.py``).
    Granted in the release namespace alone."""
    return [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["get", "create", "update"]}]


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


def user_edit_rules() -> list[dict[str, Any]]:
    """What the aggregated ``edit`` (and ``admin``) role gets: VMs in full, status read-only.

    NeonVM's editor role, which writes no status: status is the controller's (the
    admission policy refuses anyone else's change to it anyway).
    """
    return [
        {"apiGroups": [types.GROUP], "resources": [types.PLURAL],
         "verbs": ["get", "list", "watch", "create", "update", "patch", "delete",
                   "deletecollection"]},
        {"apiGroups": [types.GROUP], "resources": [f"{types.PLURAL}/status"],
         "verbs": ["get", "list", "watch"]},
    ]


def user_view_rules() -> list[dict[str, Any]]:
    """What the aggregated ``view`` role gets: VMs and their status, read-only."""
    return [
        {"apiGroups": [types.GROUP], "resources": [types.PLURAL, f"{types.PLURAL}/status"],
         "verbs": ["get", "list", "watch"]},
    ]


AGGREGATE_TO = {"edit": ("edit", "admin"), "view": ("view",)}
"""Which standard ClusterRoles each user role is aggregated into."""


def user_roles(prefix: str = USER_ROLE_PREFIX) -> list[dict[str, Any]]:
    """The ``<prefix>-edit`` and ``<prefix>-view`` ClusterRoles, aggregated into the
    standard ``edit``/``admin`` and ``view`` roles (the chart renders the same rules)."""
    rules = {"edit": user_edit_rules(), "view": user_view_rules()}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": f"{prefix}-{kind}", "labels": {
             f"rbac.authorization.k8s.io/aggregate-to-{to}": "true"
             for to in AGGREGATE_TO[kind]}},
         "rules": rules[kind]}
        for kind in ("edit", "view")
    ]


def cluster_role() -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": CLUSTER_ROLE},
        "rules": controller_rules() + pull_secret_rules() + live_scaling_rules()
        + leader_election_rules() + self_fencing_rules() + rights_endpoint_rules(),
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


def controller_status_fields() -> list[str]:
    """Every status field (JSON name) only the controller may change: all but
    :data:`STATUS_FIELDS_OPEN`, so a field added to the status is guarded at once."""
    return [json_name(f) for f in dataclasses.fields(types.VirtualMachineStatus)
            if json_name(f) not in STATUS_FIELDS_OPEN]


def admission_policy(controller_users: list[str], *,
                     limit_controller: bool = True) -> dict[str, Any]:
    """The fence; ``controller_users`` may create and ungate runner pods and write the
    controller's status fields.

    It matches ``pods/status`` as well as ``pods``: a status write keeps the spec and the
    owner references but not the labels, so without it the VM labels could be changed
    there. Every expression is total (no error on any object), because ``failurePolicy:
    Fail`` would otherwise block unrelated writes, kubelets' status updates included;
    each rule first names the resource it is about, so the others pass it.

    ``limit_controller`` adds what the controller's own identity may create (the chart's
    copy; the local cluster's tests create odd pods under that identity on purpose):
    see the module doc.
    """
    label = _cel_string(types.LABEL_VM_NAME)
    uid_label = _cel_string(types.LABEL_VM_UID)
    vm_labels = "[" + ", ".join(
        _cel_string(k) for k in (types.LABEL_VM_NAME, types.LABEL_VM_UID)
    ) + "]"
    gate = _cel_string(types.SCHEDULING_GATE)
    allowed = "[" + ", ".join(_cel_string(u) for u in controller_users) + "]"
    gc_users = "[" + ", ".join(_cel_string(u) for u in (GC_USER, GC_SA)) + "]"
    override = "[" + ", ".join(_cel_string(g) for g in OVERRIDE_GROUPS) + "]"
    is_controller = f"request.userInfo.username in {allowed}"
    on_pods = "request.resource.resource != 'pods'"

    def label_of(obj: str) -> str:
        return (f"(has({obj}.metadata.labels) && k in {obj}.metadata.labels ? "
                f"{obj}.metadata.labels[k] : '')")

    def kept(field: str) -> str:
        new, old = (f"(has(object.status) && has(object.status.{field}))",
                    f"(has(oldObject.status) && has(oldObject.status.{field}))")
        return f"({new} == {old} && (!{new} || object.status.{field} == oldObject.status.{field}))"

    rules: list[dict[str, Any]] = [
        {"apiGroups": [""], "apiVersions": ["v1"],
         "operations": ["CREATE", "UPDATE"], "resources": ["pods", "pods/status"]},
        {"apiGroups": [types.GROUP], "apiVersions": [types.VERSION],
         "operations": ["UPDATE"], "resources": [f"{types.PLURAL}/status"]},
    ]
    variables = [
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
        {"name": "statusKept",
         "expression": " && ".join(kept(f) for f in controller_status_fields())},
    ]
    validations: list[dict[str, Any]] = [
        {
            # Pod names are predictable: a pod another identity planted under the
            # next plan's name would otherwise be found by the controller's create.
            "expression": f"{on_pods} || request.operation != 'CREATE' || "
                          f"!variables.hasVMLabel || {is_controller}",
            "message": f"only the neonvm controller may create a runner pod "
                       f"(labelled {types.LABEL_VM_NAME} or {types.LABEL_VM_UID})",
            "reason": "Forbidden",
        },
        {
            "expression": f"{on_pods} || request.operation != 'CREATE' || "
                          "!variables.isRunner || variables.hasGate",
            "message": f"a runner pod (labelled {types.LABEL_VM_NAME}) must be created "
                       f"with the scheduling gate {types.SCHEDULING_GATE}",
            "reason": "Forbidden",
        },
        {
            "expression": f"{on_pods} || request.operation != 'UPDATE' || "
                          f"!variables.hadGate || variables.hasGate || {is_controller}",
            "message": f"only the neonvm controller may remove the scheduling gate "
                       f"{types.SCHEDULING_GATE}",
            "reason": "Forbidden",
        },
        {
            # Also forbids adding the label to an existing pod: a pod can only
            # become a runner pod at creation, where the first rule applies.
            "expression": f"{on_pods} || request.operation != 'UPDATE' || "
                          f"{vm_labels}.all(k, {label_of('object')} == "
                          f"{label_of('oldObject')})",
            "message": f"the {types.LABEL_VM_NAME} and {types.LABEL_VM_UID} labels of "
                       "a pod are immutable (a pod is a runner pod from creation or "
                       "never)",
            "reason": "Forbidden",
        },
        {
            "expression": f"{on_pods} || request.operation != 'UPDATE' || "
                          "!variables.wasRunner || "
                          f"request.userInfo.username in {gc_users} || "
                          "(has(object.metadata.ownerReferences) == "
                          "has(oldObject.metadata.ownerReferences) && "
                          "(!has(object.metadata.ownerReferences) || "
                          "object.metadata.ownerReferences == "
                          "oldObject.metadata.ownerReferences))",
            "message": "the owner references of a runner pod are immutable",
            "reason": "Forbidden",
        },
        {
            # The fence ends a leader's term, the plans name pods and Secrets the
            # controller reads by name: a tenant with status rights must not write them.
            "expression": f"request.resource.resource != {_cel_string(types.PLURAL)} || "
                          f"{is_controller} || (has(request.userInfo.groups) && "
                          f"request.userInfo.groups.exists(g, g in {override})) || "
                          "variables.statusKept",
            "message": "only the neonvm controller may change a VirtualMachine's status "
                       f"(every field but {', '.join(STATUS_FIELDS_OPEN)})",
            "reason": "Forbidden",
        },
    ]
    spec: dict[str, Any] = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": rules},
        "variables": variables,
        "validations": validations,
    }
    if limit_controller:
        _limit_controller(spec, is_controller, uid_label, label)
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY_NAME},
        "spec": spec,
    }


def _limit_controller(spec: dict[str, Any], is_controller: str, uid_label: str,
                      label: str) -> None:
    """Add to ``spec`` the rules on what the controller's identity may create.

    RBAC cannot say "create only pods of this shape" or "only Secrets of this name"
    (``resourceNames`` does not restrict ``create``), so this policy does: a stolen
    controller credential can still create gated runner pods and token Secrets, but no
    pod with host access, and no Secret of another type (a ServiceAccount token Secret
    would be filled in for any ServiceAccount it names).
    """
    spec["matchConstraints"]["resourceRules"].append(
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
         "resources": ["secrets"]})
    # Other identities' Secrets never reach the validations (nor cost a CEL run).
    spec["matchConditions"] = [
        {"name": "secrets-of-the-controller-only",
         "expression": f"request.resource.resource != 'secrets' || {is_controller}"},
    ]
    owner = _cel_string(types.KIND)
    api_version = _cel_string(types.API_VERSION)
    prefix = _cel_string(types.SCALING_TOKEN_SECRET_PREFIX)
    ssh_prefix = _cel_string(ssh_keys.SECRET_PREFIX)
    ssh_type = _cel_string(ssh_keys.SECRET_TYPE)
    spec["variables"] += [
        {"name": "ownedByItsVM",
         "expression": f"has(object.metadata.labels) && {label} in object.metadata.labels "
                       f"&& {uid_label} in object.metadata.labels && "
                       "has(object.metadata.ownerReferences) && "
                       "object.metadata.ownerReferences.size() == 1 && "
                       "object.metadata.ownerReferences.all(r, "
                       f"r.apiVersion == {api_version} && r.kind == {owner} && "
                       f"r.uid == object.metadata.labels[{uid_label}])"},
        {"name": "containers",
         "expression": "(has(object.spec.containers) ? object.spec.containers : []) + "
                       "(has(object.spec.initContainers) ? object.spec.initContainers : [])"},
        {"name": "noHostAccess",
         "expression": "!(has(object.spec.hostNetwork) && object.spec.hostNetwork) && "
                       "!(has(object.spec.hostPID) && object.spec.hostPID) && "
                       "!(has(object.spec.hostIPC) && object.spec.hostIPC) && "
                       "(!has(object.spec.volumes) || "
                       "object.spec.volumes.all(v, !has(v.hostPath))) && "
                       "variables.containers.all(c, !has(c.securityContext) || "
                       "!has(c.securityContext.privileged) || !c.securityContext.privileged)"},
        {"name": "secretName",
         "expression": "has(object.metadata.name) && object.metadata.name != '' ? "
                       "object.metadata.name : (has(object.metadata.generateName) ? "
                       "object.metadata.generateName : '')"},
    ]
    spec["validations"] += [
        {
            "expression": "request.resource.resource != 'pods' || "
                          f"request.operation != 'CREATE' || !({is_controller}) || "
                          "(variables.ownedByItsVM && variables.hasGate && "
                          "variables.noHostAccess)",
            "message": "the neonvm controller may create only runner pods: gated, labelled "
                       "for and owned by their VM, without host namespaces, hostPath or "
                       "privileged containers",
            "reason": "Forbidden",
        },
        {
            "expression": "request.resource.resource != 'secrets' || "
                          f"(variables.secretName.startsWith({prefix}) && "
                          "variables.ownedByItsVM && "
                          "(!has(object.type) || object.type == 'Opaque')) || "
                          "(variables.ownedByItsVM && has(object.type) && "
                          f"object.type == {ssh_type} && variables.secretName == "
                          f"{ssh_prefix} + object.metadata.labels[{label}])",
            "message": "the neonvm controller may create only scaling-token Secrets "
                       f"({types.SCALING_TOKEN_SECRET_PREFIX}..., Opaque, labelled for and "
                       f"owned by their VM) and SSH key Secrets ({ssh_keys.SECRET_PREFIX}"
                       f"<vm>, {ssh_keys.SECRET_TYPE}, labelled for and owned by that VM)",
            "reason": "Forbidden",
        },
    ]


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
        admission.cpu_amounts_policy(),
        admission.cpu_amounts_binding(),
        cluster_role(),
        cluster_role_binding(controller_user),
        admission_policy([controller_user], limit_controller=False),
        admission_policy_binding(),
        *user_roles(),
    ]


CHART_DIR = Path(__file__).resolve().parent.parent / "charts" / "neonvm-controller"
CHART_SA_PLACEHOLDER = "__CONTROLLER_SERVICE_ACCOUNT__"


def chart_files() -> dict[str, str]:
    """Generated chart files (relative path -> content)."""
    header = "# Generated by `neonvm manifests write` from neonvm/manifests.py; do not edit.\n"
    return {
        "crds/virtualmachines.vm.neon.tech.yaml": header + yaml.safe_dump(crd(), sort_keys=False),
        "files/cpu-amounts-policy.yaml": header
        + yaml.safe_dump(admission.cpu_amounts_policy(), sort_keys=False),
        "files/controller-rules.yaml": header + yaml.safe_dump(controller_rules(), sort_keys=False),
        "files/pull-secret-rules.yaml": header
        + yaml.safe_dump(pull_secret_rules(), sort_keys=False),
        "files/live-scaling-rules.yaml": header
        + yaml.safe_dump(live_scaling_rules(), sort_keys=False),
        "files/ssh-key-rules.yaml": header + yaml.safe_dump(ssh_key_rules(), sort_keys=False),
        "files/leader-election-rules.yaml": header
        + yaml.safe_dump(leader_election_rules(), sort_keys=False),
        "files/self-fencing-rules.yaml": header
        + yaml.safe_dump(self_fencing_rules(), sort_keys=False),
        "files/rights-endpoint-rules.yaml": header
        + yaml.safe_dump(rights_endpoint_rules(), sort_keys=False),
        "files/admission-policy.yaml": header
        + yaml.safe_dump(admission_policy([CHART_SA_PLACEHOLDER]), sort_keys=False),
        "files/user-edit-rules.yaml": header
        + yaml.safe_dump(user_edit_rules(), sort_keys=False),
        "files/user-view-rules.yaml": header
        + yaml.safe_dump(user_view_rules(), sort_keys=False),
    }


def write_chart_files(chart_dir: Path = CHART_DIR) -> list[Path]:
    written = []
    for rel, content in chart_files().items():
        path = chart_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    return written
