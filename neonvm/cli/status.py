"""``neonvm status``: leader, VMs, runner pods and locks in one view."""

from __future__ import annotations

import click

from neonvm import kube, overview
from neonvm.cli.output import OUTPUT_OPTION, emit


@click.command()
@click.option("--kubeconfig", type=click.Path(dir_okay=False), default=None,
              help="Kubeconfig (default: $KUBECONFIG).")
@click.option("--lease-namespace", default="neonvm-system", show_default=True)
@click.option("--lease-name", default="neonvm-controller", show_default=True)
@OUTPUT_OPTION
def status(kubeconfig: str | None, lease_namespace: str, lease_name: str, output: str) -> None:
    """Everything at a glance; exits 1 if any VM has more than one live runner pod."""
    api = kube.api_client(kubeconfig)
    try:
        ov = overview.collect(api, lease_namespace, lease_name)
    finally:
        api.close()
    if output == "table":
        click.echo(overview.render(ov))
    else:
        emit(ov.as_dict(), output)
    if ov.duplicates:
        raise SystemExit(1)
