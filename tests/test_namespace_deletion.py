"""A namespace being deleted takes its VMs with it (docs/reconciler.md, "A namespace
being deleted").

* decide: in a namespace known to be terminating, nothing that leads to a new pod (a
  Restart into a new plan, RecordPlan, CreatePod) is asked for; the answer is Wait
  (NamespaceTerminating). A VM being deleted still loses its finalizer, and a restart
  into a terminal phase is still recorded.
* the driver reads the Namespace before it replaces a VM's runner pod (a Restart into a
  new plan, a plan after the VM's first) and replaces none in a namespace being deleted;
  it also learns that from a create refused for that reason (403, "is being
  terminated") and does not retry it. What it learned is read again after a while, not
  learned again from another refused create (the namespace may be re-created under its
  name).
* on the local cluster: a namespace of converged VMs deleted with a replica running goes
  away, and the replica tries no create there.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm import kube, manifests
from neonvm.api.types import (
    FINALIZER,
    PendingPod,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import reasons
from neonvm.controller.cluster import KubeCluster
from neonvm.controller.create_policy import namespace_terminating
from neonvm.controller.step import TerminatingNamespaces
from neonvm.dev.cluster import LocalCluster
from tests.support import FAST, shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.fake_cluster import FakeCluster, api_error
from tests.support.harness import Replicas, converged, create_vm

# ---- pure logic -----------------------------------------------------------------------

FENCE = act.Fence(epoch=1, token=1)


UID = "0123456789abcdef"


def _vm(*, pod: str = "", deleting: bool = False, pending: PendingPod | None = None,
        restart_policy: str = "Always") -> VirtualMachine:
    status = VirtualMachineStatus(phase="Running" if pod else "Pending",
                                  pod_name=pod or None, pod_uid="uid-1" if pod else None,
                                  pending_pod=pending,
                                  plan_seq=pending.plan_seq if pending else 0)
    return VirtualMachine(
        name="vm-1", namespace="ns", uid=UID, resource_version="5", generation=1,
        spec=VirtualMachineSpec(restart_policy=restart_policy),  # type: ignore[arg-type]
        status=status, finalizers=[FINALIZER],
        deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None)


def _pod(name: str, *, terminating: bool = False, phase: str = "Running") -> act.PodView:
    return act.PodView(name=name, uid="uid-1", owner_uid=UID, gated=False,
                     terminating=terminating, phase=phase, fence=(1, 1))


def _obs(vm: VirtualMachine, pods: tuple[act.PodView, ...] = (), *,
         terminating: bool) -> act.Observation:
    return act.Observation(vm=vm, pods=pods, lease=FENCE, direct=True,
                         namespace_terminating=terminating)


@pytest.mark.unit
def test_a_runner_pod_going_in_a_terminating_namespace_is_not_restarted() -> None:
    vm = _vm(pod="vm-1-01234567-1")
    pods = (_pod("vm-1-01234567-1", terminating=True),)
    assert isinstance(d.decide(_obs(vm, pods, terminating=False)), act.Restart)
    action = d.decide(_obs(vm, pods, terminating=True))
    assert isinstance(action, act.Wait)
    assert action.condition == reasons.NAMESPACE_TERMINATING


@pytest.mark.unit
def test_a_runner_pod_going_in_a_terminating_namespace_is_not_read_for() -> None:
    """Every VM of a namespace being deleted is looked at when its pod goes and then
    every 30 s: a direct read each time would be two requests per VM for nothing."""
    pods = (_pod("vm-1-01234567-1", terminating=True),)
    cached = act.Observation(vm=_vm(pod="vm-1-01234567-1"), pods=pods, lease=FENCE,
                             direct=False, namespace_terminating=True)
    action = d.decide(cached)
    assert isinstance(action, act.Wait), action
    assert action.condition == reasons.NAMESPACE_TERMINATING
    assert isinstance(d.decide(replace(cached, namespace_terminating=False)),
                      act.ObserveDirect)
    # A restart into a terminal phase is recorded, from a direct read as anywhere.
    never = replace(cached, vm=_vm(pod="vm-1-01234567-1", restart_policy="Never"))
    assert isinstance(d.decide(never), act.ObserveDirect)


@pytest.mark.unit
def test_no_plan_and_no_create_in_a_terminating_namespace() -> None:
    assert isinstance(d.decide(_obs(_vm(), terminating=False)), act.RecordPlan)
    waiting = d.decide(_obs(_vm(), terminating=True))
    assert isinstance(waiting, act.Wait) and waiting.condition == reasons.NAMESPACE_TERMINATING
    plan = PendingPod(name="vm-1-01234567-1", plan_seq=1, token=1, epoch=1, generation=1)
    assert isinstance(d.decide(_obs(_vm(pending=plan), terminating=False)), act.CreatePod)
    waiting = d.decide(_obs(_vm(pending=plan), terminating=True))
    assert isinstance(waiting, act.Wait) and waiting.condition == reasons.NAMESPACE_TERMINATING


@pytest.mark.unit
def test_a_vm_being_deleted_in_a_terminating_namespace_still_loses_its_finalizer() -> None:
    vm = _vm(pod="vm-1-01234567-1", deleting=True)
    assert isinstance(d.decide(_obs(vm, terminating=True)), act.RemoveFinalizer)
    gone = (_pod("vm-1-01234567-1", terminating=True),)
    assert isinstance(d.decide(_obs(vm, gone, terminating=True)), act.Wait)


@pytest.mark.unit
def test_a_restart_into_a_terminal_phase_is_still_recorded() -> None:
    vm = _vm(pod="vm-1-01234567-1", restart_policy="Never")
    pods = (_pod("vm-1-01234567-1", phase="Failed"),)
    action = d.decide(_obs(vm, pods, terminating=True))
    assert isinstance(action, act.Restart) and action.terminal_phase == "Failed"


@pytest.mark.unit
def test_a_create_refused_because_the_namespace_is_terminating_is_recognised() -> None:
    message = ("pods \"vm-1-01234567-2\" is forbidden: unable to create new content in "
               "namespace t because it is being terminated")
    assert namespace_terminating(403, message)
    assert not namespace_terminating(403, "exceeded quota: q, requested: pods=1")
    assert not namespace_terminating(500, message)


@pytest.mark.unit
def test_a_terminating_namespace_is_remembered_for_a_while_only() -> None:
    now = [100.0]
    known = TerminatingNamespaces(remember_seconds=30.0, clock=lambda: now[0])
    assert not known.knows("t")
    known.learn("t")
    assert known.knows("t") and not known.knows("u")
    now[0] += 29.0
    assert known.knows("t")
    now[0] += 1.0
    assert not known.knows("t")  # it may have been re-created under its name


class _Reads:
    """A Namespace read that counts its calls: ``answer`` is what it returns or raises."""

    def __init__(self, answer: dict[str, Any] | Exception | None) -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self, name: str) -> dict[str, Any] | None:
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


DELETING = {"metadata": {"name": "t", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
LIVE = {"metadata": {"name": "t"}}


@pytest.mark.unit
def test_a_namespace_read_as_being_deleted_is_known_without_another_read() -> None:
    now = [100.0]
    known = TerminatingNamespaces(remember_seconds=30.0, clock=lambda: now[0])
    read = _Reads(DELETING)
    assert known.look("t", read, logger) and read.calls == 1
    assert known.knows("t") and known.look("t", read, logger) and read.calls == 1
    gone = _Reads(None)  # a namespace gone is one whose VMs are going too
    assert known.look("u", gone, logger) and not known.knows("u")


@pytest.mark.unit
def test_what_was_learned_is_read_again_after_a_while_not_learned_from_a_create() -> None:
    now = [100.0]
    known = TerminatingNamespaces(remember_seconds=30.0, clock=lambda: now[0])
    known.learn("t")  # a refused create
    now[0] += 30.0
    assert not known.knows("t") and known.stale("t")
    read = _Reads(DELETING)
    assert known.look("t", read, logger) and read.calls == 1 and known.knows("t")
    now[0] += 30.0
    read.answer = LIVE  # re-created under its name
    assert not known.look("t", read, logger) and read.calls == 2
    assert not known.knows("t") and not known.stale("t")


@pytest.mark.unit
def test_a_namespace_seen_live_is_trusted_for_a_moment_only() -> None:
    now = [100.0]
    known = TerminatingNamespaces(clock=lambda: now[0], live_seconds=2.0)
    read = _Reads(LIVE)
    assert not known.look("t", read, logger) and not known.look("t", read, logger)
    assert read.calls == 1
    now[0] += 2.0
    read.answer = DELETING
    assert known.look("t", read, logger) and read.calls == 2


@pytest.mark.unit
def test_a_namespace_read_that_fails_tells_nothing_and_a_403_is_not_asked_again() -> None:
    known = TerminatingNamespaces(live_seconds=0.0)
    failing = _Reads(api_error(503))
    assert not known.look("t", failing, logger) and not known.look("t", failing, logger)
    assert failing.calls == 2
    forbidden = _Reads(api_error(403))
    assert not known.look("t", forbidden, logger)
    assert not known.look("t", forbidden, logger) and not known.look("u", forbidden, logger)
    assert forbidden.calls == 1


# ---- the shipped driver over an in-memory cluster ------------------------------------------

_NS = "ns"


def _converged(fake: FakeCluster, name: str) -> None:
    """A VM of namespace ``ns`` whose runner pod the shipped driver created and started."""
    fake.add_vm({"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
                 "metadata": {"name": name, "namespace": _NS, "generation": 1},
                 "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                          "guest": {"rootDisk": {"image": "img"}}},
                 "status": {}})
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake)
    reconciler.reconcile(f"{_NS}/{name}", StaticAuthority(epoch=1, token=5),
                         direct_first=True)
    pod = fake.vm(_NS, name)["status"]["podName"]  # type: ignore[index]
    assert pod and not (fake.pod(_NS, pod) or {}).get("spec", {}).get("schedulingGates")


def test_a_runner_pod_deleted_with_its_namespace_is_not_replaced() -> None:
    """The namespace controller deletes a namespace's pods before its VMs. The driver
    reads the Namespace before the Restart: no Restart written, no plan, no create; the
    other VMs of that namespace need no read of their own."""
    fake = FakeCluster()
    for name in ("a", "b"):
        _converged(fake, name)
    fake.deleting_namespaces.add(_NS)
    for name in ("a", "b"):
        del fake.pods[(_NS, fake.vm(_NS, name)["status"]["podName"])]  # type: ignore[index]
    writes, creates = fake.count("put_status"), fake.count("create_pod")
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake)
    for name in ("a", "b"):
        result = reconciler.reconcile(f"{_NS}/{name}", StaticAuthority(epoch=1, token=5),
                                      direct_first=True)
        assert isinstance(result.action, act.Wait), result
        assert result.action.condition == reasons.NAMESPACE_TERMINATING, result
    assert fake.count("create_pod") == creates and fake.count("put_status") == writes
    assert fake.count("namespace_meta") == 1


def test_a_vm_made_after_its_namespace_was_seen_being_deleted_is_planned_at_once() -> None:
    """The namespace went and was made again under its name within the 30 s that its
    deletion is remembered: a VM created after that deletion began is in the new
    namespace (nothing is created in one being deleted), so the namespace is read again
    and the VM gets its first plan at once, not 30 s later."""
    fake = FakeCluster()
    _converged(fake, "a")
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake)
    authority = StaticAuthority(epoch=1, token=5)
    fake.deleting_namespaces.add(_NS)  # its deletionTimestamp: 2026-01-01T00:00:00Z
    del fake.pods[(_NS, fake.vm(_NS, "a")["status"]["podName"])]  # type: ignore[index]
    waits = reconciler.reconcile(f"{_NS}/a", authority, direct_first=True)
    assert isinstance(waits.action, act.Wait), waits
    assert waits.action.condition == reasons.NAMESPACE_TERMINATING, waits
    del fake.vms[(_NS, "a")]
    fake.deleting_namespaces.discard(_NS)
    fake.add_vm({"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
                 "metadata": {"name": "c", "namespace": _NS, "generation": 1,
                              "creationTimestamp": "2026-01-01T00:00:05Z"},
                 "spec": {"restartPolicy": "Always", "enableAcceleration": False,
                          "guest": {"rootDisk": {"image": "img"}}},
                 "status": {}})
    reads = fake.count("namespace_meta")
    reconciler.reconcile(f"{_NS}/c", authority, direct_first=True)
    assert fake.vm(_NS, "c")["status"].get("podName")  # type: ignore[index]
    assert fake.count("namespace_meta") == reads


@pytest.mark.unit
def test_a_vm_older_than_the_deletion_it_is_in_is_not_a_reason_to_read_again() -> None:
    known = TerminatingNamespaces(clock=lambda: 0.0)
    known.look("ns", lambda _: {"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}},
               logger)
    assert not known.predates("ns", "2025-12-31T23:59:59Z")
    assert known.predates("ns", "2026-01-01T00:00:00Z")  # same second: read again
    assert not known.predates("ns", None) and not known.predates("other", "2027-01-01T00:00:00Z")


def test_a_runner_pod_gone_in_a_live_namespace_is_replaced_after_one_read() -> None:
    fake = FakeCluster()
    _converged(fake, "a")
    first = fake.vm(_NS, "a")["status"]["podName"]  # type: ignore[index]
    del fake.pods[(_NS, first)]
    reads = fake.count("namespace_meta")
    reconciler = shipped_reconciler(client.ApiClient(), cluster=fake)
    reconciler.reconcile(f"{_NS}/a", StaticAuthority(epoch=1, token=5), direct_first=True)
    assert fake.vm(_NS, "a")["status"]["podName"] not in (None, first)  # type: ignore[index]
    assert fake.count("namespace_meta") == reads + 1


# ---- on the local cluster -----------------------------------------------------------------

VMS = 30
WORKERS = 4
GRACE = {"terminationGracePeriodSeconds": 2}
"""The simulated nodes end a pod's graceful deletion when its grace period is over; the
default 30 s would only stretch the namespace's deletion."""


def _create_attempts(log: str) -> int:
    """Runner pod creates the replica tried (one ``CreatePod:`` line each)."""
    count = 0
    for line in log.splitlines():
        try:
            msg = str(json.loads(line).get("msg", ""))
        except ValueError:
            continue
        if msg.startswith("CreatePod:"):
            count += 1
    return count


def _namespace_gone(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_namespace(name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def _release(api: client.ApiClient, name: str) -> None:
    """Let a namespace left behind go without a controller."""
    custom = client.CustomObjectsApi(api)
    try:
        vms = custom.list_namespaced_custom_object("vm.neon.tech", "v1", name,
                                                   "virtualmachines")
        for vm in vms.get("items", []):
            if vm["metadata"].get("finalizers"):
                custom.patch_namespaced_custom_object(
                    "vm.neon.tech", "v1", name, "virtualmachines", vm["metadata"]["name"],
                    {"metadata": {"finalizers": None}})
        client.CoreV1Api(api).delete_namespace(name)
    except ApiException:
        pass


def test_a_namespace_of_converged_vms_deleted_under_a_running_replica_goes_with_no_create(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    if not cluster.spec.nodes:
        pytest.skip("needs simulated nodes")
    core = client.CoreV1Api(api)
    doomed = f"t-{uuid.uuid4().hex[:10]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=doomed)))
    prefix = f"/t-{uuid.uuid4().hex[:8]}"
    # The Lease lives in the fixture's namespace, which outlives the deleted one.
    group = Replicas(api=api, kubeconfig=cluster.kubeconfig_for("controller"),
                     etcd_endpoints=cluster.locks_etcd_config(prefix),
                     lease_namespace=namespace, log_dir=tmp_path,
                     extra_args=[*FAST, "--watch-namespace", doomed, "--etcd-prefix", prefix,
                                 "--workers", str(WORKERS)])
    try:
        with group:
            replica = group.start("r0")
            names = [f"vm-{i}" for i in range(VMS)]
            for name in names:
                create_vm(api, doomed, name, spec=GRACE)
            wait_for(lambda: converged(api, doomed, names), timeout=240,
                     what=f"{VMS} VMs converged")
            before = _create_attempts(replica.log())
            started = time.monotonic()
            core.delete_namespace(doomed)
            wait_for(lambda: _namespace_gone(core, doomed), timeout=300,
                     interval=0.5, what="the namespace gone")
            took = time.monotonic() - started
            after = _create_attempts(replica.log()) - before
            assert replica.running()
            print(f"namespace of {VMS} VMs gone after {took:.1f}s; "
                  f"{after} pod creates tried during its deletion")
            # The pods go first (the namespace controller deletes them before the VMs):
            # each restart reads the Namespace first and finds it being deleted.
            assert after == 0, replica.log()[-20000:]
    finally:
        if not _namespace_gone(core, doomed):
            _release(api, doomed)


def test_a_role_in_a_namespace_lets_the_controller_read_that_namespace_alone(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    """The chart's ``controller.watchNamespace`` grants the controller's rules by a Role
    in that namespace: enough to read that Namespace (GET /api/v1/namespaces/X is a
    request in namespace X), and no other."""
    user = f"ns-reader-{uuid.uuid4().hex[:6]}"
    rbac = client.RbacAuthorizationV1Api(api)
    rbac.create_namespaced_role(namespace, {"metadata": {"name": user},
                                            "rules": manifests.controller_rules()})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]})
    as_user = kube.api_client(cluster.kubeconfig)
    as_user.set_default_header("Impersonate-User", user)
    reader = KubeCluster(as_user)

    def read_own() -> bool:
        meta = reader.namespace_meta(namespace)
        return meta is not None and meta["metadata"]["name"] == namespace

    wait_for(read_own, timeout=30, what="the Role's grant in effect")
    with pytest.raises(ApiException) as refused:
        reader.namespace_meta("default")
    assert refused.value.status == 403
