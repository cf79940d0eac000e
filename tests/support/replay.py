"""Replay a counterexample's writes against the real API server, step by step.

Guarantees. For every step of the trace, the replayer performs the same request against
the real kube-apiserver (same preconditions: the ``resourceVersion`` of the VM version
the model's worker decided from, the pod's uid and resourceVersion for the ungate, the
uid for a delete), using the shipped writer (:class:`~neonvm.controller.cluster.VMWriter`)
and pod manifest (:func:`~neonvm.controller.podspec.runner_pod`); then it checks that

* the server answered as the model said (success, 409 Conflict, AlreadyExists, 404), and
* the server's VM and pods now look exactly like the model's state after the step;

and raises :class:`ReplayMismatch` at the first difference. So a replayed counterexample
is real, and each replay is also a test of the model's semantics against the real server.

Not replayed: reads (cached reads cannot be forced on a real cache; the replayer just
uses the resourceVersion of the version the model's worker read, which the server still
compares exactly), the locks' etcd (lock steps change no API object), and the kubelet: a
pod "runs" when the replayer binds it to a node and sets its status, and a terminating
pod is "gone" when the replayer force-deletes it, which is what the kubelet's final
delete does. The real API server needs no scheduler or nodes for any of this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.api import types
from neonvm.api.schema import encode
from neonvm.api.types import VirtualMachine
from neonvm.controller import podspec
from neonvm.controller.cluster import VMRecord, VMWriter
from neonvm.controller.fault_wiring import bump_resource_version
from neonvm.verify.actors import Config, Step
from neonvm.verify.model import (
    NODE,
    VM,
    VM_NAME,
    VM_UID,
    Plan,
    Pod,
    Status,
    World,
    from_api_status,
    to_api_status,
)

MODEL_PREFIX = f"{VM_NAME}-{VM_UID[:8]}-"


class ReplayMismatch(AssertionError):
    """The real server disagreed with the model at a step."""


@dataclass
class ReplayResult:
    log: list[str] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)
    """The real pods of the VM after the last step."""
    vm: dict[str, Any] | None = None

    @property
    def runnable(self) -> list[str]:
        """Names of real pods without our scheduling gate (strict form: any state)."""
        return [p["metadata"]["name"] for p in self.pods if not _gated(p)]


def _gated(pod: dict[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == types.SCHEDULING_GATE for g in gates)


def _status(exc: ApiException) -> int:
    return int(exc.status or 0)


class Replayer:
    """Plays one trace into ``namespace`` (which must not hold a VM named ``vm``)."""

    def __init__(self, admin: client.ApiClient, controller: client.ApiClient,
                 namespace: str, config: Config | None = None) -> None:
        self.config = config or Config()
        self.admin_core = client.CoreV1Api(admin)
        self.admin_custom = client.CustomObjectsApi(admin)
        self.core = client.CoreV1Api(controller)
        self.custom = client.CustomObjectsApi(controller)
        self.writer = VMWriter(controller)
        self.namespace = namespace
        self.real_uid = ""
        self.uids: dict[str, str] = {}
        """Model pod uid → real pod uid."""
        self.vm_versions: list[dict[str, Any]] = []
        """Real VM objects, one per model VM version, oldest first."""
        self.base: dict[int, dict[str, Any]] = {}
        """Per worker: the real VM object its pending write is conditional on."""
        self.pod_rvs: dict[Pod, str] = {}
        """Model pod version → real resourceVersion."""

    # ---- names ---------------------------------------------------------------------------

    def real_name(self, model_name: str) -> str:
        if model_name.startswith(MODEL_PREFIX):
            return f"{VM_NAME}-{self.real_uid[:8]}-{model_name[len(MODEL_PREFIX):]}"
        return model_name

    def model_name(self, real_name: str) -> str:
        prefix = f"{VM_NAME}-{self.real_uid[:8]}-"
        if real_name.startswith(prefix):
            return MODEL_PREFIX + real_name[len(prefix):]
        return real_name

    def _real_uid(self, model_uid: str | None) -> str | None:
        return self.uids.get(model_uid, model_uid) if model_uid else model_uid

    def _model_uid(self, real_uid: str | None) -> str | None:
        back = {v: k for k, v in self.uids.items()}
        return back.get(real_uid, real_uid) if real_uid else real_uid

    def real_status(self, s: Status) -> dict[str, Any]:
        """A model status as the API object's ``status``, with real names and uids."""
        pending = s.pending
        if pending is not None:
            pending = pending._replace(name=self.real_name(pending.name))
        real = s._replace(pod_name=self.real_name(s.pod_name) if s.pod_name else s.pod_name,
                          pod_uid=self._real_uid(s.pod_uid), pending=pending)
        out: dict[str, Any] = encode(to_api_status(real))
        return out

    def model_status(self, raw: dict[str, Any]) -> Status:
        s = from_api_status(VirtualMachine.from_object(raw).status)
        pending = s.pending
        if pending is not None:
            pending = pending._replace(name=self.model_name(pending.name))
        return s._replace(pod_name=self.model_name(s.pod_name) if s.pod_name else s.pod_name,
                          pod_uid=self._model_uid(s.pod_uid), pending=pending)

    # ---- real reads ------------------------------------------------------------------------

    def get_vm(self) -> dict[str, Any] | None:
        try:
            raw: dict[str, Any] = self.admin_custom.get_namespaced_custom_object(
                types.GROUP, types.VERSION, self.namespace, types.PLURAL, VM_NAME)
        except ApiException as exc:
            if _status(exc) == 404:
                return None
            raise
        return raw

    def list_pods(self) -> list[dict[str, Any]]:
        resp = self.admin_core.list_namespaced_pod(
            self.namespace, label_selector=f"{types.LABEL_VM_NAME}={VM_NAME}",
            _preload_content=False)
        try:
            items: list[dict[str, Any]] = json.loads(resp.data).get("items") or []
        finally:
            resp.release_conn()
        return items

    def _pod_shape(self, raw: dict[str, Any]) -> tuple[Any, ...]:
        meta, spec, status = raw["metadata"], raw.get("spec") or {}, raw.get("status") or {}
        return (self.model_name(meta["name"]), self._model_uid(meta["uid"]), _gated(raw),
                spec.get("nodeName"), status.get("phase") or "Pending",
                meta.get("deletionTimestamp") is not None)

    # ---- the run ---------------------------------------------------------------------------

    def run(self, initial: World, trace: list[tuple[Step, World]]) -> ReplayResult:
        result = ReplayResult()
        self._setup(initial)
        self._compare(initial, "initial state")
        prev = initial
        for n, (step, after) in enumerate(trace, 1):
            where = f"step {n} ({step.text})"
            outcome = self._perform(step, prev, after, where)
            result.log.append(f"{n}. {step.text}" + (f"  [server: {outcome}]" if outcome else ""))
            self._compare(after, where)
            prev = after
        result.pods = self.list_pods()
        result.vm = self.get_vm()
        return result

    def _setup(self, w: World) -> None:
        """Create the VM and pods of the initial state, passing through its history."""
        assert w.vm is not None, "a replay starts from an existing VM"
        from tests.support.harness import create_vm

        # A scheduler nobody runs: the replay binds and runs pods itself, so a real
        # kube-scheduler and kwok nodes (when the cluster has them) must leave them alone.
        raw = create_vm(self.admin_custom.api_client, self.namespace, VM_NAME,
                        restart_policy=w.vm.restart_policy,
                        spec={"schedulerName": "neonvm-replay-manual"})
        self.real_uid = raw["metadata"]["uid"]
        self.vm_versions.append(raw)
        for p in w.pods:
            created = self._create_real(p.name, p.uid)
            assert created == "ok", created
        versions = [v for v in w.vm_hist if v is not None] + [w.vm]
        for v in versions:
            self._become(v)
        for p in w.pods:
            self._advance_pod(p)

    def _become(self, v: VM) -> None:
        """Write the real VM until it matches model version ``v`` (one version recorded)."""
        raw = self.vm_versions[-1]
        if v.finalizer != (types.FINALIZER in (raw["metadata"].get("finalizers") or [])):
            rec = VMRecord.from_raw(raw)
            raw = self.writer.put_main(rec, [types.FINALIZER] if v.finalizer else []).raw
        rec = VMRecord.from_raw(raw)
        raw = self.writer.put_status(rec, to_api_status_real(self, v.status)).raw
        self.vm_versions.append(raw)

    def _advance_pod(self, p: Pod) -> None:
        name = self.real_name(p.name)
        if not p.gated:
            self._ungate_real(name, self.uids[p.uid], None)
        if p.node is not None:
            self._run_real(name, p)
        if p.phase in ("Succeeded", "Failed"):
            self._phase_real(name, p.phase, p)
        if p.terminating:
            self.admin_core.delete_namespaced_pod(name, self.namespace)

    def _perform(self, step: Step, before: World, after: World, where: str) -> str:
        actor = step.actor.split("(")[0]
        if actor.startswith("c") and actor[1:].isdigit():
            return self._worker_step(int(actor[1:]), step, before, after, where)
        kind, args = step.kind, step.args
        if actor == "kubelet" and kind == "run":
            pod = next(p for p in after.pods if p.uid == args[1])
            self._run_real(self.real_name(args[0]), pod)
            return "bound + Running"
        if actor == "kubelet" and kind == "gone":
            self.admin_core.delete_namespaced_pod(self.real_name(args[0]), self.namespace,
                                                  grace_period_seconds=0)
            return "force-deleted (kubelet done)"
        if (actor, kind) in (("gc", "delete"), ("user", "delete-pod")):
            self.admin_core.delete_namespaced_pod(self.real_name(args[0]), self.namespace)
            return "deleted"
        if actor == "guest" and kind == "finish":
            pod = next(p for p in after.pods if p.name == args[0])
            self._phase_real(self.real_name(args[0]), args[1], pod)
            return str(args[1])
        if actor == "user" and kind == "delete-vm":
            self.admin_custom.delete_namespaced_custom_object(
                types.GROUP, types.VERSION, self.namespace, types.PLURAL, VM_NAME)
            self._record_vm()
            return "deleted"
        if actor == "user" and kind == "edit-spec":
            use = 1 + (after.vm.spec_v if after.vm else 0) % 2
            self.admin_custom.patch_namespaced_custom_object(
                types.GROUP, types.VERSION, self.namespace, types.PLURAL, VM_NAME,
                {"spec": {"guest": {"cpus": {"use": use}}}})
            self._record_vm()
            return "spec patched"
        if actor == "user" and kind == "plant":
            return self._plant_real(args[0], args[1], args[2] if len(args) > 2 else None)
        if actor == "fault" and kind == "conflict":
            vm = self.vm_versions[-1]
            bump_resource_version(self.custom.api_client, VMRecord.from_raw(vm))
            self._record_vm()
            return "resourceVersion bumped"
        return ""  # crash, failover, lock expiry: nothing on the API server

    def _record_vm(self) -> None:
        raw = self.get_vm()
        if raw is not None:
            self.vm_versions.append(raw)

    def _worker_step(self, i: int, step: Step, before: World, after: World,
                     where: str) -> str:
        kind, args = step.kind, step.args
        if kind == "observe":
            j = args[1]
            self.base[i] = self.vm_versions[-1 - j]
            return ""
        if kind == "get" and before.workers[i].pc == "getpod":
            return ""  # the pod GET after the VM read: the base stays the VM read
        if kind in ("get", "reread"):
            raw = self.get_vm()
            if raw is not None:
                self.base[i] = raw
            if kind == "reread" and args and args[0] == "noop" and raw is not None:
                # The seed's retry: write back exactly what was read.
                self.writer.put_status(VMRecord.from_raw(raw),
                                       VirtualMachine.from_object(raw).status)
            return ""
        if kind == "write":
            return self._write(i, args, before, after, where)
        if kind == "create":
            name, outcome = args[0], args[1]
            got = self._create_real(name, args[2] if outcome == "ok" else None)
            self._expect(where, outcome, got)
            return got
        if kind == "ungate":
            name, _uid, outcome = args
            target = before.workers[i].target
            assert target is not None
            rv = None if self.config.broken("ungate_without_precondition") else \
                self.pod_rvs[target]
            got = self._ungate_real(self.real_name(name), self.uids[target.uid], rv)
            self._expect(where, "ok" if outcome == "ok" else "409", got)
            return got
        if kind == "delete":
            name, uid, outcome = args
            real_uid = None if self.config.broken("delete_without_uid") else \
                self.uids.get(uid, "no-such-uid")
            got = self._delete_real(self.real_name(name), real_uid)
            self._expect(where, outcome, got)
            return got
        return ""  # lock, list, prelist, vmread, sweep: reads or the locks' etcd

    def _write(self, i: int, args: tuple[Any, ...], before: World, after: World,
               where: str) -> str:
        action, outcome = args[0], args[1]
        if outcome in ("noop", "fenced"):
            return "not sent (mutation declined)"
        status_write = action[0] not in ("AddFinalizer", "RemoveFinalizer")
        base = self.base[i] if outcome != "404" else self.vm_versions[-1]
        rec = VMRecord.from_raw(base)
        target = after.vm if outcome == "ok" else before.vm
        try:
            if status_write:
                assert target is not None
                raw = self.writer.put_status(rec, to_api_status_real(self, target.status)).raw
            else:
                keep = target is not None and target.finalizer
                raw = self.writer.put_main(rec, [types.FINALIZER] if keep else []).raw
        except ApiException as exc:
            got = str(_status(exc))
            self._expect(where, outcome, got)
            return got
        self._expect(where, outcome, "ok")
        if after.vm is None:
            return "ok: VM removed"
        # The answer is the worker's next observation of the VM (the driver's
        # _seen_by_write): a write decided from it carries its resourceVersion.
        self.base[i] = raw
        if not self.vm_versions or raw["metadata"]["resourceVersion"] != \
                self.vm_versions[-1]["metadata"]["resourceVersion"]:
            self.vm_versions.append(raw)
        return "ok"

    # ---- real pod writes --------------------------------------------------------------------

    def _create_real(self, model_name: str, model_uid: str | None) -> str:
        raw_vm = self.get_vm() or self.vm_versions[-1]
        vm = VirtualMachine.from_object(raw_vm)
        seq = int(model_name[len(MODEL_PREFIX):])
        plan = Plan(self.real_name(model_name), seq, 0, 0, vm.generation)
        manifest = podspec.runner_pod(vm, _pending(plan))
        try:
            created = self.core.create_namespaced_pod(self.namespace, manifest)
        except ApiException as exc:
            if _status(exc) == 409:
                return "exists"
            raise
        if model_uid is not None:
            self.uids[model_uid] = created.metadata.uid
        return "ok"

    def _plant_real(self, model_name: str, model_uid: str,
                    fence: tuple[int, int] | None = None) -> str:
        """A runner pod without the fence annotations (the user's plant), or (``fence``:
        the model's plant with an older fence) with annotations of epoch 0 and token 0,
        below any real plan's. Created with the controller's identity: the admission
        policy lets no one else create one."""
        raw_vm = self.get_vm() or self.vm_versions[-1]
        vm = VirtualMachine.from_object(raw_vm)
        seq = int(model_name[len(MODEL_PREFIX):])
        plan = Plan(self.real_name(model_name), seq, 0, 0, vm.generation)
        manifest = podspec.runner_pod(vm, _pending(plan))
        for key in (types.ANNOTATION_EPOCH, types.ANNOTATION_TOKEN):
            manifest["metadata"]["annotations"].pop(key, None)
            if fence is not None:
                manifest["metadata"]["annotations"][key] = "0"
        created = self.core.create_namespaced_pod(self.namespace, manifest)
        self.uids[model_uid] = created.metadata.uid
        return "planted"

    def _ungate_real(self, name: str, uid: str, rv: str | None) -> str:
        try:
            pod = self.admin_core.read_namespaced_pod(name, self.namespace)
        except ApiException as exc:
            if _status(exc) == 404:
                return "409"  # the model does not tell 404 from 409 for the ungate
            raise
        gates = [g.name for g in (pod.spec.scheduling_gates or [])]
        index = gates.index(types.SCHEDULING_GATE) if types.SCHEDULING_GATE in gates else 0
        patch: list[dict[str, Any]] = []
        if rv is not None:
            patch += [
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                {"op": "test", "path": f"/spec/schedulingGates/{index}/name",
                 "value": types.SCHEDULING_GATE},
            ]
        patch.append({"op": "remove", "path": f"/spec/schedulingGates/{index}"})
        try:
            self.core.patch_namespaced_pod(name, self.namespace, patch)
        except ApiException as exc:
            if _status(exc) in (404, 409, 422):
                return "409"
            raise
        return "ok"

    def _delete_real(self, name: str, uid: str | None) -> str:
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)) \
            if uid else None
        try:
            self.core.delete_namespaced_pod(name, self.namespace, body=body)
        except ApiException as exc:
            if _status(exc) in (404, 409):
                return str(_status(exc))
            raise
        return "ok"

    def _run_real(self, name: str, pod: Pod) -> None:
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}}
        self.admin_core.create_namespaced_pod_binding(name, self.namespace, binding,
                                                      _preload_content=False)
        self._phase_real(name, "Running", pod)

    def _phase_real(self, name: str, phase: str, pod: Pod) -> None:
        status: dict[str, Any] = {"phase": phase}
        if pod.ip:
            status.update(podIP=pod.ip, podIPs=[{"ip": pod.ip}])
        self.admin_core.patch_namespaced_pod_status(name, self.namespace, {"status": status})

    # ---- checks -----------------------------------------------------------------------------

    def _expect(self, where: str, model: str, real: str) -> None:
        if model == "exists":
            model = "exists"
        if model != real:
            raise ReplayMismatch(f"{where}: the model says {model}, the API server said {real}")

    def _compare(self, w: World, where: str) -> None:
        raw = self.get_vm()
        if (raw is None) != (w.vm is None):
            raise ReplayMismatch(f"{where}: VM {'gone' if raw is None else 'exists'} on the "
                                 f"server, {'exists' if raw is None else 'gone'} in the model")
        if raw is not None and w.vm is not None:
            real = self.model_status(raw)
            model = w.vm.status
            if real != model:
                raise ReplayMismatch(f"{where}: VM status differs\n  model:  {model}\n"
                                     f"  server: {real}")
            meta = raw["metadata"]
            if (types.FINALIZER in (meta.get("finalizers") or [])) != w.vm.finalizer:
                raise ReplayMismatch(f"{where}: finalizer differs")
            if (meta.get("deletionTimestamp") is not None) != w.vm.deleting:
                raise ReplayMismatch(f"{where}: deletionTimestamp differs")
        real_pods = self.list_pods()
        got = sorted(self._pod_shape(p) for p in real_pods)
        want = sorted((p.name, p.uid, p.gated, p.node, p.phase, p.terminating) for p in w.pods)
        if got != want:
            raise ReplayMismatch(f"{where}: pods differ\n  model:  {want}\n  server: {got}")
        by_uid = {p["metadata"]["uid"]: p["metadata"]["resourceVersion"] for p in real_pods}
        for p in w.pods:
            self.pod_rvs[p] = by_uid[self.uids[p.uid]]


def to_api_status_real(r: Replayer, s: Status) -> Any:
    """The model status with real names/uids, as a :class:`VirtualMachineStatus`."""
    from neonvm.api.schema import decode
    from neonvm.api.types import VirtualMachineStatus

    return decode(VirtualMachineStatus, r.real_status(s))


def _pending(plan: Plan) -> Any:
    from neonvm.api.types import PendingPod

    return PendingPod(name=plan.name, plan_seq=plan.plan_seq, token=plan.token,
                      epoch=plan.epoch, generation=plan.generation)
