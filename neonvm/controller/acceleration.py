"""The ``AccelerationUnavailable`` condition: a VM asked for KVM and its guest runs under TCG.

``spec.enableAcceleration`` (NeonVM's default: true) asks for KVM. The guest then never
falls back to TCG silently: the condition turns True, with a reason naming the cause, and
one Warning event is recorded when it does (:func:`warn_acceleration_unavailable`).

Two causes are known:

* ``NoKvmResource``: the controller runs without ``--kvm-resource``, so runner pods
  request no ``/dev/kvm`` device and the runner cannot get one. The controller knows this
  by itself, before any pod runs.
* ``KvmNotUsable``: the runner of the VM's committed pod says so. The runner probes KVM
  once at start (``/dev/kvm`` opens, answers the API version, the CPU has vmx/svm) and
  publishes the verdict in its ``GET /status`` JSON (``accel`` and
  ``accelerationUnavailable``). The controller reads it there, once per pod uid, after
  the pod is Running with an IP.

Why ``/status`` and not the pod's termination message: the kubelet copies the
termination message into the pod status only when the container ends, and a VM runs
for days; the runner has no API credentials (by design) to write anything itself. The
GET is the one channel that shows a running guest's accelerator.

The GET never runs on a reconcile's path: :meth:`RunnerReports.lookup` answers from what
it already has and at most starts a background fetch (one thread per fetch, a bounded
number at once, each bounded by one deadline for the whole exchange, with the bounds
of the controller's runner client); the next reconcile of the VM (its resync)
writes what the fetch found. A fetch that fails is retried at later lookups, after a
pause and a bounded number of times; then the pod is left alone. Until a report comes
the condition says what the controller knows by itself (or nothing). What was learnt of
a pod is forgotten when the pod informer reports it deleted (:meth:`RunnerReports.forget`),
so churn does not fill the memory up to its bound with pods that are gone.

A runner that says it uses KVM turns the condition False (``Accelerated``); a VM with
``enableAcceleration: false`` turns it False (``NotRequested``). Neither adds the
condition to a VM that does not have it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from loguru import logger

from neonvm.api.types import Condition, VirtualMachine
from neonvm.controller.actions import PodView
from neonvm.controller.conditions import ConditionUpdate
from neonvm.controller.events import EventRecorder
from neonvm.controller.observe import Snapshot
from neonvm.controller.runner_client import runner_exchange

CONDITION = "AccelerationUnavailable"
NO_KVM_RESOURCE = "NoKvmResource"
"""Reason: the controller has no ``--kvm-resource``, so no runner pod gets ``/dev/kvm``."""
KVM_NOT_USABLE = "KvmNotUsable"
"""Reason: the VM's runner reported that KVM does not work in its pod."""
ACCELERATED = "Accelerated"
NOT_REQUESTED = "NotRequested"

STATUS_TIMEOUT = 2.0
"""Seconds one GET of a runner's ``/status`` may take, all of it (connect, send, every
read)."""
RETRY_SECONDS = 10.0
"""Pause before a failed fetch is tried again (at a later lookup)."""
MAX_ATTEMPTS = 6
"""Fetches of one pod's status before the controller gives up on it."""
MAX_IN_FLIGHT = 8
"""Fetches running at once; a lookup beyond that starts none (a later one will)."""
REMEMBERED_PODS = 4096
"""Pods whose outcome is kept at most (least recently looked up forgotten first); a
deleted pod is forgotten before that."""
RUNNER_PORT_NAME = "runner"
MAX_QUOTED = 200
"""Characters of a runner's text kept (docs/security.md, "The runner as seen by the
controller")."""


@dataclass(frozen=True)
class RunnerReport:
    """What a runner's ``/status`` said about its accelerator."""

    pod: str
    accel: str | None
    """``kvm`` or ``tcg`` as the runner chose (None: the runner did not say)."""
    unavailable: str | None
    """The runner's ``accelerationUnavailable`` line (None: nothing to report)."""

    @classmethod
    def from_status(cls, pod: str, doc: Mapping[str, Any]) -> RunnerReport:
        accel = doc.get("accel")
        unavailable = doc.get("accelerationUnavailable")
        # Texts quoted from a runner (of the owner's choice) are cut to 200 characters
        # before they reach the VM's condition and the leader's memory (docs/security.md).
        return cls(pod=pod, accel=accel[:MAX_QUOTED] if isinstance(accel, str) else None,
                   unavailable=_one_line(unavailable)[:MAX_QUOTED] or None
                   if isinstance(unavailable, str) else None)


def asked(vm: VirtualMachine) -> bool:
    """The VM asks for KVM: ``enableAcceleration`` is not ``false`` (NeonVM's default)."""
    return vm.spec.enable_acceleration is not False


def acceleration_condition(vm: VirtualMachine, kvm_resource: str | None,
                           report: RunnerReport | None) -> ConditionUpdate | None:
    """What ``AccelerationUnavailable`` should say (None: nothing known, leave it).

    ``report`` is the runner's word for the VM's committed pod, when there is one; it
    outranks what the controller infers from its own configuration (a runtime may hand
    containers ``/dev/kvm`` without a device plugin)."""
    if not asked(vm):
        return ConditionUpdate(CONDITION, "False", NOT_REQUESTED,
                               "spec.enableAcceleration is false: the guest runs under TCG",
                               only_if_present=True)
    if report is not None:
        if report.unavailable:
            return ConditionUpdate(CONDITION, "True", KVM_NOT_USABLE,
                                   f"runner pod {report.pod}: {_one_line(report.unavailable)}")
        if report.accel == "kvm":
            return ConditionUpdate(CONDITION, "False", ACCELERATED,
                                   f"runner pod {report.pod} runs the guest under KVM",
                                   only_if_present=True)
        if report.accel == "tcg":
            return ConditionUpdate(CONDITION, "True", KVM_NOT_USABLE,
                                   f"runner pod {report.pod} runs the guest under TCG")
    if not kvm_resource:
        return ConditionUpdate(
            CONDITION, "True", NO_KVM_RESOURCE,
            "spec.enableAcceleration asks for KVM (NeonVM's default), but the controller "
            "runs without --kvm-resource: runner pods get no /dev/kvm and the guest runs "
            "under TCG")
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


class RunnerStatusSource(Protocol):
    """Reads one runner's ``GET /status`` JSON (raises on any failure)."""

    def get_status(self, host: str, port: int, timeout: float) -> Mapping[str, Any]: ...


class HTTPRunnerStatus:
    """``GET http://<pod IP>:<runner port>/status``, straight to the pod (no proxy from
    the environment), with the bounds of the controller's runner client (the runner is
    the VM owner's to choose): the whole exchange ends by ``timeout`` seconds however
    the answer trickles in, at most :data:`~neonvm.controller.runner_client.RUNNER_BODY_LIMIT`
    bytes are read, and a redirect is an error, never followed
    (:func:`~neonvm.controller.runner_client.runner_exchange`; docs/security.md, "The runner
    as seen by the controller")."""

    def get_status(self, host: str, port: int, timeout: float) -> Mapping[str, Any]:
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        status, body = runner_exchange("GET", f"http://{netloc}/status", None,
                                       {"Accept": "application/json"}, timeout)
        if status != 200:
            raise ValueError(f"/status answered {status}")
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError(f"/status is not a JSON object: {type(doc).__name__}")
        return doc


@dataclass
class _Fetch:
    attempts: int = 0
    last_try: float = 0.0
    running: bool = False
    report: RunnerReport | None = None


class RunnerReports:
    """Per pod uid, what its runner said; fetched in the background, never waited for."""

    def __init__(self, source: RunnerStatusSource, *,
                 timeout: float = STATUS_TIMEOUT, retry_seconds: float = RETRY_SECONDS,
                 max_attempts: int = MAX_ATTEMPTS, max_in_flight: int = MAX_IN_FLIGHT,
                 remembered: int = REMEMBERED_PODS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._timeout = timeout
        self._retry = retry_seconds
        self._max_attempts = max_attempts
        self._max_in_flight = max_in_flight
        self._remembered = remembered
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: OrderedDict[str, _Fetch] = OrderedDict()
        self._in_flight = 0

    def lookup(self, pod: PodView, port: int) -> RunnerReport | None:
        """The report of ``pod`` if one was fetched; else start a fetch (if due) and
        return None at once. Only a Running pod with an IP is asked."""
        if pod.phase != "Running" or not pod.ip or not pod.uid or pod.terminating:
            return None
        with self._lock:
            entry = self._pods.get(pod.uid)
            if entry is None:
                entry = self._pods[pod.uid] = _Fetch()
                while len(self._pods) > self._remembered:
                    self._pods.popitem(last=False)
            self._pods.move_to_end(pod.uid)
            if entry.report is not None or entry.running:
                return entry.report
            now = self._clock()
            if entry.attempts >= self._max_attempts or (
                    entry.attempts and now - entry.last_try < self._retry):
                return None
            if self._in_flight >= self._max_in_flight:
                return None
            entry.running, entry.last_try = True, now
            entry.attempts += 1
            self._in_flight += 1
        threading.Thread(target=self._fetch, args=(pod.uid, pod.name, pod.ip, port, entry),
                         name=f"runner-status-{pod.name}", daemon=True).start()
        return None

    def forget(self, uid: str) -> None:
        """The pod ``uid`` is deleted: nothing of it can be looked up again. A fetch of it
        still running ends into the forgotten entry."""
        with self._lock:
            self._pods.pop(uid, None)

    def remembered(self) -> int:
        """Pods remembered (``neonvm_controller_remembered``)."""
        with self._lock:
            return len(self._pods)

    def _fetch(self, uid: str, name: str, ip: str, port: int, entry: _Fetch) -> None:
        report: RunnerReport | None = None
        try:
            report = RunnerReport.from_status(
                name, self._source.get_status(ip, port, self._timeout))
        except Exception as exc:
            logger.debug("runner pod {}: GET /status on {}:{} failed ({}): {}", name, ip,
                         port, type(exc).__name__, exc)
        with self._lock:
            entry.running = False
            entry.report = report
            self._in_flight -= 1

    def wait_idle(self, timeout: float) -> bool:
        """True once no fetch runs (tests: let a started fetch finish)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._in_flight == 0:
                    return True
            time.sleep(0.05)
        return False


def runner_port(raw_pod: Mapping[str, Any] | None, vm: VirtualMachine,
                default: int) -> int:
    """The port the runner of ``raw_pod`` serves on: its container port named
    ``runner``, else the VM's ``runnerPort``, else ``default``."""
    for container in ((raw_pod or {}).get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == RUNNER_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return vm.spec.runner_port or default


class Acceleration:
    """The reconciler's view: the condition update for a snapshot (non-blocking)."""

    def __init__(self, kvm_resource: str | None, reports: RunnerReports,
                 default_port: int) -> None:
        self.kvm_resource = kvm_resource
        self.reports = reports
        self._default_port = default_port

    def updates(self, snap: Snapshot) -> list[ConditionUpdate]:
        vm = snap.obs.vm
        if vm is None or vm.deletion_timestamp is not None:
            return []
        report = None
        if asked(vm) and vm.status.pod_name:
            pod = snap.obs.pod(vm.status.pod_name)
            if pod is not None:
                port = runner_port(snap.pods.get(pod.name), vm, self._default_port)
                report = self.reports.lookup(pod, port)
        update = acceleration_condition(vm, self.kvm_resource, report)
        return [update] if update is not None else []


def _condition(vm: VirtualMachine) -> Condition | None:
    return next((c for c in vm.status.conditions if c.type == CONDITION), None)


def warn_acceleration_unavailable(events: EventRecorder, before: VirtualMachine,
                                  after: VirtualMachine) -> bool:
    """One Warning when a status write turns the condition True (or changes its cause,
    its reason); True if recorded."""
    now = _condition(after)
    if now is None or now.status != "True":
        return False
    was = _condition(before)
    if was is not None and was.status == "True" and was.reason == now.reason:
        return False
    events.record(after, CONDITION, now.message or "", warning=True)
    return True
