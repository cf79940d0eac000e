"""A VirtualMachine object at a given size, as the autoscaler-agent's view of it reads
it (``spec.guest.cpus``, memory slots, ``spec.targetRevision``): for the pure tests of
``tests/test_autoscaler_view.py`` and ``tests/test_neonvm_pod_shape.py``; the
autoscaler-agent's patch and a stand-in runner that takes every size, for their
real-server tests (and ``tests/test_autoscaler_view_pod_record.py``'s).
docs/neonvm-compat.md.
"""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any

from kubernetes import client

from neonvm import kube
from neonvm.api import types

AGENT_STAMP = "2020-01-01T00:00:00Z"
"""The updatedAt an autoscaler-agent sends in spec.targetRevision (its own clock)."""


def vm_of(cpus: dict[str, Any], slots: int = 1, revision: int | None = None,
          status: dict[str, Any] | None = None) -> types.VirtualMachine:
    spec: dict[str, Any] = {"guest": {
        "cpus": cpus, "memorySlots": {"min": 1, "max": 2, "use": slots},
        "memorySlotSize": "1Gi", "rootDisk": {"image": "/x.raw"}}}
    if revision is not None:
        spec["targetRevision"] = {"revision": {"value": revision, "flags": 0},
                                  "updatedAt": AGENT_STAMP}
    return types.VirtualMachine.from_object({
        "apiVersion": types.API_VERSION, "kind": types.KIND,
        "metadata": {"name": "v", "namespace": "ns", "uid": "u", "generation": 1,
                     "resourceVersion": "1", "finalizers": [types.FINALIZER]},
        "spec": spec, "status": status or {}})


GIB = 1 << 30


class ApplyingRunner:
    """Stands in for a runner that takes every size it is asked for (a real runner does so
    in tests/test_runner_scaling.py; booting a guest here would add nothing the
    controller reads): ``PUT /scale`` records the size and fence and answers 200, ``GET
    /scale`` reports them."""

    def __init__(self) -> None:
        self.size: dict[str, Any] = {"vcpus": 1, "memorySlots": 1, "memoryBytes": GIB}
        self.fence: dict[str, int] = {"epoch": 0, "token": 0, "seq": 0}
        self.pod_uid: str | None = None
        self.puts: list[dict[str, Any]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, doc: dict[str, Any]) -> None:
                body = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _report(self) -> dict[str, Any]:
                return {"mode": "QmpScaling", "lastApplied": {"fence": outer.fence},
                        "qemu": outer.size, "podUid": outer.pod_uid, "pendingRemovals": []}

            def do_GET(self) -> None:
                self._answer(self._report())

            def do_PUT(self) -> None:
                asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.puts.append(asked)
                outer.fence = asked["fence"]
                outer.size = {"vcpus": asked["cpus"], "memorySlots": asked["memorySlots"],
                              "memoryBytes": asked["memorySlots"] * GIB}
                self._answer(self._report())

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def agent_patch(api: client.ApiClient, namespace: str, name: str, cpu: str, slots: int,
                revision: int) -> None:
    """What NeonVM's autoscaler-agent sends (pkg/agent, doNeonVMRequest): a JSON patch
    replacing cpus.use (a quantity), memorySlots.use and targetRevision (stamped by the
    agent's clock)."""
    kube.request(api, "PATCH", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/{namespace}/"
                 f"{types.PLURAL}/{name}", [
                     {"op": "replace", "path": "/spec/guest/cpus/use", "value": cpu},
                     {"op": "replace", "path": "/spec/guest/memorySlots/use", "value": slots},
                     {"op": "replace", "path": "/spec/targetRevision", "value": {
                         "revision": {"value": revision, "flags": 0},
                         "updatedAt": AGENT_STAMP}}],
                 content_type="application/json-patch+json")
