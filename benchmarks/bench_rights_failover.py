"""Self-fencing at a leader failover: how long N runners wait for the new leader's grant.

    python -m benchmarks.bench_rights_failover --vms 500 --kills 4
    python -m benchmarks.bench_rights_failover --vms 5000 --kills 3 --windows 2 \\
        --delete-namespace
    python -m benchmarks.bench_rights_failover --vms 500 --client python  # the Python fleet

Opt-in: not part of the test command. A private local control plane with simulated
(kwok) nodes, three real ``neonvm controller run`` replicas with self-fencing on and a
rights audience (so every runner pod gets the projected token volume, as with the chart's
defaults, and its lease timing), and ``--vms`` VMs converged under them. The simulated
nodes run no runner, so this benchmark runs one simulated runner per VM, each with a
real token of the rights audience bound to the VM's pod (the TokenRequest API, as the
kubelet's projected volume carries), from a loopback address of its own, asking on a new
connection each time:

* ``--client go`` (the default): one Go process, a goroutine per runner
  (``benchmarks/rightsload``, :mod:`benchmarks.go_rightsload`; built with ``go build``
  once per source version into ``~/.cache/neonvm/bin``). Each runs a line-by-line port of
  the shipped :class:`~neonvm.runner.right.RightKeeper`'s schedule and deadline rule (ask
  times and timeouts, quick asks, NotLeader resends, the last chance, the first-grant
  backoff), not the keeper itself: tests/test_rightsload_parity.py checks the port
  against the keeper over scripted answers. Why: at 5,000 VMs the Python clients below
  lagged 6.4 s at p99 after a kill on a 2-core machine (they compete with the leader for
  the CPU), so G measured them, not the leader;
* ``--client python``: ``--clients`` processes running the shipped keeper itself (its
  schedule, timeouts, quick asks and deadline, unchanged), whose HTTP is done by asyncio
  (:class:`Replay`: each ask's answers are fetched, then replayed to the keeper).

Runners reach the leader as through the rights Service: this process reads the
EndpointSlice the leader writes every ``--proxy-poll`` seconds and hands it to the
runners ``--proxy-delay`` later (kube-proxy's part); an ask while the slice names the
killed leader fails at once, as a refused connection does.

Then ``--kills`` times, each at a random moment of the steady state: SIGKILL the leader
and record the new leader's election, caches-synced and slice-written times (its log),
and per runner the time G from the kill to its first grant in the new term, and whether
its right would have lapsed before it (the real runner's watchdog would have killed the
guest). Kills alternate the two ways of asking (``--styles``): ``new``, the shipped
runner's (once its guest runs, its asks say so, ``?guest=started``, and the leader's
first grant in a term then writes no pod), and ``old``, the release before it (no such
query: every pod's first grant in a term costs a pod PATCH).
``--windows`` pairs of renewal windows (runners paused, then renewing) measure steady
renewals on the same cluster (:mod:`benchmarks.bench_rights_leader`'s measures).
``--delete-namespace`` ends with the namespace deleted under the running replicas.
docs/protocol.md, "Self-fencing"; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_rights_leader as brl  # noqa: E402
from benchmarks import controller_bench as cb  # noqa: E402
from benchmarks.api_calls import request_totals  # noqa: E402
from benchmarks.go_rightsload import GoClients, binary_path  # noqa: E402
from neonvm.dev.replica import LEASE_NAMESPACE  # noqa: E402
from neonvm.drills.observer import percentile  # noqa: E402
from neonvm.runner.right import MAX_ANSWER, RightConfig, RightKeeper  # noqa: E402

Spec = tuple[str, str, str, str, str]
"""(namespace, VM, pod uid, token file, source address) of one simulated runner."""

SERVICE = "rights"
RIGHTS_PORT = 9443
"""The port of the rights URL in the pods (the Service's; unused here: replicas listen
on ports of their own, as they share this host)."""
SLICE = f"{SERVICE}-leader"
CHART_LEASE = {"duration": 4.0, "renew": 2.5, "retry": 0.5}
"""The chart's ``leaderElection`` defaults (charts/neonvm-controller/values.yaml)."""


# ---- the simulated runners (client processes) ---------------------------------------------


class NeedAnswer(Exception):
    """The keeper asked for an answer not fetched yet: what to send, within how long."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str],
                 timeout: float) -> None:
        super().__init__("answer not fetched yet")
        self.url, self.body, self.headers, self.timeout = url, body, headers, timeout


class Replay:
    """A :class:`RightKeeper`'s clock and ``post`` for asyncio: the keeper's
    ``ask_once`` runs once per answer; each run replays the answers fetched so far (the
    clock reading the send time, then each answer's arrival) and raises
    :class:`NeedAnswer` for the next one, until the ask is over. Only the last run
    changes the keeper's state (before it, ``ask_once`` only notes its first ask's
    ``t0``, the same on every run), so the keeper decides, and times, exactly as it
    does over its own blocking ``post``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.answers: list[tuple[float, tuple[int, bytes] | BaseException]] = []
        self.cursor = 0

    def clock(self) -> float:
        return self.now

    def post(self, url: str, body: bytes, headers: Any, timeout: float) -> tuple[int, bytes]:
        if self.cursor == len(self.answers):
            raise NeedAnswer(url, body, dict(headers), timeout)
        at, answer = self.answers[self.cursor]
        self.cursor += 1
        self.now = at
        if isinstance(answer, BaseException):
            raise answer
        return answer


@dataclass
class SimRunner:
    keeper: RightKeeper
    replay: Replay
    source: str
    first_after: float | None = None
    """Arrival of the first grant asked at or after the epoch (the kill)."""
    lapsed_at: float | None = None
    """The deadline that passed with no grant since the epoch (the guest killed)."""


@dataclass
class Tally:
    asks: int = 0
    codes: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lag: list[float] = field(default_factory=list)
    """How late the event loop woke for a 0.1 s sleep (the client's own lag: it delays
    asks, and answers' reading, alike)."""


class Fleet:
    """One client process's simulated runners, driven by commands on ``conn``."""

    def __init__(self, specs: list[Spec], seconds: float, url: str, conn: Any,
                 started: bool = False) -> None:
        self.conn = conn
        self.seconds = seconds
        self.runners: list[SimRunner] = []
        for namespace, vm, uid, token_file, source in specs:
            replay = Replay()
            config = RightConfig(url=url, seconds=seconds, namespace=namespace, vm=vm,
                                 pod_uid=uid, token_file=None,
                                 rights_token_file=Path(token_file))
            keeper = RightKeeper(config, replay.clock, replay.post)
            if started:
                keeper.guest_started()
            self.runners.append(SimRunner(keeper, replay, source))
        self.endpoint: tuple[str, int] | None = None
        self.style = "new"
        """``new``: the request target as the keeper makes it (``?guest=started`` once
        its guest runs); ``old``: the path alone, as a runner of the release before it."""
        self.dead: set[int] = set()
        self.epoch: float | None = None
        self.tally = Tally()
        self.running = asyncio.Event()
        self.running.set()
        self.paused_at = self.resumed_at = 0.0
        self.stopped = asyncio.Event()
        self.go = asyncio.Event()
        self.cpu0 = time.process_time()

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self.command)
        await self.go.wait()
        start = loop.time()
        spread = self.seconds / 3
        tasks = [asyncio.create_task(self.run(r, start + random.uniform(0, spread)))
                 for r in self.runners]
        tasks.append(asyncio.create_task(self.tick()))
        await self.stopped.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, r: SimRunner, at: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not self.running.is_set():
                paused_at = self.paused_at
                await self.running.wait()
                at += self.resumed_at - min(paused_at, at)  # the schedule slides, spread
                continue
            t0 = loop.time()
            await self.ask(r, t0)
            at = r.keeper.next_ask(t0)

    async def tick(self, period: float = 0.1) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(period)
            self.tally.lag.append(loop.time() - t - period)

    async def ask(self, r: SimRunner, t0: float) -> None:
        loop = asyncio.get_running_loop()
        replay = r.replay
        replay.answers = []
        before = r.keeper.deadline
        while True:
            replay.now, replay.cursor = t0, 0
            try:
                r.keeper.ask_once()
                break
            except NeedAnswer as need:
                try:
                    answer: tuple[int, bytes] | BaseException = await self.post(need, r.source)
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    answer = exc
                replay.answers.append((loop.time(), answer))
        end = loop.time()
        last = replay.answers[-1][1] if replay.answers else None
        self.tally.asks += 1
        self.tally.codes[last[0] if isinstance(last, tuple) else 0] += 1
        self.tally.latencies.append(end - t0)
        if r.keeper.last_grant != t0:
            return
        if not r.keeper.says_started():
            r.keeper.guest_started()  # QEMU starts after the first grant (SelfFence.arm)
        if self.epoch is not None:
            if before is not None and end > before and before > self.epoch \
                    and r.lapsed_at is None and r.first_after is None:
                r.lapsed_at = before
            if t0 >= self.epoch and r.first_after is None:
                r.first_after = end

    async def post(self, need: NeedAnswer, source: str) -> tuple[int, bytes]:
        """One POST to the endpoint the slice names, within ``need.timeout`` overall (as
        :func:`neonvm.runner.right.http_post`), from ``source``."""
        endpoint = self.endpoint
        if endpoint is None or endpoint[1] in self.dead:
            raise ConnectionRefusedError("no live endpoint")  # what a connect would get
        if need.timeout <= 0:
            raise TimeoutError("no time left")
        return await asyncio.wait_for(self._exchange(endpoint, need, source), need.timeout)

    async def _exchange(self, endpoint: tuple[str, int], need: NeedAnswer,
                        source: str) -> tuple[int, bytes]:
        host, port = endpoint
        parts = urllib.parse.urlsplit(need.url)
        target = parts.path + (f"?{parts.query}" if parts.query and self.style == "new"
                               else "")
        reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        try:
            head = (f"POST {target} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    + "".join(f"{k}: {v}\r\n" for k, v in need.headers.items())
                    + f"Content-Length: {len(need.body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + need.body)
            data = await reader.read(MAX_ANSWER + 4096)
            while data.find(b"\r\n\r\n") < 0 or not data.endswith(b"}"):
                more = await reader.read(MAX_ANSWER)
                if not more:
                    break
                data += more
        finally:
            writer.close()
        head_end = data.find(b"\r\n\r\n")
        status_line = data[:data.find(b"\r\n")].split()
        if head_end < 0 or len(status_line) < 2 or not status_line[1].isdigit():
            raise http.client.BadStatusLine(repr(data[:80]))
        return int(status_line[1]), data[head_end + 4:]

    def command(self) -> None:
        message = self.conn.recv()
        kind, rest = message[0], message[1:]
        if kind == "endpoint":
            self.endpoint = rest[0]
        elif kind == "go":
            self.go.set()
        elif kind == "dead":
            self.dead.add(rest[0])
        elif kind == "alive":
            self.dead.discard(rest[0])
        elif kind == "style":
            self.style = rest[0]
        elif kind == "epoch":
            self.epoch = rest[0]
            for r in self.runners:
                r.first_after = r.lapsed_at = None
        elif kind == "report":
            now = asyncio.get_running_loop().time()
            epoch = self.epoch or 0.0
            self.conn.send({
                "g": [None if r.first_after is None else r.first_after - epoch
                      for r in self.runners],
                "lapsed": sum(1 for r in self.runners if r.lapsed_at is not None or (
                    r.first_after is None and (r.keeper.deadline or 0) < now)),
            })
        elif kind == "granted_since":
            self.conn.send(sum(1 for r in self.runners
                               if (r.keeper.last_grant or -1) >= rest[0]))
        elif kind == "stats":
            t, self.tally = self.tally, Tally()
            cpu, self.cpu0 = time.process_time() - self.cpu0, time.process_time()
            self.conn.send((t.asks, dict(t.codes), t.latencies,
                            percentile(t.lag, 0.99) or 0.0, cpu))
        elif kind == "pause":
            self.paused_at = asyncio.get_running_loop().time()
            self.running.clear()
        elif kind == "resume":
            self.resumed_at = asyncio.get_running_loop().time()
            self.running.set()
        elif kind == "stop":
            self.stopped.set()


def client_proc(specs: list[Spec], seconds: float, url: str, conn: Any,
                started: bool) -> None:
    from loguru import logger

    logger.remove()  # the keepers' warnings (a failover makes thousands)
    asyncio.run(Fleet(specs, seconds, url, conn, started).main())


class Clients:
    """The client processes, each a :class:`Fleet` of a share of the runners."""

    def __init__(self, specs: list[Spec], seconds: float, url: str, processes: int,
                 started: bool = False) -> None:
        ctx = multiprocessing.get_context("fork")
        self._pipes: list[Any] = []
        self._procs: list[Any] = []
        self._lock = threading.Lock()
        for k in range(processes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=client_proc, args=(specs[k::processes], seconds, url,
                                                         theirs, started), daemon=True)
            proc.start()
            self._pipes.append(mine)
            self._procs.append(proc)

    def send(self, *message: Any) -> None:
        with self._lock:
            for pipe in self._pipes:
                pipe.send(message)

    def ask_all(self, *message: Any) -> list[Any]:
        with self._lock:
            for pipe in self._pipes:
                pipe.send(message)
            return [pipe.recv() for pipe in self._pipes]

    def stats(self) -> tuple[int, Counter[int], list[float], float, float]:
        """(asks, answers by status (0: none), latencies, the worst process's p99 event
        loop lag, client CPU seconds) since the last call."""
        got = self.ask_all("stats")
        codes: Counter[int] = Counter()
        for g in got:
            codes.update(g[1])
        return (sum(g[0] for g in got), codes, [x for g in got for x in g[2]],
                max(g[3] for g in got), sum(g[4] for g in got))

    def granted_since(self, t: float) -> int:
        return sum(self.ask_all("granted_since", t))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.send("stop")
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


# ---- the slice, as kube-proxy sees it ----------------------------------------------------


AnyClients = Clients | GoClients
"""The runners: the Python processes (``--client python``) or the Go one (``go``)."""


class Proxy:
    """Reads the rights EndpointSlice every ``poll`` seconds and hands a change to the
    runners ``delay`` seconds after it was seen (kube-proxy's watch and sync). The slice
    names a replica's fake pod IP and its port (an EndpointSlice refuses loopback): the
    runners reach that port on 127.0.0.1, where the replica listens."""

    def __init__(self, api: Any, namespace: str, clients: AnyClients, poll: float,
                 delay: float) -> None:
        self._api, self._namespace, self._clients = api, namespace, clients
        self._poll, self._delay = poll, delay
        self.seen: list[tuple[float, int | None]] = []
        """(wall time seen, port named) of each change."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proxy", daemon=True)

    def start(self) -> Proxy:
        """Hand the slice as it is now to the runners at once, then follow it."""
        port = self._read()
        self.seen.append((time.time(), port))
        self._clients.send("endpoint", None if port is None else ("127.0.0.1", port))
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def port(self) -> int | None:
        return self.seen[-1][1] if self.seen else None

    def _read(self) -> int | None:
        from neonvm import kube

        found = kube.get_or_none(
            self._api, f"/apis/discovery.k8s.io/v1/namespaces/{self._namespace}/"
            f"endpointslices/{SLICE}", timeout=10)
        if not found or not found.get("endpoints") or not found.get("ports"):
            return None
        return int(found["ports"][0]["port"])

    def _run(self) -> None:
        current = self.port()
        while not self._stop.wait(self._poll):
            try:
                port = self._read()
            except Exception:  # an API hiccup: kube-proxy keeps what it has
                continue
            if port == current:
                continue
            current = port
            self.seen.append((time.time(), port))
            endpoint = None if port is None else ("127.0.0.1", port)
            timer = threading.Timer(self._delay, self._clients.send, ("endpoint", endpoint))
            timer.daemon = True
            timer.start()


# ---- the cluster side ---------------------------------------------------------------------


@dataclass
class FailoverReplicas(brl.FencingReplicas):
    """Three replicas with self-fencing as the chart sets it: rights served on a port of
    each, the rights Service's slice written by the leader (``--pod-ip`` a fake
    10.255.0.k), a rights audience (pods get the projected token), the chart's lease
    timing, the Lease where the chart's FlowSchema puts it in its priority level
    (:func:`benchmarks.soak.install_apf`)."""

    rights_ports: list[int] = field(default_factory=list)
    audience: str = ""
    _index: int = 0

    def start(self, index: int) -> cb.Replica:
        self._index = index
        return super().start(index)

    def _argv(self, identity: str) -> list[str]:
        port = self.rights_ports[self._index]
        return [*cb.ReplicaSet._argv(self, identity),
                "--right-seconds", f"{self.right_seconds:g}",
                "--rights-url", f"http://{SERVICE}.{self.namespace}.svc:{RIGHTS_PORT}",
                "--rights-bind", f"127.0.0.1:{port}",
                "--rights-service", f"{self.namespace}/{SERVICE}",
                "--pod-ip", f"10.255.0.{self._index + 1}",
                "--rights-audience", self.audience,
                "--lease-namespace", LEASE_NAMESPACE,
                "--lease-duration", f"{CHART_LEASE['duration']:g}",
                "--renew-deadline", f"{CHART_LEASE['renew']:g}",
                "--retry-period", f"{CHART_LEASE['retry']:g}"]

    def index_of(self, replica: cb.Replica) -> int:
        return int(replica.name.rsplit("-", 1)[1])


def mint_tokens(api: Any, namespace: str, audience: str, into: Path, threads: int = 16
                ) -> list[Spec]:
    """A token of ``audience`` bound to each VM's current pod (TokenRequest for the pod's
    ServiceAccount, 7,200 s, as the kubelet's projected volume), in a file each."""
    from kubernetes import client

    from neonvm import kube
    from neonvm.api import types

    vms = client.CustomObjectsApi(api).list_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, _request_timeout=120)["items"]
    pods = {p["metadata"]["name"]: p for p in api.sanitize_for_serialization(
        client.CoreV1Api(api).list_namespaced_pod(namespace, _request_timeout=120).items)}
    wanted = []
    for i, vm in enumerate(sorted(vms, key=lambda v: v["metadata"]["name"])):
        status = vm.get("status") or {}
        pod = pods.get(status.get("podName") or "")
        if pod is None or pod["metadata"]["uid"] != status.get("podUID"):
            raise RuntimeError(f"VM {vm['metadata']['name']}: no current pod")
        wanted.append((i, vm["metadata"]["name"], pod))

    def one(item: tuple[int, str, dict[str, Any]]) -> Spec:
        i, vm_name, pod = item
        account = pod["spec"].get("serviceAccountName") or "default"
        answer = kube.request(
            api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                  "spec": {"audiences": [audience], "expirationSeconds": 7200,
                           "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                              "name": pod["metadata"]["name"],
                                              "uid": pod["metadata"]["uid"]}}}, timeout=60)
        path = into / f"{vm_name}.token"
        path.write_text(answer["status"]["token"])
        return (namespace, vm_name, pod["metadata"]["uid"], str(path), brl.source_address(i))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, wanted))


def log_events(path: Path, since: float) -> dict[str, float]:
    """Wall times (after ``since``) of a replica's term start, caches synced and slice
    written, from its JSON log."""
    keys = {"started leading": "elected", "caches synced": "synced",
            "rights Service": "slice"}
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                doc = json.loads(line)
                ts = datetime.fromisoformat(doc["ts"]).timestamp()
            except (ValueError, KeyError):
                continue
            if ts < since:
                continue
            for needle, name in keys.items():
                if name not in out and str(doc.get("msg", "")).startswith(needle):
                    out[name] = ts
    return out


def terms_started(cluster: Any, replicas: FailoverReplicas, since: float) -> int:
    """Terms begun (``started leading``) by any replica since wall time ``since``: more
    than one after a kill when a new leader lost its Lease before the runners were all
    granted (each term's first grants start over)."""
    count = 0
    for name in {m.name for m in replicas.members}:
        with contextlib.suppress(OSError):
            for line in cluster.log_file(name).read_text(errors="replace").splitlines():
                if '"started leading' not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError):
                    if datetime.fromisoformat(json.loads(line)["ts"]).timestamp() >= since:
                        count += 1
    return count


def term_costs(api: Any) -> tuple[int, int, int]:
    """(API requests, pod PATCHes, TokenReviews) so far, every client."""
    totals = request_totals(api)
    return (sum(totals.values()),
            sum(v for (verb, res, sub, _), v in totals.items()
                if (verb, res, sub) == ("PATCH", "pods", "")),
            sum(v for (verb, res, _, _), v in totals.items()
                if (verb, res) == ("POST", "tokenreviews")))


def rights_grants(replicas: FailoverReplicas, replica: cb.Replica) -> int:
    """The grants ``replica`` answered so far (its rights answers of code 200)."""
    import urllib.request

    port = replicas.metrics_port(replica)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('neonvm_controller_rights_answers_total{code="200"')))


def fmt_g(values: list[float]) -> str:
    if not values:
        return "none"
    return (f"min {min(values):.1f} s, p10 {percentile(values, 0.1) or 0:.1f} s, p50 "
            f"{percentile(values, 0.5) or 0:.1f} s, p90 {percentile(values, 0.9) or 0:.1f} s, "
            f"p99 {percentile(values, 0.99) or 0:.1f} s, max {max(values):.1f} s")


@dataclass
class Kill:
    style: str
    at: str
    """UTC time of the kill."""
    elected: float | None
    synced: float | None
    slice: float | None
    seen: float | None
    """When the runners' proxy saw the new slice (before its ``--proxy-delay``)."""
    g: list[float]
    missing: int
    lapsed: int
    patches: int
    reviews: int
    api_rps: float
    leader_cpu: float
    client_cpu: float
    not_200: dict[int, int]
    lag_p99: float
    ask_rate: float
    steady: int
    """Runners granted within D/2 before the kill (all of them in a steady state)."""
    terms: int
    """Terms begun from the kill until every runner was granted (1 unless the new
    leader lost its Lease meanwhile)."""
    leader_200: int
    """Grants the new leader answered (its ``neonvm_controller_rights_answers_total``);
    more than the runners got when answers came after the runner stopped waiting."""
    runners_200: int

    def line(self, n: int) -> str:
        def s(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f} s"
        return (f"kill at {self.at} ({self.style}): {self.steady}/{n} granted within D/2 "
                f"before it; {self.terms} terms; first elected "
                f"{s(self.elected)}, caches synced "
                f"{s(self.synced)}, slice written {s(self.slice)} (seen {s(self.seen)}); G "
                f"{fmt_g(self.g)}; not granted {self.missing}/{n}; lapsed {self.lapsed}/{n}; "
                f"{self.patches} pod PATCH, {self.reviews} TokenReviews, API {self.api_rps:.0f}"
                f" req/s; new leader {100 * self.leader_cpu:.0f} % of a core; clients "
                f"{100 * self.client_cpu:.0f} %; {self.ask_rate:.0f} asks/s, not 200 (0: no "
                f"answer) {self.not_200}; the leader answered {self.leader_200} asks 200 (the "
                f"runners got {self.runners_200}); client loop lag p99 {self.lag_p99:.2f} s")


def current_leader(api: Any, namespace: str, replicas: FailoverReplicas, cluster: Any
                   ) -> tuple[cb.Replica, brl.Leader]:
    identity, _ = cb.wait_for_leader(api, LEASE_NAMESPACE)
    replica = replicas.by_identity(identity)
    assert replica is not None, identity
    cb.wait_metrics(replicas, replica)
    port = replicas.metrics_port(replica)
    assert port is not None
    api_pid = int((cluster.state_dir / "run" / "kube-apiserver.pid").read_text())
    return replica, brl.Leader(replicas.pid(replica), port, api_pid)


@dataclass
class Run:
    """What the run has: its cluster, replicas, runners."""

    args: Any
    api: Any
    namespace: str
    cluster: Any
    replicas: FailoverReplicas
    clients: AnyClients
    proxy: Proxy
    n: int
    kills: list[Kill] = field(default_factory=list)

    def leader(self) -> tuple[cb.Replica, brl.Leader]:
        return current_leader(self.api, self.namespace, self.replicas, self.cluster)

    def wait_granted(self, since: float, timeout: float, say: Callable[[str], None]) -> int:
        """Until every runner was granted after ``since`` (monotonic); how many were."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.clients.granted_since(since)
            if got >= self.n or time.monotonic() > deadline:
                return got
            say(f"granted: {got}/{self.n}")
            time.sleep(2.0)

    def kill(self, style: str, say: Callable[[str], None]) -> Kill:
        args = self.args
        self.clients.send("style", style)
        replica, leader = self.leader()
        # The style's asks for a whole period first, then a random moment of it.
        time.sleep(args.right_seconds / 3 + random.uniform(0, args.right_seconds / 3))
        steady = self.clients.granted_since(time.monotonic() - args.right_seconds / 2)
        self.clients.stats()
        api0, patches0, reviews0 = term_costs(self.api)
        index = self.replicas.index_of(replica)
        port = self.replicas.rights_ports[index]
        granted0 = {m.name: rights_grants(self.replicas, m) for m in self.replicas.members
                    if m.name != replica.name}
        wall, mono = time.time(), time.monotonic()
        os.kill(leader.pid, signal.SIGKILL)
        self.clients.send("epoch", mono)
        self.clients.send("dead", port)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(leader.pid, 0)
        at = datetime.utcfromtimestamp(wall).strftime("%H:%M:%S")
        say(f"killed the leader {replica.name} at {at} ({style})")
        identity, _ = cb.wait_for_leader(self.api, LEASE_NAMESPACE,
                                         other_than=replica.identity)
        new = self.replicas.by_identity(identity)
        assert new is not None
        new_pid = self.replicas.pid(new)
        cpu0 = brl.cpu_seconds(new_pid)
        timeout = args.right_seconds * 4 + self.n / 20
        got = self.wait_granted(mono, timeout, say)
        elapsed = time.monotonic() - mono
        cpu = brl.cpu_seconds(new_pid) - cpu0
        api1, patches1, reviews1 = term_costs(self.api)
        report = self.clients.ask_all("report")
        asks, codes, _, lag, client_cpu = self.clients.stats()
        granted = rights_grants(self.replicas, new) - granted0.get(new.name, 0)
        ask_rate = asks / elapsed
        g = [x for r in report for x in r["g"] if x is not None]
        events = log_events(self.cluster.log_file(new.name), wall - 1)
        seen = next((t - wall for t, p in self.proxy.seen if t >= wall and p is not None),
                    None)
        def after_kill(event: str) -> float | None:
            return None if event not in events else events[event] - wall
        k = Kill(style, at, after_kill("elected"), after_kill("synced"), after_kill("slice"),
                 seen, g, self.n - got, sum(r["lapsed"] for r in report),
                 patches1 - patches0, reviews1 - reviews0, (api1 - api0) / elapsed,
                 cpu / elapsed, client_cpu / elapsed,
                 {c: v for c, v in codes.items() if c != 200}, lag, ask_rate,
                 steady, terms_started(self.cluster, self.replicas, wall), granted,
                 codes.get(200, 0))
        say(k.line(self.n))
        self.kills.append(k)
        # A Deployment brings the killed replica back, as a standby.
        self.replicas.start(index)
        self.clients.send("alive", port)
        self.clients.send("epoch", None)
        return k


# ---- the run -------------------------------------------------------------------------------


def renewal_windows(run: Run, say: Callable[[str], None]) -> list[tuple[brl.Window, float]]:
    """``--windows`` pairs on the same leader and fleet: runners paused (the baseline),
    then renewing; each with the clients' CPU."""
    args = run.args
    _, leader = run.leader()
    out: list[tuple[brl.Window, float]] = []
    client_cpu = [0.0]

    def renewing() -> tuple[int, int, list[float]]:
        run.clients.stats()
        run.clients.send("resume")
        time.sleep(args.seconds)
        run.clients.send("pause")
        asks, codes, latencies, _, client_cpu[0] = run.clients.stats()
        return asks, asks - codes.get(200, 0), latencies

    for _ in range(args.windows):
        run.clients.send("pause")
        time.sleep(1.0)  # asks in flight end
        run.clients.stats()
        w = brl.window("baseline", leader, run.api, None, args.seconds)
        cpu = run.clients.stats()[4]
        out.append((w, cpu))
        say(brl.describe(w) + f"; clients {100 * cpu / w.seconds:.1f} %")
        w = brl.window("renewals", leader, run.api, renewing)
        out.append((w, client_cpu[0]))
        say(brl.describe(w) + f"; clients {100 * client_cpu[0] / w.seconds:.1f} %")
    return out


def converge_until(api: Any, namespace: str, names: list[str], until: str,
                   say: Callable[[str], None]) -> tuple[float, float] | str:
    """:func:`benchmarks.controller_bench.converge_watched`, given up at ``until`` (UTC
    HH:MM; "" never): its result, or why there is none."""
    from benchmarks.soak import seconds_until

    result: list[tuple[float, float]] = []
    failed: list[BaseException] = []

    def converge() -> None:
        try:
            result.append(cb.converge_watched(api, namespace, names, say))
        except Exception as exc:
            failed.append(exc)

    thread = threading.Thread(target=converge, name="converge", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(timeout=seconds_until(until) if until else None)
    if result:
        return result[0]
    why = f"{failed[0]}" if failed else f"still converging at {until} UTC"
    return f"{len(names)} VMs not converged after {time.monotonic() - started:.0f} s: {why}"


def delete_namespace(api: Any, namespace: str, cluster: Any, replicas: FailoverReplicas,
                     n: int, until: float, say: Callable[[str], None]) -> str:
    """Delete the namespace with the replicas running; time it until it is gone (or
    ``until``, wall) and count the pod creates refused there and the Restarts made
    meanwhile, as :func:`benchmarks.soak.delete_namespace` does for the soak's namespace
    (its log lines, :data:`~benchmarks.soak.REFUSED` and :data:`~benchmarks.soak.RESTARTED`,
    in the replicas' logs)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    from benchmarks.soak import REFUSED, RESTARTED

    def count(text: str) -> int:
        return sum(cluster.log_file(m.name).read_text(errors="replace").count(text)
                   for m in replicas.members)

    core = client.CoreV1Api(api)
    before, restarts = count(REFUSED), count(RESTARTED)
    say(f"deleting namespace {namespace} ({n} VMs), replicas running")
    t0 = time.monotonic()
    core.delete_namespace(namespace, _request_timeout=30)
    gone = None
    while time.time() < until:
        try:
            core.read_namespace(namespace, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                gone = time.monotonic() - t0
                break
        time.sleep(2.0)
    left = "" if gone is not None else (
        f" (not gone after {time.monotonic() - t0:.0f} s; "
        f"{len(core.list_namespaced_pod(namespace, _request_timeout=60).items)} pods left)")
    line = (f"namespace of {n} VMs deleted with 3 replicas running: gone after "
            f"{'-' if gone is None else f'{gone:.0f} s'}{left}; {count(REFUSED) - before} pod "
            f"creates refused there, {count(RESTARTED) - restarts} Restarts")
    say(line)
    return line


def measure(run: Run, started: float, say: Callable[[str], None],
            load: list[tuple[float, float, float]]) -> list[str]:
    """The runners' first grants (from ``started``, monotonic), the renewal windows, the
    kills; the lines to print."""
    from benchmarks.soak import seconds_until

    args = run.args
    lines: list[str] = []
    stop_at = time.time() + seconds_until(args.kills_until) if args.kills_until else None
    limit = args.right_seconds * 4 + run.n / 10
    if stop_at is not None:
        limit = min(limit, max(60.0, stop_at - time.time()))
    got = run.wait_granted(started - args.right_seconds, limit, say)
    first = time.monotonic() - started
    asks, codes, _, lag, cpu = run.clients.stats()
    lines.append(f"runners' first grants ({args.setup_asks} asks): {got}/{run.n} in "
                 f"{first:.1f} s after the runners started ({asks} asks, not 200 "
                 f"{ {c: v for c, v in codes.items() if c != 200} }"
                 f", client loop lag p99 {lag:.2f} s, clients {100 * cpu / first:.0f} % of a "
                 "core)")
    say(lines[-1])
    time.sleep(args.right_seconds)
    run.clients.stats()
    if args.windows and (stop_at is None or time.time() < stop_at):
        for w, cpu in renewal_windows(run, say):
            lines.append(brl.describe(w) + f"; clients {100 * cpu / w.seconds:.1f} % of a core")
        run.clients.send("resume")
        time.sleep(args.right_seconds / 3 + 2)
    load.append(os.getloadavg())
    styles = [args.styles[i % len(args.styles)] for i in range(args.kills)]
    for style in styles:
        if stop_at is not None and time.time() > stop_at:
            lines.append(f"no more kills after {args.kills_until} UTC ({len(run.kills)} made)")
            say(lines[-1])
            break
        k = run.kill(style, say)
        lines.append(k.line(run.n))
        load.append(os.getloadavg())
        # Steady again: every runner renewed by the new leader, then a whole D more.
        run.wait_granted(time.monotonic() - 1, args.right_seconds * 4 + run.n / 5, say)
        time.sleep(args.right_seconds)
    for style in sorted(set(styles)):
        ks = [k for k in run.kills if k.style == style]
        lines.append(f"{style}: {len(ks)} kills, G over all: "
                     f"{fmt_g([x for k in ks for x in k.g])}; lapsed "
                     f"{sum(k.lapsed for k in ks)}/{run.n * len(ks)}")
    return lines


def on_cluster(args: Any, cluster: Any, tokens: Path,
               load: list[tuple[float, float, float]], say: Callable[[str], None]
               ) -> list[str]:
    """The run on a started cluster: the lines to print."""
    from benchmarks.soak import install_apf, seconds_until
    from neonvm import kube
    from neonvm.controller.config import http_pool_size
    from neonvm.drills import fleet

    lines: list[str] = []
    api = kube.api_client(cluster.kubeconfig, pool_size=http_pool_size(cb.WORKERS))
    controller_api = kube.api_client(cluster.kubeconfig_for("controller"))
    apf = install_apf(api, controller_api)
    say(f"the chart's priority level: {apf}")
    namespace = f"bench-failover-{uuid.uuid4().hex[:5]}"
    fleet.ensure_namespace(api, namespace)
    audience = f"vm.neon.tech/rights/{namespace}/bench"
    ports = [brl.free_port() for _ in range(3)]
    replicas = FailoverReplicas(cluster, namespace, count=3,
                                right_seconds=args.right_seconds, rights_ports=ports,
                                audience=audience)
    with replicas:
        cb.wait_for_leader(api, LEASE_NAMESPACE)
        names = [f"vm-{i:05d}" for i in range(args.vms)]
        say(f"converging {args.vms} self-fencing VMs under 3 replicas")
        until = (time.time() + seconds_until(args.until) if args.until
                 else time.time() + 1500)
        converged = converge_until(api, namespace, names, args.converge_until, say)
        if isinstance(converged, str):
            lines.append(converged)
            if args.delete_namespace:
                lines.append(delete_namespace(api, namespace, cluster, replicas,
                                              args.vms, until, say))
            return lines
        lines.append(f"converged {converged[0]:.0f} s after the last create (creates "
                     f"{converged[1]:.0f} s)")
        say(lines[-1])
        _, leader = current_leader(api, namespace, replicas, cluster)
        waited = brl.settle(leader, args.settle, args.settle_timeout, say)
        lines.append(f"settled after {waited:.0f} s")
        load.append(os.getloadavg())
        t0 = time.monotonic()
        specs = mint_tokens(api, namespace, audience, tokens)
        say(f"{len(specs)} tokens minted in {time.monotonic() - t0:.0f} s")
        started = args.setup_asks == "started"
        if args.client == "go":
            binary = binary_path()
            say(f"Go client: {'reusing' if binary.exists() else 'building (go build)'} "
                f"{binary}, one process for {len(specs)} runners")
            clients: AnyClients = GoClients(specs, args.right_seconds, started=started)
        else:
            clients = Clients(specs, args.right_seconds, f"http://{SERVICE}:0",
                              args.clients, started=started)
        proxy = Proxy(api, namespace, clients, args.proxy_poll, args.proxy_delay).start()
        run = Run(args, api, namespace, cluster, replicas, clients, proxy, len(specs))
        clients.send("go")
        try:
            lines += measure(run, time.monotonic(), say, load)
            if args.record is not None:
                args.record.write_text(json.dumps([asdict(k) for k in run.kills]))
            if args.delete_namespace:
                clients.send("pause")
                lines.append(delete_namespace(api, namespace, cluster, replicas,
                                              len(specs), until, say))
        finally:
            proxy.stop()
            clients.stop()
    api.close()
    return lines


def client_text(args: Any) -> str:
    return ("one Go client process" if args.client == "go"
            else f"{args.clients} Python client processes")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--vms", type=int, default=500)
    brl.add_window_args(parser, windows=0, settle_timeout=300.0)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--styles", type=lambda s: s.split(","), default=["old", "new"],
                        help="ways of asking, in turn per kill: old, new (comma-separated)")
    parser.add_argument("--proxy-poll", type=float, default=1.0)
    parser.add_argument("--proxy-delay", type=float, default=1.0)
    parser.add_argument("--delete-namespace", action="store_true")
    parser.add_argument("--until", default="",
                        help="UTC HH:MM by which the namespace delete stops waiting")
    parser.add_argument("--converge-until", default="",
                        help="UTC HH:MM: not converged by then, go to --delete-namespace")
    parser.add_argument("--kills-until", default="",
                        help="UTC HH:MM after which no kill starts")
    parser.add_argument("--setup-asks", choices=("runner", "started"), default="runner",
                        help="the runners' first asks, before any kill: as a runner before "
                             "its guest starts (a pod PATCH each), or saying the guest runs "
                             "(none: a quicker setup at 5,000 VMs, not what a runner does)")
    parser.add_argument("--client", choices=("go", "python"), default="go",
                        help="the simulated runners: one Go process (benchmarks/rightsload, "
                             "built with go build) or --clients Python processes")
    parser.add_argument("--record", type=Path, default=None,
                        help="write each kill's figures (every G) to this JSON file")
    args = parser.parse_args()

    from loguru import logger

    from benchmarks.__main__ import local_cluster, say

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster's down() runs
    load = [os.getloadavg()]
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    dirty = os.popen(f"git -C {ROOT} status --porcelain --untracked-files=no -- neonvm"
                     ).read().split()[1::2]
    if dirty:
        commit += " + uncommitted " + ", ".join(dirty)
    began = datetime.utcnow().strftime("%Y-%m-%d %H:%M")
    with local_cluster(None, args.nodes, pods=args.vms + 50) as cluster, \
            tempfile.TemporaryDirectory(prefix="failbench-tokens-") as tokens:
        lines = on_cluster(args, cluster, Path(tokens), load, say)
    load.append(os.getloadavg())
    print(f"{args.vms} VMs, D = {args.right_seconds:g} s, 3 replicas (lease "
          f"{CHART_LEASE['duration']:g}/{CHART_LEASE['renew']:g}/{CHART_LEASE['retry']:g} s), "
          f"{client_text(args)}, proxy poll {args.proxy_poll:g} s + delay "
          f"{args.proxy_delay:g} s; commit {commit}, began {began} UTC; load average "
          + ", ".join(f"{x[0]:.1f}" for x in load))
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
