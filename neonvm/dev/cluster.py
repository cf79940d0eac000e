"""A real local control plane on loopback, started and stopped as plain processes.

Components, in start order:

* ``etcd``: storage for the API server.
* ``locks-etcd``: a separate etcd for the controller's per-VM locks (in production the
  locks' etcd is not the API server's etcd, so the local cluster keeps them apart too).
  It runs as the chart asks production to: TLS, client certificates of its own CA only,
  authentication on, and each client a user whose role reads and writes one key prefix
  (:meth:`LocalCluster.locks_etcd_config`; docs/local-cluster.md, "The locks' etcd").
* ``kube-apiserver``: TLS on 127.0.0.1, client-certificate authentication, RBAC.
* with ``nodes > 0``: ``kube-scheduler``, ``kube-controller-manager`` and ``kwok``
  (simulated nodes that run pods and finish their graceful deletion).

Everything a cluster needs lives in one state directory: ``cluster.json`` (ports, node
count), PKI, kubeconfigs, data directories, logs and pid files. ``up`` is idempotent: a
component whose recorded process is alive and healthy is left alone. ``down`` stops every
recorded process and waits until each is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from neonvm.dev import binaries, bootstrap, nodes
from neonvm.dev.common import (
    CONTROLLER_KUBECONFIG_ENV,
    CONTROLLER_USER,
    DEFAULT_PORTS,
    KWOK_USER,
    ClusterError,
    ClusterSpec,
    _port_in_use,
    default_state_dir,
    free_port,
)
from neonvm.dev.pki import SERVICE_CLUSTER_IP_RANGE, CertPair, LocalPKI
from neonvm.leader.etcd import DEFAULT_PREFIX, Etcd, EtcdConfig, EtcdUnavailable

LOCKS_ETCD_ROOT = "root"
"""The etcd user (a client certificate's CN) that administers the locks' etcd."""
LOCKS_ETCD_CONTROLLER = "neonvm-controller"
"""The etcd user of the controller's default prefix (``/neonvm``): read and write there only."""
LOCKS_ETCD_PATIENCE = 30.0
"""How long making a user waits for a locks' etcd that is restarting (seconds)."""
DELETE_COLLECTION_WORKERS = 8
"""kube-apiserver's ``--delete-collection-workers`` (default 1): a namespace's deletion is
one DELETE of each collection in it (its pods, events, VMs), which the API server works
through one object at a time with one worker; at a few thousand objects that took longer
than a request may (60 s) on this machine (docs/benchmarks.md, "A namespace of 5,000 VMs
deleted with the replicas running")."""
REAL_NODE_IPS = tuple(f"10.251.{octet}.1" for octet in range(250))
"""Every address a real node's pods may reach the locks' etcd at (see
``neonvm.dev.realnode``: ``10.251.<0..249>.1``); its server certificate names them all."""

__all__ = [
    "CONTROLLER_KUBECONFIG_ENV", "CONTROLLER_USER", "DEFAULT_PORTS", "KWOK_USER",
    "ClusterError", "ClusterSpec", "ComponentStatus", "LocalCluster", "default_state_dir",
    "free_port", "running",
]

@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str


def _pid_alive(pid: int, binary_name: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    if not cmdline:
        # Right after exec the kernel may not show the new argv yet; the command name
        # (at most 15 characters) in stat is already the binary's. An exiting process
        # shows no argv either, for as long as its threads take to end: without a name
        # to compare, it still counts as alive until it is a zombie.
        return not binary_name or f"({binary_name[:15]})" in stat
    return binary_name.encode() in cmdline


class LocalCluster:
    """One local control plane rooted at ``state_dir``."""

    def __init__(self, state_dir: Path | None = None, spec: ClusterSpec | None = None) -> None:
        self.state_dir = (state_dir or default_state_dir()).resolve()
        saved = self.state_dir / "cluster.json"
        if spec is None and saved.exists():
            data = json.loads(saved.read_text())
            spec = ClusterSpec(nodes=data["nodes"], ports={**DEFAULT_PORTS, **data["ports"]},
                               service_account_tokens=data.get("service_account_tokens", False),
                               pods_per_node=data.get("pods_per_node", 110),
                               priority_and_fairness=data.get("priority_and_fairness", False))
        self.spec = spec or ClusterSpec()

    # ---- paths -------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    def kubeconfig_for(self, user: str) -> Path:
        return self.state_dir / f"{user}.kubeconfig"

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.spec.ports['kube-apiserver']}"

    @property
    def etcd_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.ports['etcd']}"

    @property
    def locks_etcd_url(self) -> str:
        """TLS only: a client needs the CA and a client certificate
        (:meth:`locks_etcd_config`, :meth:`locks_etcd_env`)."""
        return f"https://127.0.0.1:{self.spec.ports['locks-etcd']}"

    @property
    def locks_pki(self) -> LocalPKI:
        """The locks' etcd's own CA (not the API server's): only its certificates get in."""
        return LocalPKI(self.state_dir / "pki" / "locks-etcd", ca_name="neonvm-dev-locks-etcd-ca")

    def locks_etcd_identity(self, prefix: str = DEFAULT_PREFIX) -> tuple[str, CertPair]:
        """The etcd user allowed ``prefix`` and its client certificate (CN = user), made
        on first use. The default prefix's user is the controller's; others are named
        after the prefix. Creates files only: :meth:`locks_etcd_config` also makes sure
        etcd knows the user."""
        user = LOCKS_ETCD_CONTROLLER if prefix == DEFAULT_PREFIX else f"neonvm-prefix:{prefix}"
        file = "client-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", user)
        return user, self.locks_pki.issue(file, user)

    def locks_etcd_config(self, prefix: str = DEFAULT_PREFIX, *,
                          timeout: float | None = None) -> EtcdConfig:
        """A client of the locks' etcd confined to ``prefix``: TLS, the CA, and the client
        certificate of a user whose role reads and writes ``<prefix>/...`` only. The user
        is created in etcd (by root) if it is not there yet."""
        user, pair = self.locks_etcd_identity(prefix)
        self._grant_prefix_waiting_for_etcd(user, prefix)
        config = EtcdConfig(endpoints=(self.locks_etcd_url,), prefix=prefix,
                            ca=self.locks_pki.ca.cert, cert=pair.cert, key=pair.key)
        return config if timeout is None else config.with_overrides(timeout=timeout)

    def _grant_prefix_waiting_for_etcd(self, user: str, prefix: str,
                                       patience: float = LOCKS_ETCD_PATIENCE) -> None:
        """Create ``user`` with a role on ``prefix``. The locks' etcd may be restarting
        (a drill running beside this one restarts it), so an unreachable etcd is tried
        again for up to ``patience`` seconds; any other refusal is raised at once."""
        deadline = time.monotonic() + patience
        while True:
            try:
                with Etcd(self._locks_etcd_root()) as root:
                    root.grant_prefix(user, secrets.token_urlsafe(24), prefix)
                return
            except EtcdUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def locks_etcd_env(self, prefix: str = DEFAULT_PREFIX) -> dict[str, str]:
        """``NEONVM_ETCD_*`` for :meth:`locks_etcd_config` (for a child process)."""
        return self.locks_etcd_config(prefix).env()

    def _locks_etcd_root(self) -> EtcdConfig:
        root = self.locks_pki.issue(f"client-{LOCKS_ETCD_ROOT}", LOCKS_ETCD_ROOT)
        return EtcdConfig(endpoints=(self.locks_etcd_url,), ca=self.locks_pki.ca.cert,
                          cert=root.cert, key=root.key)

    def _secure_locks_etcd(self) -> None:
        """Auth on, root, and the controller's user on the default prefix (idempotent)."""
        with Etcd(self._locks_etcd_root()) as root:
            root.ensure_auth(secrets.token_urlsafe(24))
            root.grant_prefix(LOCKS_ETCD_CONTROLLER, secrets.token_urlsafe(24),
                              DEFAULT_PREFIX)

    def components(self) -> list[str]:
        names = ["etcd", "locks-etcd", "kube-apiserver"]
        if self.spec.nodes > 0:
            names += ["kube-scheduler", "kube-controller-manager", "kwok"]
        return names

    def env(self) -> dict[str, str]:
        """Environment variables that point tools at this cluster: the admin kubeconfig for
        kubectl and the inspection commands, the controller identity's kubeconfig for
        ``neonvm controller run`` (the admission fence lets only that identity ungate a
        runner pod), and the locks' etcd as the controller's etcd user (TLS; the
        default prefix only)."""
        _user, pair = self.locks_etcd_identity()
        return {
            "KUBECONFIG": str(self.kubeconfig),
            CONTROLLER_KUBECONFIG_ENV: str(self.kubeconfig_for("controller")),
            **EtcdConfig(endpoints=(self.locks_etcd_url,), prefix=DEFAULT_PREFIX,
                         ca=self.locks_pki.ca.cert, cert=pair.cert, key=pair.key).env(),
        }

    # ---- lifecycle ---------------------------------------------------------------------

    def up(self, progress: Callable[[str], None] = lambda _m: None, timeout: float = 90.0) -> None:
        """Start whatever is not running and healthy; wait until all of it is."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "cluster.json").write_text(json.dumps(asdict(self.spec), indent=2))
        for name in self.components():
            binaries.require(_binary_of(name))
        pki = self._pki()
        for name in self.components():
            if name == "kwok":
                nodes.ensure_nodes(self, progress)
            status = self.component_status(name)
            if status.running and status.healthy:
                progress(f"{name}: already running (pid {status.pid})")
                continue
            if status.running:
                progress(f"{name}: running but unhealthy ({status.detail}), restarting")
                self._stop(name)
            self._start(name, pki)
            progress(f"{name}: starting")
            self._wait_healthy(name, timeout)
            progress(f"{name}: healthy")
            if name == "locks-etcd":
                self._secure_locks_etcd()
            if name == "kube-apiserver":
                bootstrap.apply_cluster_objects(self, progress)
        if self.spec.nodes > 0:
            nodes.wait_nodes_schedulable(self, timeout)
            progress(f"{self.spec.nodes} simulated nodes ready")

    def down(self, timeout: float = 20.0) -> list[str]:
        """Stop every component this state directory recorded; return what was stopped."""
        stopped = []
        if any(self.state_dir.glob("rn*/containerd.toml")):  # real nodes: clean teardown
            from neonvm.dev import realnode

            stopped += realnode.stop(self)
        extra = sorted(p.stem for p in (self.state_dir / "run").glob("*.pid")
                       if p.stem not in DEFAULT_PORTS)
        for name in [*extra, *reversed(list(DEFAULT_PORTS))]:
            if self._pid(name) is not None:
                self._stop(name, timeout)
                stopped.append(name)
        return stopped

    def start_process(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        """Run an extra process (e.g. a controller replica) that ``down`` also stops."""
        if name in DEFAULT_PORTS:
            raise ClusterError(f"{name} is a control-plane component")
        pid = self._pid(name)
        if pid is not None and _pid_alive(pid, argv[0].rsplit("/", 1)[-1]):
            return pid
        return self._spawn(name, argv, env)

    def process_pid(self, name: str) -> int | None:
        """The pid recorded for a process started by ``start_process`` (None if none)."""
        return self._pid(name)

    def process_alive(self, name: str, binary_name: str) -> bool:
        pid = self._pid(name)
        return pid is not None and _pid_alive(pid, binary_name)

    def stop_component(self, name: str, sig: int = signal.SIGTERM,
                       timeout: float = 20.0) -> None:
        """Stop one component (used by failure tests: etcd restart, API server restart);
        after ``timeout`` seconds without exiting it is killed."""
        self._stop(name, timeout, sig=sig)

    def start_component(self, name: str, timeout: float = 60.0) -> None:
        """Start one stopped component; waits (up to 30 s) for its ports to be released
        first, since a killed process's sockets outlive its pid for a moment."""
        ports = [self.spec.ports[k] for k in (name, f"{name}-peer") if k in self.spec.ports]
        deadline = time.monotonic() + 30
        while any(_port_in_use(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._start(name, self._pki())
        self._wait_healthy(name, timeout)
        if name == "locks-etcd":
            self._secure_locks_etcd()

    def status(self) -> list[ComponentStatus]:
        return [self.component_status(n) for n in self.components()]

    def component_status(self, name: str) -> ComponentStatus:
        pid = self._pid(name)
        if pid is None:
            return ComponentStatus(name, None, False, False, "not running")
        if not _pid_alive(pid, _binary_of(name)):
            return ComponentStatus(name, pid, False, False, "exited")
        ok, detail = self._health(name)
        return ComponentStatus(name, pid, True, ok, detail)

    # ---- internals ---------------------------------------------------------------------

    def _pki(self) -> LocalPKI:
        pki = LocalPKI(self.state_dir / "pki")
        pki.issue("apiserver", "kube-apiserver", server=True)
        admin = pki.issue("admin", "neonvm-dev-admin", orgs=("system:masters",))
        self._write_kubeconfig(self.kubeconfig, admin, pki)
        controller = pki.issue("controller", CONTROLLER_USER, orgs=("neonvm:controllers",))
        self._write_kubeconfig(self.kubeconfig_for("controller"), controller, pki)
        sched = pki.issue("scheduler", "system:kube-scheduler")
        self._write_kubeconfig(self.kubeconfig_for("scheduler"), sched, pki)
        kcm = pki.issue("controller-manager", "system:kube-controller-manager")
        self._write_kubeconfig(self.kubeconfig_for("controller-manager"), kcm, pki)
        kwok = pki.issue("kwok", KWOK_USER)
        self._write_kubeconfig(self.kubeconfig_for("kwok"), kwok, pki)
        pki.service_account_key()
        return pki

    def _write_kubeconfig(self, path: Path, client: CertPair, pki: LocalPKI) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "neonvm-dev",
                    "cluster": {
                        "server": self.api_url,
                        "certificate-authority": str(pki.ca.cert),
                    },
                }
            ],
            "users": [
                {
                    "name": path.stem,
                    "user": {
                        "client-certificate": str(client.cert),
                        "client-key": str(client.key),
                    },
                }
            ],
            "contexts": [
                {"name": "neonvm-dev", "context": {"cluster": "neonvm-dev", "user": path.stem}}
            ],
            "current-context": "neonvm-dev",
        }
        path.write_text(yaml.safe_dump(config))

    def _pid_file(self, name: str) -> Path:
        return self.state_dir / "run" / f"{name}.pid"

    def _pid(self, name: str) -> int | None:
        try:
            return int(self._pid_file(name).read_text())
        except (OSError, ValueError):
            return None

    def log_file(self, name: str) -> Path:
        return self.state_dir / "logs" / f"{name}.log"

    def _argv(self, name: str, pki: LocalPKI) -> list[str]:
        p = self.spec.ports
        d = self.state_dir
        binary = str(binaries.require(_binary_of(name)))
        if name in ("etcd", "locks-etcd"):
            client, peer = p[name], p[f"{name}-peer"]
            scheme, tls = "http", []
            if name == "locks-etcd":
                # Listening on 127.0.0.1 only; a real node's pods reach it through a DNAT
                # rule (neonvm.dev.realnode), so the certificate names their addresses.
                serving = self.locks_pki.issue("server", "locks-etcd", server=True,
                                               ips=REAL_NODE_IPS)
                scheme = "https"
                tls = [f"--cert-file={serving.cert}", f"--key-file={serving.key}",
                       "--client-cert-auth", f"--trusted-ca-file={self.locks_pki.ca.cert}"]
            return [
                binary,
                f"--name={name}",
                f"--data-dir={d / 'data' / name}",
                f"--listen-client-urls={scheme}://127.0.0.1:{client}",
                f"--advertise-client-urls={scheme}://127.0.0.1:{client}",
                *tls,
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster={name}=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ]
        if name == "kube-apiserver":
            serving = pki.issue("apiserver", "kube-apiserver", server=True)
            sa_key = pki.service_account_key()
            kubelet_client = pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client")
            return [
                binary,
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={p['kube-apiserver']}",
                f"--cert-dir={d / 'pki'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={pki.ca.cert}",
                "--authorization-mode=RBAC",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--allow-privileged=true",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_key}",
                f"--service-account-signing-key-file={sa_key}",
                *([] if self.spec.service_account_tokens and self.spec.nodes > 0
                  else ["--disable-admission-plugins=ServiceAccount"]),
                # Real nodes' kubelets accept clients of the cluster CA (logs, exec).
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                "--kubelet-preferred-address-types=InternalIP,Hostname",
                f"--enable-priority-and-fairness={str(self.spec.priority_and_fairness).lower()}",
                f"--delete-collection-workers={DELETE_COLLECTION_WORKERS}",
                "--profiling=false",
                "--v=1",
            ]
        if name == "kube-scheduler":
            kc = self.kubeconfig_for("scheduler")
            return [
                binary,
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['kube-scheduler']}",
                f"--cert-dir={d / 'pki' / 'scheduler-serving'}",
                "--v=1",
            ]
        if name == "kube-controller-manager":
            kc = self.kubeconfig_for("controller-manager")
            return [
                binary,
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={p['kube-controller-manager']}",
                f"--cert-dir={d / 'pki' / 'kcm-serving'}",
                f"--service-account-private-key-file={pki.service_account_key()}",
                f"--root-ca-file={pki.ca.cert}",
                # Each controller acts as its own service account (as kubeadm runs it):
                # the garbage collector, pod GC and node lifecycle controllers need the
                # verbs of their bootstrap roles; the KCM user's own role only reads.
                "--use-service-account-credentials=true",
                "--controllers=*,-bootstrapsigner,-tokencleaner,-nodeipam",
                "--node-monitor-grace-period=20s",
                "--v=1",
            ]
        if name == "kwok":
            return nodes.kwok_argv(self, binary)
        raise ClusterError(f"unknown component {name}")

    def _start(self, name: str, pki: LocalPKI) -> None:
        for port_name in (name, f"{name}-peer"):
            port = self.spec.ports.get(port_name)
            if port is not None and _port_in_use(port):
                raise ClusterError(
                    f"{name}: port {port} on 127.0.0.1 is already in use "
                    f"(another cluster running? try 'neonvm dev down' or pick other ports)"
                )
        self._spawn(name, self._argv(name, pki), dict(os.environ))

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        log = self.log_file(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        self._pid_file(name).parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.state_dir,
                env=env,
            )
        self._pid_file(name).write_text(str(proc.pid))
        return proc.pid

    def _wait_healthy(self, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        detail = ""
        while time.monotonic() < deadline:
            status = self.component_status(name)
            if status.healthy:
                return
            if not status.running:
                tail = _tail(self.log_file(name), 8)
                raise ClusterError(f"{name} exited during start-up; last log lines:\n{tail}")
            detail = status.detail
            time.sleep(0.2)
        raise ClusterError(f"{name} not healthy after {timeout:.0f}s: {detail}")

    def _stop(self, name: str, timeout: float = 20.0, sig: int = signal.SIGTERM) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        binary = _binary_of(name) if name in DEFAULT_PORTS else ""
        if _pid_alive(pid, binary):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout
            while _pid_alive(pid, binary) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid, binary):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                while _pid_alive(pid, binary):
                    time.sleep(0.05)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        self._pid_file(name).unlink(missing_ok=True)

    def _health(self, name: str) -> tuple[bool, str]:
        p = self.spec.ports
        if name == "etcd":
            return _http_ok(f"http://127.0.0.1:{p[name]}/health", None)
        if name == "locks-etcd":
            root = self._locks_etcd_root()
            ctx = ssl.create_default_context(cafile=str(root.ca))
            ctx.load_cert_chain(str(root.cert), str(root.key))
            return _http_ok(f"{self.locks_etcd_url}/health", ctx)
        pki_dir = self.state_dir / "pki"
        if name == "kube-apiserver":
            ctx = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
            ctx.load_cert_chain(str(pki_dir / "admin.crt"), str(pki_dir / "admin.key"))
            return _http_ok(f"{self.api_url}/readyz", ctx)
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        if name in ("kube-scheduler", "kube-controller-manager"):
            return _http_ok(f"https://127.0.0.1:{p[name]}/healthz", insecure)
        if name == "kwok":
            return _http_ok(f"http://127.0.0.1:{p[name]}/healthz", None)
        return False, "unknown component"


def _binary_of(component: str) -> str:
    return "etcd" if component == "locks-etcd" else component


def _http_ok(url: str, ctx: ssl.SSLContext | None) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=2, context=ctx) as resp:
            body = resp.read(200).decode(errors="replace").strip()
            return resp.status == 200, body or "ok"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (OSError, ssl.SSLError) as e:
        return False, str(getattr(e, "reason", e))


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def running(state_dir: Path, spec: ClusterSpec) -> Iterator[LocalCluster]:
    """A cluster for the duration of a ``with`` block (tests), always torn down."""
    cluster = LocalCluster(state_dir, spec)
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()
