"""Which exceptions are the user's to fix, and how to say so in one line."""

from __future__ import annotations

import socket


def user_facing_message(exc: BaseException) -> str | None:
    """A one-line message for an expected failure, or None for a bug (show the traceback)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError as Urllib3Error

    from neonvm.dev.binaries import BinaryError
    from neonvm.dev.cluster import ClusterError
    from neonvm.kube import api_error_message

    if isinstance(exc, ClusterError | BinaryError):
        return str(exc)
    if isinstance(exc, ApiException):
        if exc.status == 0 or exc.status is None:
            return f"API server unreachable: {exc.reason}"
        return f"API server said {exc.status}: {api_error_message(exc)}"
    if isinstance(exc, Urllib3Error | ConnectionError | socket.timeout):
        return f"API server unreachable: {exc}"
    try:
        from neonvm.leader.etcd import EtcdError
    except ImportError:
        pass
    else:
        if isinstance(exc, EtcdError):  # EtcdUnavailable, EtcdRequestFailed, config
            return str(exc)
    if isinstance(exc, FileNotFoundError):
        return str(exc)
    from neonvm.api.schema import DecodeError

    if isinstance(exc, DecodeError):
        return f"invalid VirtualMachine: {exc}"
    return None
