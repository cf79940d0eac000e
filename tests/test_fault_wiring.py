"""Fault injection is composed around the production parts, never inside them.

With no knob on, a replica is built from exactly the production classes (nothing wraps
them); each knob wraps only the part it needs; the crash fault leaves a JSON record a
supervisor can read. The faults' effect on a real controller is shown by
tests/test_reconcile.py (stale reads and conflicts), tests/test_reconcile_failover.py
(crash after each step) and tests/test_campaign.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from neonvm.controller import actions as act
from neonvm.controller.cluster import VMWriter
from neonvm.controller.fault_wiring import (
    FaultWiring,
    FaultyCacheReader,
    FaultyWriter,
    VersionedStore,
    wiring_for,
)
from neonvm.controller.faults import FaultConfig, FaultConfigError, Faults, read_crash_record
from neonvm.controller.informer import Store
from neonvm.controller.observe import CacheReader, pod_index
from neonvm.controller.wiring import Wiring

pytestmark = pytest.mark.unit

LEASE = act.Fence(epoch=1, token=1)


def vm_raw(rv: str, restart_count: int) -> dict[str, object]:
    return {"apiVersion": types.API_VERSION, "kind": types.KIND,
            "metadata": {"name": "vm", "namespace": "ns", "uid": "u", "generation": 1,
                         "resourceVersion": rv},
            "spec": {"guest": {"rootDisk": {"image": "img"}}},
            "status": {"restartCount": restart_count}}


def test_no_fault_builds_the_plain_production_parts() -> None:
    api = client.ApiClient()
    for config in (FaultConfig(), FaultConfig(seed=3, crash_record="/nowhere/crash.json")):
        wiring = wiring_for(config)
        assert type(wiring) is Wiring, "nothing of fault injection is there"
        vms, pods = wiring.store(), wiring.store(index=pod_index)
        assert type(vms) is Store and type(pods) is Store
        assert type(wiring.observer(vms, pods)) is CacheReader
        assert type(wiring.writer(api)) is VMWriter
        assert wiring.event_filter("pods") is None and wiring.after_step() is None


@pytest.mark.parametrize("knob", ["stale_reads", "drop_watch_events", "conflict", "crash"])
def test_each_knob_wraps_only_its_own_part(knob: str) -> None:
    config = {"stale_reads": FaultConfig(stale_reads=0.5),
              "drop_watch_events": FaultConfig(drop_watch_events=0.5),
              "conflict": FaultConfig(conflict=0.5),
              "crash": FaultConfig(crash_after="commit")}[knob]
    wiring = wiring_for(config)
    assert isinstance(wiring, FaultWiring)
    vms, pods = wiring.store(), wiring.store(index=pod_index)
    wrapped = {
        "stale_reads": type(vms) is VersionedStore
        and type(wiring.observer(vms, pods)) is FaultyCacheReader,
        "drop_watch_events": wiring.event_filter("pods") is not None,
        "conflict": type(wiring.writer(client.ApiClient())) is FaultyWriter,
        "crash": wiring.after_step() is not None,
    }
    assert [k for k, on in wrapped.items() if on] == [knob]
    if knob != "stale_reads":
        assert type(vms) is Store and type(wiring.observer(vms, pods)) is CacheReader


def test_the_crash_fires_after_a_step_that_took_effect_and_leaves_a_record_first(
        tmp_path: Path) -> None:
    record = tmp_path / "crash.json"
    seen_at_exit: list[dict[str, object] | None] = []
    faults = Faults(FaultConfig.parse(f"crash_after=commit@2,crash_record={record}"),
                    exit=lambda code: seen_at_exit.append(read_crash_record(record)))
    hook = FaultWiring(faults).after_step()
    assert hook is not None
    hook("ns/vm", "commit", "done")
    hook("ns/vm", "commit", "conflict")  # did not take effect: not an occurrence
    hook("ns/vm", "plan", "done")
    assert seen_at_exit == [] and read_crash_record(record) is None
    hook("ns/vm", "commit", "done")
    assert len(seen_at_exit) == 1, "exited once, the record already in place"
    assert seen_at_exit[0] is not None
    assert {k: seen_at_exit[0][k] for k in ("fault", "step", "occurrence", "vm",
                                             "exit_code")} == {
        "fault": "crash_after", "step": "commit", "occurrence": 2, "vm": "ns/vm",
        "exit_code": 137}
    assert json.loads(record.read_text())["step"] == "commit"
    assert list(tmp_path.iterdir()) == [record], "no temporary file left behind"


def test_a_crash_record_path_must_be_given() -> None:
    with pytest.raises(FaultConfigError, match="file path"):
        FaultConfig.parse("crash_record=")


def test_stale_reads_come_from_the_versions_the_wrapper_kept() -> None:
    wiring = FaultWiring(Faults(FaultConfig(stale_reads=0.99, seed=4)))
    vms, pods = wiring.store(), wiring.store(index=pod_index)
    for rv in range(1, 4):
        vms.apply("MODIFIED", vm_raw(str(rv), rv))
    reader = wiring.observer(vms, pods)
    plain = CacheReader(vms, pods)
    assert isinstance(reader, FaultyCacheReader)

    def rv_of(raw: dict[str, Any] | None) -> str | None:
        return None if raw is None else str(raw["metadata"]["resourceVersion"])

    seen = {rv_of(reader.vm_raw("ns/vm")) for _ in range(40)}
    assert seen - {"3"}, "older versions were served"
    assert seen <= {None, "1", "2", "3"}, "only versions the store once held"
    assert {rv_of(plain.vm_raw("ns/vm")) for _ in range(10)} == {"3"}
    snap = plain.observe("ns/vm", LEASE)
    assert snap.record is not None and snap.record.resource_version == "3"


def test_dropped_watch_events_are_filtered_out() -> None:
    wiring = FaultWiring(Faults(FaultConfig(drop_watch_events=0.999999, seed=1)))
    accept = wiring.event_filter("vms")
    assert accept is not None
    assert not any(accept("MODIFIED", vm_raw(str(i), i)) for i in range(20))
