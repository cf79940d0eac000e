"""Who this controller is to the API server, for the messages of a refusal.

The admission fence lets only the controller's identity create and ungate runner pods; a
403 from it names the identity the controller runs as (asked once with a
SelfSubjectReview) and the remedy (docs/reconciler.md, "Reconciles that cannot
converge").
"""

from __future__ import annotations

import threading
from typing import Protocol

from neonvm.controller.conditions import api_error_text


class Whoami(Protocol):
    """The one call this needs (:meth:`~neonvm.controller.cluster.Cluster.username`)."""

    def username(self) -> str: ...


class Identity:
    """This controller's user name, asked once and kept (an answer only: a failed ask is
    asked again next time)."""

    def __init__(self, cluster: Whoami) -> None:
        self._cluster = cluster
        self._name: str | None = None
        self._mutex = threading.Lock()

    def __call__(self) -> str:
        """Who this controller is to the API server (SelfSubjectReview), for messages."""
        with self._mutex:
            if self._name is not None:
                return self._name
        try:
            user = self._cluster.username()
        except Exception as exc:  # messages only: never fail a reconcile over it
            return f"this controller's identity (unknown: {type(exc).__name__})"
        with self._mutex:
            self._name = f'"{user}"'
            return self._name

    def forbidden_detail(self, what: str, message: str) -> str:
        """A 403 from the admission fence: who we are to the API server, and the remedy."""
        who = self()
        return (f"the API server refused to let {who} {what} (403: {api_error_text(message)}"
                f"). Only the controller's own identity may create and start runner pods: "
                f"run the controller with its own credentials (the chart's ServiceAccount; "
                f"on a `neonvm dev` cluster, its controller.kubeconfig), or, if {who} is the "
                f"controller, name it in the admission policy")
