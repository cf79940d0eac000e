"""AccelerationUnavailable: a VM that asks for KVM and cannot have it says so in a condition
and one Warning event (neonvm/controller/acceleration.py); ``enableAcceleration: false``
means TCG; the compat table reports settings only where the runner does not apply them.

The pure tables cover the decision, the event and the background fetch; the cluster test
runs the controller's own :class:`Reconciler` against the real API server, with a real
runner HTTP server (:class:`neonvm.runner.server.RunnerHTTPServer`) answering ``/status``
on loopback for the pod.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import compat, types
from neonvm.controller import actions as act
from neonvm.controller.acceleration import (
    ACCELERATED,
    CONDITION,
    KVM_NOT_USABLE,
    NO_KVM_RESOURCE,
    NOT_REQUESTED,
    HTTPRunnerStatus,
    RunnerReport,
    RunnerReports,
    acceleration_condition,
    warn_acceleration_unavailable,
)
from neonvm.controller.actions import PodView
from neonvm.controller.events import EventRecorder
from neonvm.controller.podspec import PodDefaults, runner_pod
from neonvm.controller.reconciler import Reconciler, ReconcilerConfig
from neonvm.controller.scaling import ScalingError
from neonvm.runner.host import acceleration_unavailable, probe_kvm
from neonvm.runner.metrics import runner_registry
from neonvm.runner.server import RunnerHTTPServer
from neonvm.runner.state import RunnerState, Sizing
from tests.support import shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import get_vm, runner_pods, vm_manifest

AUTHORITY = StaticAuthority(epoch=1, token=10)
KVM = "devices.kubevirt.io/kvm"
NOWHERE = {"neonvm.test/unschedulable": "true"}


def a_vm(spec: dict[str, Any] | None = None) -> types.VirtualMachine:
    raw = vm_manifest("v", spec=spec)
    raw["metadata"].update(namespace="ns", uid="uid-1")
    return types.VirtualMachine.from_object(raw)


# ---- the decision (pure) --------------------------------------------------------------------

UNUSABLE = RunnerReport("v-1", "tcg", "AccelerationUnavailable: KVM is not usable, the guest "
                                       "runs under TCG: /dev/kvm: No such file or directory")


@pytest.mark.unit
@pytest.mark.parametrize(("accel", "resource", "report", "expected"), [
    # Asked (NeonVM's default, or explicitly), the controller cannot hand out /dev/kvm.
    (None, None, None, ("True", NO_KVM_RESOURCE, False)),
    (True, None, None, ("True", NO_KVM_RESOURCE, False)),
    # A resource is configured, nothing heard from the runner yet: leave it as it is.
    (None, KVM, None, None),
    # The runner's word outranks the configuration, both ways.
    (None, KVM, UNUSABLE, ("True", KVM_NOT_USABLE, False)),
    (None, None, UNUSABLE, ("True", KVM_NOT_USABLE, False)),
    (None, KVM, RunnerReport("v-1", "kvm", None), ("False", ACCELERATED, True)),
    (None, None, RunnerReport("v-1", "kvm", None), ("False", ACCELERATED, True)),
    (None, KVM, RunnerReport("v-1", "tcg", None), ("True", KVM_NOT_USABLE, False)),
    # A runner that says nothing about its accelerator (an older one) is no evidence.
    (None, KVM, RunnerReport("v-1", None, None), None),
    # Not asked: never True, and not added just to say False.
    (False, None, None, ("False", NOT_REQUESTED, True)),
    (False, KVM, UNUSABLE, ("False", NOT_REQUESTED, True)),
])
def test_the_condition_names_why_a_vm_that_asks_for_kvm_runs_under_tcg(
        accel: bool | None, resource: str | None, report: RunnerReport | None,
        expected: tuple[str, str, bool] | None) -> None:
    spec = {} if accel is None else {"enableAcceleration": accel}
    update = acceleration_condition(a_vm(spec), resource, report)
    if expected is None:
        assert update is None
        return
    assert update is not None and update.type == CONDITION
    assert (update.status, update.reason, update.only_if_present) == expected
    assert "\n" not in update.message
    if update.reason == KVM_NOT_USABLE:
        assert "runner pod v-1" in update.message
    if report is UNUSABLE and update.status == "True":
        assert "/dev/kvm: No such file or directory" in update.message
    if update.reason == NO_KVM_RESOURCE:
        assert "--kvm-resource" in update.message


@pytest.mark.unit
def test_a_runners_text_is_cut_to_200_characters_before_the_condition() -> None:
    """A runner of the owner's choice may send up to the exchange's 64 KiB; the VM's
    condition and the leader's memory keep 200 characters of it (docs/security.md)."""
    report = RunnerReport.from_status("v-1", {"accel": "x" * 70_000,
                                              "accelerationUnavailable": "why " * 16_000})
    assert report.unavailable is not None and len(report.unavailable) == 200
    assert report.accel is not None and len(report.accel) == 200
    update = acceleration_condition(a_vm({"enableAcceleration": True}), KVM, report)
    assert update is not None and len(update.message) <= len("runner pod v-1: ") + 200
    assert RunnerReport.from_status("v-1", {"accelerationUnavailable": " \n "}).unavailable \
        is None


class Recorded:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    def record(self, vm: types.VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        self.seen.append((reason, message, warning))


def with_condition(status: str | None, reason: str = NO_KVM_RESOURCE) -> types.VirtualMachine:
    vm = a_vm()
    if status is not None:
        vm.status.conditions = [types.Condition(type=CONDITION, status=status,  # type: ignore[arg-type]
                                                reason=reason, message=f"m-{reason}")]
    return vm


@pytest.mark.unit
def test_one_warning_when_the_condition_turns_true_or_its_cause_changes() -> None:
    events = Recorded()
    recorder: EventRecorder = events  # type: ignore[assignment]
    assert warn_acceleration_unavailable(recorder, with_condition(None), with_condition("True"))
    assert events.seen == [(CONDITION, f"m-{NO_KVM_RESOURCE}", True)]
    assert not warn_acceleration_unavailable(recorder, with_condition("True"),
                                             with_condition("True"))
    assert warn_acceleration_unavailable(recorder, with_condition("False", ACCELERATED),
                                         with_condition("True"))
    assert warn_acceleration_unavailable(recorder, with_condition("True"),
                                         with_condition("True", KVM_NOT_USABLE))
    assert not warn_acceleration_unavailable(recorder, with_condition("True"),
                                             with_condition("False", ACCELERATED))
    assert not warn_acceleration_unavailable(recorder, with_condition(None),
                                             with_condition(None))
    assert len(events.seen) == 3


# ---- the background fetch -------------------------------------------------------------------


class GatedSource:
    """A runner-status source whose answers the test releases, counting the calls."""

    def __init__(self, answers: list[Mapping[str, Any] | Exception]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int, float]] = []
        self.release = threading.Event()

    def get_status(self, host: str, port: int, timeout: float) -> Mapping[str, Any]:
        self.calls.append((host, port, timeout))
        assert self.release.wait(30)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def running(uid: str = "u1", phase: str = "Running", ip: str | None = "10.0.0.7") -> PodView:
    return PodView(name=f"pod-{uid}", uid=uid, owner_uid="uid-1", gated=False,
                   terminating=False, phase=phase, ip=ip)


@pytest.mark.unit
def test_a_lookup_never_waits_and_a_pods_status_is_fetched_once() -> None:
    source = GatedSource([{"accel": "tcg", "accelerationUnavailable": "why"}])
    reports = RunnerReports(source, timeout=1.5)
    # Not running yet, or no IP: nothing is asked.
    assert reports.lookup(running(phase="Pending"), 25183) is None
    assert reports.lookup(running(ip=None), 25183) is None
    assert source.calls == []
    # The fetch blocks (the runner is slow): the lookup still answers at once.
    assert reports.lookup(running(), 25183) is None
    assert reports.lookup(running(), 25183) is None  # no second fetch while one runs
    source.release.set()
    assert reports.wait_idle(30)
    assert source.calls == [("10.0.0.7", 25183, 1.5)]
    assert reports.lookup(running(), 25183) == RunnerReport("pod-u1", "tcg", "why")
    assert len(source.calls) == 1


@pytest.mark.unit
def test_a_failed_fetch_is_retried_after_a_pause_and_a_bounded_number_of_times() -> None:
    now = [0.0]
    source = GatedSource([ConnectionRefusedError("no"), TimeoutError("slow"),
                          ConnectionRefusedError("no")])
    source.release.set()
    reports = RunnerReports(source, retry_seconds=10, max_attempts=3, clock=lambda: now[0])
    for step in range(6):
        assert reports.lookup(running(), 1) is None
        assert reports.wait_idle(30)
        assert reports.lookup(running(), 1) is None  # within the pause: no new fetch
        assert len(source.calls) == min(step + 1, 3)
        now[0] += 11
    assert source.answers == []


# ---- the pod and the compat table -----------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(("accel", "forced"), [(None, None), (True, None), (False, "tcg")])
def test_acceleration_off_makes_the_runner_use_tcg(accel: bool | None,
                                                   forced: str | None) -> None:
    spec = {} if accel is None else {"enableAcceleration": accel}
    vm = a_vm(spec)
    plan = types.PendingPod(name="v-1", plan_seq=1, token=10, epoch=1, generation=1)
    pod = runner_pod(vm, plan, PodDefaults(kvm_resource=KVM))
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env.get("NEONVM_ACCEL") == forced
    assert not compat.unimplemented_fields(vm.spec)


@pytest.mark.unit
@pytest.mark.parametrize("kernel", [None, "/vm/kernel/vmlinuz"])
def test_sysctl_and_swap_are_reported_only_when_the_guest_boots_its_own_kernel(
        kernel: str | None) -> None:
    guest: dict[str, Any] = {
        "cpus": {"min": 1, "max": 1}, "memorySlots": {"min": 1, "max": 1},
        "memorySlotSize": "1Gi", "rootDisk": {"image": "img"},
        "settings": {"sysctl": ["vm.swappiness = 1"], "swap": "1Gi"}}
    if kernel:
        guest["kernelImage"] = kernel
    spec = a_vm({"guest": guest}).spec
    reported = compat.unimplemented_fields(spec)
    if kernel:
        assert reported == ["spec.guest.settings.sysctl", "spec.guest.settings.swap"]
        assert "guest.kernelImage" in compat.unimplemented_message(spec)
    else:
        assert reported == []
    # NeonVM's swapInfo.size counts as swap too.
    guest["settings"] = {"swapInfo": {"size": "1Gi"}}
    assert ("spec.guest.settings.swap" in compat.unimplemented_fields(
        a_vm({"guest": guest}).spec)) is bool(kernel)


# ---- against the real API server ------------------------------------------------------------


@pytest.fixture
def runner_server(tmp_path: Path) -> Iterator[RunnerHTTPServer]:
    """A real runner HTTP server as a runner pod with no usable KVM serves it: its state
    built from the real probe of a missing device (what the runner does at start)."""
    why = acceleration_unavailable("auto", True, probe_kvm(tmp_path / "no-kvm"))
    assert why is not None
    state = RunnerState("ns/vm", "tcg", "", Sizing(), acceleration_unavailable=why)
    server = RunnerHTTPServer(state, runner_registry(state), "127.0.0.1", 0)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def settle(reconciler: Reconciler, key: str, rounds: int = 10) -> act.Action:
    action: act.Action = act.Wait(seconds=0)
    for _ in range(rounds):
        action = reconciler.reconcile(key, AUTHORITY, direct_first=True).action
        if isinstance(action, act.Done):
            break
    return action


def condition_of(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    vm = get_vm(api, namespace, name) or {}
    status = vm.get("status") or {}
    return next((c for c in [*(status.get("conditions") or []),
                             *(status.get("extraConditions") or [])]
                 if c["type"] == CONDITION), None)


def warnings_for(api: client.ApiClient, namespace: str, name: str) -> list[Any]:
    return [e for e in client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}").items
        if e.type == "Warning" and e.reason == CONDITION]


def run_on_loopback(api: client.ApiClient, namespace: str, name: str) -> None:
    """What a kubelet would report for the VM's one runner pod: Running at 127.0.0.1."""
    (pod,) = runner_pods(api, namespace, name)
    client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "podIPs": [{"ip": "127.0.0.1"}]}})


@pytest.mark.unit
def test_the_http_source_reads_a_real_runners_status_and_fails_fast_elsewhere(
        runner_server: RunnerHTTPServer) -> None:
    source = HTTPRunnerStatus()
    report = RunnerReport.from_status("p", source.get_status("127.0.0.1", runner_server.port,
                                                             5.0))
    assert report.accel == "tcg" and report.unavailable is not None
    assert report.unavailable.startswith("AccelerationUnavailable: KVM is not usable")
    closed = runner_server.port
    runner_server.stop()
    with pytest.raises(ScalingError):  # connection refused, at once
        source.get_status("127.0.0.1", closed, 5.0)


@pytest.mark.cluster
def test_without_a_kvm_resource_a_vm_asking_for_kvm_is_told_and_one_with_it_off_is_not(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"))
    for name, spec in (("asks", {}), ("off", {"enableAcceleration": False})):
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL,
            vm_manifest(name, spec={"nodeSelector": NOWHERE, **spec}))
        settle(reconciler, f"{namespace}/{name}")
        settle(reconciler, f"{namespace}/{name}")  # idle: no second event

    told = condition_of(api, namespace, "asks")
    assert told is not None and (told["status"], told["reason"]) == ("True", NO_KVM_RESOURCE)
    assert "--kvm-resource" in told["message"]
    (event,) = wait_for(lambda: warnings_for(api, namespace, "asks"), 30,
                        what="the AccelerationUnavailable warning")
    assert event.message == told["message"] and (event.count or 1) == 1
    assert condition_of(api, namespace, "off") is None
    assert warnings_for(api, namespace, "off") == []


@pytest.mark.cluster
def test_the_runners_report_becomes_the_condition_and_one_warning(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        runner_server: RunnerHTTPServer) -> None:
    """The controller has a --kvm-resource, so only the runner can say KVM is missing:
    the controller GETs its /status once the pod runs and writes the runner's reason."""
    config = ReconcilerConfig(pod_defaults=PodDefaults(kvm_resource=KVM))
    reconciler = shipped_reconciler(controller_api, events=EventRecorder(controller_api, "test"),
                                    config=config)
    port = runner_server.port
    for name, spec in (("asks", {}), ("off", {"enableAcceleration": False})):
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL,
            vm_manifest(name, spec={"nodeSelector": NOWHERE, "runnerPort": port, **spec}))
        key = f"{namespace}/{name}"
        settle(reconciler, key)
        assert condition_of(api, namespace, name) is None  # nothing known yet
        run_on_loopback(api, namespace, name)

    def reported() -> dict[str, Any] | None:
        settle(reconciler, f"{namespace}/asks")
        found = condition_of(api, namespace, "asks")
        return found if found is not None and found["status"] == "True" else None

    told = wait_for(reported, 60, what="AccelerationUnavailable from the runner")
    assert told["reason"] == KVM_NOT_USABLE
    (pod,) = runner_pods(api, namespace, "asks")
    assert told["message"].startswith(f"runner pod {pod.metadata.name}: "
                                      "AccelerationUnavailable: KVM is not usable")
    assert "no-kvm" in told["message"]
    (event,) = wait_for(lambda: warnings_for(api, namespace, "asks"), 30,
                        what="the AccelerationUnavailable warning")
    assert event.message == told["message"]

    # Acceleration off: the same runner answers, nobody asks it, nothing is said.
    settle(reconciler, f"{namespace}/off")
    assert reconciler.acceleration.reports.wait_idle(30)
    settle(reconciler, f"{namespace}/off")
    settle(reconciler, f"{namespace}/asks")
    assert condition_of(api, namespace, "off") is None
    assert warnings_for(api, namespace, "off") == []
    assert len(warnings_for(api, namespace, "asks")) == 1
