"""A tenant's large objects cannot make a replica's lists exhaust its memory (issue 28,
"Exhaustion"; security review H1, H2; docs/security.md). A stub API server serves list
pages of crafted objects; a child process lists them through the controller's own code
(the VM informer's re-list; the sweeps' metadata-only list of VMs) and reports its peak
resident memory (VmHWM), a resource figure. Before the fix, pages were decoded whole:
16 VMs of 1.4 MiB built of empty JSON objects added 571 MiB, 60 VMs whose metadata holds
30,000 annotations 313 MiB (docs/security.md); the cases here are smaller, to be cheap."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
GROWTH_MIB = 100
"""The most a list may add to the child's resident memory (the new code: 20 to 30; the
old: about 300 for each case below)."""

CHILD = r'''
import re, sys
from kubernetes import client
from loguru import logger
from neonvm import kube
from neonvm.controller import informer, sweeps
from neonvm.controller.wiring import Wiring

logger.remove()

def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read())[1]) // 1024

config = client.Configuration()
config.host = "http://127.0.0.1:" + sys.argv[1]
lister = kube.Lister(client.ApiClient(config), "/apis/vm.neon.tech/v1/virtualmachines")
before = status("VmRSS")
if sys.argv[2] == "informer":
    skipped = []
    inf = informer.Informer("virtualmachines", lister, Wiring().store(), lambda *a: None,
                            on_undecodable=skipped.append,
                            max_object_bytes=informer.MAX_CACHED_VM_BYTES)
    inf._relist()
    listed = len(set(inf.store.all_keys()) | {found.key for found in skipped})
else:
    listed = len(sweeps.live_vm_uids(lister))
print(listed, status("VmHWM") - before)
'''


def _stub(items: list[str]) -> type[BaseHTTPRequestHandler]:
    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            start = int((query.get("continue") or ["0"])[0])
            end = min(len(items), start + int((query.get("limit") or ["500"])[0]))
            meta = {"resourceVersion": "1000",
                    **({"continue": str(end)} if end < len(items) else {})}
            pieces = ['{"kind":"List","metadata":' + json.dumps(meta) + ',"items":[',
                      *(("," if n else "") + item for n, item in enumerate(items[start:end])),
                      "]}"]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(sum(map(len, pieces))))
            self.end_headers()
            try:
                for piece in pieces:
                    self.wfile.write(piece.encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client dropped a page above its budget

        def handle(self) -> None:
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                super().handle()  # the client dropped a page above its budget

        def log_message(self, *_: object) -> None:
            pass

    return Stub


def list_in_child(items: list[str], mode: str) -> tuple[int, int]:
    """(objects listed, MiB the list added to the child's peak resident memory)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _stub(items))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(server.server_address[1]), mode],
                             capture_output=True, text=True, check=False, cwd=ROOT, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert out.returncode == 0, out.stderr[-3000:]
    listed, growth = out.stdout.split()
    return int(listed), int(growth)


def head(i: int) -> dict[str, object]:
    return {"apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
            "metadata": {"name": f"vm-{i:03}", "namespace": "ns", "uid": f"uid-{i}",
                         "resourceVersion": str(100 + i)}}


def dicts_vms(n: int, kib: int) -> Iterator[str]:
    """VMs whose affinity is ``{"x": [{}, {}, ...]}``: about 24 times larger decoded."""
    body = '{"x":[' + ",".join(["{}"] * (kib * 1024 // 3)) + "]}"
    for i in range(n):
        yield json.dumps({**head(i), "spec": {"affinity": "@"}},
                         separators=(",", ":")).replace('"@"', body)


def annotated_vms(n: int, keys: int) -> Iterator[str]:
    """Metadata-only VMs with ``keys`` empty annotations and their managedFields mirror
    (what the real API server answers for such a VM: about 880 KB for 30,000)."""
    annotations = json.dumps({f"a{k}": "" for k in range(keys)}, separators=(",", ":"))
    fields = json.dumps({f"f:a{k}": {} for k in range(keys)}, separators=(",", ":"))
    for i in range(n):
        obj = head(i)
        obj["metadata"]["annotations"] = "@A"  # type: ignore[index]
        obj["metadata"]["managedFields"] = [  # type: ignore[index]
            {"manager": "kubectl", "operation": "Update", "apiVersion": "vm.neon.tech/v1",
             "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": "@F"}}}]
        yield json.dumps(obj, separators=(",", ":")).replace('"@A"', annotations).replace(
            '"@F"', fields)


def test_the_first_page_of_vms_built_of_tiny_json_objects_does_not_exhaust_a_replica() -> None:
    """16 VMs (the first page) of 800 KiB of ``{}``: each is cached as a stub, undecoded."""
    listed, growth = list_in_child(list(dicts_vms(16, 800)), "informer")
    assert listed == 16
    assert growth < GROWTH_MIB, f"the list added {growth} MiB"


@pytest.mark.long
def test_the_sweeps_list_every_vm_with_huge_metadata_without_exhausting_the_leader() -> None:
    """40 VMs of 30,000 annotations: every uid is listed (none may be skipped: a missed
    one would make its pods look orphaned), one item decoded at a time. Opt-in
    (NEONVM_TEST_LONG=1) to keep the default run short; tests/test_sweeps_bounds.py is
    its cheap counterpart (the byte budget, no item skipped)."""
    listed, growth = list_in_child(list(annotated_vms(40, 30_000)), "sweeps")
    assert listed == 40
    assert growth < GROWTH_MIB, f"the list added {growth} MiB"
