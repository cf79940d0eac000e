"""The CLI's exit codes, and which failure gets which.

===  ==========================================================================
 0   success (``check``/``status``: the invariant holds)
 1   the invariant is violated (``check``, ``status``, drills), a component is
     unhealthy (``dev status``), or the command failed for another reason it
     states in one line (e.g. no such VM, the API server refused a write)
 2   usage: an unknown flag, a bad value (click's own code)
 3   cannot reach the cluster: no usable kubeconfig or context, the API server or
     the locks' etcd refused the connection, timed out or failed TLS
 4   ``check`` and ``status`` only: the cluster was reached but could not be read
     (e.g. 403), so there is no verdict
===  ==========================================================================
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Iterator
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    NO_VERDICT = 4


VIOLATION = ExitCode.FAILED
"""``check`` and ``status`` exit with this, and only this, on a violation."""


class CliFailure(Exception):
    """A failure the CLI prints as ``error: <message>`` and exits with ``code``."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


def unreachable_message(exc: BaseException) -> str | None:
    """A one-line message if ``exc`` means the cluster could not be reached, else None."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError as Urllib3Error

    if isinstance(exc, ConfigException):
        text = str(exc).strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        from neonvm.kube import KubeconfigError

        return first if isinstance(exc, KubeconfigError) else f"cannot load kubeconfig: {first}"
    if isinstance(exc, ApiException) and not exc.status:
        return f"API server unreachable: {exc.reason}"
    if isinstance(exc, Urllib3Error | ConnectionError | socket.timeout | ssl.SSLError):
        return f"API server unreachable: {exc}"
    try:
        from neonvm.leader.etcd import EtcdUnavailable
    except ImportError:  # pragma: no cover - the package always has it
        return None
    if isinstance(exc, EtcdUnavailable):
        return str(exc)
    return None


@contextlib.contextmanager
def verdict_errors() -> Iterator[None]:
    """For ``check`` and ``status``: an error that is neither a usage error nor an
    unreachable cluster means no verdict (exit 4), never a violation (exit 1)."""
    import click

    from neonvm.errors import user_facing_message

    try:
        yield
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException,
            CliFailure, SystemExit):
        raise
    except Exception as exc:
        if unreachable_message(exc) is not None:
            raise
        message = user_facing_message(exc)
        if message is None:
            raise
        raise CliFailure(f"{message} (no verdict)", ExitCode.NO_VERDICT) from exc
