"""Find or build the control-plane binaries the local cluster runs.

Nothing here downloads a prebuilt binary: every binary is compiled from the Go module
proxy with the machine's Go toolchain, the only source this project may rely on.

Lookup order for a binary ``name`` (first hit wins):

1. ``$NEONVM_BIN_<NAME>`` (e.g. ``NEONVM_BIN_KUBE_APISERVER``): an explicit file.
2. ``$KUBEBUILDER_ASSETS/<name>``: the directory controller-runtime's envtest uses.
3. ``<cache>/bin/<group>-<version>/<name>``: built earlier by :func:`build`.

The cache root is ``$NEONVM_CACHE_DIR`` or ``~/.cache/neonvm``; it lives outside the
repository and is reused across runs and clones. Go's own module and build caches make
a rebuild after a cache wipe cheap.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v4.3.2"
# Helm 3 beside Helm 4: most clusters are still driven by Helm 3, so the chart is tested
# with both (tests/test_chart_etcd.py). Cached as ``helm3``.
HELM3_VERSION = "v3.22.0"
# The real node's runtime (neonvm.dev.realnode; docs/real-node.md).
CONTAINERD_VERSION = "v2.4.2"
RUNC_VERSION = "v1.5.3"
CNI_PLUGINS_VERSION = "v1.10.0"


class BinaryError(RuntimeError):
    """A binary is missing and cannot be built; the message says what to do."""


@dataclass(frozen=True)
class BinaryGroup:
    """Binaries built together from one Go module at one version."""

    name: str
    version: str
    binaries: tuple[str, ...]
    go_mod: Callable[[Path], str] | None = None
    """Writes the build module; returns the package paths to build. None: go install."""
    install_paths: tuple[str, ...] = field(default=())
    cgo: bool = False
    tags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    """(what the build writes, the cached name): for a binary cached under a name of its
    own, like Helm 3's ``helm`` kept as ``helm3`` beside Helm 4's."""

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    def version_ldflags(self) -> list[str]:
        """Stamp the release into Kubernetes binaries, as the release build does.

        Without it kube-apiserver reports ``v0.0.0-master``, and tools that check the
        server version (helm's ``kubeVersion``, clients' discovery) misjudge it.
        """
        if self.name not in ("kubernetes", "kubelet"):
            return list(self.ldflags)
        major, minor = self.version.removeprefix("v").split(".")[:2]
        values = {"gitVersion": self.version, "gitMajor": major, "gitMinor": minor,
                  "gitTreeState": "clean"}
        return [
            f"-X {pkg}.{k}={v}"
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for k, v in values.items()
        ]


def cache_root() -> Path:
    return Path(os.environ.get("NEONVM_CACHE_DIR", Path.home() / ".cache" / "neonvm"))


def _kubernetes_module(
    build_dir: Path,
    commands: tuple[str, ...] = ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
) -> str:
    """go.mod for building kube-* from k8s.io/kubernetes.

    k8s.io/kubernetes replaces its staging modules with local paths, which Go ignores in
    a dependency; we restate each replace at the matching v0.N.M release.
    """
    staging = _kubernetes_staging_modules()
    minor = KUBERNETES_VERSION.removeprefix("v1.")
    replaces = "\n".join(f"\t{m} => {m} v0.{minor}" for m in staging)
    (build_dir / "tools.go").write_text(
        "//go:build tools\n\npackage tools\n\nimport (\n"
        + "".join(
            f'\t_ "k8s.io/kubernetes/cmd/{b}"\n'
            for b in commands
        )
        + ")\n"
    )
    (build_dir / "go.mod").write_text(
        "module neonvm.local/build/kubernetes\n\ngo 1.26.0\n\n"
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}\n\nreplace (\n{replaces}\n)\n"
    )
    return " ".join(f"k8s.io/kubernetes/cmd/{b}" for b in commands)


def _kubernetes_staging_modules() -> list[str]:
    out = _run(
        ["go", "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        cwd=Path.cwd(),
        capture=True,
    )
    import json

    gomod = Path(json.loads(out)["GoMod"]).read_text()
    mods = []
    for line in gomod.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] == "=>" and parts[2].startswith("./staging/"):
            mods.append(parts[0])
    if not mods:
        raise BinaryError("could not read k8s.io/kubernetes staging modules from its go.mod")
    return mods


def _etcd_module(build_dir: Path) -> str:
    """etcd's root module replaces its own submodules, so we wrap etcdmain in a tiny main."""
    (build_dir / "main.go").write_text(
        "package main\n\nimport (\n\t\"os\"\n\n"
        '\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\n'
        "func main() { etcdmain.Main(os.Args) }\n"
    )
    (build_dir / "go.mod").write_text(
        "module neonvm.local/build/etcd\n\ngo 1.26.0\n\n"
        f"require go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
    )
    return "."


def _real_node_groups() -> tuple[BinaryGroup, ...]:
    """kubelet, containerd, runc and CNI plugins: only ``neonvm.dev.realnode`` builds them."""
    cni = "github.com/containernetworking/plugins/plugins"
    ctrd = "github.com/containerd/containerd/v2"
    return (
        BinaryGroup("kubelet", KUBERNETES_VERSION, ("kubelet",),
                    go_mod=lambda d: _kubernetes_module(d, ("kubelet",))),
        BinaryGroup("containerd", CONTAINERD_VERSION, ("containerd", "containerd-shim-runc-v2",
                                                       "ctr"),
                    install_paths=tuple(f"{ctrd}/cmd/{c}" for c in
                                        ("containerd", "containerd-shim-runc-v2", "ctr")),
                    tags=("no_btrfs", "no_devmapper", "no_zfs"),
                    ldflags=(f"-X {ctrd}/version.Version={CONTAINERD_VERSION}",)),
        BinaryGroup("runc", RUNC_VERSION, ("runc",),
                    install_paths=("github.com/opencontainers/runc",), cgo=True,
                    tags=("seccomp",),
                    ldflags=(f"-X main.version={RUNC_VERSION.removeprefix('v')}",)),
        BinaryGroup("cni-plugins", CNI_PLUGINS_VERSION,
                    ("bridge", "host-local", "loopback", "portmap"),
                    install_paths=(f"{cni}/main/bridge", f"{cni}/ipam/host-local",
                                   f"{cni}/main/loopback", f"{cni}/meta/portmap")),
    )


GROUPS: dict[str, BinaryGroup] = {
    g.name: g
    for g in (
        BinaryGroup("etcd", ETCD_VERSION, ("etcd",), go_mod=_etcd_module),
        BinaryGroup(
            "kubernetes",
            KUBERNETES_VERSION,
            ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
            go_mod=_kubernetes_module,
        ),
        BinaryGroup(
            "kwok", KWOK_VERSION, ("kwok",), install_paths=("sigs.k8s.io/kwok/cmd/kwok",)
        ),
        BinaryGroup(
            "helm", HELM_VERSION, ("helm",), install_paths=("helm.sh/helm/v4/cmd/helm",)
        ),
        BinaryGroup(
            "helm3", HELM3_VERSION, ("helm3",), install_paths=("helm.sh/helm/v3/cmd/helm",),
            renames=(("helm", "helm3"),),
        ),
        *_real_node_groups(),
    )
}

BINARY_GROUP: dict[str, BinaryGroup] = {b: g for g in GROUPS.values() for b in g.binaries}


def find(name: str) -> Path | None:
    """Where binary ``name`` is, by the lookup order in the module docstring; None if absent."""
    var = "NEONVM_BIN_" + name.upper().replace("-", "_")
    env = os.environ.get(var)
    if env:
        if not Path(env).is_file():
            raise BinaryError(f"${var} points at {env}, which is not a file")
        return Path(env)
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and (Path(assets) / name).is_file():
        return Path(assets) / name
    group = BINARY_GROUP[name]
    cached = cache_root() / "bin" / group.key / name
    return cached if cached.is_file() else None


def require(name: str) -> Path:
    path = find(name)
    if path is None:
        raise BinaryError(
            f"{name} not found (looked at $NEONVM_BIN_{name.upper().replace('-', '_')}, "
            f"$KUBEBUILDER_ASSETS and {cache_root() / 'bin'}); run 'neonvm dev install'"
        )
    return path


def build(group: BinaryGroup, progress: Callable[[str], None] = lambda _msg: None) -> float:
    """Build every binary of ``group`` into the cache; return seconds spent (0 if cached).

    Concurrent callers (several test sessions, a demo) serialise on a lock file, and the
    later ones find the binaries built.
    """
    if all(find(b) for b in group.binaries):
        return 0.0
    lock_path = cache_root() / "bin" / f".{group.key}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(find(b) for b in group.binaries):
            return 0.0
        return _build_locked(group, progress)


def _build_locked(group: BinaryGroup, progress: Callable[[str], None]) -> float:
    if shutil.which("go") is None:
        raise BinaryError("'go' is not on PATH; install Go 1.26 to build the control plane")
    out_dir = cache_root() / "bin" / group.key
    tmp_dir = cache_root() / "bin" / f".{group.key}.partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    started = time.monotonic()
    env = {**os.environ, "CGO_ENABLED": "1" if group.cgo else "0", "GOFLAGS": "-buildvcs=false"}
    flags = ["-trimpath", "-ldflags=" + " ".join(["-s", "-w", *group.version_ldflags()])]
    flags += [f"-tags={','.join(group.tags)}"] if group.tags else []
    if group.go_mod is not None:
        build_dir = cache_root() / "build" / group.key
        build_dir.mkdir(parents=True, exist_ok=True)
        progress(f"{group.key}: resolving modules")
        packages = group.go_mod(build_dir).split()
        _run(["go", "mod", "tidy"], cwd=build_dir, env=env)
        progress(f"{group.key}: compiling {', '.join(group.binaries)}")
        if packages == ["."]:
            target = ["-o", str(tmp_dir / group.binaries[0]), "."]
        else:
            target = ["-o", str(tmp_dir) + "/", *packages]
        _run(["go", "build", *flags, *target], cwd=build_dir, env=env)
    else:
        progress(f"{group.key}: compiling {', '.join(group.binaries)}")
        _run(
            ["go", "install", *flags, *(f"{p}@{group.version}" for p in group.install_paths)],
            cwd=cache_root(),
            env={**env, "GOBIN": str(tmp_dir)},
        )
    for built, cached in group.renames:
        if (tmp_dir / built).is_file():
            (tmp_dir / built).rename(tmp_dir / cached)
    missing = [b for b in group.binaries if not (tmp_dir / b).is_file()]
    if missing:
        raise BinaryError(f"{group.key}: build produced no {', '.join(missing)}")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return time.monotonic() - started


def _run(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None, capture: bool = False
) -> str:
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise BinaryError(f"'{' '.join(cmd)}' failed in {cwd}:\n{tail}")
    return proc.stdout if capture else ""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def install_binaries(with_nodes: bool, with_helm: bool = False,
                     say: Callable[[str], None] = _stderr) -> None:
    """Build the control-plane binaries that are not in the cache yet (etcd, Kubernetes;
    kwok with simulated nodes; Helm 4 and Helm 3 if asked), telling ``say`` what it builds."""
    wanted = ["etcd", "kubernetes"] + (["kwok"] if with_nodes else [])
    wanted += ["helm", "helm3"] if with_helm else []
    for group_name in wanted:
        group = GROUPS[group_name]
        if all(find(b) for b in group.binaries):
            continue
        say(f"building {group.key} from the Go module proxy (cached in "
            f"{cache_root()}; a cold build takes minutes)")
        seconds = build(group, progress=lambda m: say(f"  {m}"))
        say(f"built {group.key} in {seconds:.0f}s" if seconds
            else f"{group.key}: built meanwhile by another build (waited for its lock)")
