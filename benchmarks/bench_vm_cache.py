"""The VM informer's memory with N large VMs (issue 28, "Exhaustion").

A stub API server (another process) answers the VirtualMachine list with N VMs whose
spec is about ``--spec-kib`` KiB (``spec.affinity`` keeps unknown fields: the CRD admits
about 1.5 MiB there, etcd's request limit). A child process lists them through the
controller's own lister and informer into the controller's compact store, as a replica
does when its term starts, and prints its resident memory after the list (VmRSS) and at
its peak (VmHWM), and the list's wall time. Run from a checkout:
``python -m benchmarks.bench_vm_cache --vms 350``; figures in docs/benchmarks.md ("The
VM cache with large VMs").

``--shape dicts`` builds the affinity of empty JSON objects (3 bytes each, about 24
times more once decoded); ``--small N`` puts N VMs of 1 KiB before the large ones (their
size would grow the next page's limit); ``--list sweeps`` lists through the sweeps'
metadata-only :func:`~neonvm.controller.sweeps.live_vm_uids` instead of the informer.
The child runs the code of the checkout this file is in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse


def dicts_vm_json(i: int, spec_kib: int) -> str:
    """A VM whose ``spec.affinity.nodeAffinity`` is ``{"x": [{}, {}, ...]}``."""
    body = '{"x":[' + ",".join(["{}"] * (spec_kib * 1024 // 3)) + "]}"
    return json.dumps({
        "apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
        "metadata": {"name": f"vm-{i}", "namespace": "ns", "uid": f"uid-{i}",
                     "resourceVersion": str(100 + i)},
        "spec": {"guest": {"rootDisk": {"image": "img"}}, "affinity": {"nodeAffinity": "@"}},
    }, separators=(",", ":")).replace('"@"', body)


def vm_json(i: int, spec_kib: int) -> str:
    terms = [{"weight": 1, "podAffinityTerm": {
        "topologyKey": f"k{i}-{t}-" + os.urandom(60).hex(),
        "labelSelector": {"matchLabels": {"a": str(t)}}}}
        for t in range(max(1, spec_kib * 1024 // 200))]
    return json.dumps({
        "apiVersion": "vm.neon.tech/v1", "kind": "VirtualMachine",
        "metadata": {"name": f"vm-{i}", "namespace": "ns", "uid": f"uid-{i}",
                     "resourceVersion": str(100 + i)},
        "spec": {"guest": {"cpus": {"min": 1, "max": 1}, "memorySlots": {"min": 1, "max": 1},
                           "memorySlotSize": "1Gi", "rootDisk": {"image": "img"}},
                 "affinity": {"podAntiAffinity": {
                     "preferredDuringSchedulingIgnoredDuringExecution": terms}}},
    }, separators=(",", ":"))


CHILD = r'''
import inspect, re, sys, threading, time
from kubernetes import client
from loguru import logger
from neonvm import kube
from neonvm.controller import informer
from neonvm.controller.wiring import Wiring

logger.remove()

def status(field):
    return int(re.search(field + r":\s+(\d+) kB", open("/proc/self/status").read())[1]) // 1024

config = client.Configuration()
config.host = "http://127.0.0.1:" + sys.argv[1]
api = client.ApiClient(config)
store = Wiring().store()
kwargs = {}
if "max_object_bytes" in inspect.signature(informer.Informer).parameters:
    kwargs["max_object_bytes"] = informer.MAX_CACHED_VM_BYTES
skipped = []
lister = kube.Lister(api, "/apis/vm.neon.tech/v1/virtualmachines")
inf = informer.Informer("virtualmachines", lister,
                        store, lambda *a: None, on_undecodable=skipped.append, **kwargs)
before = status("VmRSS")
start = time.perf_counter()
if sys.argv[2] == "sweeps":
    from neonvm.controller.sweeps import live_vm_uids
    listed = f"uids={len(live_vm_uids(lister))}"
else:
    inf._relist()
    listed = f"cached={len(store.all_keys())} left_out={len(skipped)}"
took = time.perf_counter() - start
print(f"{listed} rss_before={before} rss_after={status('VmRSS')} peak={status('VmHWM')} "
      f"list_seconds={took:.2f}")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=350)
    parser.add_argument("--spec-kib", type=int, default=1400)
    parser.add_argument("--shape", choices=("terms", "dicts"), default="terms")
    parser.add_argument("--small", type=int, default=0)
    parser.add_argument("--list", choices=("informer", "sweeps"), default="informer")
    args = parser.parse_args()
    make = dicts_vm_json if args.shape == "dicts" else vm_json
    vms = [vm_json(-1 - i, 1) for i in range(args.small)] + \
        [make(i, args.spec_kib) for i in range(args.vms)]
    print(f"{args.small} small VMs, then {args.vms} VMs ({args.shape}) of "
          f"{len(vms[-1]) / 1024:,.0f} KiB each ({sum(map(len, vms)) / 2**20:,.0f} MiB)",
          flush=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _stub(vms))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = subprocess.run([sys.executable, "-c", CHILD, str(server.server_address[1]),
                          args.list], capture_output=True, text=True, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    server.shutdown()
    print(out.stdout.strip() or out.stderr[-3000:])
    if out.returncode:
        print(f"the child exited {out.returncode}")


def _stub(vms: list[str]) -> type[BaseHTTPRequestHandler]:
    class Stub(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            query = parse_qs(urlparse(self.path).query)
            start = int((query.get("continue") or ["0"])[0])
            limit = int((query.get("limit") or ["500"])[0])
            end = min(len(vms), start + limit)
            meta = {"resourceVersion": "1000",
                    **({"continue": str(end)} if end < len(vms) else {})}
            # Streamed piece by piece (the JSON is ASCII), headers first.
            pieces = ['{"kind":"VirtualMachineList","metadata":' + json.dumps(meta)
                      + ',"items":[', *(("," if n else "") + vm
                                        for n, vm in enumerate(vms[start:end])), "]}"]
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(sum(map(len, pieces))))
            self.end_headers()
            try:
                for piece in pieces:
                    self.wfile.write(piece.encode())
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client dropped a page above its byte budget

        def handle(self) -> None:
            with contextlib.suppress(ConnectionResetError, BrokenPipeError):
                super().handle()  # the client dropped a page above its budget

        def log_message(self, *_: object) -> None:
            pass

    return Stub


if __name__ == "__main__":
    main()
