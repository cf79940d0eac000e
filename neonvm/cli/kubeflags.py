"""The flags every command that talks to a cluster shares, with kubectl's meanings.

``--kubeconfig`` and ``--context`` pick the cluster and credentials (resolution order in
:mod:`neonvm.kube`); ``-n`` without a value means the context's namespace;
``--request-timeout`` bounds each request (kubectl's format: ``0`` for none, ``5``,
``5s``, ``2m``, ``1h``). Contexts, namespaces and VM names complete in the shell
(docs/cli.md, "Completion").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml
from click.shell_completion import CompletionItem
from kubernetes import client

from neonvm import kube

F = TypeVar("F", bound=Callable[..., Any])

KUBECONFIG_HELP = ("Kubeconfig file [default: $KUBECONFIG, else ~/.kube/config, "
                   "else in-cluster].")
COMPLETION_TIMEOUT = 5.0
"""Seconds a completion may wait for the API server before offering nothing."""

_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|ms|m|s))+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


class Duration(click.ParamType):  # type: ignore[type-arg]  # generic from click 8.3
    """kubectl's ``--request-timeout``: a bare number of seconds or a Go duration
    (``1m30s``); ``0`` means no timeout (None)."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> float | None:
        if value is None:
            return None
        if isinstance(value, float | int):
            return float(value) or None
        text = str(value).strip()
        if re.fullmatch(r"\d+", text):
            return float(text) or None
        if not _DURATION.match(text):
            self.fail(f"invalid duration {text!r}: a number of seconds, or with a unit "
                      "(e.g. 1s, 2m, 3h)", param, ctx)
        seconds = sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))
        return seconds or None


def _complete_context(ctx: click.Context, _param: click.Parameter,
                      incomplete: str) -> list[CompletionItem]:
    try:
        names: set[str] = set()
        for path in kube.kubeconfig_files(ctx.params.get("kubeconfig")):
            doc = yaml.safe_load(path.read_text()) or {}
            names.update(str(c["name"]) for c in doc.get("contexts") or []
                         if isinstance(c, dict) and c.get("name") is not None)
    except Exception:  # completion offers nothing rather than fail
        return []
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


def kube_options(f: F) -> F:
    """``--kubeconfig PATH``, ``--context NAME`` and ``--request-timeout DURATION``
    (parameters ``kubeconfig``, ``context``, ``request_timeout``)."""
    f = click.option("--request-timeout", "request_timeout", type=Duration(), default="0",
                     metavar="DURATION",
                     help="Give up on a single request after this long (e.g. 5s, 1m; "
                          "0: never) [default: 0].")(f)
    f = click.option("--context", "context", default=None, metavar="NAME",
                     shell_complete=_complete_context,
                     help="Kubeconfig context [default: its current-context].")(f)
    f = click.option("--kubeconfig", default=None, is_eager=True,
                     type=click.Path(dir_okay=False, path_type=Path),
                     help=KUBECONFIG_HELP)(f)
    return f


def cluster_client(kubeconfig: Path | None, context: str | None,
                   request_timeout: float | None) -> client.ApiClient:
    """An ApiClient for these flags; with a ``request_timeout``, every request it sends
    with a single-number timeout or none gets that timeout instead. A request that names
    a (connect, read) pair keeps it: a watch's stream does, and is bounded by its own
    server-side timeout."""
    api = kube.api_client(kubeconfig, context)
    if request_timeout is None:
        return api
    rest = api.rest_client
    send = rest.request

    def request(method: str, url: str, headers: Any = None, body: Any = None,
                post_params: Any = None, _request_timeout: Any = None) -> Any:
        if not isinstance(_request_timeout, tuple):
            _request_timeout = request_timeout
        return send(method, url, headers=headers, body=body, post_params=post_params,
                    _request_timeout=_request_timeout)

    rest.request = request  # this client only
    return api


def _complete_namespace(ctx: click.Context, _param: click.Parameter,
                        incomplete: str) -> list[CompletionItem]:
    try:
        api = kube.api_client(ctx.params.get("kubeconfig"), ctx.params.get("context"))
        try:
            body = kube.request(api, "GET", "/api/v1/namespaces",
                                timeout=COMPLETION_TIMEOUT)
        finally:
            api.close()
    except Exception:
        return []
    names = sorted((i.get("metadata") or {}).get("name", "") for i in body.get("items") or [])
    return [CompletionItem(n) for n in names if n and n.startswith(incomplete)]


def namespace_option(help_text: str = "Namespace [default: the context's namespace, "
                                      "else 'default'].") -> Callable[[F], F]:
    """``-n/--namespace``, None when not given (resolve with :func:`namespace_of`)."""
    return click.option("-n", "--namespace", default=None, help=help_text,
                        shell_complete=_complete_namespace)


def namespace_of(namespace: str | None, kubeconfig: Path | None, context: str | None) -> str:
    """``-n`` if given, else the namespace of the context the flags select."""
    return namespace or kube.default_namespace(kubeconfig, context)
