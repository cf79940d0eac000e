"""Live scaling across leader failovers: the leader is SIGKILLed in the middle of a change.

Real kube-apiserver and etcd, three ``neonvm controller run`` replicas as processes, and
one real runner with the tiny test guest under QEMU, started for the VM's pod as in
``tests/test_scaling_controller.py`` (the test plays the kubelet: the pod's spec and
environment, the VM's token Secret, the pod reported Running on 127.0.0.1).

Between the controllers and the runner sits a recording relay on the VM's
``runnerPort`` (the address the controllers use); it forwards every request to the
runner's real port and writes down each ``PUT /scale`` (fence, target, answer). It can
hold one request before the runner sees it, or hold the runner's answer after it has
applied: that is where the leader is killed. The request held before the runner is
delivered after the next leader has scaled further, as a request of a dead leader that
the network delivered late.

The guest converges to the newest size (its own report line: online CPUs, MemTotal),
the pod is the same one throughout, and the sizes the runner applied, in the order it
applied them, have strictly increasing fences: no older plan's size after a newer one.
"""

from __future__ import annotations

import base64
import http.server
import itertools
import json
import re
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.dev.cluster import LocalCluster
from tests.support import replica_group, wait_for
from tests.support.harness import Replica, Replicas, create_vm, get_vm, runner_pods
from tests.support.runner import free_port
from tests.support.runner_scaling import guest_sees
from tests.support.scaling_controller import NOWHERE, set_use, start_runner_for, status_of

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GIB = 1 << 30
SCALE_LOG = re.compile(r"scale to (\d+) vCPUs, (\d+) memory slots \(fence epoch (\d+) "
                       r"token (\d+) seq (\d+), (newer|retry)\)")


@dataclass
class Put:
    """One ``PUT /scale`` as the relay forwarded it."""

    fence: tuple[int, int, int]
    target: tuple[int, int]
    code: int = 0
    answered: int = 0
    """Order in which the runner's answers came back (1, 2, ...); 0: not forwarded yet."""


@dataclass
class Relay:
    """Forwards everything on ``port`` to the runner on ``upstream``; records PUT /scale.

    ``hold_request``: the next PUT is kept (not forwarded) until :meth:`release`.
    ``hold_answer``: the next PUT is forwarded, its answer kept from the caller until
    :meth:`release` (the runner has applied; the caller has not heard)."""

    port: int
    upstream: int
    puts: list[Put] = field(default_factory=list)
    hold_request: bool = False
    hold_answer: bool = False
    held: Put | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release: threading.Event = field(default_factory=threading.Event)
    _answers: int = 0

    def start(self) -> Relay:
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                put = None
                hold_answer = False
                if method == "PUT" and self.path == "/scale":
                    doc = json.loads(body)
                    f = doc["fence"]
                    put = Put((f["epoch"], f["token"], f.get("seq", 0)),
                              (doc["cpus"], doc["memorySlots"]))
                    with relay._lock:
                        relay.puts.append(put)
                        hold_request = relay.hold_request and relay.held is None
                        hold_answer = relay.hold_answer and relay.held is None
                        if hold_request or hold_answer:
                            relay.held = put
                            relay.hold_request = relay.hold_answer = False
                    if hold_request:
                        relay._release.wait()
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() in ("authorization", "content-type")}
                request = urllib.request.Request(
                    f"http://127.0.0.1:{relay.upstream}{self.path}", method=method,
                    data=body if method == "PUT" else None, headers=headers)
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        code, data = response.status, response.read()
                except urllib.error.HTTPError as err:
                    code, data = err.code, err.read()
                except OSError as exc:
                    code, data = 502, json.dumps({"error": f"relay: {exc}"}).encode()
                if put is not None:
                    with relay._lock:
                        relay._answers += 1
                        put.code, put.answered = code, relay._answers
                    if hold_answer:
                        relay._release.wait()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the caller is gone (a killed leader)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_PUT(self) -> None:
                self._forward("PUT")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def release(self) -> None:
        self._release.set()

    def rearm(self) -> None:
        """Ready to hold another request (the one held before was released)."""
        with self._lock:
            self.held, self._release = None, threading.Event()

    def close(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()

    def applied(self) -> list[Put]:
        """The PUTs the runner answered 200, in the order it answered them."""
        with self._lock:
            return sorted((p for p in self.puts if p.code == 200), key=lambda p: p.answered)


@pytest.fixture
def replicas(cluster: LocalCluster, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[Replicas]:
    with replica_group(cluster, api, namespace, tmp_path / "replicas", workers=2,
                       log_tail=8000) as group:
        yield group


def leader_of(replicas: Replicas) -> Replica:
    leader = wait_for(replicas.leader, 60, what="a leader")
    assert leader is not None
    return leader


def pending_seq(api: client.ApiClient, namespace: str, name: str) -> int | None:
    pending = status_of(api, namespace, name).get("pendingScale")
    return None if not pending else int(pending["seq"])


def committed(api: client.ApiClient, namespace: str, name: str, cpus: int,
              memory: str) -> bool:
    status = status_of(api, namespace, name)
    return ("pendingScale" not in status and status.get("cpus") == cpus
            and status.get("memorySize") == memory)


def test_a_leader_killed_mid_change_never_lets_an_older_size_back(
        api: client.ApiClient, namespace: str, replicas: Replicas,
        test_guest: Any, tmp_path: Path) -> None:
    port, runner_port = free_port(), free_port()
    relay = Relay(port=port, upstream=runner_port).start()
    root = tmp_path / "root.raw"
    with root.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(root)], check=True)
    for name in ("r0", "r1", "r2"):
        replicas.start(name)
    leader_of(replicas)
    create_vm(api, namespace, "live", spec={
        "nodeSelector": NOWHERE, "runnerPort": port, "terminationGracePeriodSeconds": 10,
        "cpuScalingMode": "SysfsScaling",
        "guest": {"cpus": {"min": 1, "max": 3, "use": 1},
                  "memorySlots": {"min": 1, "max": 2, "use": 1}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": str(root)}, "kernelImage": str(test_guest.kernel),
                  "initrdImage": str(test_guest.initrd),
                  "appendKernelCmdline": "quiet neonvm.test=powerdown"}})

    def the_pod() -> Any:
        pods = runner_pods(api, namespace, "live")
        raw = get_vm(api, namespace, "live") or {}
        if len(pods) == 1 and (raw.get("status") or {}).get("scalingTokenSecret"):
            return pods[0]
        return None
    pod = wait_for(the_pod, 120, what="the VM's pod and token Secret")
    uid = pod.metadata.uid
    raw = get_vm(api, namespace, "live")
    assert raw is not None
    secret = client.CoreV1Api(api).read_namespaced_secret(
        raw["status"]["scalingTokenSecret"], namespace)
    token = base64.b64decode(secret.data["token"]).decode()

    runner = start_runner_for(pod, token, runner_port, tmp_path)
    try:
        qemu_pid = runner.wait_ready()["qemuPid"]
        boot_kb = guest_sees(runner, cpus=1)["guestMemTotalKb"]
        two = (boot_kb + GIB // 1024, boot_kb + GIB // 1024)
        client.CoreV1Api(api).patch_namespaced_pod_status(pod.metadata.name, namespace, {
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "podIPs": [{"ip": "127.0.0.1"}]}})
        wait_for(lambda: status_of(api, namespace, "live").get("phase") == "Running", 120,
                 what="the VM Running")

        # A change under the first leader, to the end: 1 -> 2 vCPUs, 1 -> 2 GiB.
        set_use(api, namespace, "live", 2, 2)
        wait_for(lambda: committed(api, namespace, "live", 2, "2Gi"), 240,
                 what="2 vCPUs, 2Gi committed")
        guest_sees(runner, cpus=2, mem_kb=two)

        # Kill #1: the plan is recorded (status.pendingScale), its PUT /scale is on its
        # way but has not reached the runner.
        first = leader_of(replicas)
        relay.hold_request = True
        set_use(api, namespace, "live", 1, 1)
        wait_for(lambda: relay.held is not None, 120, what="the plan's PUT /scale in flight")
        stale = relay.held
        assert stale is not None and stale.target == (1, 1)
        assert pending_seq(api, namespace, "live") == stale.fence[2]
        first.kill()
        set_use(api, namespace, "live", 3, 2)  # a newer size before anyone applied the old
        second = wait_for(lambda: (r := replicas.leader()) is not None and r is not first
                          and r, 120, what="a new leader")
        assert isinstance(second, Replica)
        wait_for(lambda: committed(api, namespace, "live", 3, "2Gi"), 240,
                 what="3 vCPUs, 2Gi committed by the new leader")
        guest_sees(runner, cpus=3, mem_kb=two)
        # The dead leader's request arrives now: the runner must refuse it.
        relay.release()
        wait_for(lambda: stale.code != 0, 120, what="the late request answered")
        assert stale.code == 409, stale
        guest_sees(runner, cpus=3, mem_kb=two)

        # Kill #2: the runner has applied the plan, the leader has not heard (no commit).
        relay.rearm()
        relay.hold_answer = True
        set_use(api, namespace, "live", 1, 1)
        wait_for(lambda: relay.held is not None and relay.held.code != 0, 240,
                 what="the runner's answer to the plan, held")
        applied = relay.held
        assert applied is not None and applied.code == 200 and applied.target == (1, 1)
        assert pending_seq(api, namespace, "live") == applied.fence[2]
        second.kill()
        set_use(api, namespace, "live", 2, 2)
        wait_for(lambda: (r := replicas.leader()) is not None and r not in (first, second),
                 120, what="a third leader")
        wait_for(lambda: committed(api, namespace, "live", 2, "2Gi"), 240,
                 what="2 vCPUs, 2Gi committed by the third leader")
        relay.release()

        # Several patches in a row, none waited for: only the last one counts.
        for cpus, slots in ((1, 1), (3, 2), (1, 2), (2, 1)):
            set_use(api, namespace, "live", cpus, slots)
        wait_for(lambda: committed(api, namespace, "live", 2, "1Gi"), 240,
                 what="2 vCPUs, 1Gi committed")

        # The newest size, as the guest itself reports it.
        final = guest_sees(runner, cpus=2, mem_kb=(boot_kb, boot_kb))
        assert final["guestCpusOnline"] == 2

        # Applied in strictly increasing fence order, so no older plan's size after a
        # newer one; the relay's record and the runner's own log agree.
        history = relay.applied()
        print("PUT /scale as relayed:", *relay.puts, sep="\n  ")
        logged = [(int(c), int(m), int(e), int(t), int(q), how)
                  for c, m, e, t, q, how in SCALE_LOG.findall(runner.log())]
        assert [(p.target, p.fence) for p in history] == [
            ((c, m), (e, t, q)) for c, m, e, t, q, _ in logged], (history, logged)
        # A retry (the same fence again) carries the same target; past those, each fence
        # the runner applied is newer than the one before.
        distinct = [p for i, p in enumerate(history) if i == 0 or p.fence != history[i - 1].fence
                    or p.target != history[i - 1].target]
        fences = [p.fence for p in distinct]
        assert all(a < b for a, b in itertools.pairwise(fences)), history
        assert history[-1].target == (2, 1)
        assert stale.fence not in fences
        # Three leaders, one pod, one QEMU.
        epochs = {p.fence[0] for p in history}
        assert len(epochs) >= 2, history
        assert [p.metadata.uid for p in runner_pods(api, namespace, "live")] == [uid]
        assert runner.qemu_pids == {qemu_pid}
    finally:
        relay.close()
        runner.cleanup()
    wait_for(lambda: runner.proc.poll() is not None, timeout=30, what="runner gone")
