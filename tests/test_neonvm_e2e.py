"""NeonVM's own e2e suite, run as kuttl runs it, against this controller on simulated nodes.

``tests/neonvm_manifests/autoscaling/`` holds verbatim copies of NeonVM's ``tests/e2e``
(its 14 kuttl tests) and the two samples its ``vm-migration`` test applies, laid out as in
NeonVM's repository so the tests' relative paths resolve. ``tests/kuttl.py`` runs them
with kuttl's semantics (kuttl itself cannot be built here). Each test gets a fresh
namespace, a controller replica watching it, and the module's kube-scheduler named
``autoscale-scheduler``, as NeonVM's suite expects.

:data:`REACH` is the specification under kuttl's exact semantics: for every test, the
step it stops at here and why (what that step needs that this project does not have).
Every status assert compares ``status.conditions`` as a whole list (kuttl wants the same
length); a healthy VM's list holds NeonVM's one condition, ``Available``, here as there
(this controller's others are in ``status.extraConditions``). The run of the whole suite,
with kuttl's timeouts (a failing step waits its full timeout), is opt-in
(``NEONVM_TEST_LONG=1``); by default :data:`CHEAP` runs, two steps that pass in seconds,
and the objects of :data:`OBJECTS_ONLY`'s first steps.
docs/neonvm-compat.md, "NeonVM's e2e suite", has the table.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from neonvm.dev.cluster import LocalCluster
from tests.kuttl import Runner, StepResult, is_subset, load_test
from tests.support import replica_group, wait_for

SUITE = Path(__file__).resolve().parent / "neonvm_manifests" / "autoscaling" / "tests" / "e2e"
TESTS = sorted(p.name for p in SUITE.iterdir() if p.is_dir())

AGENT = ("NeonVM's autoscaler-agent (it sets cpus.use to 250m when idle, to the bounds' max "
         "under load)")
EXEC = "kubectl exec into the runner container and SSH into NeonVM's vm-builder guest"
TLS = "cert-manager's Certificate and status.tlsSecretName (spec.tls is not built)"
MIGRATION = "the VirtualMachineMigration kind (live migration is not built)"

REACH: dict[str, tuple[int | None, str]] = {
    "autoscaling": (0, AGENT),
    "autoscaling.cpu-sys-fs-state-scaling": (0, AGENT),
    "autoscaling.revisions": (2, AGENT),
    "default-values": (None, ""),
    "disk-quota": (0, EXEC),
    "restart-counted": (1, EXEC),
    "runner-pod": (None, ""),
    "s3": (2, AGENT),
    "swap": (0, EXEC),
    "vm-migration": (1, MIGRATION),
    "vm-neonvmd": (0, EXEC),
    "vm-secret-sync": (0, EXEC),
    "vm-ssh": (0, EXEC),
    "vm-tls": (0, TLS + "; " + EXEC),
}
"""Where each of NeonVM's tests stops here under kuttl's exact semantics, and what that
step needs. vm-ssh's and vm-neonvmd's step 00 asserts the SSH key Secret and
status.sshSecretName too: those objects match here (:data:`OBJECTS_ONLY`), only the
exec into NeonVM's guest is left."""


def run(api: client.ApiClient, cluster: LocalCluster, namespace: str, tmp: Path, test: str,
        last_step: int | None = None) -> list[StepResult]:
    runner = Runner(api, cluster.kubeconfig)
    with replica_group(cluster, api, namespace, tmp / "replicas") as group:
        group.start("c1")
        # As in NeonVM's suite, the controller runs before the test starts.
        wait_for(group.leader, 60, what="the controller replica leading")
        return list(runner.run_test(SUITE / test, namespace, last_step=last_step))


def check_reach(test: str, results: list[StepResult], reach: tuple[int | None, str]) -> None:
    for r in results:
        print(f"{test} {r.label}: {'passed' if r.passed else 'FAILED: ' + r.reason}")
    stops_at, why = reach
    steps = [s.index for s in load_test(SUITE / test)]
    failed = [r for r in results if not r.passed]
    if stops_at is None:
        assert not failed and [r.index for r in results] == steps
    else:
        assert [r.index for r in results if r.passed] == [i for i in steps if i < stops_at]
        assert failed[0].index == stops_at, (why, failed[0].reason)


@pytest.fixture
def e2e(cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path,
        autoscale_scheduler: str) -> Iterator[tuple[LocalCluster, client.ApiClient, str, Path]]:
    yield cluster, api, namespace, tmp_path


@pytest.fixture
def kubectl() -> str:
    """NeonVM's step and assert commands call kubectl (the long runs only)."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("NeonVM's steps run kubectl, which is not on PATH")
    return found


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("test", TESTS)
def test_neonvms_e2e_test_stops_where_specified_under_kuttls_semantics(
        e2e: tuple[LocalCluster, client.ApiClient, str, Path], kubectl: str, test: str) -> None:
    cluster, api, namespace, tmp = e2e
    check_reach(test, run(api, cluster, namespace, tmp, test), REACH[test])


CHEAP = [
    ("autoscaling.revisions", 1),
]
"""Run by default, ``(test, last step)``: the VM running with NeonVM's status (exactly
one condition, Available; cpus 250m, 1Gi, currentRevision), then a merge-patched
targetRevision propagated, within seconds. The long run above covers every step of every
test (the test budget has room for no more by default)."""


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize(("test", "last_step"), CHEAP)
def test_these_steps_of_neonvms_e2e_suite_pass(
        e2e: tuple[LocalCluster, client.ApiClient, str, Path], test: str,
        last_step: int | None) -> None:
    cluster, api, namespace, tmp = e2e
    results = run(api, cluster, namespace, tmp, test, last_step=last_step)
    steps = [s.index for s in load_test(SUITE / test)
             if last_step is None or s.index <= last_step]
    assert [(r.index, r.passed, r.reason) for r in results] == [(i, True, "") for i in steps]


OBJECTS_ONLY = ["vm-ssh", "vm-neonvmd"]
"""Run by default: the step 00 of these two applied, and every object it asserts (the VM's
status with ``sshSecretName: ssh-neonvm-example``, and the immutable ``kubernetes.io/ssh-auth``
Secret owned by the VM) found as kuttl matches it; the assert's commands (``kubectl exec``
and ``ssh guest-vm`` in NeonVM's runner image) are not run."""


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.parametrize("test", OBJECTS_ONLY)
def test_the_objects_step_00_of_neonvms_ssh_tests_asserts_match(
        e2e: tuple[LocalCluster, client.ApiClient, str, Path], test: str) -> None:
    cluster, api, namespace, tmp = e2e
    runner = Runner(api, cluster.kubeconfig)
    step = load_test(SUITE / test)[0]
    kinds = sorted(o["kind"] for o in step.asserts)
    assert kinds == ["Secret", "VirtualMachine"], kinds
    with replica_group(cluster, api, namespace, tmp / "replicas") as group:
        group.start("c1")
        wait_for(group.leader, 60, what="the controller replica leading")
        for obj in step.apply:
            runner.create_or_update(obj, namespace, time.monotonic() + 60)
        wait_for(lambda: not [w for o in step.asserts
                              if (w := runner.check_object(o, namespace))],
                 90, what=f"{test} step 00's objects as kuttl matches them")
    pod = next(p for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items
               if p.metadata.labels.get("vm.neon.tech/name") == "example")
    keys = [i.key for v in pod.spec.volumes if v.secret for i in v.secret.items or []
            if v.secret.secret_name == "ssh-neonvm-example"]
    assert keys == ["ssh-publickey"]


# ---- the runner's own semantics (kuttl's) ------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("expected", "actual", "ok"), [
    ({"a": 1}, {"a": 1, "b": 2}, True),
    ({"a": {"b": "x"}}, {"a": {"b": "x", "c": 1}}, True),
    ({"a": [{"t": "A"}]}, {"a": [{"t": "A", "s": "True"}]}, True),
    # lists must have the same length: a status with more conditions than listed fails
    ({"a": [{"t": "A"}]}, {"a": [{"t": "A"}, {"t": "B"}]}, False),
    ({"a": 1}, {"a": "1"}, False),
    ({"a": 1}, {"a": 2}, False),
    ({"a": 1}, {}, False),
    ({"a": True}, {"a": 1}, False),
])
def test_an_assert_matches_as_kuttls_is_subset(expected: object, actual: object,
                                               ok: bool) -> None:
    assert (is_subset(expected, actual) is None) is ok


@pytest.mark.unit
def test_the_suites_files_load_as_kuttl_groups_them() -> None:
    assert len(TESTS) == 14
    steps = load_test(SUITE / "autoscaling.revisions")
    assert [(s.index, s.name) for s in steps] == [
        (0, "create-vm"), (1, "change-target-revision"), (2, "upscale")]
    assert [o["kind"] for o in steps[0].apply] == ["Service", "VirtualMachine", "ConfigMap"]
    assert steps[0].test_assert["timeout"] == 90
    assert steps[1].asserts[0]["status"]["currentRevision"]["revision"] == {
        "value": 1, "flags": 123}
    # a timestamp stays a string, as kubectl and kuttl read it
    assert steps[0].apply[1]["spec"]["targetRevision"]["updatedAt"] == "2006-01-02T15:04:05Z"
    (delete,) = load_test(SUITE / "autoscaling")[2].test_step["delete"]
    assert delete == {"apiVersion": "v1", "kind": "Pod", "name": "workload"}
    # vm-migration applies NeonVM's sample by a path relative to the test, after the
    # objects of the step's own file
    migration = load_test(SUITE / "vm-migration")
    assert [o["kind"] for o in migration[0].apply][:3] == ["Pod", "Service", "VirtualMachine"]
    assert migration[1].apply[0]["kind"] == "VirtualMachineMigration"
    # vm-ssh's assert file has two TestAsserts: kuttl keeps the last
    assert "scp" in load_test(SUITE / "vm-ssh")[0].test_assert["commands"][0]["script"]
