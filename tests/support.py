"""Helpers shared by tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 60.0, interval: float = 0.1, what: str = ""
) -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds.

    Tests wait on conditions with generous bounds, never on sleeps.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = condition()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {what or condition!r}; last={last!r}"
    )


def create_pull_secret(api: client.ApiClient, namespace: str, name: str) -> None:
    """An (empty) registry credential, as a VM's ``imagePullSecrets`` would name."""
    client.CoreV1Api(api).create_namespaced_secret(namespace, {
        "metadata": {"name": name}, "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": json.dumps({"auths": {}})}})
