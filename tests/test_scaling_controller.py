"""Live scaling end to end: the controller scales a real guest through its runner.

Real kube-apiserver and etcd (the session's local cluster), the reconciler under the
controller's identity, and a real ``neonvm-runner`` process booting the tiny test guest
under QEMU (TCG). Runner pods in the local cluster are never run by a kubelet (their
nodes are simulated), so the test plays the kubelet, honestly and no more: it starts the
runner with exactly what the pod carries (the spec annotation as the spec file, the
pod's environment: fence floor, CPU scaling mode; the VM's token Secret as the token
file), on the VM's ``runnerPort`` on loopback, and reports the pod Running with
``podIP: 127.0.0.1``. The controller then reaches the runner as it would in a cluster:
``http://<podIP>:<runnerPort>/scale`` with the Secret's bearer token.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm import kube
from neonvm.api import times, types
from neonvm.api.scale_protocol import pod_token
from neonvm.controller import actions as act
from neonvm.controller import decide as d
from neonvm.controller import looks, reasons
from neonvm.controller.reconciler import Reconciler
from neonvm.controller.scaling import USAGE_ANNOTATION
from tests.support import shipped_reconciler, wait_for
from tests.support.authority import StaticAuthority
from tests.support.harness import create_vm, get_vm, runner_pods
from tests.support.runner import free_port
from tests.support.runner_scaling import guest_sees
from tests.support.scaling_controller import (
    NOWHERE,
    OLD,
    _running_on,
    set_use,
    settle,
    start_runner_for,
    status_of,
    vm_path,
)

pytestmark = pytest.mark.cluster

GIB = 1 << 30
NEW = StaticAuthority(epoch=2, token=11)


def put_scale(port: int, token: str, body: dict[str, Any]) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/scale", method="PUT", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_the_controller_scales_a_running_guest_live_under_its_fence(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        test_guest: Any, tmp_path: Path) -> None:
    port = free_port()
    root = tmp_path / "root.raw"  # a file on the "node": the runner boots from it as it is
    with root.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(root)], check=True)
    create_vm(api, namespace, "live", spec={
        "nodeSelector": NOWHERE, "runnerPort": port, "terminationGracePeriodSeconds": 10,
        "cpuScalingMode": "SysfsScaling",
        # max 3 vCPUs: the CPU request (use) stays below the limit (max), so the pod stays
        # Burstable and an in-place resize is allowed (it may not change the QoS class).
        "guest": {"cpus": {"min": 1, "max": 3, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": str(root)}, "kernelImage": str(test_guest.kernel),
                  "initrdImage": str(test_guest.initrd),
                  "appendKernelCmdline": "quiet neonvm.test=powerdown"}})
    key = f"{namespace}/live"
    reconciler = shipped_reconciler(controller_api)
    settle(reconciler, key, OLD)
    (pod,) = runner_pods(api, namespace, "live")
    uid = pod.metadata.uid
    env = {e.name: e.value for e in pod.spec.containers[0].env or []}
    assert env["NEONVM_CPU_SCALING_MODE"] == "SysfsScaling"

    # The token Secret the controller created before the pod, owned by the VM.
    raw = get_vm(api, namespace, "live")
    assert raw is not None
    secret = client.CoreV1Api(api).read_namespaced_secret(
        raw["status"]["scalingTokenSecret"], namespace)
    assert [ref.uid for ref in secret.metadata.owner_references] == [raw["metadata"]["uid"]]
    assert secret.metadata.uid == raw["status"]["scalingTokenSecretUID"]
    token = base64.b64decode(secret.data["token"]).decode()

    runner = start_runner_for(pod, token, port, tmp_path)
    try:
        first = runner.wait_ready()
        qemu_pid = first["qemuPid"]
        boot = guest_sees(runner, cpus=1)
        boot_kb = boot["guestMemTotalKb"]
        client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
        settle(reconciler, key, OLD)
        status = status_of(api, namespace, "live")
        assert (status["phase"], status["cpus"], status["memorySize"]) == ("Running", 1, "1Gi")

        # 1 -> 2 vCPUs, 1 -> 2 GiB: planned, applied by the runner, committed.
        set_use(api, namespace, "live", 2, 2)
        result = settle(reconciler, key, OLD)
        assert isinstance(result.action, act.Done), result
        status = status_of(api, namespace, "live")
        assert (status["phase"], status["cpus"], status["memorySize"]) == ("Running", 2, "2Gi")
        assert status["scaleSeq"] == 1 and "pendingScale" not in status
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert (scaling["status"], scaling["reason"]) == ("False", "ScalingDone")
        guest_sees(runner, cpus=2, mem_kb=(boot_kb + GIB // 1024, boot_kb + GIB // 1024))
        annotated = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, namespace)
        assert json.loads(annotated.metadata.annotations[USAGE_ANNOTATION]) == {
            "cpu": "2", "memory": "2Gi"}
        # In-place resize: the runner container's CPU request follows cpus.use.
        assert annotated.spec.containers[0].resources.requests["cpu"] == "2"

        # A new leader scales back: 2 -> 1 vCPUs (the guest offlines one), 2 -> 1 GiB.
        set_use(api, namespace, "live", 1, 1)
        result = settle(reconciler, key, NEW)
        assert isinstance(result.action, act.Done), result
        status = status_of(api, namespace, "live")
        assert (status["cpus"], status["memorySize"], status["scaleSeq"]) == (1, "1Gi", 2)
        guest_sees(runner, cpus=1, mem_kb=(boot_kb, boot_kb))
        resized = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, namespace)
        assert resized.spec.containers[0].resources.requests["cpu"] == "1"
        assert json.loads(resized.metadata.annotations[USAGE_ANNOTATION]) == {
            "cpu": "1", "memory": "1Gi"}

        # The bearer is good for this pod only: HMAC(secret, pod uid). The Secret's token
        # itself, or the token of another pod (the old pod's IP reused), is refused.
        newer = {"cpus": 2, "memorySlots": 2, "fence": {"epoch": 9, "token": 0, "seq": 9}}
        assert put_scale(port, token, newer) == 401
        assert put_scale(port, pod_token(token.encode(), "uid-of-another-pod"), newer) == 401
        # The deposed leader resends its own recorded plan (2 vCPUs, 2 GiB, fence 1/10/1):
        # the runner refuses it, and the guest keeps the newest size.
        assert put_scale(port, pod_token(token.encode(), uid), {
            "cpus": 2, "memorySlots": 2, "fence": {"epoch": 1, "token": 10, "seq": 1}}) == 409
        code, body = runner.get("/scale")
        report = json.loads(body)
        assert code == 200 and report["lastApplied"]["fence"] == {"epoch": 2, "token": 11,
                                                                  "seq": 2}
        assert (report["guest"]["cpusOnline"], report["qemu"]["memorySlots"]) == (1, 1)

        # One pod and one QEMU throughout.
        assert [p.metadata.uid for p in runner_pods(api, namespace, "live")] == [uid]
        assert runner.status() is not None and runner.qemu_pids == {qemu_pid}
    finally:
        runner.cleanup()
    wait_for(lambda: runner.proc.poll() is not None, timeout=30, what="runner gone")


class RefusingRunner:
    """Stands in for a runner whose pod cannot take a size (its bounds differ, or it was
    built without live scaling): GET /scale answers its fence floor and boot size, every
    PUT /scale answers ``code`` (200: taken, its fence and size reported from then on).
    (A real runner gives these answers in ``tests/test_runner_scaling.py``; booting one
    here would only add a guest.)"""

    def __init__(self, code: int, reason: str = "",
                 answer: dict[str, Any] | None = None) -> None:
        import http.server
        import threading

        self.puts = 0
        self.gets = 0
        self.size: dict[str, Any] = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}
        """What GET /scale reports QEMU has (a test may change it: a PUT landed)."""
        self.fence: dict[str, int] = {"epoch": 0, "token": 0, "seq": 0}
        self.pod_uid: str | None = None
        """The pod it says it runs in (GET /scale's podUid); None: not said."""
        self.removals: list[str] = []
        """What GET /scale reports as pendingRemovals."""
        answer = answer or {"error": f"refused ({code})"}
        if reason:
            answer["reason"] = reason
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                outer.gets += 1
                self._answer(200, {"mode": "QmpScaling", "lastApplied": {
                    "fence": outer.fence}, "qemu": outer.size, "podUid": outer.pod_uid,
                    "pendingRemovals": outer.removals})

            def do_PUT(self) -> None:
                outer.puts += 1
                asked = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if code != 200:
                    self._answer(code, answer)
                    return
                # Taken: a runner that answers 200 has applied it, and reports so.
                asked_doc = json.loads(asked)
                outer.fence = asked_doc["fence"]
                outer.size = {"vcpus": asked_doc["cpus"],
                              "memorySlots": asked_doc["memorySlots"],
                              "memoryBytes": asked_doc["memorySlots"] * GIB}
                self._answer(200, {"mode": "QmpScaling", "lastApplied": {
                    "fence": outer.fence}, "qemu": outer.size, "podUid": outer.pod_uid,
                    "pendingRemovals": outer.removals})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(("code", "secret", "reason"), [
    (400, "keep", reasons.SCALING_NEEDS_RESTART),  # bounds changed after boot
    (401, "keep", reasons.SCALING_NEEDS_RESTART),  # the pod was built without live scaling
    # A wrong token, refused for longer than a token rotation takes (here: at once).
    (401, "wrong", reasons.SCALING_NEEDS_RESTART),
    (200, "delete", reasons.SCALING_DISABLED),     # no token for the controller (no RBAC, ...)
    # F7: a Secret planted under the recorded name (owned by the VM, but not the one the
    # controller created) is never used: its token is not sent anywhere.
    (200, "plant", reasons.SCALING_DISABLED),
])
def test_a_scaling_refused_for_good_ends_in_a_condition_not_a_retry_loop(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        code: int, secret: str, reason: str) -> None:
    from neonvm.api.scale_protocol import NO_TOKEN

    runner = RefusingRunner(code, NO_TOKEN if (code, secret) == (401, "keep") else "")
    try:
        reconciler = _running_on(runner, api, controller_api, namespace, "stuck",
                                 token_sync_seconds=0.0 if secret == "wrong" else 3600.0)
        key = f"{namespace}/stuck"
        if secret in ("delete", "plant"):
            raw = get_vm(api, namespace, "stuck")
            assert raw is not None
            name = raw["status"]["scalingTokenSecret"]
            core = client.CoreV1Api(api)
            core.delete_namespaced_secret(name, namespace)
            if secret == "plant":
                wait_for(lambda: not any(s.metadata.name == name for s in
                                         core.list_namespaced_secret(namespace).items),
                         timeout=30, what="the Secret gone")
                core.create_namespaced_secret(namespace, {"metadata": {
                    "name": name, "ownerReferences": [{
                        "apiVersion": types.API_VERSION, "kind": types.KIND, "name": "stuck",
                        "uid": raw["metadata"]["uid"]}]},
                    "stringData": {"token": "planted"}})
        set_use(api, namespace, "stuck", 2, 2)
        result = settle(reconciler, key, OLD)
        assert isinstance(result.action, act.Done) and result.stuck is None, result
        status = status_of(api, namespace, "stuck")
        assert status["phase"] == "Running" and "pendingScale" not in status, status
        assert (status["cpus"], status["memorySize"]) == (1, "1Gi")
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert (scaling["status"], scaling["reason"]) == ("False", reason), scaling
        assert not any(c["type"] == "Degraded" and c["status"] == "True"
                       for c in status["conditions"]), status["conditions"]
        puts = runner.puts
        assert puts <= (0 if secret in ("delete", "plant") else 1)
        # Nothing more is tried for this spec ...
        assert isinstance(settle(reconciler, key, OLD).action, act.Done)
        assert runner.puts == puts and status_of(api, namespace, "stuck")["scaleSeq"] == 1
        # ... and a new spec tries again.
        set_use(api, namespace, "stuck", 1, 2)
        settle(reconciler, key, OLD)
        assert status_of(api, namespace, "stuck")["scaleSeq"] == 2
    finally:
        runner.close()


@pytest.mark.parametrize(("code", "answer", "outcome"), [
    # Review S6: a wrong-token 401 (the rotated Secret not yet on the pod).
    (401, {"error": "wrong bearer token"}, "token_refused"),
    # Review R5: the guest refused an unplug; the runner says so at once. Asking again
    # may succeed (the guest may free the memory), and a newer spec supersedes the plan.
    (504, {"error": "refused: the guest refused to eject dimm-slot1; it stays plugged",
           "refused": ["dimm-slot1"]}, "guest_refused"),
])
def test_an_answer_that_may_change_keeps_the_plan(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        code: int, answer: dict[str, Any], outcome: str) -> None:
    # Asked again after the VM's stuck backoff, never twice in one reconcile (protocol
    # review F1: the runner chooses how long any answer takes): the plan stays, no
    # ScalingNeedsRestart for the generation. A guest's refusal also ends the reconcile
    # at once (review scalefix2 F3: each ask makes the guest offline the memory again).
    from neonvm.controller.reasons import NOT_TAKING_EFFECT

    runner = RefusingRunner(code, answer=answer)
    try:
        reconciler = _running_on(runner, api, controller_api, namespace, "rotating",
                                 token_sync_seconds=3600.0)
        key = f"{namespace}/rotating"
        set_use(api, namespace, "rotating", 2, 2)
        result = reconciler.reconcile(key, OLD, direct_first=True)
        assert result.stuck == f"ApplyScale{NOT_TAKING_EFFECT}", result
        assert runner.puts == 1, runner.puts
        status = status_of(api, namespace, "rotating")
        assert status["pendingScale"]["seq"] == 1, status
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert scaling["status"] == "True", scaling
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert f"({outcome}: " in degraded["message"], degraded
    finally:
        runner.close()


def test_a_late_older_plan_never_puts_its_size_back_on_the_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Issue 19 review F6: the usage annotation (and the CPU request) of plan #2 must not be
    # overwritten by a late apply of plan #1 (a deposed leader, a slow PUT /scale).
    from loguru import logger

    from neonvm.controller.observe import pod_view
    from neonvm.controller.scaling import SCALE_FENCE_ANNOTATION, RunnerScaling

    create_vm(api, namespace, "late", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})
    settle(shipped_reconciler(controller_api), f"{namespace}/late", OLD)
    (pod,) = runner_pods(api, namespace, "late")
    raw = get_vm(api, namespace, "late")
    assert raw is not None
    vm = types.VirtualMachine.from_object(raw)
    view = pod_view(api.sanitize_for_serialization(pod))
    scaling = RunnerScaling(controller_api)

    def plan(seq: int, cpus: int, epoch: int = 1) -> types.PendingScale:
        return types.PendingScale(cpus=cpus, memory_slots=cpus, seq=seq, epoch=epoch,
                                  token=10, pod_name=pod.metadata.name,
                                  pod_uid=pod.metadata.uid, generation=1)

    def annotations() -> dict[str, str]:
        read = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, namespace)
        return dict(read.metadata.annotations or {})

    scaling._tell_kubernetes(vm, view, 2 * GIB, plan(2, 2), logger)
    assert json.loads(annotations()[USAGE_ANNOTATION]) == {"cpu": "2", "memory": "2Gi"}
    assert annotations()[SCALE_FENCE_ANNOTATION] == "1,10,2"
    scaling._tell_kubernetes(vm, view, GIB, plan(1, 1), logger)  # late: plan #1
    assert json.loads(annotations()[USAGE_ANNOTATION]) == {"cpu": "2", "memory": "2Gi"}
    scaling._tell_kubernetes(vm, view, GIB, plan(3, 1), logger)  # newer: taken
    assert json.loads(annotations()[USAGE_ANNOTATION]) == {"cpu": "1", "memory": "1Gi"}
    assert annotations()[SCALE_FENCE_ANNOTATION] == "1,10,3"


def test_a_late_plan_carrying_an_older_fraction_never_puts_it_back_on_the_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Issue 31: a cpus.use changed within the same whole vCPUs is a plan of its own, so
    # the fraction the pod's annotations carry (the scheduler plugin's, the runner's
    # quota) is fenced like any size: plan #1's late write, from a VM read at 500m,
    # cannot undo plan #2's 750m.
    from loguru import logger

    from neonvm.controller.observe import pod_view
    from neonvm.controller.podspec import ANNOTATION_RESOURCES
    from neonvm.controller.scaling import RunnerScaling

    create_vm(api, namespace, "frac", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": "250m", "max": 2, "use": "250m"},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})
    settle(shipped_reconciler(controller_api), f"{namespace}/frac", OLD)
    (pod,) = runner_pods(api, namespace, "frac")
    view = pod_view(api.sanitize_for_serialization(pod))
    scaling = RunnerScaling(controller_api)

    def at(use: str) -> types.VirtualMachine:
        kube.request(api, "PATCH", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/"
                     f"{namespace}/{types.PLURAL}/frac", [
                         {"op": "replace", "path": "/spec/guest/cpus/use", "value": use}],
                     content_type="application/json-patch+json")
        raw = get_vm(api, namespace, "frac")
        assert raw is not None
        return types.VirtualMachine.from_object(raw)

    def plan(seq: int, vm: types.VirtualMachine) -> types.PendingScale:
        return types.PendingScale(cpus=1, memory_slots=1, seq=seq, epoch=1, token=10,
                                  pod_name=pod.metadata.name, pod_uid=pod.metadata.uid,
                                  generation=vm.generation)

    def carried() -> tuple[str, str]:
        read = client.CoreV1Api(api).read_namespaced_pod(pod.metadata.name, namespace)
        annotations = read.metadata.annotations or {}
        return (json.loads(annotations[ANNOTATION_RESOURCES])["cpus"]["use"],
                json.loads(annotations[USAGE_ANNOTATION])["cpu"])

    old = at("500m")
    new = at("750m")
    scaling._tell_kubernetes(new, view, GIB, plan(2, new), logger)
    assert carried() == ("750m", "750m")
    scaling._tell_kubernetes(old, view, GIB, plan(1, old), logger)  # late: a deposed leader
    assert carried() == ("750m", "750m")


def test_a_put_that_lands_after_its_plan_was_dropped_is_adopted_into_status(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Review S5: plan #1 (2 vCPUs, 2 slots) is dropped because the controller cannot get
    # the token (ScalingDisabled: no new plan for this spec). A PUT of plan #1 sent before
    # (by a deposed leader, or this controller's own request that timed out) then lands:
    # the guest has 2/2. Status must come to say so; before the fix nobody looked again.
    runner = RefusingRunner(200)
    try:
        reconciler = _running_on(runner, api, controller_api, namespace, "late",
                                 token_sync_seconds=3600.0)
        key = f"{namespace}/late"
        (pod,) = runner_pods(api, namespace, "late")
        runner.pod_uid = pod.metadata.uid
        raw = get_vm(api, namespace, "late")
        assert raw is not None
        client.CoreV1Api(api).delete_namespaced_secret(raw["status"]["scalingTokenSecret"],
                                                       namespace)
        gets = runner.gets
        set_use(api, namespace, "late", 2, 2)
        assert isinstance(settle(reconciler, key, OLD).action, act.Done)
        status = status_of(api, namespace, "late")
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert (scaling["status"], scaling["reason"]) == ("False", reasons.SCALING_DISABLED)
        assert (status["cpus"], status["memorySize"], status["scaleSeq"]) == (1, "1Gi", 1)
        assert runner.puts == 0 and runner.gets > gets  # looked at after the drop
        # The late PUT of plan #1 lands.
        runner.fence = {"epoch": OLD.epoch, "token": OLD.token, "seq": 1}
        runner.size = {"vcpus": 2, "memorySlots": 2, "memoryBytes": 2 * GIB}
        assert isinstance(settle(reconciler, key, OLD).action, act.Done)
        status = status_of(api, namespace, "late")
        assert (status["cpus"], status["memorySize"]) == (2, "2Gi"), status
        assert "pendingScale" not in status and status["scaleSeq"] == 1, status
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert scaling["reason"] == reasons.SCALING_DISABLED, scaling  # still refused for it
        # A runner that does not name the pod (another pod at a reused IP) is not adopted.
        runner.pod_uid = "some-other-pod"
        runner.size = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}
        settle(reconciler, key, OLD)
        status = status_of(api, namespace, "late")
        assert (status["cpus"], status["memorySize"]) == (2, "2Gi"), status
    finally:
        runner.close()


def test_a_conflict_on_the_pods_size_annotation_or_resize_is_redone(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Review S9: the pod's resourceVersion moves with any update (the kubelet's status
    # updates too), so a 409 on the usage annotation or on the in-place resize is not
    # always a newer plan's write. It is redone from a fresh read (the fence check on
    # the fresh pod keeps a redo from overwriting a newer plan's size).
    from loguru import logger

    from neonvm.controller.observe import pod_view
    from neonvm.controller.scaling import SCALE_FENCE_ANNOTATION, RunnerScaling

    create_vm(api, namespace, "busy", spec={
        "nodeSelector": NOWHERE,
        # max 3: the request (use) stays below the limit, the pod Burstable (resizable).
        "guest": {"cpus": {"min": 1, "max": 3, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})
    settle(shipped_reconciler(controller_api), f"{namespace}/busy", OLD)
    (pod,) = runner_pods(api, namespace, "busy")
    core = client.CoreV1Api(api)
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    set_use(api, namespace, "busy", 2, 2)
    raw = get_vm(api, namespace, "busy")
    assert raw is not None
    vm = types.VirtualMachine.from_object(raw)
    view = pod_view(api.sanitize_for_serialization(pod))
    scaling = RunnerScaling(controller_api)
    plan = types.PendingScale(cpus=2, memory_slots=2, seq=1, epoch=1, token=10,
                              pod_name=pod.metadata.name, pod_uid=pod.metadata.uid,
                              generation=vm.generation)
    updates = 0

    def kubelet_update() -> None:
        nonlocal updates
        updates += 1
        core.patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"message": f"kubelet update {updates}"}})

    real_request = kube.request
    pod_path = f"/api/v1/namespaces/{namespace}/pods/{pod.metadata.name}"

    def request(api: Any, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        answer = real_request(api, method, path, *args, **kwargs)
        if (method, path, updates) in (("GET", pod_path, 0), ("PATCH", pod_path, 1)):
            # Between the first read and the annotation patch, then between the
            # annotation patch and the resize.
            kubelet_update()
        return answer

    monkeypatch.setattr(kube, "request", request)
    scaling._tell_kubernetes(vm, view, 2 * GIB, plan, logger)
    read_back = core.read_namespaced_pod(pod.metadata.name, namespace)
    annotations = read_back.metadata.annotations or {}
    assert annotations.get(SCALE_FENCE_ANNOTATION) == "1,10,1", annotations
    assert json.loads(annotations[USAGE_ANNOTATION]) == {"cpu": "2", "memory": "2Gi"}
    assert read_back.spec.containers[0].resources.requests["cpu"] == "2"
    assert updates == 2  # each patch met a conflict once


CRD_PATH = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{types.PLURAL}.{types.GROUP}"


@contextlib.contextmanager
def bound_rules_lifted(api: client.ApiClient) -> Iterator[None]:
    """The CRD without its rules that make ``cpus.max``/``memorySlots.max`` immutable,
    for the duration (as a VM stored before those rules existed); restored after."""
    original = kube.request(api, "GET", CRD_PATH)
    lifted = copy.deepcopy(original)
    guest = lifted["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]["guest"]
    guest["x-kubernetes-validations"] = [
        r for r in guest.get("x-kubernetes-validations", [])
        if "max is immutable" not in r.get("message", "")]
    kube.request(api, "PUT", CRD_PATH, lifted)
    try:
        yield
    finally:
        current = kube.request(api, "GET", CRD_PATH)
        original["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        kube.request(api, "PUT", CRD_PATH, original)


def _patched(api: client.ApiClient, path: str, ops: list[dict[str, Any]]) -> bool:
    try:
        kube.request(api, "PATCH", path, ops, content_type="application/json-patch+json")
    except client.ApiException as exc:
        if exc.status == 422 and "immutable" in str(exc.body):
            return False  # the CRD change has not reached the validator yet
        raise
    return True


def test_a_pod_built_without_live_scaling_needs_a_restart_not_rbac(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Review S10 (a): a VM created with equal bounds gets no token Secret, and its pod
    # no token mount. Its bounds widened later, a plan cannot reach that pod's runner;
    # the reason is that the pod needs a restart, not that RBAC may be off.
    from neonvm.controller.scaling import RunnerScaling

    runner = RefusingRunner(200)
    try:
        create_vm(api, namespace, "fixed", spec={
            "nodeSelector": NOWHERE,
            "guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                      "memorySlots": {"min": 1, "max": 1, "use": 1},
                      "memorySlotSize": "1Gi", "rootDisk": {"image": "/nonexistent.raw"}}})
        key = f"{namespace}/fixed"
        reconciler = shipped_reconciler(controller_api, scaling=RunnerScaling(
            controller_api, address=lambda vm, pod: f"http://127.0.0.1:{runner.port}"))
        settle(reconciler, key, OLD)
        (pod,) = runner_pods(api, namespace, "fixed")
        client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
        settle(reconciler, key, OLD)
        assert "scalingTokenSecret" not in status_of(api, namespace, "fixed")
        # The bounds are immutable now (NeonVM's rule); a VM stored before that rule
        # existed can still carry widened bounds, so the rule is lifted for the widen.
        widen = [{"op": "replace", "path": "/spec/guest/cpus/max", "value": 2},
                 {"op": "replace", "path": "/spec/guest/memorySlots/max", "value": 2}]
        with bound_rules_lifted(api):
            wait_for(lambda: _patched(api, f"{vm_path(namespace)}/fixed", widen), 30,
                     what="the widened bounds are stored")
        set_use(api, namespace, "fixed", 2, 2)
        assert isinstance(settle(reconciler, key, OLD).action, act.Done)
        status = status_of(api, namespace, "fixed")
        scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
        assert (scaling["status"], scaling["reason"]) == ("False", reasons.SCALING_NEEDS_RESTART), \
            scaling
        assert "built without live scaling" in scaling["message"], scaling
        assert runner.puts == 0 and "pendingScale" not in status
        # Review lookfix L3: no PUT can reach that runner, so the drop asks for no look
        # (one that nothing could ever end).
        assert "scaleLookPodUID" not in status and "scaleLookSince" not in status, status
    finally:
        runner.close()


def test_a_removal_pending_after_a_drop_is_looked_at_past_the_window_until_it_settles(
        ) -> None:
    # Review S5, the unplug version: the dropped plan's PUT started an unplug the guest
    # has not finished when the window after the drop ends (LATE_PUT_SECONDS). Status
    # asks for the look (scaleLookPodUID, set by the drop), so the controller keeps
    # asking GET /scale until the runner reports it settled, then adopts the size, and
    # stops asking once that write has landed. (The observations are built by hand: the
    # clock is the only thing that differs from the cluster tests above.)
    import datetime as dt

    from neonvm.api.types import Condition
    from neonvm.controller.action_table import status_mutation
    from neonvm.controller.observe import Snapshot
    from neonvm.controller.scaling import RunnerScaling
    from tests.support.scaling_decide import LEASE, running
    from tests.support.scaling_decide import vm as make_vm

    runner = RefusingRunner(200)
    try:
        scaling = RunnerScaling(client.ApiClient(),
                                address=lambda vm, pod: f"http://127.0.0.1:{runner.port}")
        dropped_at = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
        v = make_vm(cpus_use=1, slots_use=1, status_slots=2, scale_seq=1)
        v.status.conditions.append(Condition(
            type=reasons.SCALING_CONDITION, status="False",  # type: ignore[arg-type]
            reason=reasons.SCALING_DISABLED, message="dropped", observed_generation=2,
            last_transition_time=times.format_microtime(dropped_at)))
        v.status.scale_look_pod_uid = "uid-1"  # as the drop wrote it, with its time
        v.status.scale_look_since = times.format_microtime(dropped_at)
        runner.pod_uid = "uid-1"
        runner.size = {"vcpus": 1, "memorySlots": 2, "memoryBytes": 2 * GIB}

        def look(seconds: float, removals: list[str]) -> act.Observation:
            runner.removals = removals
            obs = act.Observation(vm=v, pods=(running(),), lease=LEASE, direct=True,
                                now=dropped_at + dt.timedelta(seconds=seconds))
            return scaling.observe(Snapshot(obs=obs, record=None)).obs

        gets = runner.gets
        seen = look(10, ["dimm-slot1"])  # in the window: asked, the unplug pending
        assert runner.gets == gets + 1 and seen.runner is not None
        assert isinstance(d.decide(seen), act.Done)  # nothing settled to adopt
        seen = look(looks.LATE_PUT_SECONDS + 60, ["dimm-slot1"])  # past it: still asked
        assert runner.gets == gets + 2 and seen.runner is not None
        runner.size = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}  # ejected
        seen = look(looks.LATE_PUT_SECONDS + 120, [])
        assert runner.gets == gets + 3
        action = d.decide(seen)
        assert isinstance(action, act.CommitScale) and action.adopt, action
        assert (action.vcpus, action.memory_bytes) == (1, GIB)
        look(looks.LATE_PUT_SECONDS + 180, [])  # the write has not landed: asked again
        assert runner.gets == gets + 4
        written = status_mutation(action, LEASE)(v)  # the adopting write lands
        assert written is not None and written.scale_look_pod_uid is None
        v.status = written
        look(looks.LATE_PUT_SECONDS + 240, [])  # settled and written: no longer asked
        assert runner.gets == gets + 4
    finally:
        runner.close()


class FailingStatusWrites:
    """The cluster as the reconciler writes VMs through it, with the next ``/status``
    write failing (503, the API server unavailable) once :attr:`armed`."""

    def __init__(self, cluster: Any) -> None:
        self.cluster = cluster
        self.armed = False
        self.failed = 0

    def put_status(self, record: Any, status: types.VirtualMachineStatus) -> Any:
        if self.armed:
            self.armed = False
            self.failed += 1
            raise client.ApiException(status=503, reason="Service Unavailable")
        return self.cluster.put_status(record, status)

    def put_main(self, record: Any, finalizers: list[str]) -> Any:
        return self.cluster.put_main(record, finalizers)


def _past_the_window(reconciler: Reconciler) -> None:
    """From now on ``reconciler`` observes with a clock past the late-PUT window of any
    drop made so far (what a controller sees LATE_PUT_SECONDS later)."""
    import datetime as dt

    from neonvm.controller.observe import DirectReader

    skew = dt.timedelta(seconds=looks.LATE_PUT_SECONDS + 60)
    reconciler.ctx.reader = DirectReader(reconciler.cluster,
                                         clock=lambda: dt.datetime.now(dt.UTC) + skew)


def _dropped_with_an_unplug_pending(api: client.ApiClient, controller_api: client.ApiClient,
                                    namespace: str, name: str,
                                    runner: RefusingRunner) -> tuple[Reconciler, str, str]:
    """A VM scaled to 2/2 (plan #1 committed), then asked for 1/1: plan #2 is dropped
    (ScalingDisabled: the token Secret is gone), and a PUT of it sent before lands
    late: the runner applied its fence, unplugged a vCPU and started a DIMM unplug
    the guest has not finished. The controller has looked (GET /scale) within the
    window and seen the removal pending. (reconciler, key, the pod's uid)."""
    reconciler = _running_on(runner, api, controller_api, namespace, name,
                             token_sync_seconds=3600.0)
    key = f"{namespace}/{name}"
    (pod,) = runner_pods(api, namespace, name)
    runner.pod_uid = pod.metadata.uid
    set_use(api, namespace, name, 2, 2)  # plan #1's PUT: taken
    assert isinstance(settle(reconciler, key, OLD).action, act.Done)
    status = status_of(api, namespace, name)
    assert (status["cpus"], status["memorySize"], status["scaleSeq"]) == (2, "2Gi", 1)
    client.CoreV1Api(api).delete_namespaced_secret(status["scalingTokenSecret"], namespace)
    set_use(api, namespace, name, 1, 1)
    assert isinstance(settle(reconciler, key, OLD).action, act.Done)
    status = status_of(api, namespace, name)
    scaling = next(c for c in status["conditions"] if c["type"] == "Scaling")
    assert (scaling["reason"], status["scaleSeq"]) == (reasons.SCALING_DISABLED, 2), status
    # The late PUT of plan #2 lands; the DIMM's eject is still pending.
    runner.fence = {"epoch": OLD.epoch, "token": OLD.token, "seq": 2}
    runner.size = {"vcpus": 1, "memorySlots": 2, "memoryBytes": 2 * GIB}
    runner.removals = ["dimm-slot1"]
    gets = runner.gets
    assert isinstance(settle(reconciler, key, OLD).action, act.Done)
    assert runner.gets > gets  # looked at within the window: not settled, nothing adopted
    status = status_of(api, namespace, name)
    assert (status["cpus"], status["memorySize"]) == (2, "2Gi"), status
    return reconciler, key, pod.metadata.uid


def test_an_adopting_write_that_fails_past_the_window_is_retried_at_the_next_observation(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Review MEDIUM 1: the guest finishes the unplug after the window. The controller
    # sees it settled and decides to adopt 1/1, but that status write fails. The look
    # must not end with the answer: the next observation asks the runner again and
    # adopts. (Before the fix the memory of the pending removal was dropped with the
    # answer, and status kept 2/2 for good.)
    runner = RefusingRunner(200)
    try:
        reconciler, key, _ = _dropped_with_an_unplug_pending(
            api, controller_api, namespace, "retry", runner)
        _past_the_window(reconciler)
        runner.size = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}  # ejected
        runner.removals = []
        failing = FailingStatusWrites(reconciler.cluster)
        reconciler.ctx.writer = failing
        failing.armed = True
        with pytest.raises(client.ApiException):
            reconciler.reconcile(key, OLD, direct_first=True)
        assert failing.failed == 1
        status = status_of(api, namespace, "retry")
        assert (status["cpus"], status["memorySize"]) == (2, "2Gi"), status
        gets = runner.gets
        assert isinstance(settle(reconciler, key, OLD).action, act.Done)
        assert runner.gets > gets  # asked again, past the window
        status = status_of(api, namespace, "retry")
        assert (status["cpus"], status["memorySize"]) == (1, "1Gi"), status
        assert "scaleLookPodUID" not in status, status  # the look has ended
        gets = runner.gets
        settle(reconciler, key, OLD)
        assert runner.gets == gets  # ... and the runner is no longer asked
    finally:
        runner.close()


def test_a_new_leader_past_the_window_still_looks_at_a_removal_pending_after_a_drop(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Review MEDIUM 2: the leader that dropped the plan saw the unplug pending, then
    # lost its leadership. A new controller process (nothing in its memory), past the
    # window, must still look and adopt the size the guest settles at: status says
    # which runner to look at. (Before the fix only the old process remembered it.)
    from neonvm.controller.scaling import RunnerScaling

    runner = RefusingRunner(200)
    try:
        _, key, pod_uid = _dropped_with_an_unplug_pending(
            api, controller_api, namespace, "failover", runner)
        assert status_of(api, namespace, "failover").get("scaleLookPodUID") == pod_uid
        new_leader = shipped_reconciler(controller_api, scaling=RunnerScaling(
            controller_api, address=lambda vm, pod: f"http://127.0.0.1:{runner.port}",
            token_sync_seconds=3600.0))
        _past_the_window(new_leader)
        gets = runner.gets
        assert isinstance(settle(new_leader, key, NEW).action, act.Done)
        assert runner.gets > gets  # looked at: the removal still pending, nothing adopted
        assert (status_of(api, namespace, "failover")["memorySize"]) == "2Gi"
        runner.size = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}  # ejected
        runner.removals = []
        assert isinstance(settle(new_leader, key, NEW).action, act.Done)
        status = status_of(api, namespace, "failover")
        assert (status["cpus"], status["memorySize"]) == (1, "1Gi"), status
        assert "scaleLookPodUID" not in status, status
    finally:
        runner.close()


def test_the_runner_containers_cpu_limit_is_neonvms_quota_at_build_and_after_each_resize(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str) -> None:
    # Issue 31: an unprivileged runner cannot write its cgroup, so the fractional CPU
    # (NeonVM's quota: 4 x cpus.use) is the container's CPU limit, which the kubelet
    # enforces; the in-place resize that moves the request moves the limit with it.
    # The API server (1.36) takes a limit in pods/resize.
    from loguru import logger

    from neonvm.controller.observe import pod_view
    from neonvm.controller.scaling import RunnerScaling

    create_vm(api, namespace, "quota", spec={
        "nodeSelector": NOWHERE,
        "guest": {"cpus": {"min": "250m", "max": 3, "use": "250m"},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "/nonexistent.raw"}}})
    settle(shipped_reconciler(controller_api), f"{namespace}/quota", OLD)
    (pod,) = runner_pods(api, namespace, "quota")
    core = client.CoreV1Api(api)

    def cpu() -> tuple[str, str]:
        resources = core.read_namespaced_pod(pod.metadata.name, namespace).spec.containers[
            0].resources
        return resources.requests["cpu"], resources.limits["cpu"]

    assert cpu() == ("250m", "1")  # 4 x 250m, not max (3)
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})
    scaling = RunnerScaling(controller_api)
    # Review-protocol F8: at use == max the limit stays above the request (max + 1m), or
    # the pod would turn Guaranteed, the API server would refuse the resize (422) and the
    # old limit would cap a 3-vCPU guest.
    for seq, use, expected in ((1, "500m", ("500m", "2")), (2, "1500m", ("1500m", "3")),
                               (3, 3, ("3", "3001m")), (4, "250m", ("250m", "1"))):
        kube.request(api, "PATCH", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/"
                     f"{namespace}/{types.PLURAL}/quota", [
                         {"op": "replace", "path": "/spec/guest/cpus/use", "value": use}],
                     content_type="application/json-patch+json")
        raw = get_vm(api, namespace, "quota")
        assert raw is not None
        vm = types.VirtualMachine.from_object(raw)
        plan = types.PendingScale(cpus=vm.spec.guest.cpus.current.rounded_up(),
                                  memory_slots=1, seq=seq, epoch=1, token=10,
                                  pod_name=pod.metadata.name, pod_uid=pod.metadata.uid,
                                  generation=vm.generation)
        scaling._tell_kubernetes(vm, pod_view(api.sanitize_for_serialization(pod)), GIB,
                                 plan, logger)
        assert cpu() == expected  # 4 x use, at most max (above use: Burstable kept)
    (same,) = runner_pods(api, namespace, "quota")
    assert same.metadata.uid == pod.metadata.uid
