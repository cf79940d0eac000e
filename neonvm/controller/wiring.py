"""The parts a leader term is built from, and the one seam where wrappers go in.

A :class:`~neonvm.controller.manager.ControllerProcess` builds every leader term's caches,
informer event filters, cache reader, VM writer and after-step hook by asking its
:class:`Wiring`. The base class answers with the production parts and nothing around
them. A subclass may wrap or replace any of them; fault injection does
(:class:`neonvm.controller.fault_wiring.FaultWiring`), and only the command line that starts a
replica with ``--fault`` chooses it. The classes built here know nothing of what wraps
them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import urllib3
from kubernetes import client

from neonvm.controller.cluster import VMWriter
from neonvm.controller.informer import EventFilter, Obj, Store
from neonvm.controller.observe import CacheReader, Observer
from neonvm.controller.step import StepHook, Writer


class Wiring:
    """The production parts, unwrapped."""

    def store(self, index: Callable[[Obj], str | None] | None = None) -> Store:
        """A cache store (``index``: the secondary index, as :class:`Store` takes it),
        compact: objects kept serialized (see :class:`Store`)."""
        return Store(index=index, compact=True)

    def event_filter(self, informer: str) -> EventFilter | None:
        """The filter of the named informer's watch events (None: every event counts)."""
        return None

    def observer(self, vms: Store, pods: Store) -> Observer:
        """The reader of the two stores that the reconciler starts decisions from."""
        return CacheReader(vms, pods)

    def writer(self, api: client.ApiClient) -> Writer:
        """What writes VMs (status and main resource, both conditional)."""
        return VMWriter(api)

    def elector_api(self, api: client.ApiClient) -> client.ApiClient:
        """The leader elector's own client: the same server, credentials and default
        headers (impersonation, user agent) as ``api``, but its own connection pool, so
        Lease renewals never wait for, or open connections beside, the workers' burst of
        requests on ``api``. The caller closes it."""
        configuration = copy.copy(api.configuration)
        # No resend after a read timeout (a renewal would block for several times its
        # budget); the elector retries by itself, within its deadline. Connect errors
        # are retried: the request never left.
        configuration.retries = urllib3.Retry(total=2, connect=2, read=0, status=0,
                                              other=0, redirect=0)
        own = client.ApiClient(configuration)
        own.default_headers.update(api.default_headers)
        own.cookie = api.cookie
        return own

    def after_step(self) -> StepHook | None:
        """Called after each step the reconciler performed (None: nothing)."""
        return None
