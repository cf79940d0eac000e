"""A controller replica talks to the API server without the client's generated API classes.

With ``kubernetes`` 37 (pydantic models, a lazy ``kubernetes.client``), importing one
generated API class (``CoreV1Api``, ``CustomObjectsApi``, ...) loads its module and the
models it names: about 20 MiB of resident memory in every replica, leader or standby.
The controller's calls are raw REST requests (``neonvm.kube``) and plain JSON dicts
instead, so a replica that builds its parts, leads a term and makes every kind of call
it makes (reads, conditional writes, lists, watches, Events, the Lease, the scaling
token Secrets and the pod's size annotation) never loads ``kubernetes.client.api.*`` and
never builds a typed model.

The calls go to a stub HTTP server that answers every request with plausible JSON; the
check runs in a subprocess, so the imports of this test process do not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

REPLICA = textwrap.dedent(r'''
    import base64, datetime as dt, json, resource, sys, tempfile, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import parse_qs, urlparse

    from neonvm import kube
    from neonvm.api.types import PendingScale, VirtualMachine
    from neonvm.controller import actions as act
    from neonvm.controller.cluster import KubeCluster, VMRecord
    from neonvm.controller.events import EventRecorder, PendingEvent
    from neonvm.controller.manager import ControllerConfig, ControllerProcess, LeaderTerm
    from neonvm.controller.scaling import RunnerScaling
    from neonvm.controller.sweeps import iter_items
    from neonvm.leader.election import ElectionConfig, Leadership
    from neonvm.leader.etcd import EtcdConfig
    from neonvm.leader.lease_store import KubernetesLeaseStore
    from kubernetes.watch.watch import iter_resp_lines
    from loguru import logger

    logger.remove()
    META = {"name": "vm", "namespace": "ns", "uid": "uid-1", "resourceVersion": "5"}
    VM = {"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine", "metadata": META,
          "spec": {"guest": {"cpus": {"min": 1, "max": 2, "use": 1},
                             "memorySlots": {"min": 1, "max": 2, "use": 1},
                             "memorySlotSize": "1Gi", "rootDisk": {"image": "img"}},
                   "enableAcceleration": False},
          "status": {"scalingTokenSecret": "tok", "scalingTokenSecretUID": "uid-1"}}
    ANSWER = {**VM, "items": [], "data": {"token": base64.b64encode(b"t").decode()},
              "spec": {**VM["spec"], "holderIdentity": "x", "leaseDurationSeconds": 4}}
    requests = []

    class Stub(BaseHTTPRequestHandler):
        def _answer(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            url = urlparse(self.path)
            requests.append((self.command, url.path))
            if parse_qs(url.query).get("watch") == ["true"]:
                body = json.dumps({"type": "ADDED", "object": ANSWER}).encode() + b"\n"
            elif url.path.endswith("/selfsubjectreviews"):
                body = json.dumps({"status": {"userInfo": {"username": "me"}}}).encode()
            else:
                body = json.dumps(ANSWER).encode()
            self.send_response(201 if self.command == "POST" else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "stub",
               "clusters": [{"name": "stub", "cluster": {
                   "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
               "users": [{"name": "stub", "user": {"token": "t"}}],
               "contexts": [{"name": "stub", "context": {"cluster": "stub",
                                                         "user": "stub"}}]}, kubeconfig)
    kubeconfig.close()

    api = kube.api_client(kubeconfig.name)
    process = ControllerProcess(api, EtcdConfig(endpoints=("http://127.0.0.1:9",)),
                                ElectionConfig(namespace="ns", name="lease", identity="me"),
                                ControllerConfig())
    failures = []

    def call(what, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            failures.append(f"{what}: {type(exc).__name__}: {exc}")

    # The standby: the Lease.
    leases = KubernetesLeaseStore(process.elector_api, "ns", "lease")
    record = call("lease get", leases.get, 5)
    call("lease create", leases.create, {"holderIdentity": "me"}, 5)
    if record is not None:
        call("lease update", leases.update, record, {"holderIdentity": "me"}, 5)
    call("lease watch", lambda: list(leases.watch(2)))

    # The leader: the informers' and sweeps' lists and watches.
    term = LeaderTerm(process, Leadership(1, "me", time.monotonic() + 600))
    for lister in (term._list_vms, term._list_pods):
        call("list", lambda: list(iter_items(lister, metadata_only=True)))
        def watch(lister=lister):
            resp = lister(watch=True, resource_version="1", allow_watch_bookmarks=True,
                          timeout_seconds=5, _preload_content=False,
                          _request_timeout=(10, 20))
            try:
                return [json.loads(line) for line in iter_resp_lines(resp) if line]
            finally:
                resp.release_conn()
        call("watch", watch)

    # The reconciler's calls.
    cluster = KubeCluster(api)
    vm_record = VMRecord.from_raw(VM)
    vm = vm_record.vm
    call("list_pods", cluster.list_pods, "ns", "vm")
    call("get_vm_raw", cluster.get_vm_raw, "ns", "vm")
    call("get_pod", cluster.get_pod, "ns", "p")
    call("secret_metadata", cluster.secret_metadata, "ns", "s")
    call("delete_pod", cluster.delete_pod, "ns", "p", uid="u", resource_version="3")
    call("username", cluster.username)
    call("put_status", cluster.put_status, vm_record, vm.status)
    call("put_main", cluster.put_main, vm_record, ["f"])

    # Events: a create, then a repeat (a patch).
    events = EventRecorder(api, "me")
    event = PendingEvent("ns", "vm", "uid-1", "5", "Reason", "message", False,
                         dt.datetime.now(dt.UTC))
    call("event", events._write_locked, event)
    call("event repeat", events._write_locked, event)

    # Live scaling: the token Secret and the pod's size annotation.
    scaling = RunnerScaling(api)
    call("create_token", scaling.create_token, vm)
    call("token", scaling.token, vm)
    call("discard_token", scaling.discard_token, "ns", "tok")
    pod = act.PodView(name="p", uid="uid-1", owner_uid="uid-1", gated=False,
                    terminating=False, phase="Running", node="n", ip="10.0.0.1")
    plan = PendingScale(cpus=1, memory_slots=1, seq=1, epoch=1, token=1, pod_name="p",
                        pod_uid="uid-1", generation=1)
    call("tell_kubernetes", scaling._tell_kubernetes, vm, pod, 1 << 30, plan,
         logger.bind())

    server.shutdown()
    print(json.dumps({
        "api_modules": sorted(m for m in sys.modules
                              if m.startswith("kubernetes.client.api.")),
        "model_modules": sorted(m for m in sys.modules
                                if m.startswith("kubernetes.client.models.")),
        "failures": failures,
        "requests": len(requests),
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))
''')


def test_a_replica_leading_and_calling_never_loads_the_generated_api_classes() -> None:
    done = subprocess.run([sys.executable, "-c", REPLICA], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["api_modules"] == [], report["api_modules"]
    assert report["model_modules"] == [], report["model_modules"]
    assert report["failures"] == [], report["failures"]
    # Every call above reached the server (the token's create is skipped: the recorded
    # Secret is there).
    assert report["requests"] == 24, report
