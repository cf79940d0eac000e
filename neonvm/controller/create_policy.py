"""How a failed runner pod create is handled: taken (``exists``), retried, or refused
for the VM's generation. docs/reconciler.md says why each answer lands where it does.
"""

from __future__ import annotations

from typing import Literal

from neonvm.controller.reasons import NAMESPACE_TERMINATING

CreateErrorKind = Literal["exists", "retry", "refuse"]

RETRIED_CREATE_STATUSES = frozenset({401, 404, 408, 410, 429})
"""4xx answers to a pod create that say nothing about the pod itself: credentials being
rotated (401), a namespace or resource in flux (404, 410), a timeout (408), throttling
(429). Retried with backoff."""

RETRIED_FORBIDDEN = ("exceeded quota", "cannot create resource", "is being terminated",
                     "error looking up service account", "not yet ready to handle request",
                     "status unknown for quota")
"""403s that pass: quota (the old pod still counts while it terminates), RBAC being set
up, a namespace being deleted (its VMs go with it), and admission that is not ready yet:
the ServiceAccount admission plugin answers ``error looking up service account ns/sa:
serviceaccount "sa" not found`` until the namespace's ServiceAccount exists (a namespace
just created, or the ServiceAccount applied after the VM), admission plugins answer ``not
yet ready to handle request`` until their caches sync after an API-server restart, and
ResourceQuota admission ``status unknown for quota`` until the quota's usage is computed.
None of these is fixed by a change to the VM, so none may leave it refused."""

FENCE_CREATOR_RULE = "only the neonvm controller may create a runner pod"
"""The admission fence's answer to a runner pod create by another identity: not a
problem of the pod or the spec, so no spec change helps (see :meth:`Reconciler.identity`)."""

TOO_LARGE_FOR_STORAGE = ("etcdserver: request is too large", "larger than max")
"""500s that are permanent: the object is too large for etcd. kube-apiserver 1.36 takes
a request body up to 3 MiB (larger: 413), but answers 500 ``etcdserver: request is too
large`` for an object over etcd's 1.5 MiB request limit, and 500 ``rpc error: code =
ResourceExhausted desc = trying to send message larger than max`` over its own 2 MiB
gRPC limit (both seen on the real servers, ``tests/test_reconcile_loops.py``)."""

NAMESPACE_TERMINATING_TEXT = "is being terminated"
"""A 403 to a create in a namespace being deleted: ``unable to create new content in
namespace ns because it is being terminated`` (its cause: ``NamespaceTerminating``)."""

def namespace_terminating(status: int | None, message: str) -> bool:
    """The create was refused because the namespace is being deleted."""
    return status == 403 and (NAMESPACE_TERMINATING_TEXT in message
                              or NAMESPACE_TERMINATING in message)

CREATE_FAILURES_BEFORE_CONDITION = 3
"""Transient create failures in a row (lasting ``create_failing_after`` seconds) after
which Degraded ``CreateFailing`` is written."""

def classify_create_error(status: int | None, message: str) -> CreateErrorKind:
    """How a failed runner pod create is handled, from the status and message.

    ``exists``: 409, the name is taken (see who took it). ``retry``: no answer at all
    (status 0 or None: connection refused, timeout), 5xx, 429 and the others of
    :data:`RETRIED_CREATE_STATUSES`, and the 403s of :data:`RETRIED_FORBIDDEN`.
    ``refuse``: every other 4xx (400, 403 from admission, 405, 413 too large, 415,
    422 invalid, ...) and a 500 saying the object is too large to store
    (:data:`TOO_LARGE_FOR_STORAGE`): the same pod asked again gets the same answer, so
    the VM is Degraded (``CreateRefused``) until its spec changes.
    """
    if status == 409:
        return "exists"
    if status == 500 and any(text in message for text in TOO_LARGE_FOR_STORAGE):
        return "refuse"
    if not status or status >= 500 or status in RETRIED_CREATE_STATUSES:
        return "retry"
    if status == 403 and any(text in message for text in RETRIED_FORBIDDEN):
        return "retry"
    if 400 <= status < 500:
        return "refuse"
    return "retry"
