"""The ``neonvm`` command: run a replica, inspect leaders, locks and VMs, run a local cluster.

Errors the user can act on (bad flags, unreachable servers, missing binaries) print one
line on stderr and exit non-zero; tracebacks are for bugs only.
"""

from __future__ import annotations

import sys

import click

from neonvm import logs


class _Main(click.Group):
    """Turns known failures into one-line errors and exit code 1."""

    def invoke(self, ctx: click.Context) -> object:
        from neonvm.errors import user_facing_message

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as exc:
            message = user_facing_message(exc)
            if message is None:
                raise
            click.echo(f"error: {message}", err=True)
            sys.exit(1)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--log-format", default="text", show_default=True,
              type=click.Choice(["text", "json"]), help="json: one JSON object per line.")
@click.version_option(package_name="neonvm")
def main(log_level: str, log_format: str) -> None:
    """neonvm: exactly one runner pod per VirtualMachine, highly available."""
    logs.configure(log_level, log_format)


def _register() -> None:
    from neonvm.cli import dev, manifests_cmd

    main.add_command(dev.dev)
    main.add_command(manifests_cmd.manifests)
    for module_name, attr in (
        ("neonvm.cli.leader", "leader"),
        ("neonvm.cli.locks", "locks"),
        ("neonvm.cli.controller", "controller"),
        ("neonvm.cli.vm", "vm"),
        ("neonvm.cli.drill", "drill"),
        ("neonvm.cli.runner", "runner"),
        ("neonvm.cli.demo", "demo"),
        ("neonvm.cli.verify", "verify"),
        ("neonvm.cli.status", "status"),
        ("neonvm.cli.check", "check"),
    ):
        try:
            module = __import__(module_name, fromlist=[attr])
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        main.add_command(getattr(module, attr))


_register()
