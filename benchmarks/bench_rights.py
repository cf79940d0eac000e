"""Self-fencing's renewals at scale: the leader's CPU for one ask per VM per ``D/3``.

    python -m benchmarks.bench_rights                 # 5,000 VMs, D = 30 s, 30 s measured
    python -m benchmarks.bench_rights --vms 1000 --seconds 20

Opt-in: not part of the test command. A child process serves ``POST /v1/rights`` (the
shipped :class:`~neonvm.controller.rights.RightsServer` and
:class:`~neonvm.controller.rights.RightsService`, the ledger in an active term) over
in-memory caches of ``--vms`` VMs and their self-fencing pods, in the steady state:
every token already read (the token cache's hit) and every pod already marked in this
term (no API call per ask; those come once per pod per term, and once per VM per ten
minutes for the token). Client processes ask for every VM once per ``D/3`` (spread
evenly), each ask on a new connection with a real bearer, as runners do. The run reports
asks per second, answers that were not 200, the answers' p50/p99 latency, and the
server process's CPU (user + system, from /proc) over the measured period, beside the
same server idle for as long (the baseline: a leader without renewals).
docs/protocol.md, "Self-fencing"; figures in docs/benchmarks.md.

``--per-ask`` (opt-in) reports the server's CPU per ask instead, over ``--runs`` windows
of ``--seconds`` (percentiles across them), with lighter clients (one prebuilt request
per VM on a raw socket, so the clients take less of a shared machine). With it:
``--jwt`` (runners present pod-bound RS256 tokens of a key made for the run, verified
locally by the shipped :class:`~neonvm.controller.token_verify.TokenVerifier`; the first
pass over the fleet, a term's first asks, is measured apart: each costs one RSA verify),
``--compact`` (the controller's own compact store, VMs of about 7 KiB as converged, pods
as projected), ``--stale`` (every ask dropped stale: what a dropped ask costs) and
``--profile FILE`` (yappi over every server thread during the windows; the CPU figures
of such a run include the profiler's own cost).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from neonvm.api.rights import RIGHT_SECONDS_ANNOTATION, RIGHTS_PATH, authorization_header  # noqa: E402
from neonvm.controller.observe import pod_index  # noqa: E402

TOKEN = b"bench-token"
AUDIENCE = "vm.neon.tech/rights/bench/neonvm-controller"
ISSUER = "https://kubernetes.default.svc.cluster.local"


def vm_names(n: int) -> list[str]:
    return [f"vm-{i:05d}" for i in range(n)]


class Cache(dict[str, Any]):
    """A store by ``namespace/name``, pods also by VM key (as the informer's store)."""

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.__dict__.setdefault("index", {}).setdefault(pod_index(value), []).append(value)

    def by_index(self, value: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.__dict__.get("index", {}).get(value, [])
        return found


def padded_vm(vm: dict[str, Any]) -> dict[str, Any]:
    """``vm`` grown to about the size of a converged VM in the compact store (7 KiB of
    JSON: a full spec and a status with its conditions)."""
    vm["apiVersion"], vm["kind"] = "vm.neon.tech/v1", "VirtualMachine"
    vm["metadata"].update(resourceVersion="123456", generation=3,
                          creationTimestamp="2026-12-05T00:00:00Z",
                          labels={"app": "bench", "tier": "db"},
                          annotations={f"vm.neon.tech/note-{k}": "x" * 40 for k in range(8)})
    vm["spec"] = {
        "guest": {"cpus": {"min": 1, "max": 4, "use": 2},
                  "memorySlots": {"min": 1, "max": 8, "use": 2}, "memorySlotSize": "1Gi",
                  "rootDisk": {"image": "registry.example.com/vm-postgres:15", "size": "8Gi"},
                  "command": ["/bin/sh"], "args": ["-c", "echo hello; sleep infinity"],
                  "env": [{"name": f"ENV_{k}", "value": "v" * 20} for k in range(10)],
                  "ports": [{"port": 5432 + k, "protocol": "TCP"} for k in range(4)]},
        "disks": [{"name": f"disk-{k}", "mountPath": f"/mnt/d{k}",
                   "emptyDisk": {"size": "1Gi"}} for k in range(6)],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "podAffinityTerm": {"topologyKey": f"zone-{k}-" + "z" * 60,
                                              "labelSelector": {"matchLabels": {"a": str(k)}}}}
            for k in range(12)]}},
        "restartPolicy": "Always", "schedulerName": "default-scheduler",
        "runnerImage": "registry.example.com/neonvm-runner:latest"}
    vm["status"].update(
        phase="Running", node="node-1", podIP="10.0.0.1", cpus=2, memorySize="2Gi",
        restartCount=0, epoch=7, planSeq=12,
        conditions=[{"type": f"Cond{k}", "status": "True", "reason": "Fine" * 4,
                     "message": "m" * 60, "lastTransitionTime": "2026-12-05T00:00:00Z",
                     "observedGeneration": 3} for k in range(10)])
    return vm


def serve(args: argparse.Namespace) -> None:
    """The child: the shipped server over ``args.vms`` VMs; prints its port, runs until
    stdin closes (a line ``reset`` on stdin starts the profile afresh)."""
    from neonvm.controller.rights import (
        STALE_AFTER,
        RightsLedger,
        RightsServer,
        RightsService,
        TokenCache,
        TokenReviewer,
    )

    n, seconds = args.vms, args.right_seconds
    vms: Any
    pods: Any
    if args.compact:
        from neonvm.controller.informer import Store
        vms, pods = Store(compact=True), Store(index=pod_index, compact=True)
    else:
        vms, pods = Cache(), Cache()
    for name in vm_names(n):
        vm = {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"},
              "status": {"podName": f"{name}-p", "podUID": f"p-{name}",
                         "scalingTokenSecret": "tok", "scalingTokenSecretUID": "s"}}
        pod: dict[str, Any] = {"metadata": {
            "name": f"{name}-p", "namespace": "ns", "uid": f"p-{name}",
            "labels": {"vm.neon.tech/name": name},
            "annotations": {RIGHT_SECONDS_ANNOTATION: f"{seconds:g}"},
            "ownerReferences": [{"uid": f"u-{name}", "controller": True}]}}
        if args.compact:
            pod["metadata"].update(resourceVersion="654321")
            pod["metadata"]["ownerReferences"][0].update(
                apiVersion="vm.neon.tech/v1", kind="VirtualMachine", name=name)
            pod["spec"] = {"nodeName": "node-1"}
            pod["status"] = {"phase": "Running", "podIP": "", "qosClass": "Guaranteed"}
            vms.put(padded_vm(vm))
            pods.put(pod)
        else:
            vms[f"ns/{name}"] = vm
            pods[f"ns/{name}-p"] = pod
    secret = {"metadata": {"uid": "s"}, "data": {"token": base64.b64encode(TOKEN).decode()}}
    ledger = RightsLedger()
    ledger.begin_term(lambda: True)
    reviewer = None
    if args.keys:
        from neonvm.controller.token_verify import DISCOVERY_PATH, JWKS_PATH, TokenVerifier
        keys = json.loads(Path(args.keys).read_text())
        answers: dict[str, dict[str, Any]] = {DISCOVERY_PATH: {"issuer": ISSUER},
                                              JWKS_PATH: {"keys": [keys["jwk"]]}}
        verifier = TokenVerifier(None, AUDIENCE, fetch=lambda path, _accept: answers[path])
        verifier.load()

        def no_review(_token: str, _audience: str) -> dict[str, Any]:
            raise AssertionError("a TokenReview was sent")

        reviewer = TokenReviewer(None, AUDIENCE, verify=verifier.decide, review=no_review)
    service = RightsService(ledger, lambda: (vms, pods),
                            TokenCache(None, read=lambda _ns, _name: secret),
                            lambda _ns, _name, _uid: True, reviewer=reviewer)
    if args.null_service:  # the listener alone: every ask granted with no work
        service.answer = lambda *_a, **_k: (200, {"seconds": seconds})  # type: ignore[method-assign]
    profiling = False
    if args.profile:
        import yappi
        yappi.set_clock_type("cpu")
        profiling = True
    stale_after = 1e-9 if args.stale else STALE_AFTER
    workers = {"workers": args.workers} if args.workers else {}
    with RightsServer(service, "127.0.0.1", 0, max_connections=4096,
                      stale_after=stale_after, **workers) as server:
        print(server.port, flush=True)
        for line in sys.stdin:
            if line.strip() == "reset" and profiling:
                yappi.stop()
                yappi.clear_stats()
                yappi.start(builtins=True)
        if profiling:
            yappi.stop()
            stats = yappi.get_func_stats()
            stats.save(args.profile, type="pstat")
            with open(args.profile + ".txt", "w") as out:
                stats.sort("tsub").print_all(out=out, columns={
                    0: ("name", 70), 1: ("ncall", 9), 2: ("tsub", 8), 3: ("ttot", 8)})
                yappi.get_thread_stats().print_all(out=out)


def cpu_seconds(pid: int) -> float:
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """The process's (user, system) CPU seconds so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def switches(pid: int) -> int:
    """Context switches (voluntary and not) of every thread of the process so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines()
                     if line.endswith("ctxt_switches") or "ctxt_switches:" in line)
    return total


def client(port: int, names: list[str], interval: float, until: float,
           out: Any) -> None:
    """Ask for each of ``names`` once per ``interval``, spread evenly, until ``until``."""
    step = interval / max(1, len(names))
    latencies: list[float] = []
    refused = 0
    start = time.monotonic()
    i = 0
    while True:
        at = start + i * step
        if at >= until:
            break
        delay = at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        name = names[i % len(names)]
        body = json.dumps({"namespace": "ns", "vm": name, "podUID": f"p-{name}"})
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", RIGHTS_PATH, body=body, headers={
                "Authorization": authorization_header(TOKEN, f"p-{name}")})
            status = conn.getresponse().status
            conn.close()
        except OSError:
            status = 0
        latencies.append(time.monotonic() - t0)
        refused += status != 200
        i += 1
    out.put((len(latencies), refused, latencies))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def pod_tokens(names: list[str], keys_file: Path) -> dict[str, str]:
    """A pod-bound RS256 token per VM's pod (the claims the API server writes, 7,200 s),
    signed by a key made now; its JWK is written to ``keys_file`` for the server."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    numbers = key.public_key().public_numbers()
    jwk = {"kty": "RSA", "kid": "bench", "alg": "RS256", "use": "sig",
           "n": _b64(numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")),
           "e": _b64(numbers.e.to_bytes(3, "big"))}
    keys_file.write_text(json.dumps({"jwk": jwk}))
    header = _b64(json.dumps({"alg": "RS256", "kid": "bench"}).encode())
    now = int(time.time())
    tokens = {}
    for name in names:
        claims = {"aud": [AUDIENCE], "exp": now + 7200, "iat": now, "nbf": now,
                  "iss": ISSUER, "sub": "system:serviceaccount:ns:runner",
                  "kubernetes.io": {"namespace": "ns",
                                    "pod": {"name": f"{name}-p", "uid": f"p-{name}"},
                                    "serviceaccount": {"name": "runner", "uid": "sa-uid"}}}
        signing = f"{header}.{_b64(json.dumps(claims).encode())}"
        signature = key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        tokens[name] = f"{signing}.{_b64(signature)}"
    return tokens


def raw_requests(names: list[str], tokens: dict[str, str] | None) -> list[bytes]:
    """One prebuilt ask per VM (a runner whose guest runs: ``?guest=started``)."""
    out = []
    for name in names:
        body = json.dumps({"namespace": "ns", "vm": name, "podUID": f"p-{name}"}).encode()
        bearer = (f"Bearer {tokens[name]}" if tokens is not None
                  else authorization_header(TOKEN, f"p-{name}"))
        out.append((f"POST {RIGHTS_PATH}?guest=started HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: {bearer}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    return out


def raw_client(port: int, requests: list[bytes], interval: float, until: float,
               out: Any, once: bool = False) -> None:
    """Send each of ``requests`` once per ``interval``, spread evenly, until ``until``
    (or each once if ``once``); put (asks, not 200)."""
    import socket

    step = interval / max(1, len(requests))
    start = time.monotonic()
    asked = refused = 0
    while (not once or asked < len(requests)) and start + asked * step < until:
        delay = start + asked * step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(requests[asked % len(requests)])
                answer = b""
                while chunk := sock.recv(4096):
                    answer += chunk
            status = int(answer.split(b" ", 2)[1]) if answer else 0
        except (OSError, ValueError, IndexError):
            status = 0
        refused += status != 200
        asked += 1
    out.put((asked, refused))


def per_ask(args: argparse.Namespace) -> None:
    """The server's CPU per ask: a pass of first asks, then ``args.runs`` windows."""
    import statistics
    import tempfile

    names = vm_names(args.vms)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        tokens = pod_tokens(names, keys) if args.jwt else None
        argv = [sys.executable, "-m", "benchmarks.bench_rights", "--serve",
                "--vms", str(args.vms), "--right-seconds", str(args.right_seconds)]
        argv += ["--keys", str(keys)] if args.jwt else []
        argv += ["--compact"] if args.compact else []
        argv += ["--stale"] if args.stale else []
        argv += ["--null-service"] if args.null_service else []
        argv += ["--workers", str(args.workers)] if args.workers else []
        argv += ["--profile", args.profile] if args.profile else []
        child = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            port = int(child.stdout.readline())
            requests = raw_requests(names, tokens)
            shards = [requests[k::args.clients] for k in range(args.clients)]
            interval = args.right_seconds / 3

            split: list[tuple[float, float, int]] = []

            def window(seconds: float, once: bool = False) -> tuple[int, int, float]:
                out: Any = multiprocessing.Queue()
                until = time.monotonic() + seconds
                (user0, sys0), sw0 = cpu_split(child.pid), switches(child.pid)
                cpu0 = cpu_seconds(child.pid)
                procs = [multiprocessing.Process(target=raw_client,
                                                 args=(port, s, interval, until, out, once))
                         for s in shards]
                for p in procs:
                    p.start()
                results = [out.get() for _ in procs]
                cpu = cpu_seconds(child.pid) - cpu0
                (user1, sys1), sw1 = cpu_split(child.pid), switches(child.pid)
                split.append((user1 - user0, sys1 - sys0, sw1 - sw0))
                for p in procs:
                    p.join()
                return sum(r[0] for r in results), sum(r[1] for r in results), cpu

            cpu0 = cpu_seconds(child.pid)
            time.sleep(min(args.seconds, 5.0))
            idle = (cpu_seconds(child.pid) - cpu0) / min(args.seconds, 5.0)
            asked, refused, cpu = window(interval * 2, once=True)  # one pass: every first ask
            print(f"first asks: {asked} asks, not 200: {refused}, "
                  f"{cpu / max(1, asked) * 1e6:,.0f} us of server CPU per ask")
            if args.profile:
                child.stdin.write("reset\n")
                child.stdin.flush()
            per: list[float] = []
            for run in range(args.runs):
                asked, refused, cpu = window(args.seconds)
                per.append(cpu / max(1, asked) * 1e6)
                user, system, switched = split[-1]
                print(f"window {run + 1}: {asked / args.seconds:.0f} asks/s, not 200: "
                      f"{refused}, {per[-1]:,.0f} us per ask (user "
                      f"{user / max(1, asked) * 1e6:,.0f}, system "
                      f"{system / max(1, asked) * 1e6:,.0f}; "
                      f"{switched / max(1, asked):.1f} context switches; "
                      f"idle {idle * 100:.1f} % of a core)", flush=True)
        finally:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(60)
    per.sort()
    print(f"per ask over {len(per)} windows: p50 {statistics.median(per):,.0f} us, "
          f"min {per[0]:,.0f}, max {per[-1]:,.0f} (load average {os.getloadavg()[0]:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--vms", type=int, default=5000)
    parser.add_argument("--right-seconds", type=float, default=30.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured period")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--per-ask", action="store_true",
                        help="report the server's CPU per ask over --runs windows")
    parser.add_argument("--runs", type=int, default=5, help="windows (with --per-ask)")
    parser.add_argument("--jwt", action="store_true", help="pod-bound RS256 tokens")
    parser.add_argument("--compact", action="store_true", help="the controller's store")
    parser.add_argument("--stale", action="store_true", help="every ask dropped stale")
    parser.add_argument("--profile", default="", help="yappi stats to this file")
    parser.add_argument("--null-service", action="store_true",
                        help="the listener alone (every ask granted with no work)")
    parser.add_argument("--workers", type=int, default=0,
                        help="the server's worker threads (default: RIGHTS_WORKERS)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--keys", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    if args.per_ask:
        per_ask(args)
        return
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_rights", "--serve",
                              "--vms", str(args.vms), "--right-seconds",
                              str(args.right_seconds)],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        idle0 = cpu_seconds(child.pid)
        time.sleep(args.seconds)
        idle = cpu_seconds(child.pid) - idle0
        interval = args.right_seconds / 3
        names = vm_names(args.vms)
        out: Any = multiprocessing.Queue()
        until = time.monotonic() + args.seconds
        shards = [names[k::args.clients] for k in range(args.clients)]
        busy0 = cpu_seconds(child.pid)
        procs = [multiprocessing.Process(target=client, args=(port, s, interval, until, out))
                 for s in shards]
        for p in procs:
            p.start()
        results = [out.get() for _ in procs]
        busy = cpu_seconds(child.pid) - busy0
        for p in procs:
            p.join()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(10)
    asked = sum(r[0] for r in results)
    refused = sum(r[1] for r in results)
    latencies = sorted(x for r in results for x in r[2])
    p50 = latencies[len(latencies) // 2] * 1000
    p99 = latencies[int(len(latencies) * 0.99)] * 1000
    print(f"{args.vms} VMs, D = {args.right_seconds:g} s (one ask per VM per "
          f"{interval:g} s), {args.seconds:g} s measured on {os.cpu_count()} CPUs:")
    print(f"  asks/s {asked / args.seconds:.0f}; not 200: {refused}; latency p50 "
          f"{p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"  server CPU: {busy / args.seconds * 100:.1f} % of a core with renewals, "
          f"{idle / args.seconds * 100:.1f} % idle (the same server, no asks)")


if __name__ == "__main__":
    main()
