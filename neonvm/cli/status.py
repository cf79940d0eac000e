"""``neonvm status``: leader, VMs, runner pods and locks in one view.

Exit codes as ``neonvm check``: 1 only when a VM has more than one live runner pod, 3
when the API server cannot be reached, 4 when it cannot be read.
"""

from __future__ import annotations

from pathlib import Path

import click

from neonvm import overview
from neonvm.cli.exits import VIOLATION, verdict_errors
from neonvm.cli.kubeflags import cluster_client, kube_options
from neonvm.cli.output import emit, output_option


@click.command()
@kube_options
@click.option("--lease-namespace", default="neonvm-system", show_default=True)
@click.option("--lease-name", default="neonvm-controller", show_default=True)
@output_option()
def status(kubeconfig: Path | None, context: str | None, request_timeout: float | None,
           lease_namespace: str, lease_name: str, output: str) -> None:
    """Everything at a glance; exits 1 if any VM has more than one live runner pod."""
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        with verdict_errors():
            ov = overview.collect(api, lease_namespace, lease_name)
    finally:
        api.close()
    if output == "table":
        click.echo(overview.render(ov))
    else:
        emit(ov.as_dict(), output)
    if ov.duplicates:
        raise SystemExit(int(VIOLATION))
