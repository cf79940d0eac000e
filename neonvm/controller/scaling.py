"""Live scaling, the controller's side: the token Secret, asking the runner, telling Kubernetes.

``decide`` plans a change (``PlanScale``), asks for it (``ApplyScale``) and commits what
the runner reports (``CommitScale``); :class:`RunnerScaling` performs the part that is not
a status write: the VM's token Secret, ``GET``/``PUT /scale`` on the runner (through the
hostile-peer client of :mod:`~neonvm.controller.runner_client`), then the pod's usage
annotation and CPU request. The protocol: docs/protocol.md, "Live scaling"; the token
and who may call the runner: docs/runner.md, "Live scaling"; the runner as a hostile
peer: docs/security.md.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger

from neonvm import kube
from neonvm.api import types
from neonvm.api.scale_protocol import NO_TOKEN, ScaleFence, pod_token, request_body
from neonvm.api.types import VirtualMachine
from neonvm.controller import actions as act
from neonvm.controller import autoscaler_view, looks, podspec
from neonvm.controller import decide as d
from neonvm.controller.cluster import KubeCluster, TokenSecrets
from neonvm.controller.observe import Snapshot, annotated_size, runner_cpu_request
from neonvm.controller.reasons import RUNNER_MISBEHAVING_REASON, RUNNER_UNREACHABLE_REASON
from neonvm.controller.runner_client import (
    MAX_RUNNER_BYTES,
    ScalingError,
    bounded_count,
    error_text,
    runner_exchange,
    runner_view,
    short,
)
from neonvm.controller.scaling_token import TOKEN_KEY, recorded_token

STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
USAGE_ANNOTATION = "vm.neon.tech/usage"
"""NeonVM's runner-pod annotation with the guest's current size (JSON cpu, memory)."""
SCALE_FENCE_ANNOTATION = types.ANNOTATION_SCALE_FENCE
"""``epoch,token,seq`` of the plan whose size the pod's usage annotation and CPU request
carry: a plan writes them only over an older one (and by resourceVersion)."""

TOKEN_SYNC_SECONDS = 150.0
"""How long a runner may keep refusing the controller's token (a 401 other than
``NoToken``) before that counts as for good. The kubelet refreshes a mounted Secret about
a minute after it changes, so a rotated token is refused until then."""

TOKEN_QUIET_SECONDS = 2 * TOKEN_SYNC_SECONDS
"""A runner's refusals that stopped for this long (no 401 from it meanwhile: the plan
ended another way, or it was not asked) are forgotten: the next 401 starts a new
:data:`TOKEN_SYNC_SECONDS` window. Longer than the retries' backoff cap (300 s), so the
401s of one refusal, however spaced, stay in one window."""


@dataclasses.dataclass
class _Refusing:
    """One runner pod refusing the controller's token (a 401 that may pass), or failing
    to answer ``GET /scale``: since when, and when last."""

    vm_uid: str
    first: float
    last: float


TELL_ATTEMPTS = 4
"""How many times the pod's usage annotation and CPU request are read, checked and patched
when each patch meets a conflict (409)."""

POD_WITHOUT_TOKEN = "pod_without_token"
"""The outcome of an ``ApplyScale`` for a VM with no token Secret recorded: its pod was
built without one, so only its replacement can scale (``ScalingNeedsRestart``)."""

GUEST_REFUSED = "guest_refused"
"""The outcome of an ``ApplyScale`` the runner answered 504 ``refused``: the guest keeps a
device it was asked to give back. It may agree later; see ``reconciler.PAUSED``."""

POD_NOT_ANNOTATED = "pod_not_annotated"
"""The outcome of an ``ApplyScale`` whose pod annotation write the API server refused
(say 422: the tenant filled the pod's annotations): asked again after the stuck backoff,
not at once (see :meth:`RunnerScaling._tell_kubernetes`)."""

POD_NOT_RESIZED = "pod_not_resized"
"""The outcome of an ``ApplyScale`` whose pod carries the plan's annotations but whose
in-place resize failed in a way that may pass (no answer, 429, 5xx), or whose record of
a refused resize could not be written: asked again after the stuck backoff (a commit
then leaves the pod behind the spec, and the next plan resizes it: docs/protocol.md,
"Live scaling", "The pod's record")."""

RUNNER_UNREACHABLE = "unreachable"
"""The outcome of an ``ApplyScale`` whose runner gave no answer (connection refused or
reset, nothing back within the deadline)."""

RUNNER_MISBEHAVING = "runner_misbehaving"
"""The outcome of an ``ApplyScale`` whose runner answered what no runner answers: a
redirect, an answer over :data:`~neonvm.controller.runner_client.RUNNER_BODY_LIMIT`, one
still arriving at the deadline, or one that is not the JSON the protocol says
(docs/security.md, "The runner as seen by the controller")."""

RUNNER_FAILURES_QUIET_SECONDS = 600.0
"""A runner's failed ``GET /scale`` run that stopped for this long (no failure from it
meanwhile) is forgotten: the next failure starts a new :data:`RUNNER_GRACE_SECONDS`. Twice
the stuck backoff's cap (300 s, ``ControllerConfig.stuck_backoff``): a silent runner looked
at once per cap, each look taking up to its deadline, stays one run, and its VM stays
Degraded instead of flapping to ``Recovered``."""

RUNNER_GRACE_SECONDS = 30.0
"""How long a runner that gives no answer to ``GET /scale`` (refused, reset, silent) is
asked again at decide's own pace (``RUNNER_RECHECK_SECONDS``) before its VM is Degraded
(``RunnerUnreachable``) and looked at with the stuck backoff instead. Counted per pod
by this process from the first failure in a row. A runner that misbehaves is Degraded at
once."""

RunnerAddress = Callable[[VirtualMachine, act.PodView], str]
"""``http://host:port`` of a pod's runner."""


def token_secret_prefix(vm: VirtualMachine) -> str:
    """The generateName of the VM's scaling-token Secret (the API server adds a suffix)."""
    return f"neonvm-scaling-{vm.uid[:8]}-"


def scalable(vm: VirtualMachine) -> bool:
    """Whether the spec leaves room to scale (its bounds differ): only then a token."""
    return podspec.scalable(vm)


def default_address(vm: VirtualMachine, pod: act.PodView) -> str:
    """The pod's runner: its IP and the port in the pod's own spec (the VM's
    ``runnerPort`` may have changed since the pod was built)."""
    port = pod.runner_port or vm.spec.runner_port or podspec.RUNNER_PORT
    return f"http://{pod.ip}:{port}"


def parse_scale_fence(text: object) -> tuple[int, int, int] | None:
    """(epoch, token, seq) from :data:`SCALE_FENCE_ANNOTATION`; None: absent or malformed."""
    try:
        e, t, s = (int(v) for v in str(text).split(","))
    except (TypeError, ValueError):
        return None
    return (e, t, s)


class Result(str):
    """What an apply came to ("done", or why not), with a detail for people, and the
    message of a Warning event the performer records ("" none: a resize refused)."""

    detail: str
    warning: str

    def __new__(cls, value: str, detail: str = "", warning: str = "") -> Result:
        obj = super().__new__(cls, value)
        obj.detail = detail
        obj.warning = warning
        return obj


class RunnerTrouble(str):
    """``Observation.runner_error`` as :meth:`RunnerScaling.observe` sets it: the text,
    whether the runner misbehaved, and for how long (seconds, this process's count) the
    runner of that pod has failed to answer in a row."""

    misbehaving: bool
    failing_for: float

    def __new__(cls, value: str, misbehaving: bool = False,
                failing_for: float = 0.0) -> RunnerTrouble:
        obj = super().__new__(cls, value)
        obj.misbehaving = misbehaving
        obj.failing_for = failing_for
        return obj


def runner_trouble(error: str | None) -> tuple[str, str] | None:
    """The Degraded (reason, message) of a reconcile whose ``GET /scale`` failed, when that
    ends it stuck (backoff) instead of decide's short Wait: at once for a runner that
    misbehaves, after :data:`RUNNER_GRACE_SECONDS` of failures in a row for one that does
    not answer. None: not (yet) a reason to stop asking at decide's pace."""
    if error is None:
        return None
    misbehaving = bool(getattr(error, "misbehaving", False))
    failing_for = float(getattr(error, "failing_for", 0.0))
    if misbehaving:
        return (RUNNER_MISBEHAVING_REASON,
                f"the VM's runner answers GET /scale in a way no runner does ({error}); "
                "its scaling plan is kept and asked again with backoff")
    if failing_for >= RUNNER_GRACE_SECONDS:
        return (RUNNER_UNREACHABLE_REASON,
                f"the VM's runner has not answered GET /scale for {RUNNER_GRACE_SECONDS:.0f} s "
                f"or more ({error}); its scaling plan is kept and asked again with backoff")
    return None


def asks_again_later(outcome: str) -> bool:
    """An ``ApplyScale`` outcome after which the reconcile ends (stuck, with backoff)
    instead of asking the runner again at once: the guest refused, the runner did not
    answer or misbehaved, or it answered 5xx (a 504: an unplug the guest neither finished
    nor refused within the runner's own wait). Asked again at once, each such PUT may
    hold a worker for the whole deadline (docs/protocol.md, "Live scaling")."""
    return outcome in (GUEST_REFUSED, RUNNER_UNREACHABLE, RUNNER_MISBEHAVING,
                       POD_NOT_ANNOTATED, POD_NOT_RESIZED) or (
        outcome.startswith("runner_5"))


class RunnerScaling:
    """Performs ``ApplyScale`` and adds the runner's view to observations."""

    def __init__(self, api: client.ApiClient, *, secrets: TokenSecrets | None = None,
                 timeout: float = 90.0,
                 look_timeout: float = 3.0, address: RunnerAddress = default_address,
                 token_sync_seconds: float = TOKEN_SYNC_SECONDS,
                 token_quiet_seconds: float = TOKEN_QUIET_SECONDS,
                 failures_quiet_seconds: float = RUNNER_FAILURES_QUIET_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``api``: the pod reads and patches that tell Kubernetes a new size;
        ``secrets``: the token Secret's calls (the composition root passes its
        :class:`~neonvm.controller.cluster.KubeCluster`; None: one over ``api``);
        ``timeout``: a ``PUT /scale`` (the runner waits up to its own 60 s for an
        unplug); ``look_timeout``: a ``GET /scale``, asked during observations;
        ``token_sync_seconds``, ``token_quiet_seconds``: see :data:`TOKEN_SYNC_SECONDS`
        and :data:`TOKEN_QUIET_SECONDS`; ``failures_quiet_seconds``: see
        :data:`RUNNER_FAILURES_QUIET_SECONDS` (longer than the stuck backoff's cap)."""
        self._api = api
        self._secrets: TokenSecrets = secrets if secrets is not None else KubeCluster(api)
        self._timeout = timeout
        self._look_timeout = look_timeout
        self._address = address
        self._token_sync = token_sync_seconds
        self._token_quiet = token_quiet_seconds
        self._failures_quiet = failures_quiet_seconds
        self._clock = clock
        self._unauthorized_since: dict[str, _Refusing] = {}
        """Per pod uid: since when (and until when) its runner refuses our token (a 401
        that may pass). Forgotten when the VM's plan ends or moves to another pod, and
        when the refusals stopped for :data:`TOKEN_QUIET_SECONDS`."""
        self._unauthorized_lock = threading.Lock()
        self._failing_since: dict[str, _Refusing] = {}
        """Per pod uid: since when (and until when) its runner fails ``GET /scale`` (see
        :data:`RUNNER_GRACE_SECONDS`); dropped at its first answer, when it is no longer
        the VM's committed pod, and after :data:`RUNNER_FAILURES_QUIET_SECONDS` without a
        failure."""

    # ---- the token ---------------------------------------------------------------------

    def create_token(self, vm: VirtualMachine, *, wanted: bool = False) -> tuple[str, str] | None:
        """Create a token Secret for ``vm`` (before its pod is created) under a generated
        name; (name, uid) to record in status, or None (not scalable and not ``wanted``,
        the recorded one is still there, or the create was refused: the pod then starts
        without live scaling). ``wanted``: a self-fencing VM, whose runner's bearer comes
        from the token whether or not it can scale.

        A recorded Secret that is gone, or was replaced under its name (another uid), is
        replaced by a new one: otherwise every later pod of the VM would mount nothing
        usable and never scale."""
        if not scalable(vm) and not wanted:
            return None
        if vm.status.scaling_token_secret_uid and self._recorded_token_present(vm):
            return None
        body = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {
                "generateName": token_secret_prefix(vm), "namespace": vm.namespace,
                "labels": {types.LABEL_VM_NAME: vm.name, types.LABEL_VM_UID: vm.uid},
                "ownerReferences": [{"apiVersion": types.API_VERSION, "kind": types.KIND,
                                     "name": vm.name, "uid": vm.uid,
                                     "blockOwnerDeletion": False}],
            },
            "stringData": {TOKEN_KEY: secrets.token_urlsafe(32)},
        }
        try:
            created = self._secrets.create_secret(vm.namespace, body)
        except ApiException as exc:
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                # Transient: the pod waits for its token (the step is retried with
                # backoff); a pod built without one could never scale in its life.
                raise
            # Refused (RBAC without live scaling, quota, admission): scaling will say why
            # it cannot ask the runner; the pod is still created.
            logger.bind(vm=vm.key).warning("cannot create a scaling token Secret: {} {}",
                                           exc.status, exc.reason)
            return None
        meta = created.get("metadata") or {}
        return str(meta.get("name") or ""), str(meta.get("uid") or "")

    def _recorded_token_present(self, vm: VirtualMachine) -> bool:
        """Whether the Secret recorded in status still exists with the recorded uid. Only
        a 404 or another uid says no; a refusal to read (403) keeps the record, and a
        transient error is raised (the pod waits)."""
        name = vm.status.scaling_token_secret or ""
        if not name:
            return False
        try:
            secret = self._secrets.get_secret(vm.namespace, name)
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                raise
            return True
        return bool((secret.get("metadata") or {}).get("uid")
                    == vm.status.scaling_token_secret_uid)

    def discard_token(self, namespace: str, name: str) -> None:
        """Best effort: delete a token Secret this controller created but could not
        record (another one was recorded first). Left behind, the VM's owner reference
        still removes it with the VM."""
        try:
            self._secrets.delete_secret(namespace, name)
        except ApiException as exc:
            logger.debug("could not delete the unrecorded token Secret {}: {}", name,
                         exc.status)

    def token(self, vm: VirtualMachine) -> str:
        """The VM's secret: from the Secret recorded in status, only if its UID is the one
        its creation returned (a Secret planted under that name is not used)."""
        name, uid = vm.status.scaling_token_secret, vm.status.scaling_token_secret_uid
        if not name or not uid:
            raise ScalingError("no scaling token Secret recorded for this VM (the controller "
                               "could not create one: is rbac.liveScaling on?)", permanent=True)
        try:
            secret = self._secrets.get_secret(vm.namespace, name)
        except ApiException as exc:
            raise ScalingError(f"scaling token Secret {name}: {exc.status} {exc.reason}",
                               permanent=exc.status in (403, 404)) from None
        token = recorded_token(secret, name, uid)
        if isinstance(token, str):
            raise ScalingError(token, permanent=True)
        return token.decode()

    # ---- the runner --------------------------------------------------------------------

    def observe(self, snap: Snapshot) -> Snapshot:
        """``snap`` with the runner's ``GET /scale`` answer, when the committed pod runs
        and :func:`looks.looks_at_runner <neonvm.controller.looks.looks_at_runner>`
        says so (a plan is recorded, or one was dropped: a PUT of it may still land);
        otherwise ``snap`` itself. A VM at its size is not looked at. Whether the look
        after a drop goes on is status's (``scaleLookPodUID``), not this process's: the
        answer is asked after the observation's ``now``, and only a status write decided
        from it ends the look."""
        obs = snap.obs
        vm = obs.vm
        if vm is not None:
            plan = vm.status.pending_scale
            self._forget_refusals(vm.uid, keep=plan.pod_uid if plan is not None else None)
            self._forget_failures(vm.uid, keep=vm.status.pod_uid or None)
        if vm is None or vm.deletion_timestamp is not None:
            return snap
        if not looks.looks_at_runner(vm, obs.now if obs.now is not None
                                 else dt.datetime.now(dt.UTC)):
            return snap
        pod = obs.pod(vm.status.pod_name)
        if pod is None or pod.phase != "Running" or not pod.ip or pod.gated:
            return snap
        try:
            view = self._view(vm, pod)
        except ScalingError as exc:
            trouble = RunnerTrouble(str(exc), misbehaving=exc.misbehaving,
                                    failing_for=self._failing(vm.uid, pod.uid))
            return dataclasses.replace(snap, obs=dataclasses.replace(obs,
                                                                     runner_error=trouble))
        self._answered(pod.uid)
        return dataclasses.replace(snap, obs=dataclasses.replace(obs, runner=view))

    def _view(self, vm: VirtualMachine, pod: act.PodView) -> act.RunnerView:
        code, doc = self._call("GET", f"{self._address(vm, pod)}/scale", None, None,
                               self._look_timeout)
        if code != 200:
            raise ScalingError(f"GET /scale answered {code}: {error_text(doc)}")
        try:
            return runner_view(doc, pod.uid)
        except (KeyError, TypeError, ValueError) as exc:
            raise ScalingError(f"GET /scale answered 200 with a malformed report "
                               f"({type(exc).__name__}: {short(str(exc))})",
                               misbehaving=True) from None

    def apply(self, action: act.ApplyScale, snap: Snapshot, log: Any) -> str:
        """``PUT /scale`` for the recorded plan; "done" when the runner reached it."""
        vm = snap.obs.vm
        assert vm is not None
        plan = action.plan
        pod = snap.obs.pod(plan.pod_name)
        if pod is None or pod.uid != plan.pod_uid or not pod.ip:
            return "no_pod"
        if not vm.status.scaling_token_secret and d.fraction_only(vm, plan, pod):
            # A cpus.use change within the vCPUs the pod was built with (and keeps, with
            # no token): nothing for the runner, only the fenced annotation write, after
            # which decide commits (docs/protocol.md, "Live scaling").
            left = self._tell_kubernetes(vm, pod, d.status_memory_bytes(vm) or 0, plan, log)
            return "done" if left is None else left
        if not vm.status.scaling_token_secret:
            # Pods mount the recorded Secret: with none recorded, the committed pod was
            # built without a token (its bounds were equal then, or the controller could
            # not create one) and no token will ever reach its runner.
            detail = (f"{pod.name} was built without live scaling (no scaling token Secret "
                      "was recorded when it was created: its bounds were equal then, or "
                      "the controller could not create one: is rbac.liveScaling on?); "
                      "its next start is built at the spec's size")
            log.warning("scaling plan #{seq}: {detail}", seq=plan.seq, detail=detail)
            return Result(POD_WITHOUT_TOKEN, detail)
        try:
            token = pod_token(self.token(vm).encode(), plan.pod_uid)
        except ScalingError as exc:
            log.warning("scaling plan #{seq}: {err}", seq=plan.seq, err=str(exc))
            return Result("no_token" if exc.permanent else "token_unavailable", str(exc))
        body = request_body(plan.cpus, plan.memory_slots,
                            ScaleFence(epoch=plan.epoch, token=plan.token, seq=plan.seq))
        try:
            code, doc = self._call("PUT", f"{self._address(vm, pod)}/scale", body, token,
                                   self._timeout)
        except ScalingError as exc:
            log.warning("scaling plan #{seq}: {err}", seq=plan.seq, err=str(exc))
            return Result(RUNNER_MISBEHAVING if exc.misbehaving else RUNNER_UNREACHABLE,
                          f"the runner of {pod.name}: {exc}")
        detail = f"the runner of {pod.name} answered {code}: {error_text(doc)}"
        if code == 401:
            log.warning("scaling plan #{seq}: {detail}", seq=plan.seq, detail=detail)
            return self.unauthorized(plan.pod_uid, doc, detail, vm_uid=vm.uid)
        self._authorized(plan.pod_uid)
        if code != 200:
            log.warning("scaling plan #{seq}: the runner answered {code}: {err}", seq=plan.seq,
                        code=code, err=error_text(doc))
            if code == 504 and doc.get("refused"):
                # The guest refused to give a device back: asking again at once gets the
                # same answer (and makes the guest try again); the reconcile ends and the
                # plan is asked again after the VM's stuck backoff.
                return Result(GUEST_REFUSED, detail)
            return Result("stale" if code == 409 else f"runner_{code}", detail)
        qemu = doc.get("qemu")
        try:
            memory_bytes = bounded_count((qemu if isinstance(qemu, dict) else {}).get(
                "memoryBytes") or 0, MAX_RUNNER_BYTES)
        except ValueError as exc:
            detail = (f"the runner of {pod.name} answered 200 with a malformed "
                      f"report ({short(str(exc))})")
            log.warning("scaling plan #{seq}: {detail}", seq=plan.seq, detail=detail)
            return Result(RUNNER_MISBEHAVING, detail)
        left = self._tell_kubernetes(vm, pod, memory_bytes, plan, log)
        return "done" if left is None else left

    def unauthorized(self, pod_uid: str, doc: dict[str, Any], detail: str,
                     vm_uid: str = "") -> Result:
        """A 401 from the runner of ``pod_uid`` (of the VM ``vm_uid``). ``NoToken`` (the
        pod has no token file) is for good at once: "runner_401". Any other (a wrong
        token, an unreadable file: a rotated Secret not yet on the pod) is
        "token_refused", retried like any failed step, until the runner has refused for
        :data:`TOKEN_SYNC_SECONDS` without a pause of :data:`TOKEN_QUIET_SECONDS`; then
        "runner_401" too."""
        now = self._clock()
        with self._unauthorized_lock:
            # Refusals that stopped long ago (this pod's or a gone pod's) say nothing
            # about this one: its window starts now.
            for uid in [u for u, r in self._unauthorized_since.items()
                        if now - r.last > self._token_quiet]:
                del self._unauthorized_since[uid]
            refusing = self._unauthorized_since.setdefault(
                pod_uid, _Refusing(vm_uid=vm_uid, first=now, last=now))
            refusing.last = now
            since = refusing.first
            if doc.get("reason") != NO_TOKEN and now - since < self._token_sync:
                return Result("token_refused",
                              f"{detail} (refused for {now - since:.0f} s; a rotated token "
                              f"reaches the pod within about a minute: asked again)")
            del self._unauthorized_since[pod_uid]
        if doc.get("reason") == NO_TOKEN:
            return Result("runner_401", detail)
        return Result("runner_401", f"{detail} (for {now - since:.0f} s, longer than a "
                                    "token rotation takes)")

    def _authorized(self, pod_uid: str) -> None:
        with self._unauthorized_lock:
            self._unauthorized_since.pop(pod_uid, None)

    def _forget_refusals(self, vm_uid: str, keep: str | None) -> None:
        """The VM's plan ended (``keep`` None) or is for the pod ``keep``: the refusals of
        its other pods are over (the next plan's first 401 starts a new window)."""
        with self._unauthorized_lock:
            for uid in [u for u, r in self._unauthorized_since.items()
                        if r.vm_uid == vm_uid and u != keep]:
                del self._unauthorized_since[uid]

    def _failing(self, vm_uid: str, pod_uid: str) -> float:
        """One more failed ``GET /scale`` of the runner of ``pod_uid``: seconds since the
        first of its failures in a row (0 for the first). A run that stopped for
        :data:`RUNNER_FAILURES_QUIET_SECONDS` starts again."""
        now = self._clock()
        with self._unauthorized_lock:
            for uid in [u for u, r in self._failing_since.items()
                        if now - r.last > self._failures_quiet]:
                del self._failing_since[uid]
            failing = self._failing_since.setdefault(
                pod_uid, _Refusing(vm_uid=vm_uid, first=now, last=now))
            failing.last = now
            return now - failing.first

    def _answered(self, pod_uid: str) -> None:
        with self._unauthorized_lock:
            self._failing_since.pop(pod_uid, None)

    def _forget_failures(self, vm_uid: str, keep: str | None) -> None:
        """The failures of the VM's pods other than its committed one (``keep``) are
        over: the pod is gone, or the VM is."""
        with self._unauthorized_lock:
            for uid in [u for u, r in self._failing_since.items()
                        if r.vm_uid == vm_uid and u != keep]:
                del self._failing_since[uid]

    def _call(self, method: str, url: str, body: dict[str, Any] | None,
              token: str | None, timeout: float) -> tuple[int, dict[str, Any]]:
        """One exchange with a runner (:func:`runner_exchange`): its status and, for a
        2xx, its JSON object (an error answer's body is read for its ``error`` text when
        it is one, else ``{}``)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else None
        code, raw = runner_exchange(method, url, data, headers, timeout)
        try:
            doc = json.loads(raw) if raw.strip() else {}
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            if 200 <= code < 300:
                raise ScalingError(f"{method} {url}: answered {code} with a body that is "
                                   f"not a JSON object", misbehaving=True)
            doc = {}
        return code, doc

    # ---- Kubernetes --------------------------------------------------------------------

    def _tell_kubernetes(self, vm: VirtualMachine, pod: act.PodView, memory_bytes: int,
                         plan: types.PendingScale, log: Any) -> Result | None:
        """The usage and resources annotations, then the CPU request and limit by in-place
        resize. None: done (or nothing to do); else the outcome that ends the reconcile
        stuck, the plan kept and asked again after the VM's stuck backoff: the pod
        could not be read or annotated (:data:`POD_NOT_ANNOTATED`: refused, say a 422
        because the tenant filled the pod's annotations, or a conflict on every attempt),
        or its resize failed in a way that may pass (:data:`POD_NOT_RESIZED`). A
        commit records a fraction only once the pod carries the plan, and a pod behind
        the spec is planned again (``decide.pod_behind``), so asking again at once
        would loop.

        Fenced like the runner: the annotations are written only over the record of an
        older plan (:data:`SCALE_FENCE_ANNOTATION`), each write with the resourceVersion
        just read, so a late apply of an older plan never puts an older size back; the
        resize only on a pod whose annotations carry this read's size. A conflict (409:
        the pod changed since the read; the kubelet's status updates change it too) is
        redone from a fresh read, up to :data:`TELL_ATTEMPTS` times. docs/protocol.md,
        "Live scaling", "Status and Kubernetes" and "The pod's record"."""
        fence = d.scale_fence(plan)
        for _ in range(TELL_ATTEMPTS):
            told = self._tell_once(vm, pod, memory_bytes, plan, fence, log)
            if told == "done":  # with the warning of a refused resize, if any
                return told if isinstance(told, Result) and told.warning else None
            if told != "conflict":
                return told if isinstance(told, Result) else Result(POD_NOT_ANNOTATED, told)
        detail = (f"the usage annotation or the CPU request of {pod.name} for plan {fence} "
                  f"met a conflict {TELL_ATTEMPTS} times")
        log.warning("{detail}: asked again later", detail=detail)
        return Result(POD_NOT_ANNOTATED, detail)

    def _tell_once(self, vm: VirtualMachine, pod: act.PodView, memory_bytes: int,
                   plan: types.PendingScale, fence: tuple[int, int, int], log: Any) -> str:
        """One read-check-patch of :meth:`_tell_kubernetes`: "done" (or nothing to do),
        "conflict" (a 409: read again and redo), or else the :class:`Result` that ends
        the apply stuck."""

        try:
            current = kube.request(self._api, "GET", _pod_path(vm.namespace, pod.name),
                                   timeout=30)
        except ApiException as exc:
            log.warning("reading {pod} before annotating its size: {s}", pod=pod.name,
                        s=exc.status)
            if exc.status == 404:
                return "done"  # the pod is gone: its VM restarts
            return Result(POD_NOT_ANNOTATED, f"reading {pod.name} before annotating its "
                                             f"size failed: {exc.status} "
                                             f"{kube.api_error_message(exc)}")
        meta = current.get("metadata") or {}
        recorded = parse_scale_fence((meta.get("annotations") or {}).get(
            SCALE_FENCE_ANNOTATION))
        if meta.get("uid") != pod.uid or (recorded is not None and recorded > fence):
            log.info("{pod} already carries the size of plan {r}: not annotated with plan "
                     "{f}'s", pod=pod.name, r=recorded, f=fence)
            return "done"
        version = meta.get("resourceVersion")
        cpus = autoscaler_view.landed_cpus(vm, plan.cpus)  # "250m" where use is fractional
        if recorded != fence:
            patch = {"metadata": {"uid": pod.uid, "resourceVersion": version,
                                  "annotations": {
                                      USAGE_ANNOTATION: autoscaler_view.usage_json(
                                          cpus, memory_bytes),
                                      podspec.ANNOTATION_RESOURCES:
                                          autoscaler_view.resources_json(
                                              vm, cpus, plan.memory_slots),
                                      SCALE_FENCE_ANNOTATION: ",".join(
                                          str(v) for v in fence)}}}
            try:
                # The generated patch_namespaced_pod sent a dict as a strategic merge.
                written = kube.request(self._api, "PATCH", _pod_path(vm.namespace, pod.name),
                                       body=patch, content_type=STRATEGIC_MERGE_PATCH,
                                       timeout=30)
            except ApiException as exc:
                log.warning("annotating {pod} with its size: {s} {m}", pod=pod.name,
                            s=exc.status, m=kube.api_error_message(exc))
                if exc.status == 409:
                    return "conflict"
                return (f"annotating {pod.name} with its size was refused: {exc.status} "
                        f"{kube.api_error_message(exc)}")
            version = (written.get("metadata") or {}).get("resourceVersion")
        elif annotated_size(meta) != (int(cpus), plan.memory_slots):
            # The pod carries this plan, written from another read of the VM (another
            # leader's apply of the same plan, the spec changed between): that read's
            # tell resizes to what the annotations say; this one's size would not be
            # theirs. If that tell is lost, the pod is behind the spec and planned again.
            log.info("{pod} carries plan {f} from another read of the VM: not resized to "
                     "this read's cpus.use", pod=pod.name, f=fence)
            return "done"
        # The annotations carry this plan and this read's size (written now, or by an
        # earlier attempt).
        use = vm.spec.guest.cpus.current
        if vm.spec.pod_resources is not None or use.rounded_up() != plan.cpus:
            return "done"  # the user's resources (not ours to change), or the spec moved on
        # The request follows use, the limit NeonVM's quota rule (use x 4, within [use,
        # max]): the kubelet's cgroup caps the fraction (docs/neonvm-compat.md).
        # Kubernetes refuses a resize that changes the pod's QoS class (422), so it is
        # kept: a Guaranteed pod (built at use == max: request == limit) is not resized;
        # a Burstable one keeps its limit above the request (use == max: max + 1m), or
        # the refused resize would leave the old, lower limit capping the new vCPUs.
        if _qos_class(current) == "Guaranteed":
            log.info("{pod} is Guaranteed (built at cpus.use == max): its CPU request and "
                     "limit are left as built", pod=pod.name)
            return "done"
        request = d.resize_request(vm)
        limit = max(int(autoscaler_view.cpu_limit(vm)), int(use) + 1)
        resize = {"metadata": {"uid": pod.uid, "resourceVersion": version},
                  "spec": {"containers": [{"name": podspec.RUNNER_CONTAINER, "resources": {
                      "requests": {"cpu": podspec.millicores(request / 1000)},
                      "limits": {"cpu": podspec.millicores(limit / 1000)}}}]}}
        try:
            resized = kube.request(self._api, "PATCH",
                                   f"{_pod_path(vm.namespace, pod.name)}/resize",
                                   resize, content_type=STRATEGIC_MERGE_PATCH)
        except ApiException as exc:
            log.info("in-place resize of {pod} not taken: {s} {m}", pod=pod.name,
                     s=exc.status, m=kube.api_error_message(exc))
            if exc.status == 409:
                return "conflict"
            why = f"{exc.status} {kube.api_error_message(exc)}"
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                return Result(POD_NOT_RESIZED, f"the in-place resize of {pod.name} "
                                               f"failed: {why}")
            # Refused for good (no in-place resize before Kubernetes 1.33, a QoS class
            # change, RBAC), or until something else changes (a ResourceQuota's 403, an
            # admission webhook's denial): recorded, so that the pod is not planned
            # again for it, and said by a Warning event (on a cluster without in-place
            # resize, the 404, only at the pod's first refusal).
            first = types.ANNOTATION_RESIZE_REFUSED not in (meta.get("annotations") or {})
            return self._resize_refused(vm, pod, fence, version, why, log,
                                        warn=first or exc.status != 404)
        taken = runner_cpu_request(resized if isinstance(resized, dict) else {})
        if taken is not None and taken != request:
            # Taken at another request (an admission plugin's change): asking again
            # would get the same, so it is recorded like a refusal.
            return self._resize_refused(
                vm, pod, fence, (resized.get("metadata") or {}).get("resourceVersion"),
                f"taken with CPU request {taken}m, not {request}m", log, warn=True)
        return "done"

    def _resize_refused(self, vm: VirtualMachine, pod: act.PodView,
                        fence: tuple[int, int, int], version: object, why: str,
                        log: Any, warn: bool) -> str:
        """Record on the pod that plan ``fence``'s resize was refused for good
        (:data:`~neonvm.api.types.ANNOTATION_RESIZE_REFUSED`, by the resourceVersion of
        the read or write whose pod carries that plan): "done" (with the Warning event's
        message when ``warn``), "conflict", or the :data:`POD_NOT_RESIZED` result when
        the record cannot be written."""
        log.warning("{pod}: the in-place resize of plan {f} was refused ({why}): its CPU "
                    "request and limit stay as they are", pod=pod.name, f=fence, why=why)
        patch = {"metadata": {"uid": pod.uid, "resourceVersion": version, "annotations": {
            types.ANNOTATION_RESIZE_REFUSED: ",".join(str(v) for v in fence)}}}
        try:
            kube.request(self._api, "PATCH", _pod_path(vm.namespace, pod.name), body=patch,
                         content_type=STRATEGIC_MERGE_PATCH, timeout=30)
        except ApiException as exc:
            if exc.status == 409:
                return "conflict"
            return Result(POD_NOT_RESIZED, f"the in-place resize of {pod.name} was refused "
                                           f"({why}) and recording so failed: {exc.status} "
                                           f"{kube.api_error_message(exc)}")
        if not warn:
            return "done"
        return Result("done", warning=(
            f"the in-place resize of runner pod {pod.name} was refused ({why}): its CPU "
            "request and limit stay as they are until a later scaling plan's resize is "
            "taken (this plan's is not asked again, even if what refused it, a "
            "ResourceQuota or an admission webhook, would take it now)"))


def _qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class: as the API server recorded it at creation, else (a pod read
    without it) "Guaranteed" when every container's CPU and memory requests equal its
    limits, else "Burstable"."""
    recorded = (pod.get("status") or {}).get("qosClass")
    if recorded:
        return str(recorded)
    containers = (pod.get("spec") or {}).get("containers") or []
    for c in containers:
        resources = c.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        if any(not limits.get(k) or str(requests.get(k, limits.get(k))) != str(limits[k])
               for k in ("cpu", "memory")):
            return "Burstable"
    return "Guaranteed" if containers else "Burstable"


def _pod_path(namespace: str, name: str) -> str:
    """A pod's path; ``name`` (read from a VM's status or a pod) percent-quoted."""
    return f"/api/v1/namespaces/{kube.path_segment(namespace)}/pods/{kube.path_segment(name)}"
