"""Properties of decide() and of the status mutations re-applied on a fresh copy.

A decision is made from one observation; its write is re-applied by the update helper
on whatever version of the VM is current when the write finally goes out (after any
number of conflicts, failovers and other writers). So the mutations must be right not
only for the copy the decision saw but for *every* later copy. These tests generate
both: an observation, the decision, and an arbitrary fresh copy.

The first test is the counterexample the interleaving explorer found (see
docs/verification.md, "Found by the explorer").
"""

from __future__ import annotations

import dataclasses

import pytest

from neonvm.api.types import (
    FINALIZER,
    Fence,
    VirtualMachine,
    VirtualMachineSpec,
    VirtualMachineStatus,
)
from neonvm.controller import decide as d
from neonvm.controller.mutations import status_mutation

pytestmark = pytest.mark.unit

UID = "a1b2c3d4-0000-4000-8000-00000000000a"
LEASE = d.Lease(epoch=3, token=7)
POD1 = f"vm-{UID[:8]}-1"
POD2 = f"vm-{UID[:8]}-2"


def vm(*, deleting: bool = False, restart_policy: str = "Always",
       finalizers: tuple[str, ...] = (FINALIZER,), **status: object) -> VirtualMachine:
    return VirtualMachine(
        name="vm", namespace="ns", uid=UID, resource_version="1", generation=1,
        spec=VirtualMachineSpec(restart_policy=restart_policy),  # type: ignore[arg-type]
        status=VirtualMachineStatus(**status),  # type: ignore[arg-type]
        deletion_timestamp="2026-01-01T00:00:00Z" if deleting else None,
        finalizers=list(finalizers),
    )


def test_a_status_sync_decided_for_the_old_pod_is_refused_on_the_replacements_status() -> None:
    """Explorer counterexample (scenario seed-pod-deleted, 20 steps): a new leader decides
    SyncStatus from a cached observation in which the old pod runs; before its write
    lands, the old pod is deleted, the VM restarted and the replacement committed. The
    conflict retry re-applies the sync on the fresh copy, which names the replacement: it
    must not write the old pod's node and IP into the replacement's status."""
    old = d.PodView(name=POD1, uid="u1", owner_uid=UID, gated=False, terminating=False,
                    phase="Running", node="node-1", ip="10.0.0.1")
    seen = vm(pod_name=POD1, pod_uid="u1", plan_seq=1, phase="Pending",
              fence=Fence(epoch=2, token=1))
    action = d.decide(d.Observation(vm=seen, pods=(old,), lease=LEASE, direct=False))
    assert isinstance(action, d.SyncStatus)

    fresh = vm(pod_name=POD2, pod_uid="u2", plan_seq=2, phase="Pending", restart_count=1,
               fence=Fence(epoch=2, token=1))
    assert status_mutation(action, LEASE)(fresh) is None
    # The same sync on the copy it was decided for still goes through.
    assert status_mutation(action, LEASE)(seen) is not None


def test_sync_is_still_written_for_the_pod_it_was_decided_for() -> None:
    pod = d.PodView(name=POD2, uid="u2", owner_uid=UID, gated=False, terminating=False,
                    phase="Running", node="node-1", ip="10.0.0.2")
    seen = vm(pod_name=POD2, pod_uid="u2", plan_seq=2, phase="Pending")
    action = d.decide(d.Observation(vm=seen, pods=(pod,), lease=LEASE, direct=True))
    assert isinstance(action, d.SyncStatus)
    raced = dataclasses.replace(seen, status=dataclasses.replace(seen.status,
                                                                 restart_count=5))
    new = status_mutation(action, LEASE)(raced)
    assert new is not None
    assert (new.phase, new.node, new.pod_ip, new.restart_count) == (
        "Running", "node-1", "10.0.0.2", 5)

