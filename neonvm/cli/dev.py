"""``neonvm dev``: a real local control plane (etcd, kube-apiserver, and optionally a
scheduler, controller-manager and simulated nodes) on loopback."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from pathlib import Path

import click

from neonvm.cli.output import OUTPUT_OPTION, emit
from neonvm.dev.binaries import install_binaries
from neonvm.dev.cluster import ClusterSpec, LocalCluster, default_state_dir

STATE_DIR_OPTION = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help=f"Where the cluster keeps its state [default: {default_state_dir()}]",
)


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


@click.group()
def dev() -> None:
    """Run a local control plane for demos, drills and tests."""


@dev.command()
@click.option("--nodes", type=click.IntRange(0, 100), default=None,
              help="Simulated nodes (adds kube-scheduler, kube-controller-manager, kwok).")
@click.option("--real-nodes", is_flag=True,
              help="Also build what a real kubelet node needs (kubelet, containerd, runc, "
                   "CNI plugins, the runner image), if a real node can start here; "
                   "otherwise say why in one line and go on.")
def install(nodes: int | None, real_nodes: bool) -> None:
    """Build (or find) the control-plane binaries; cached outside the repository."""
    install_binaries(with_nodes=nodes is None or nodes > 0, with_helm=True)
    if real_nodes:
        install_real_node(_progress)


def install_real_node(say: Callable[[str], None]) -> bool:
    """Build the real node's binaries and the runner image (cached) when a real node can
    start on this host; otherwise say why (one line). True when everything is there."""
    from neonvm.dev import images, realnode

    problem = realnode.unavailable_reason() or images.unavailable_reason()
    if problem:
        say(f"real node: skipped, it cannot start on this host: {problem}")
        return False
    started = time.monotonic()
    try:
        spent = realnode.build(progress=say)
        built = images.build(("runner",), None, say)
    except Exception as exc:  # the test command goes on; the real-node test then says why
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        say(f"real node: build failed after {time.monotonic() - started:.0f}s: "
            f"{type(exc).__name__}: {first[:300]}")
        return False
    say(f"real node: binaries and runner image ready in {time.monotonic() - started:.0f}s "
        f"({', '.join(f'{k} {v:.0f}s' for k, v in spent.items() if v >= 1) or 'all cached'}; "
        f"{built[0].reference})")
    return True


@dev.command()
@STATE_DIR_OPTION
@click.option("--nodes", type=click.IntRange(0, 100), default=None,
              help="Simulated nodes; 0 runs only etcd and the API server. "
                   "[default: as last time, else 3]")
@click.option("--ports", type=click.Choice(["default", "free"]), default="default",
              show_default=True, help="'free' picks unused ports (several clusters at once).")
@click.option("--real-nodes", type=click.IntRange(0, 4), default=0, show_default=True,
              help="Also run kubelet+containerd nodes (opt-in; see docs/real-node.md).")
def up(state_dir: Path | None, nodes: int | None, ports: str, real_nodes: int) -> None:
    """Start the local control plane (idempotent) and print how to use it."""
    existing = LocalCluster(state_dir)
    spec = existing.spec if (existing.state_dir / "cluster.json").exists() else None
    if spec is None or ports == "free":
        spec = ClusterSpec.with_free_ports() if ports == "free" else ClusterSpec()
        spec.nodes = 3
    if nodes is not None:
        spec.nodes = nodes
    if real_nodes:
        # Pods on a real node (the chart's controller) need ServiceAccount tokens.
        spec.service_account_tokens = True
    install_binaries(with_nodes=spec.nodes > 0)
    cluster = LocalCluster(state_dir, spec)
    started = time.monotonic()
    click.echo(f"starting local control plane in {cluster.state_dir}", err=True)
    cluster.up(progress=_progress)
    if real_nodes:
        from neonvm.dev import realnode

        realnode.start(cluster, real_nodes, progress=_progress)
    click.echo(f"ready in {time.monotonic() - started:.1f}s; to use it:", err=True)
    print_exports(cluster)


@dev.command()
@STATE_DIR_OPTION
def down(state_dir: Path | None) -> None:
    """Stop every process of the local control plane."""
    stopped = LocalCluster(state_dir).down()
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


@dev.command()
@STATE_DIR_OPTION
@OUTPUT_OPTION
def status(state_dir: Path | None, output: str) -> None:
    """Health of each component; exits 1 unless all are healthy."""
    cluster = LocalCluster(state_dir)
    rows = [
        {"component": s.name, "pid": s.pid, "running": s.running, "healthy": s.healthy,
         "detail": s.detail[:60]}
        for s in cluster.status()
    ]
    emit(rows, output)
    if not all(r["healthy"] for r in rows):
        raise SystemExit(1)


@dev.command()
@STATE_DIR_OPTION
def env(state_dir: Path | None) -> None:
    """Print shell exports for the local cluster (eval "$(neonvm dev env)").

    KUBECONFIG is the admin's (kubectl, neonvm vm/leader/status/check);
    NEONVM_CONTROLLER_RUN_KUBECONFIG is the controller identity's, which
    'neonvm controller run' uses by default: the admission fence lets only that identity
    start a runner pod. NEONVM_ETCD_ENDPOINTS is the locks' etcd.
    """
    print_exports(LocalCluster(state_dir))


def print_exports(cluster: LocalCluster) -> None:
    """``export KEY=value`` lines for ``eval``, values shell-quoted."""
    for key, value in cluster.env().items():
        click.echo(f"export {key}={shlex.quote(value)}")


@dev.command()
@click.option("--only", type=click.Choice(["controller", "runner"]), multiple=True,
              help="Build only these images (repeatable) [default: both].")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the OCI archives go [default: <cache>/images/archives].")
@OUTPUT_OPTION
def images(only: tuple[str, ...], out_dir: Path | None, output: str) -> None:
    """Build the controller and runner OCI images without a Docker engine (docs/images.md).

    Debian root filesystems from mmdebstrap plus a venv with this checkout's neonvm,
    cached under the cache dir; prints each image, tag, archive path and size.
    """
    from neonvm.dev import images as dev_images

    started = time.monotonic()
    try:
        built = dev_images.build(only or ("controller", "runner"), out_dir,
                                 progress=_progress)
    except dev_images.ImageBuildError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"built in {time.monotonic() - started:.1f}s", err=True)
    emit(dev_images.as_rows(built), output,
         columns=None if output != "table" else
         ["image", "tag", "size", "unpacked", "cached", "archive"])


# Fault knobs of the simulated nodes (neonvm/cli/nodes.py): ``neonvm dev node|pod ...``.
from neonvm.cli.nodes import node as _node_group  # noqa: E402
from neonvm.cli.nodes import pod as _pod_group  # noqa: E402

dev.add_command(_node_group)
dev.add_command(_pod_group)
