"""A real node for the local cluster: kubelet + containerd + runc + CNI plugins.

Opt-in (``neonvm dev up --real-nodes N``); kwok nodes stay the default and are kept for
scale. Every binary is compiled from the Go module proxy into ``~/.cache/neonvm`` (see
``neonvm.dev.binaries``): the kubelet from the same Kubernetes release as the API server,
containerd 2.x, runc (with seccomp) and the bridge/host-local/loopback/portmap plugins.

There is no registry here, so the images a node needs are made locally: one tiny static
Go program (``tiny``) is packed into an OCI archive under two names, the sandbox
("pause") image and ``neonvm.local/tiny`` for test pods, and imported into containerd.

Everything of node ``i`` lives in ``<state dir>/rn<i>/`` (configs, containerd's root and
state, the kubelet's root dir, pod logs, CNI state) except what the kernel keeps
elsewhere: the pod cgroups under ``/<cgroup root>`` of each cgroup v1 hierarchy, the
node's bridge, and shim processes. :func:`stop` removes all of it: it stops the kubelet,
kills and deletes every container through containerd, stops containerd, ends the shims
that served this containerd (found by its socket address on their command line),
unmounts what is left under the node's directory, removes the cgroups and the bridge.

Why each non-default setting is needed on this host is in docs/real-node.md.
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import ssl
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from neonvm import kube
from neonvm.dev import binaries
from neonvm.dev.common import ClusterError, free_port
from neonvm.dev.pki import KUBERNETES_SERVICE_IP, CertPair, LocalPKI

if TYPE_CHECKING:
    from neonvm.dev.cluster import LocalCluster

REAL_LABEL = "neonvm.dev/real-node"
"""Marks a Node as a real (kubelet) node of the local cluster (value ``true``)."""
PAUSE_IMAGE = "neonvm.local/pause:1"
TINY_IMAGE = "neonvm.local/tiny:1"
"""A test image: ``/tiny echo WORDS...`` prints and exits, ``/tiny`` waits for SIGTERM."""
GROUPS = ("kubelet", "containerd", "runc", "cni-plugins")
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": 1, "vm/panic_on_oom": 0, "kernel/panic": 10,
    "kernel/panic_on_oops": 1, "kernel/keys/root_maxkeys": 1000000,
    "kernel/keys/root_maxbytes": 25000000, "net/ipv4/ip_forward": 1,
}
"""What the kubelet writes into /proc/sys on start (there is no setting that leaves them
alone: ``protectKernelDefaults`` only turns the write into a start-up failure), and
``ip_forward``, which the CNI bridge plugin turns on for a gateway bridge at the first
pod. The node records the host's values first and puts back those that were changed
when it stops."""
KUBELET_HOST_DIR = Path("/var/lib/kubelet")
"""The kubelet's device-plugin directory stays here whatever ``--root-dir`` says
(``device-plugins/kubelet.sock`` and a checkpoint file)."""
CGROUP_V1_CONTROLLERS = (
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd",
)

TINY_GO = """package main

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

// /tiny echo WORDS... prints WORDS and exits 0; /tiny exit N exits N; /tiny alone waits
// for SIGTERM or SIGINT (the pod sandbox's "pause"), reaping children meanwhile.
func main() {
	if len(os.Args) > 1 && os.Args[1] == "echo" {
		fmt.Println(strings.Join(os.Args[2:], " "))
		return
	}
	if len(os.Args) > 2 && os.Args[1] == "exit" {
		var code int
		fmt.Sscan(os.Args[2], &code)
		os.Exit(code)
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				var ws syscall.WaitStatus
				pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
				if pid <= 0 || err != nil {
					break
				}
			}
			continue
		}
		return
	}
}
"""


class RealNodeError(ClusterError):
    """A real node cannot be built, started or stopped; the message says why."""


def node_name(index: int) -> str:
    return f"neonvm-real-{index}"


def build(progress: Callable[[str], None] = lambda _m: None) -> dict[str, float]:
    """Build (or find) the real node's binaries and the tiny image; seconds per group."""
    spent: dict[str, float] = {}
    for name in GROUPS:
        group = binaries.GROUPS[name]
        if not all(binaries.find(b) for b in group.binaries):
            progress(f"building {group.key} from the Go module proxy")
        spent[name] = binaries.build(group, progress)
    started = time.monotonic()
    tiny_binary()
    spent["tiny"] = time.monotonic() - started
    return spent


def built() -> bool:
    """Whether the real node's binaries are all in the cache (nothing to build)."""
    return all(binaries.find(b) for g in GROUPS for b in binaries.GROUPS[g].binaries)


def tiny_binary() -> Path:
    """The static ``tiny`` binary (pause and test image entrypoint), built once."""
    digest = hashlib.sha256(TINY_GO.encode()).hexdigest()[:12]
    out = binaries.cache_root() / "bin" / f"tiny-{digest}" / "tiny"
    if out.is_file():
        return out
    build_dir = binaries.cache_root() / "build" / f"tiny-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    (build_dir / "main.go").write_text(TINY_GO)
    (build_dir / "go.mod").write_text("module neonvm.local/build/tiny\n\ngo 1.26.0\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}
    proc = subprocess.run(
        ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(out) + ".partial", "."],
        cwd=build_dir, env=env, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise RealNodeError(f"building tiny failed:\n{proc.stderr.strip()}")
    Path(str(out) + ".partial").rename(out)
    return out


# ---- the OCI image ------------------------------------------------------------------------


def _blob(layout: dict[str, bytes], media_type: str, data: bytes) -> dict[str, Any]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    layout[f"blobs/sha256/{digest[7:]}"] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def oci_archive(binary: Path, names: tuple[str, ...]) -> bytes:
    """A tar of an OCI image layout holding one image (``/tiny``) under every name.

    Byte-for-byte reproducible: fixed mtimes, owners and gzip header. containerd's import
    reads the name from the ``io.containerd.image.name`` annotation.
    """
    layer_tar = io.BytesIO()
    with tarfile.open(fileobj=layer_tar, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("tiny")
        data = binary.read_bytes()
        info.size, info.mode, info.mtime = len(data), 0o755, 0
        tar.addfile(info, io.BytesIO(data))
    layer = layer_tar.getvalue()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=6) as f:
        f.write(layer)
    blobs: dict[str, bytes] = {}
    layer_desc = _blob(blobs, "application/vnd.oci.image.layer.v1.tar+gzip", gz.getvalue())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/tiny"], "WorkingDir": "/"},
        "rootfs": {"type": "layers",
                   "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_desc = _blob(blobs, "application/vnd.oci.image.config.v1+json",
                        json.dumps(config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(blobs, "application/vnd.oci.image.manifest.v1+json",
                          json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {**manifest_desc, "platform": {"architecture": "amd64", "os": "linux"},
             "annotations": {"io.containerd.image.name": name,
                             "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}}
            for name in names
        ],
    }
    files = {"oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
             "index.json": json.dumps(index, sort_keys=True).encode(), **blobs}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(content), 0o644, 0
            tar.addfile(info, io.BytesIO(content))
    return out.getvalue()


# ---- one node ----------------------------------------------------------------------------


@dataclass(frozen=True)
class NodePorts:
    kubelet: int
    healthz: int


class RealNode:
    """Real node ``index`` of ``cluster``: paths, configs, start and stop."""

    def __init__(self, cluster: LocalCluster, index: int = 0, cluster_dns: bool = False
                 ) -> None:
        self.cluster = cluster
        self.index = index
        # Cluster DNS and ClusterIP routing for this node's pods (neonvm.dev.nodeservices).
        self.cluster_dns = cluster_dns
        self.name = node_name(index)
        self.dir = cluster.state_dir / f"rn{index}"
        # One tag per (state dir, node): cgroup root and bridge must not collide with
        # another cluster's real node on the same host (parallel test sessions).
        self.tag = hashlib.sha256(f"{self.dir}".encode()).hexdigest()[:8]

    # ---- names ---------------------------------------------------------------------------

    @property
    def containerd_socket(self) -> Path:
        return self.dir / "c.sock"

    @property
    def cgroup_root(self) -> str:
        return f"/neonvm-{self.tag}"

    @property
    def bridge(self) -> str:
        return f"nvm{self.tag}"

    @property
    def pod_subnet(self) -> str:
        return f"10.251.{self._subnet_octet}.0/24"

    @property
    def node_ip(self) -> str:
        """The bridge's gateway address: the kubelet must report a non-loopback IP."""
        return f"10.251.{self._subnet_octet}.1"

    @property
    def _subnet_octet(self) -> int:
        return int(self.tag[:4], 16) % 250

    def process_names(self) -> tuple[str, str]:
        return (f"rn{self.index}-containerd", f"rn{self.index}-kubelet")

    def ports(self) -> NodePorts:
        saved = self.dir / "ports.json"
        if saved.exists():
            return NodePorts(**json.loads(saved.read_text()))
        kubelet = free_port()
        ports = NodePorts(kubelet, free_port(taken={kubelet}))
        self.dir.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(ports.__dict__))
        return ports

    # ---- configuration -------------------------------------------------------------------

    def containerd_config(self) -> str:
        runc = binaries.require("runc")
        cni_bin = binaries.require("bridge").parent
        d = self.dir
        # Version 3: containerd 2.4 migrates it in memory (one warning). Version 4 moves
        # [grpc]/[ttrpc] into plugin sections; written as here, a v4 file would silently
        # listen on the host-wide /run/containerd/containerd.sock.
        return f"""version = 3
imports = []
root = "{d / 'containerd' / 'root'}"
state = "{d / 'containerd' / 'state'}"
# NRI listens on a fixed host path (/var/run/nri/nri.sock): two nodes would collide.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{self.containerd_socket}"

[ttrpc]
  address = "{self.containerd_socket}.ttrpc"

[debug]
  level = "info"

[metrics]
  address = ""

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_selinux = false
  # This host withholds CAP_SYS_RESOURCE even from root: nobody may lower an
  # oom_score_adj. The kubelet asks -998 for every sandbox, and runc fails with
  # "failed to update /proc/self/oom_score_adj: Permission denied". Restricted, containerd
  # never asks for less than its own score (as in rootless mode).
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  # Device nodes a device plugin adds (/dev/kvm) belong to the container's uid/gid, not
  # to the host's owner: a runner pod (uid 65532) can then open this host's 0660 root:kvm
  # /dev/kvm.
  device_ownership_from_security_context = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{d / 'runc'}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{d / 'cni' / 'net.d'}"
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
"""

    def cni_config(self) -> dict[str, Any]:
        """A bridge network without masquerade: pods reach the host and each other only.

        The default route through the bridge's gateway lets a pod's packets to the
        `kubernetes` Service's ClusterIP reach the host, where the node forwards them to
        the API server (:meth:`_forward_control_plane`); nothing else is routed.
        """
        return {
            "cniVersion": "1.0.0",
            "name": "neonvm-dev",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "isDefaultGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_subnet}]],
                        "dataDir": str(self.dir / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
            ],
        }

    def kubelet_config(self, pki: LocalPKI) -> dict[str, Any]:
        ports = self.ports()
        serving = self._serving_cert(pki)
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # cgroup v1 host (hybrid, /sys/fs/cgroup is a tmpfs): 1.36 refuses v1 unless told.
            "failCgroupV1": False,
            # No systemd here. The kubelet takes the driver from containerd's runc options
            # (SystemdCgroup = false) over the CRI; this only states the same.
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup_root,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            # The API server reaches the kubelet at the node's InternalIP (logs, exec).
            "address": self.node_ip,
            "port": ports.kubelet,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": ports.healthz,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            # The API server calls the kubelet (logs, exec) with a cert of the cluster CA.
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(pki.ca.cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.dir / "pod-logs"),
            "resolvConf": "",
            "registerNode": True,
            # The host's disk is shared and may be fuller than a dedicated node's:
            # evict only when it is really full, and never garbage-collect the local
            # images (nothing can pull them back).
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "nodeStatusReportFrequency": "10s",
            "serializeImagePulls": False,
            **({"clusterDNS": [self.node_ip], "clusterDomain": "cluster.local"}
               if self.cluster_dns else {}),
        }

    def _serving_cert(self, pki: LocalPKI) -> CertPair:
        return pki.issue(f"kubelet-{self.name}-serving", self.name, server=True)

    def _client_kubeconfig(self, pki: LocalPKI) -> Path:
        pair = pki.issue(f"kubelet-{self.name}", f"system:node:{self.name}",
                         orgs=("system:nodes",))
        path = self.cluster.kubeconfig_for(f"kubelet-{self.name}")
        self.cluster._write_kubeconfig(path, pair, pki)
        return path

    def write_configs(self, pki: LocalPKI) -> tuple[Path, Path, Path]:
        """containerd config, kubelet config, kubelet kubeconfig (all under the node dir)."""
        for sub in ("cni/net.d", "cni/ipam", "kubelet", "pod-logs", "containerd", "runc"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        containerd = self.dir / "containerd.toml"
        containerd.write_text(self.containerd_config())
        (self.dir / "cni" / "net.d" / "10-neonvm.conflist").write_text(
            json.dumps(self.cni_config(), indent=2))
        kubelet = self.dir / "kubelet.yaml"
        kubelet.write_text(yaml.safe_dump(self.kubelet_config(pki)))
        return containerd, kubelet, self._client_kubeconfig(pki)

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] = lambda _m: None,
              timeout: float = 120.0) -> float:
        """Start containerd and the kubelet (idempotent); wait until the Node is Ready.

        Returns the seconds from starting to Ready.
        """
        started = time.monotonic()
        started_wall = time.time()
        pki = LocalPKI(self.cluster.state_dir / "pki")
        _apply_rbac(self.cluster, self.name)
        containerd_cfg, kubelet_cfg, kubeconfig = self.write_configs(pki)
        self._make_cgroup_root()
        self._make_bridge()
        self._forward_control_plane()
        if self.cluster_dns:
            from neonvm.dev import nodeservices

            nodeservices.start(self)
            progress(f"{self.name}: cluster DNS and Service routing on {self.node_ip}")
        ctrd_name, kubelet_name = self.process_names()
        ctrd_bin = binaries.require("containerd")
        env = {**os.environ, "PATH": f"{ctrd_bin.parent}:{os.environ.get('PATH', '')}"}
        self.cluster.start_process(ctrd_name, [str(ctrd_bin), f"--config={containerd_cfg}"],
                                   env)
        self._wait(self._ctr_ok, timeout, "containerd answering",
                   ctrd_name, "containerd")
        progress(f"{self.name}: containerd up")
        self.import_images()
        progress(f"{self.name}: images {PAUSE_IMAGE}, {TINY_IMAGE} imported")
        kubelet_argv = [
            str(binaries.require("kubelet")),
            f"--config={kubelet_cfg}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={self.dir / 'kubelet'}",
            f"--cert-dir={self.dir / 'kubelet' / 'pki'}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.node_ip}",
            f"--node-labels={REAL_LABEL}=true,type=real",
            "--v=1",
        ]
        self._record_sysctls()
        self.cluster.start_process(kubelet_name, kubelet_argv, dict(os.environ))
        self._wait(self._kubelet_healthy, timeout, "kubelet healthy", kubelet_name, "kubelet")
        progress(f"{self.name}: kubelet healthy")
        # A Node left from an earlier run may still show Ready: only a heartbeat from
        # this kubelet counts.
        self._wait(lambda: node_ready(self.cluster, self.name, since=started_wall), timeout,
                   "Node Ready", kubelet_name, "kubelet")
        seconds = time.monotonic() - started
        progress(f"{self.name}: Ready after {seconds:.1f}s")
        return seconds

    def _wait(self, check: Callable[[], bool], timeout: float, what: str,
              process: str, binary: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if not self.cluster.process_alive(process, binary):
                log = self.cluster.log_file(process)
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
                raise RealNodeError(f"{process} exited before {what}; last log lines:\n{tail}")
            time.sleep(0.5)
        raise RealNodeError(f"{self.name}: not {what} after {timeout:.0f}s "
                            f"(see {self.cluster.log_file(process)})")

    def ctr(self, *args: str, check: bool = True, timeout: float = 60) -> str:
        proc = subprocess.run(
            [str(binaries.require("ctr")), "--address", str(self.containerd_socket),
             "--namespace", "k8s.io", *args],
            capture_output=True, text=True, timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def _ctr_ok(self) -> bool:
        if not self.containerd_socket.exists():
            return False
        try:
            self.ctr("version")
        except (RealNodeError, subprocess.TimeoutExpired):
            return False
        return True

    def import_images(self) -> None:
        archive = self.dir / "tiny-image.tar"
        archive.write_bytes(oci_archive(tiny_binary(), (PAUSE_IMAGE, TINY_IMAGE)))
        self.ctr("images", "import", "--platform", "linux/amd64", str(archive))
        listed = self.ctr("images", "ls", "-q")
        missing = [n for n in (PAUSE_IMAGE, TINY_IMAGE) if n not in listed.split()]
        if missing:
            raise RealNodeError(f"image import left out {missing}: {listed!r}")

    def _kubelet_healthy(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.ports().healthz}/healthz"
            with urllib_request(url) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _make_bridge(self) -> None:
        """The CNI bridge, made early with its gateway address, which is the node IP.

        The kubelet refuses a loopback node IP ("nodeIP can't be loopback address") and
        then reports no address at all, so the API server cannot reach it for logs. The
        bridge plugin adopts a bridge that already has its gateway address.
        """
        if not Path(f"/sys/class/net/{self.bridge}").exists():
            _ip("link", "add", self.bridge, "type", "bridge")
        addrs = subprocess.run(["ip", "-o", "addr", "show", "dev", self.bridge],
                               capture_output=True, text=True).stdout
        if f" {self.node_ip}/" not in addrs:
            _ip("addr", "add", f"{self.node_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    @property
    def nat_chain(self) -> str:
        return f"NVM-{self.tag}"

    @property
    def locks_etcd_url_for_pods(self) -> str:
        """The locks' etcd as a pod on this node reaches it (see
        :meth:`_forward_control_plane`)."""
        return f"https://{self.node_ip}:{self.cluster.spec.ports['locks-etcd']}"

    def _forward_control_plane(self) -> None:
        """Let pods reach the API server and the locks' etcd, which listen on 127.0.0.1.

        There is no kube-proxy: a DNAT rule in a chain of this node's own (jumped to from
        ``nat PREROUTING`` for packets entering through its bridge) sends the
        `kubernetes` Service's ClusterIP, port 443 (what a pod's in-cluster config
        connects to; the API server's certificate names that IP) to the API server, and
        ``<node IP>:<locks-etcd port>`` to the locks' etcd. A packet to 127.0.0.1 that
        came in on another interface is dropped as martian unless the interface has
        ``route_localnet`` (as kube-proxy sets for node ports on localhost).
        """
        self._remove_forwarding()
        ports = self.cluster.spec.ports
        chain = self.nat_chain
        _iptables("-t", "nat", "-N", chain)
        for dest, port, to in ((KUBERNETES_SERVICE_IP, 443, ports["kube-apiserver"]),
                               (self.node_ip, ports["locks-etcd"], ports["locks-etcd"])):
            _iptables("-t", "nat", "-A", chain, "-d", f"{dest}/32", "-p", "tcp",
                      "--dport", str(port), "-j", "DNAT", "--to-destination", f"127.0.0.1:{to}")
        _iptables("-t", "nat", "-I", "PREROUTING", "-i", self.bridge, "-j", chain)
        Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet").write_text("1\n")

    def _remove_forwarding(self) -> list[str]:
        chain = self.nat_chain
        if subprocess.run(["iptables", "-t", "nat", "-S", chain],
                          capture_output=True).returncode != 0:
            return []
        while subprocess.run(["iptables", "-t", "nat", "-D", "PREROUTING", "-i", self.bridge,
                              "-j", chain], capture_output=True).returncode == 0:
            pass
        _iptables("-t", "nat", "-F", chain)
        _iptables("-t", "nat", "-X", chain)
        return [f"iptables chain {chain}"]

    def _make_cgroup_root(self) -> None:
        """The kubelet refuses to start unless its cgroup root exists in every hierarchy
        ("invalid configuration: cgroup [...] has some missing paths"); a fresh cpuset
        cgroup needs its cpus and mems before anything can join it."""
        for ctrl in CGROUP_V1_CONTROLLERS:
            base = Path("/sys/fs/cgroup") / ctrl
            if not base.is_dir():
                continue
            path = base / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            if ctrl == "cpuset":
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (path / f).read_text().strip():
                        (path / f).write_text((base / f).read_text())

    def stop(self, timeout: float = 60.0) -> list[str]:
        """Stop the node and remove what it left on the host; return what was cleaned."""
        from neonvm.dev import nodeservices

        done: list[str] = nodeservices.stop(self)
        ctrd_name, kubelet_name = self.process_names()
        if self.cluster.process_alive(kubelet_name, "kubelet"):
            pid = self.cluster.process_pid(kubelet_name)
            self.cluster.stop_component(kubelet_name)
            done.append("kubelet")
            # The host directory is restored only when no kubelet runs: wait out this
            # one's exit (its threads may still be ending after its pid file is gone).
            deadline = time.monotonic() + timeout
            while pid in other_kubelets() and time.monotonic() < deadline:
                time.sleep(0.1)
        done += self._restore_sysctls()
        done += self._restore_kubelet_host_dir()
        if self.cluster.process_alive(ctrd_name, "containerd"):
            done += self._remove_containers(timeout)
            self.cluster.stop_component(ctrd_name)
            done.append("containerd")
        else:
            self.cluster.stop_component(ctrd_name)
        shims = self._end_shims(timeout)
        if shims:
            done.append(f"{shims} shims")
        done += self._unmount_all()
        done += self._remove_cgroups()
        done += self._remove_forwarding()
        if Path(f"/sys/class/net/{self.bridge}").exists():
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            done.append(f"bridge {self.bridge}")
        return done

    def _record_sysctls(self) -> None:
        saved = self.dir / "sysctls-before.json"
        if not saved.exists():
            saved.write_text(json.dumps({
                k: int(Path("/proc/sys", k).read_text()) for k in KUBELET_SYSCTLS}))
        existed = self.dir / "kubelet-host-dir-existed"
        if not existed.exists():
            existed.write_text("1" if KUBELET_HOST_DIR.exists() else "0")

    def _restore_kubelet_host_dir(self) -> list[str]:
        """Remove what the kubelet left in /var/lib/kubelet (its device-plugin socket and
        checkpoint; the directories too if they were not there before), unless another
        kubelet on this host still runs."""
        existed = self.dir / "kubelet-host-dir-existed"
        if not existed.exists():
            return []
        if other_kubelets():
            return []
        plugins = KUBELET_HOST_DIR / "device-plugins"
        removed = []
        for name in ("kubelet.sock", "kubelet_internal_checkpoint"):
            with contextlib.suppress(FileNotFoundError):
                (plugins / name).unlink()
                removed.append(name)
        if existed.read_text() == "0":
            for d in (plugins, KUBELET_HOST_DIR):
                with contextlib.suppress(OSError):
                    d.rmdir()
                    removed.append(str(d))
        existed.unlink()
        return [f"removed {', '.join(removed)} (kubelet host dir)"] if removed else []

    def _restore_sysctls(self) -> list[str]:
        saved = self.dir / "sysctls-before.json"
        if not saved.exists():
            return []
        restored = []
        for key, before in json.loads(saved.read_text()).items():
            path = Path("/proc/sys", key)
            if int(path.read_text()) == KUBELET_SYSCTLS[key] != before:
                path.write_text(str(before))
                restored.append(key.replace("/", "."))
        saved.unlink()
        return [f"sysctls restored ({', '.join(restored)})"] if restored else []

    def _remove_containers(self, timeout: float) -> list[str]:
        tasks = [line.split()[0] for line in self.ctr("tasks", "ls", check=False).splitlines()[1:]
                 if line.strip()]
        for task in tasks:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + timeout
        for task in tasks:
            while time.monotonic() < deadline:
                out = subprocess.run(
                    [str(binaries.require("ctr")), "--address", str(self.containerd_socket),
                     "--namespace", "k8s.io", "tasks", "delete", task],
                    capture_output=True, text=True, timeout=30,
                )
                if out.returncode == 0 or "not found" in out.stderr:
                    break
                time.sleep(0.2)
        containers = self.ctr("containers", "ls", "-q", check=False).split()
        if containers:
            self.ctr("containers", "delete", *containers, check=False)
        return [f"{len(tasks)} tasks, {len(containers)} containers"] if containers else []

    def shim_pids(self) -> list[int]:
        marker = str(self.containerd_socket).encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and marker in cmdline:
                pids.append(int(proc.name))
        return pids

    def _end_shims(self, timeout: float) -> int:
        """Kill this containerd's shims until none is left (a shim whose task was just
        deleted may still be exiting, or one may be starting as containerd stops)."""
        killed: set[int] = set()
        deadline = time.monotonic() + timeout
        while (pids := self.shim_pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.1)
        return len(killed)

    def _unmount_all(self) -> list[str]:
        prefix = f"{self.dir}/"
        mounts = [line.split()[1].replace("\\040", " ")
                  for line in Path("/proc/mounts").read_text().splitlines()]
        ours = sorted({m for m in mounts if m.startswith(prefix)}, key=len, reverse=True)
        for m in ours:
            subprocess.run(["umount", "-l", m], capture_output=True)
        return [f"{len(ours)} mounts"] if ours else []

    def _remove_cgroups(self) -> list[str]:
        removed = 0
        # runc also mirrors the cgroup into the (empty) cgroup2 hierarchy of a hybrid host.
        for ctrl in (*CGROUP_V1_CONTROLLERS, "unified"):
            root = Path("/sys/fs/cgroup") / ctrl / self.cgroup_root.lstrip("/")
            if not root.is_dir():
                continue
            dirs = sorted((p for p in root.rglob("*") if p.is_dir()),
                          key=lambda p: len(p.parts), reverse=True)
            for p in [*dirs, root]:
                with contextlib.suppress(OSError):
                    p.rmdir()
                    removed += 1
        return [f"{removed} cgroups"] if removed else []


def _iptables(*args: str) -> None:
    proc = subprocess.run(["iptables", "-w", "10", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RealNodeError(f"iptables {' '.join(args)}: {proc.stderr.strip()}")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RealNodeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def urllib_request(url: str) -> Any:
    import urllib.request

    return urllib.request.urlopen(url, timeout=2)


def node_ready(cluster: LocalCluster, name: str, since: float = 0.0) -> bool:
    """Whether Node ``name`` is Ready, by a heartbeat at or after ``since`` (epoch s)."""
    ctx = ssl.create_default_context(cafile=str(cluster.state_dir / "pki" / "ca.crt"))
    ctx.load_cert_chain(str(cluster.state_dir / "pki" / "admin.crt"),
                        str(cluster.state_dir / "pki" / "admin.key"))
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{cluster.api_url}/api/v1/nodes/{name}", timeout=5,
                                    context=ctx) as resp:
            node = json.loads(resp.read())
    except (urllib.error.URLError, OSError):
        return False
    for cond in node.get("status", {}).get("conditions", []):
        if cond["type"] == "Ready":
            beat = datetime.datetime.fromisoformat(cond["lastHeartbeatTime"]).timestamp()
            # Heartbeats have whole seconds.
            return bool(cond["status"] == "True" and beat >= int(since))
    return False


def _apply_rbac(cluster: LocalCluster, name: str) -> None:
    """The kubelet's user gets the bootstrap ``system:node`` role (no Node authorizer here)."""
    api = kube.api_client(cluster.kubeconfig)
    try:
        kube.apply(api, {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"neonvm-dev-{name}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": f"system:node:{name}"}],
        })
    finally:
        api.close()


# ---- the cluster's real nodes ------------------------------------------------------------


def recorded_nodes(cluster: LocalCluster) -> list[RealNode]:
    return [RealNode(cluster, int(p.name[2:])) for p in sorted(cluster.state_dir.glob("rn*"))
            if p.is_dir() and p.name[2:].isdigit()]


def start(cluster: LocalCluster, count: int,
          progress: Callable[[str], None] = lambda _m: None) -> list[RealNode]:
    """Build what is missing and start ``count`` real nodes (idempotent)."""
    problem = unavailable_reason()
    if problem:
        raise RealNodeError(f"a real node cannot start here: {problem}")
    build(progress)
    nodes = [RealNode(cluster, i) for i in range(count)]
    for node in nodes:
        node.start(progress)
    return nodes


def stop(cluster: LocalCluster) -> list[str]:
    """Stop every real node recorded in the cluster's state dir and clean up after it."""
    done = []
    for node in recorded_nodes(cluster):
        cleaned = node.stop()
        if cleaned:
            done.append(f"{node.name}: {', '.join(cleaned)}")
    return done


def other_kubelets() -> list[int]:
    """Pids of kubelet processes running on this host (another cluster's real node)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (proc / "stat").read_text()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                state = stat[stat.rindex(")") + 2:].split()[0]
                if name == "kubelet" and state not in ("Z", "X"):  # not a zombie
                    found.append(int(proc.name))
    return found


def unavailable_reason() -> str | None:
    """Why a real node cannot start on this host (one line), or None if it can try."""
    if os.geteuid() != 0:
        return "containerd and the kubelet need root"
    if shutil.which("go") is None and not all(
        binaries.find(b) for g in GROUPS for b in binaries.GROUPS[g].binaries
    ):
        return "'go' is not on PATH and the real node's binaries are not built"
    if not Path("/sys/fs/cgroup/memory").is_dir() and not Path(
        "/sys/fs/cgroup/cgroup.controllers"
    ).exists():
        return "no memory cgroup controller mounted under /sys/fs/cgroup"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem (containerd's overlayfs snapshotter)"
    for tool in ("ip", "iptables", "mount"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (apt-get install iproute2 iptables mount)"
    return None
