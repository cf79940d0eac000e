"""``neonvm dev node`` and ``neonvm dev pod``: fault knobs of the local cluster's simulated
nodes (kwok), for drills and tests. See docs/local-cluster.md.

Every command talks to the cluster of ``--state-dir`` with its admin kubeconfig and does
one API write; none waits unless asked (``--wait``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from kubernetes import client

from neonvm import kube
from neonvm.cli.output import emit, object_name, output_option
from neonvm.dev import nodes
from neonvm.dev.cluster import LocalCluster, default_state_dir

_STATE_DIR_OPTION = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help=f"Where the cluster keeps its state [default: {default_state_dir()}]",
)


def _admin_api(state_dir: Path | None) -> tuple[LocalCluster, client.ApiClient]:
    cluster = LocalCluster(state_dir)
    if not cluster.kubeconfig.exists():
        raise nodes.NodeError(f"no local cluster in {cluster.state_dir} (run 'neonvm dev up')")
    return cluster, kube.api_client(cluster.kubeconfig)


@click.group()
def node() -> None:
    """Simulated nodes: list them, power them off and on, mark them out of service."""


@node.command("list")
@_STATE_DIR_OPTION
@output_option("name")
def list_(state_dir: Path | None, output: str) -> None:
    """Each simulated node: power, Ready condition, taints, pods bound to it."""
    _cluster, api = _admin_api(state_dir)
    if output == "name":
        for n in nodes.list_nodes(api):
            click.echo(object_name("Node", "", n.name))
        return
    rows = [
        {"node": n.name, "power": n.power, "ready": n.ready or "-",
         "out_of_service": n.out_of_service, "pods": n.pods, "terminating": n.terminating,
         "taints": ",".join(n.taints)}
        for n in nodes.list_nodes(api)
    ]
    emit(rows, output)


def _wait_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--wait", "wait_seconds", type=click.FloatRange(min=0), default=None,
        metavar="SECONDS", help=f"Wait up to SECONDS until the node is {what}.",
    )


@node.command("power-off")
@_STATE_DIR_OPTION
@click.argument("name")
@_wait_option("NotReady")
def power_off(state_dir: Path | None, name: str, wait_seconds: float | None) -> None:
    """Stop the node's simulated kubelet (no heartbeats, pods frozen, deletions hang).

    kube-controller-manager marks the node NotReady about 20-25 s later.
    """
    _cluster, api = _admin_api(state_dir)
    nodes.power_off(api, name)
    click.echo(f"{name}: powered off")
    if wait_seconds is not None:
        n = nodes.wait_for_node(api, name, lambda n: n.ready not in ("True", ""),
                                wait_seconds, "NotReady")
        click.echo(f"{name}: Ready={n.ready}")


@node.command("power-on")
@_STATE_DIR_OPTION
@click.argument("name")
@_wait_option("Ready and schedulable")
def power_on(state_dir: Path | None, name: str, wait_seconds: float | None) -> None:
    """Resume the node's simulated kubelet; it turns Ready and its pods' stages resume."""
    _cluster, api = _admin_api(state_dir)
    nodes.power_on(api, name)
    click.echo(f"{name}: powered on")
    if wait_seconds is not None:
        nodes.wait_for_node(api, name, lambda n: n.schedulable,
                            wait_seconds, "schedulable")
        click.echo(f"{name}: Ready, schedulable")


@node.command("out-of-service")
@_STATE_DIR_OPTION
@click.argument("name")
@click.option("--remove", is_flag=True, help="Remove the taint instead of adding it.")
def out_of_service(state_dir: Path | None, name: str, remove: bool) -> None:
    """Taint the node node.kubernetes.io/out-of-service=nodeshutdown:NoExecute.

    kube-controller-manager's pod GC then force-deletes the node's Terminating pods
    (within about 20 s) if the node is NotReady. On a real cluster do this only after
    confirming the node is powered off: a force-deleted pod whose node still runs leaves
    its guest running beside the replacement.
    """
    _cluster, api = _admin_api(state_dir)
    current = nodes.get_node(api, name)
    changed = nodes.set_out_of_service(api, name, present=not remove)
    state = "removed" if remove else "added"
    click.echo(f"{name}: out-of-service taint {state if changed else 'unchanged'}")
    if not remove and current.ready == "True":
        click.echo(f"warning: {name} is Ready; pod GC force-deletes its Terminating pods "
                   "only once it is NotReady ('neonvm dev node power-off')", err=True)


@click.group()
def pod() -> None:
    """Per-pod knobs honoured by the simulated kubelet (slow shutdown, guest exit)."""


@pod.command("delay-termination")
@_STATE_DIR_OPTION
@click.option("-n", "--namespace", required=True)
@click.argument("name")
@click.option("--seconds", type=click.IntRange(min=0), default=None,
              help="Stay Terminating this long past the deletion timestamp.")
@click.option("--clear", is_flag=True, help="Remove the delay (a due pod then goes at once).")
def delay_termination(
    state_dir: Path | None, namespace: str, name: str, seconds: int | None, clear: bool
) -> None:
    """Make a pod's termination outlast its grace period (a slow shutdown)."""
    if (seconds is None) == (not clear):
        raise click.UsageError("give exactly one of --seconds N and --clear")
    _cluster, api = _admin_api(state_dir)
    nodes.delay_termination(api, namespace, name, None if clear else seconds)
    click.echo(f"{namespace}/{name}: " + ("termination delay cleared" if clear
                                          else f"terminates {seconds}s past its deadline"))


@pod.command("exit")
@_STATE_DIR_OPTION
@click.option("-n", "--namespace", required=True)
@click.argument("name")
@click.option("--code", type=click.IntRange(0, 255), default=0, show_default=True,
              help="Exit code: 0 ends the pod Succeeded, anything else Failed.")
def exit_(state_dir: Path | None, namespace: str, name: str, code: int) -> None:
    """Make a running pod's guest exit (its containers terminate with CODE)."""
    _cluster, api = _admin_api(state_dir)
    nodes.exit_pod(api, namespace, name, code)
    click.echo(f"{namespace}/{name}: exits with code {code}")
