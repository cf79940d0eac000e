"""``neonvm manifests``: print or write the generated CRD, RBAC and admission policy."""

from __future__ import annotations

import click
import yaml

from neonvm import manifests as gen
from neonvm.dev.cluster import CONTROLLER_USER


@click.group()
def manifests() -> None:
    """Generated cluster objects (one source for the local cluster and the chart)."""


@manifests.command("crd")
def crd() -> None:
    """Print the VirtualMachine CRD as YAML."""
    click.echo(yaml.safe_dump(gen.crd(), sort_keys=False).rstrip())


@manifests.command("all")
@click.option("--controller-user", default=CONTROLLER_USER, show_default=True,
              help="Identity allowed to ungate runner pods.")
def all_objects(controller_user: str) -> None:
    """Print every cluster object the local cluster applies."""
    click.echo(yaml.safe_dump_all(gen.cluster_objects(controller_user), sort_keys=False).rstrip())


@manifests.command("write")
def write() -> None:
    """Regenerate the chart's generated files."""
    for path in gen.write_chart_files():
        click.echo(f"wrote {path}")
