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

from collections.abc import Callable

from kubernetes import client

from neonvm.controller.informer import EventFilter, Obj, Store
from neonvm.controller.observe import CacheReader, Observer
from neonvm.controller.reconciler import StepHook, VMWriter, Writer


class Wiring:
    """The production parts, unwrapped."""

    def store(self, index: Callable[[Obj], str | None] | None = None) -> Store:
        """A cache store (``index``: the secondary index, as :class:`Store` takes it)."""
        return Store(index=index)

    def event_filter(self, informer: str) -> EventFilter | None:
        """The filter of the named informer's watch events (None: every event counts)."""
        return None

    def observer(self, vms: Store, pods: Store) -> Observer:
        """The reader of the two stores that the reconciler starts decisions from."""
        return CacheReader(vms, pods)

    def writer(self, api: client.ApiClient) -> Writer:
        """What writes VMs (status and main resource, both conditional)."""
        return VMWriter(api)

    def after_step(self) -> StepHook | None:
        """Called after each step the reconciler performed (None: nothing)."""
        return None
