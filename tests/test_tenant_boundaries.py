"""A tenant's reach, checked on the real API server: what a VM owner may and may not do.

What is shown here (docs/security.md, "Tenants"):

* **Status is the controller's.** A user granted ``virtualmachines/status`` write is
  refused, by the fence itself, any change to the fence, the plans or the names in
  status; conditions stay open. The controller's identity and cluster administrators
  (``system:masters``) may still write them.
* **Names stay in their namespace.** The CRD refuses a pull secret, a secret or
  ConfigMap disk, or a status name that is not an object name (``../../kube-system/...``),
  and the controller's client never sends a path with a dot segment: on the real server
  such a path would read an object of another namespace.
* **A VM cannot mount a scaling token.** ``disks[].secret`` naming a Secret with the token
  prefix is refused.
* **User roles.** Whoever is bound to the standard ``edit`` role may create and change
  VMs and read their status, but not write status; ``view`` reads only.
* **The chart, per installation.** Two releases watching different namespaces do not
  fence each other out; each ServiceAccount is granted its namespace only, and may create
  only runner pods and scaling-token Secrets.

Not shown here: the whole controller running under two releases (test_chart.py runs the
real controller under one release's identity).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm import kube, manifests
from neonvm.api import types
from neonvm.controller import scaling, ssh_keys
from neonvm.controller.cluster import KubeCluster
from neonvm.dev import binaries
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for
from tests.support.chart import Helm, Rendered
from tests.support.tenant import installed

SAMPLE_VM = Path(__file__).resolve().parent.parent / "examples" / "vm-deploy.yaml"
OUTSIDE = "../../kube-system/secrets/target"
"""A name that, put into a REST path unchecked, reads a Secret of another namespace."""


# ---- helpers -----------------------------------------------------------------------------


def sample_vm(name: str) -> dict[str, Any]:
    vm: dict[str, Any] = yaml.safe_load(SAMPLE_VM.read_text())
    vm["metadata"] = {"name": name}
    return vm


def create_vm(api: client.ApiClient, namespace: str, vm: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm)
    return created


def get_vm(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    vm: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, name)
    return vm


def put_status(api: client.ApiClient, namespace: str, name: str,
               change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read the VM, apply ``change`` to its status, PUT /status (resourceVersion kept)."""
    vm = get_vm(api, namespace, name)
    vm.setdefault("status", {})
    change(vm["status"])
    out: dict[str, Any] = client.CustomObjectsApi(api).replace_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, name, vm)
    return out


def as_user(cluster: LocalCluster, user: str) -> client.ApiClient:
    """The admin kubeconfig, impersonating ``user`` (no groups but the defaults)."""
    api = kube.api_client(cluster.kubeconfig)
    api.set_default_header("Impersonate-User", user)
    return api


def refused(call: Callable[[], object]) -> ApiException:
    with pytest.raises(ApiException) as err:
        call()
    return err.value


def fenced_by(err: ApiException, policy: str, fragment: str) -> bool:
    message = kube.api_error_message(err)
    return err.status == 403 and f"'{policy}'" in message and fragment in message


def grant(api: client.ApiClient, namespace: str, user: str, *, role: str | None = None,
          rules: list[dict[str, Any]] | None = None) -> None:
    """Bind ``user`` in ``namespace`` to ClusterRole ``role``, or to a Role of ``rules``."""
    rbac = client.RbacAuthorizationV1Api(api)
    name = f"grant-{uuid.uuid4().hex[:6]}"
    if rules is not None:
        rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role" if rules is not None else "ClusterRole",
                    "name": name if rules is not None else role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})


STATUS_WRITER_RULES = [
    {"apiGroups": [types.GROUP], "resources": [types.PLURAL], "verbs": ["get", "list"]},
    {"apiGroups": [types.GROUP], "resources": [f"{types.PLURAL}/status"],
     "verbs": ["get", "update", "patch"]},
]
"""What "a tenant with edit plus status rights" holds on VMs."""

STATUS_CHANGES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("fence", lambda s: s.update(fence={"epoch": 10**9, "token": 1})),
    ("pendingPod", lambda s: s.update(pendingPod={"name": "planted", "planSeq": 7},
                                      planSeq=7)),
    ("pendingScale", lambda s: s.update(pendingScale={"cpus": 2, "memorySlots": 1, "seq": 1,
                                                      "epoch": 10**9, "token": 1})),
    ("podName", lambda s: s.update(podName="someone-elses-pod", podUID="u")),
    ("scalingTokenSecret", lambda s: s.update(scalingTokenSecret="another-vms-token",
                                              scalingTokenSecretUID="u")),
    ("fence removed", lambda s: s.pop("fence", None)),
]


# ---- status is the controller's ------------------------------------------------------------


@pytest.fixture
def fenced_vm(api: client.ApiClient, controller_api: client.ApiClient,
              namespace: str) -> str:
    """A VM whose status the controller has written (a fence, a plan sequence)."""
    create_vm(api, namespace, sample_vm("tenant"))
    put_status(controller_api, namespace, "tenant",
               lambda s: s.update(fence={"epoch": 3, "token": 40}, planSeq=1, phase="Pending"))
    return "tenant"


@pytest.mark.cluster
@pytest.mark.parametrize(("what", "change"), STATUS_CHANGES, ids=[w for w, _ in STATUS_CHANGES])
def test_a_tenant_with_status_rights_cannot_change_the_controllers_status_fields(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, fenced_vm: str,
    what: str, change: Callable[[dict[str, Any]], None],
) -> None:
    grant(api, namespace, "mallory", rules=STATUS_WRITER_RULES)
    mallory = as_user(cluster, "mallory")
    err = refused(lambda: put_status(mallory, namespace, fenced_vm, change))
    assert fenced_by(err, manifests.POLICY_NAME, "only the neonvm controller may change"), (
        kube.api_error_message(err))
    assert get_vm(api, namespace, fenced_vm)["status"]["fence"] == {"epoch": 3, "token": 40}


@pytest.mark.cluster
def test_conditions_stay_open_and_the_controller_and_administrators_may_write_the_rest(
    cluster: LocalCluster, api: client.ApiClient, controller_api: client.ApiClient,
    namespace: str, fenced_vm: str,
) -> None:
    grant(api, namespace, "mallory", rules=STATUS_WRITER_RULES)
    mallory = as_user(cluster, "mallory")
    condition = {"type": "example.com/Backup", "status": "True", "reason": "Done",
                 "message": "nightly", "lastTransitionTime": "2024-01-01T00:00:00Z"}
    put_status(mallory, namespace, fenced_vm, lambda s: s.update(conditions=[condition]))
    # A merge patch of conditions alone also leaves the guarded fields as they are.
    client.CustomObjectsApi(mallory).patch_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, fenced_vm,
        {"status": {"conditions": [{**condition, "message": "weekly"}]}})

    put_status(controller_api, namespace, fenced_vm,
               lambda s: s.update(fence={"epoch": 4, "token": 41}))
    # The remedy reconciler.md gives an operator (a cluster administrator).
    put_status(api, namespace, fenced_vm, lambda s: s.update(fence={"epoch": 1, "token": 1}))
    assert get_vm(api, namespace, fenced_vm)["status"]["fence"] == {"epoch": 1, "token": 1}


# ---- names stay in their namespace ---------------------------------------------------------


NAME_FIELDS: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("imagePullSecrets", lambda v: v["spec"].update(imagePullSecrets=[{"name": OUTSIDE}])),
    ("disks.secret", lambda v: v["spec"]["disks"].append(
        {"name": "s", "mountPath": "/s", "secret": {"secretName": OUTSIDE}})),
    ("disks.configMap", lambda v: v["spec"]["disks"].append(
        {"name": "c", "mountPath": "/c", "configMap": {"name": "a/b"}})),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("what", "change"), NAME_FIELDS, ids=[w for w, _ in NAME_FIELDS])
def test_the_crd_refuses_spec_names_that_are_not_object_names(
    api: client.ApiClient, namespace: str, what: str,
    change: Callable[[dict[str, Any]], None],
) -> None:
    vm = sample_vm("names")
    change(vm)
    err = refused(lambda: create_vm(api, namespace, vm))
    assert err.status == 422 and "should match" in kube.api_error_message(err), (
        kube.api_error_message(err))


STATUS_NAMES = ["podName", "scalingTokenSecret"]


@pytest.mark.cluster
@pytest.mark.parametrize("field", STATUS_NAMES)
def test_the_crd_refuses_status_names_that_are_not_object_names_even_from_an_admin(
    api: client.ApiClient, namespace: str, fenced_vm: str, field: str,
) -> None:
    err = refused(lambda: put_status(api, namespace, fenced_vm,
                                     lambda s: s.update({field: OUTSIDE})))
    assert err.status == 422 and field in kube.api_error_message(err)
    err = refused(lambda: put_status(api, namespace, fenced_vm, lambda s: s.update(
        pendingPod={"name": OUTSIDE, "planSeq": 2}, planSeq=2)))
    assert err.status == 422 and "pendingPod.name" in kube.api_error_message(err)
    # Empty stays allowed: the controller clears podName by writing "".
    put_status(api, namespace, fenced_vm, lambda s: s.update(podName=""))


@pytest.fixture
def secret_elsewhere(api: client.ApiClient) -> Iterator[tuple[str, str]]:
    """A Secret in a namespace of its own: (namespace, name)."""
    core = client.CoreV1Api(api)
    ns = f"else-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_secret(ns, {"metadata": {"name": "target"},
                                       "stringData": {"k": "v"}})
    yield ns, "target"
    with contextlib.suppress(ApiException):
        core.delete_namespace(ns)


@pytest.mark.cluster
def test_the_controllers_reads_by_name_never_leave_the_vms_namespace(
    api: client.ApiClient, namespace: str, secret_elsewhere: tuple[str, str],
) -> None:
    """Unchecked, ``.../namespaces/<ns>/secrets/../../<other>/secrets/target`` reads the
    other namespace's Secret (the client resolves the dot segments): a status name would
    have been an oracle for Secrets and pods anywhere."""
    other, name = secret_elsewhere
    reads = KubeCluster(api)
    sneaky = f"../../{other}/secrets/{name}"
    assert reads.secret_metadata(namespace, sneaky) is None
    assert reads.get_pod(namespace, f"../../{other}/pods/x") is None
    with pytest.raises(ValueError, match="not an object name"):
        reads.get_pod(namespace, "..")
    with pytest.raises(ValueError, match="dot segment"):
        kube.request(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/{sneaky}")
    # The same reads, by a name that is one, still work.
    assert (reads.secret_metadata(other, name) or {})["metadata"]["name"] == name


@pytest.mark.unit
def test_a_path_segment_is_quoted_and_never_a_dot_name() -> None:
    assert kube.path_segment("a.b-c") == "a.b-c"
    assert kube.path_segment("../x") == "..%2Fx"
    for name in ("", ".", ".."):
        with pytest.raises(ValueError):
            kube.path_segment(name)


# ---- a VM cannot mount a scaling token -----------------------------------------------------


@pytest.mark.unit
def test_the_crds_token_prefix_is_the_one_the_controller_names_its_tokens_with() -> None:
    vm = types.VirtualMachine.from_object({"metadata": {"name": "v", "uid": "1234abcd-x"},
                                           "spec": sample_vm("v")["spec"]})
    assert scaling.token_secret_prefix(vm).startswith(types.SCALING_TOKEN_SECRET_PREFIX)


@pytest.mark.cluster
def test_a_vm_may_mount_a_secret_of_its_namespace_but_not_a_scaling_token(
    api: client.ApiClient, namespace: str,
) -> None:
    thief = sample_vm("thief")
    thief["spec"]["disks"].append({"name": "loot", "mountPath": "/loot",
                                   "secret": {"secretName": "neonvm-scaling-1234abcd-x7k2p"}})
    err = refused(lambda: create_vm(api, namespace, thief))
    assert err.status == 422 and "live scaling token" in kube.api_error_message(err)

    fine = sample_vm("fine")
    fine["spec"]["disks"].append({"name": "conf", "mountPath": "/conf",
                                  "secret": {"secretName": "app-config"}})
    created = create_vm(api, namespace, fine)
    # Nor can an existing VM be changed to mount one.
    created["spec"]["disks"][-1]["secret"]["secretName"] = "neonvm-scaling-1234abcd-x7k2p"
    err = refused(lambda: client.CustomObjectsApi(api).replace_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "fine", created))
    assert err.status == 422 and "live scaling token" in kube.api_error_message(err)


# ---- user roles ----------------------------------------------------------------------------


def _aggregated(api: client.ApiClient, role: str, resource: str, verb: str) -> bool:
    rules = client.RbacAuthorizationV1Api(api).read_cluster_role(role).rules or []
    return any(types.GROUP in (r.api_groups or []) and resource in (r.resources or [])
               and verb in (r.verbs or []) for r in rules)


@pytest.mark.cluster
@pytest.mark.nodes
def test_edit_may_change_vms_and_read_status_but_not_write_it_and_view_only_reads(
    cluster: LocalCluster, api: client.ApiClient, namespace: str,
) -> None:
    if not cluster.spec.nodes:
        pytest.skip("role aggregation is kube-controller-manager's (NEONVM_TEST_NODES=0)")
    wait_for(lambda: _aggregated(api, "edit", types.PLURAL, "create")
             and _aggregated(api, "view", f"{types.PLURAL}/status", "get"),
             what="the VM rules aggregated into edit and view")
    grant(api, namespace, "erin", role="edit")
    grant(api, namespace, "vera", role="view")
    erin, vera = as_user(cluster, "erin"), as_user(cluster, "vera")

    vm = create_vm(erin, namespace, sample_vm("owned"))
    vm["spec"]["guest"]["cpus"]["use"] = 2
    client.CustomObjectsApi(erin).replace_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "owned", vm)
    client.CustomObjectsApi(erin).get_namespaced_custom_object_status(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "owned")
    # No status write at all, by RBAC (before any admission policy is asked).
    err = refused(lambda: put_status(erin, namespace, "owned",
                                     lambda s: s.update(fence={"epoch": 10**9, "token": 1})))
    assert err.status == 403 and "virtualmachines/status" in kube.api_error_message(err)

    assert get_vm(vera, namespace, "owned")["spec"]["guest"]["cpus"]["use"] == 2
    err = refused(lambda: create_vm(vera, namespace, sample_vm("viewers")))
    assert err.status == 403
    err = refused(lambda: put_status(vera, namespace, "owned", lambda s: s.update(phase="Failed")))
    assert err.status == 403


# ---- the chart, per installation -----------------------------------------------------------


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    try:
        binary = binaries.require("helm")
    except binaries.BinaryError as exc:
        pytest.skip(str(exc))
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


def service_account(cluster: LocalCluster, rendered: Rendered) -> client.ApiClient:
    sa = rendered.one("ServiceAccount")["metadata"]
    return as_user(cluster, f"system:serviceaccount:{rendered.namespace}:{sa['name']}")


def runner_pod(vm: dict[str, Any], name: str, **spec: Any) -> dict[str, Any]:
    meta = vm["metadata"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name,
                     "labels": {types.LABEL_VM_NAME: meta["name"], types.LABEL_VM_UID: meta["uid"]},
                     "ownerReferences": [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                          "name": meta["name"], "uid": meta["uid"],
                                          "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}], "restartPolicy": "Never",
                 "containers": [{"name": "runner", "image": "neonvm-runner:test"}], **spec},
    }


def token_secret(vm: dict[str, Any]) -> dict[str, Any]:
    """A scaling-token Secret as the controller creates it (neonvm/controller/scaling.py)."""
    meta = vm["metadata"]
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"generateName": f"{types.SCALING_TOKEN_SECRET_PREFIX}{meta['uid'][:8]}-",
                         "labels": {types.LABEL_VM_NAME: meta["name"],
                                    types.LABEL_VM_UID: meta["uid"]},
                         "ownerReferences": [{"apiVersion": types.API_VERSION,
                                              "kind": types.KIND, "name": meta["name"],
                                              "uid": meta["uid"], "blockOwnerDeletion": False}]},
            "stringData": {"token": "t"}}


def _ungate(pod: client.V1Pod) -> list[dict[str, Any]]:
    return [{"op": "test", "path": "/metadata/uid", "value": pod.metadata.uid},
            {"op": "remove", "path": "/spec/schedulingGates/0"}]


def _allowed(call: Callable[[], object]) -> bool:
    try:
        call()
    except ApiException:
        return False
    return True


@pytest.fixture
def second_namespace(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace({"metadata": {"name": name}})
    yield name
    with contextlib.suppress(ApiException):
        core.delete_namespace(name)


@pytest.mark.cluster
def test_two_releases_side_by_side_do_not_fence_each_other_out(
    helm: Helm, cluster: LocalCluster, api: client.ApiClient, namespace: str,
    second_namespace: str,
) -> None:
    """Release A watches one namespace, B another: each ServiceAccount creates, ungates
    and writes status in its own namespace, is refused by RBAC in the other, and a third
    party is still fenced out in both."""
    a = helm.template(f"a{uuid.uuid4().hex[:6]}", namespace,
                      sets=(f"controller.watchNamespace={namespace}",))
    b = helm.template(f"b{uuid.uuid4().hex[:6]}", second_namespace,
                      sets=(f"controller.watchNamespace={second_namespace}",))
    vms = {ns: create_vm(api, ns, sample_vm("shared-name")) for ns in (namespace, second_namespace)}
    with installed(api, a, b):
        for rendered, own, other in ((a, namespace, second_namespace),
                                     (b, second_namespace, namespace)):
            sa = client.CoreV1Api(service_account(cluster, rendered))
            vm = vms[own]
            # Policies load asynchronously: wait until the create goes through.
            wait_for(lambda sa=sa, own=own, vm=vm: _allowed(  # type: ignore[misc]
                lambda: sa.create_namespaced_pod(own, runner_pod(vm, "r1"))),
                what=f"{rendered.release}'s runner pod admitted in {own}")
            pod = sa.read_namespaced_pod("r1", own)
            sa.patch_namespaced_pod("r1", own, _ungate(pod))
            put_status(service_account(cluster, rendered), own, "shared-name",
                       lambda s: s.update(fence={"epoch": 1, "token": 2}, podName="r1"))
            err = refused(functools.partial(sa.create_namespaced_pod, other,
                                            runner_pod(vms[other], "r2")))
            assert err.status == 403 and "cannot create resource" in kube.api_error_message(err)

        grant(api, namespace, "mallory", rules=STATUS_WRITER_RULES)
        mallory = as_user(cluster, "mallory")
        policy_a = a.one("ValidatingAdmissionPolicy")["metadata"]["name"]
        wait_for(lambda: not _allowed(lambda: put_status(
            mallory, namespace, "shared-name", lambda s: s.update(fence={"epoch": 9, "token": 9}))),
            what="A's fence refusing a tenant's fence write")
        err = refused(lambda: put_status(mallory, namespace, "shared-name",
                                         lambda s: s.update(fence={"epoch": 9, "token": 9})))
        assert fenced_by(err, policy_a, "only the neonvm controller may change"), (
            kube.api_error_message(err))


def test_a_release_watching_one_namespace_is_granted_that_namespace_alone(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops", sets=("controller.watchNamespace=tenant-a",
                                                 "rbac.liveScaling=true"))
    roles = {(o["kind"], o["metadata"]["name"]): o for o in rendered.objects
             if o["kind"] in ("Role", "ClusterRole")}
    assert ("ClusterRole", "nvm-neonvm-controller") not in roles
    role = roles[("Role", "nvm-neonvm-controller")]
    assert role["metadata"]["namespace"] == "tenant-a"
    assert role["rules"] == (manifests.controller_rules() + manifests.live_scaling_rules()
                             + manifests.ssh_key_rules())
    binding = next(o for o in rendered.all("RoleBinding")
               if o["metadata"]["name"] == "nvm-neonvm-controller")
    assert binding["metadata"]["namespace"] == "tenant-a"
    assert binding["roleRef"]["kind"] == "Role"
    fence = rendered.one("ValidatingAdmissionPolicyBinding")["spec"]
    assert fence["matchResources"] == {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "tenant-a"}}}

    everywhere = helm.template("nvm", "ops", sets=("rbac.liveScaling=true",))
    # and self-fencing's (with liveScaling; `get` on nodes: tests/test_chart_self_fencing.py)
    assert sorted(o["metadata"]["name"] for o in everywhere.all("ClusterRoleBinding")) == [
        "nvm-neonvm-controller", "nvm-neonvm-controller-self-fencing"]
    assert "matchResources" not in everywhere.one("ValidatingAdmissionPolicyBinding")["spec"]


def test_the_chart_ships_user_roles_aggregated_into_edit_admin_and_view(helm: Helm) -> None:
    rendered = helm.template("nvm", "ops")
    roles = {o["metadata"]["name"]: o for o in rendered.all("ClusterRole")}
    edit, view = roles["nvm-neonvm-controller-edit"], roles["nvm-neonvm-controller-view"]
    assert edit["rules"] == manifests.user_edit_rules()
    assert view["rules"] == manifests.user_view_rules()
    assert {k: v for k, v in edit["metadata"]["labels"].items() if "aggregate" in k} == {
        "rbac.authorization.k8s.io/aggregate-to-edit": "true",
        "rbac.authorization.k8s.io/aggregate-to-admin": "true"}
    assert {k: v for k, v in view["metadata"]["labels"].items() if "aggregate" in k} == {
        "rbac.authorization.k8s.io/aggregate-to-view": "true"}
    status_writes = [r for r in edit["rules"] + view["rules"]
                     if f"{types.PLURAL}/status" in r["resources"]
                     and {"update", "patch", "create"} & set(r["verbs"])]
    assert status_writes == []
    assert not [o for o in helm.template("nvm", "ops", sets=("rbac.userRoles=false",)).all(
        "ClusterRole") if o["metadata"]["name"].endswith(("-edit", "-view"))]


LIMITS = "the neonvm controller may create only"


@pytest.mark.cluster
def test_the_charts_service_account_may_create_only_runner_pods_and_token_secrets(
    helm: Helm, cluster: LocalCluster, api: client.ApiClient, namespace: str,
) -> None:
    rendered = helm.template(f"l{uuid.uuid4().hex[:6]}", namespace,
                             sets=("rbac.liveScaling=true",))
    policy = rendered.one("ValidatingAdmissionPolicy")["metadata"]["name"]
    vm = create_vm(api, namespace, sample_vm("limited"))
    with installed(api, rendered):
        sa_api = service_account(cluster, rendered)
        core = client.CoreV1Api(sa_api)
        wait_for(lambda: _allowed(lambda: core.create_namespaced_pod(
            namespace, runner_pod(vm, "r1"))), what="the controller's runner pod admitted")
        created = core.create_namespaced_secret(namespace, token_secret(vm))
        assert created.metadata.name.startswith(types.SCALING_TOKEN_SECRET_PREFIX)

        plain = runner_pod(vm, "plain")
        plain["metadata"]["labels"] = {"app": "anything"}
        host = runner_pod(vm, "host", hostNetwork=True)
        disk = runner_pod(vm, "disk", volumes=[{"name": "root", "hostPath": {"path": "/"}}])
        privileged = runner_pod(vm, "priv")
        privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
        orphan = runner_pod(vm, "orphan")
        orphan["metadata"]["ownerReferences"][0]["uid"] = str(uuid.uuid4())
        for pod in (plain, host, disk, privileged, orphan):
            err = refused(functools.partial(core.create_namespaced_pod, namespace, pod))
            assert fenced_by(err, policy, LIMITS), (pod["metadata"]["name"],
                                                    kube.api_error_message(err))

        named = token_secret(vm)
        named["metadata"] = {**named["metadata"], "name": "db-password"}
        del named["metadata"]["generateName"]
        sa_token = token_secret(vm)
        sa_token["type"] = "kubernetes.io/service-account-token"
        sa_token["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "default"}
        unowned = token_secret(vm)
        del unowned["metadata"]["ownerReferences"]
        # The VM's SSH key Secret (enableSSH) as the controller creates it is admitted;
        # under another name, of another type, or owned by nothing it is not.
        decoded = types.VirtualMachine.from_object(vm)
        ssh = ssh_keys.secret_manifest(decoded, b"pub", b"priv")
        assert core.create_namespaced_secret(namespace, copy.deepcopy(ssh)).metadata.name \
            == f"ssh-neonvm-{decoded.name}"
        ssh_misnamed = copy.deepcopy(ssh)
        ssh_misnamed["metadata"]["name"] = "ssh-neonvm-other"
        ssh_opaque = copy.deepcopy(ssh)
        ssh_opaque["type"] = "Opaque"
        ssh_unowned = copy.deepcopy(ssh)
        del ssh_unowned["metadata"]["ownerReferences"]
        for secret in (named, sa_token, unowned, ssh_misnamed, ssh_opaque, ssh_unowned):
            err = refused(functools.partial(core.create_namespaced_secret, namespace, secret))
            assert fenced_by(err, policy, LIMITS), kube.api_error_message(err)
        # Anyone else's Secrets are none of this policy's business.
        client.CoreV1Api(api).create_namespaced_secret(namespace, copy.deepcopy(named))
