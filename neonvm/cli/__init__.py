"""The ``neonvm`` command: run a replica, inspect leaders, locks and VMs, run a local cluster.

Errors the user can act on (bad flags, unreachable servers, missing binaries) print one
line on stderr and exit non-zero; tracebacks are for bugs only. Exit codes
(:mod:`neonvm.cli.exits`): 1 a violation or a stated failure, 2 usage, 3 the cluster cannot
be reached, 4 (``check``, ``status``) no verdict.

Shell completion comes from click: ``eval "$(_NEONVM_COMPLETE=bash_source neonvm)"``
(``zsh_source``, ``fish_source`` for those shells).

Installed as ``kubectl-neonvm`` too, the same command is a kubectl plugin: ``kubectl neonvm
vm list`` (kubectl finds ``kubectl-neonvm`` on ``PATH`` and passes the arguments after
``neonvm``); its usage lines then say ``kubectl neonvm``. See docs/cli.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from neonvm import logs
from neonvm.cli.exits import CliFailure, ExitCode, unreachable_message

PLUGIN_EXECUTABLE = "kubectl-neonvm"
PLUGIN_PROG_NAME = "kubectl neonvm"
PLUGIN_COMPLETE_VAR = "_KUBECTL_NEONVM_COMPLETE"


class _Main(click.Group):
    """Turns known failures into one-line errors: exit 3 when the cluster cannot be
    reached, the code a :class:`CliFailure` carries, else 1."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        # Run as kubectl's plugin: usage lines name the command as the user typed it.
        # Not when producing a completion script, which registers that name with the
        # shell (it would take over kubectl's own completion).
        if os.path.basename(sys.argv[0]) == PLUGIN_EXECUTABLE and len(args) < 2 \
                and kwargs.get("prog_name") is None and PLUGIN_COMPLETE_VAR not in os.environ:
            kwargs["prog_name"] = PLUGIN_PROG_NAME
        return super().main(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> object:
        from neonvm.errors import user_facing_message

        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except CliFailure as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(int(exc.code))
        except Exception as exc:
            unreachable = unreachable_message(exc)
            if unreachable is not None:
                click.echo(f"error: {unreachable}", err=True)
                sys.exit(int(ExitCode.UNREACHABLE))
            message = user_facing_message(exc)
            if message is None:
                raise
            click.echo(f"error: {message}", err=True)
            sys.exit(int(ExitCode.FAILED))


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
