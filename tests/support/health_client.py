"""A probe and metrics server on loopback, and a client's GET of it (the health server's
tests: tests/test_health_server.py, tests/test_health_probes_first.py)."""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator

from prometheus_client import CollectorRegistry

from neonvm.leader.health import HealthServer


def get(port: int, path: str) -> tuple[int, str]:
    """``GET path`` on ``port``: (status, body), an error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@contextlib.contextmanager
def running_server(read_timeout: float) -> Iterator[HealthServer]:
    """A started server with 2 workers, 64 connections and one passing check, ``always``."""
    health = HealthServer(0, CollectorRegistry(), host="127.0.0.1", read_timeout=read_timeout,
                          workers=2, max_connections=64)
    health.add_check("always", lambda: None)
    with health:
        yield health
