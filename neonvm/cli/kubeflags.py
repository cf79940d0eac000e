"""The flags every command that talks to a cluster shares, with kubectl's meanings.

``--kubeconfig`` and ``--context`` pick the cluster and credentials (resolution order in
:mod:`neonvm.kube`); ``-n`` without a value means the context's namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from neonvm import kube

F = TypeVar("F", bound=Callable[..., Any])

KUBECONFIG_HELP = ("Kubeconfig file [default: $KUBECONFIG, else ~/.kube/config, "
                   "else in-cluster].")


def kube_options(f: F) -> F:
    """``--kubeconfig PATH`` and ``--context NAME`` (parameters ``kubeconfig``, ``context``)."""
    f = click.option("--context", "context", default=None, metavar="NAME",
                     help="Kubeconfig context [default: its current-context].")(f)
    f = click.option("--kubeconfig", default=None,
                     type=click.Path(dir_okay=False, path_type=Path),
                     help=KUBECONFIG_HELP)(f)
    return f


def namespace_option(help_text: str = "Namespace [default: the context's namespace, "
                                      "else 'default'].") -> Callable[[F], F]:
    """``-n/--namespace``, None when not given (resolve with :func:`namespace_of`)."""
    return click.option("-n", "--namespace", default=None, help=help_text)


def namespace_of(namespace: str | None, kubeconfig: Path | None, context: str | None) -> str:
    """``-n`` if given, else the namespace of the context the flags select."""
    return namespace or kube.default_namespace(kubeconfig, context)
