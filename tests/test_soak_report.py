"""The soak's record as figures (benchmarks/soak.py; docs/benchmarks.md, "Soak"): pure
logic over a made-up record, no cluster; and the API Priority and Fairness objects its
private cluster gets (rendered by the real helm binary)."""

from __future__ import annotations

import argparse
import os
import xml.etree.ElementTree as ET

import pytest
from prometheus_client import generate_latest

from benchmarks.soak import (
    Counters,
    Record,
    Sample,
    chart_apf_objects,
    gauge_by_label,
    markdown,
    per_minute,
    proc_memory,
    render_svg,
    window,
)
from neonvm.controller.metrics import ControllerMetrics
from neonvm.dev.common import CONTROLLER_USER
from neonvm.dev.replica import LEASE_NAMESPACE


def _record() -> Record:
    """30 minutes, a sample every minute: RSS 100 MiB rising to 129, the API server's
    counter growing by 600 a minute, one leader change at minute 12."""
    samples = [Sample(t=60.0 * m, leader="a" if m < 12 else "b", epoch=0 if m < 12 else 1,
                      leader_rss_mib=100.0 + m, rss_mib={}, apiserver_requests=600.0 * m,
                      controller_requests=300.0 * m, load1=2.0,
                      not_converged=m % 3, stuck=0)
               for m in range(30)]
    return Record(vms=10, minutes=30, samples=samples,
                  leader_changes=[{"at_min": 12.0, "from": "a", "from_epoch": 0, "to": "b",
                                   "to_epoch": 1}])


@pytest.mark.unit
def test_a_replica_restart_resets_its_counter_without_a_negative_rate() -> None:
    c = Counters()
    for source, value in [("r0", 10.0), ("r0", 25.0), ("r1", 5.0), ("r0", 3.0), ("r1", 9.0)]:
        c.add(source, value)
    # r0: +15, then restarted (3 counted from zero); r1: +4. A first look counts nothing.
    assert c.total == 15 + 3 + 4
    c.add("r0", None)  # a scrape that failed changes nothing
    assert c.total == 22


@pytest.mark.unit
def test_rates_are_per_minute_between_samples_and_the_windows_compare_first_and_last() -> None:
    record = _record()
    assert {round(v) for _, v in per_minute(record.samples, "apiserver_requests")} == {600}
    first, last = window(record, first=True), window(record, first=False)
    assert first["rss_mean"] == pytest.approx(105.0)  # minutes 0..10
    assert last["rss_mean"] == pytest.approx(124.0)  # minutes 19..29
    assert first["api_per_min"] == pytest.approx(600.0)
    assert last["ctl_per_min"] == pytest.approx(300.0)


@pytest.mark.unit
def test_the_table_names_the_leader_change_and_the_picture_marks_it() -> None:
    record = _record()
    args = argparse.Namespace(minutes=30, vms=10, churn_interval=5.0, churn_pods=5,
                              nodes=4, stuck_minutes=5.0, delete_namespace=False,
                              write_docs=False)
    text = markdown(record, args, "docs/soak.svg")
    assert "leader changes: **1** (12.0 min: a (epoch 0) -> b (epoch 1))" in text
    assert "| leader RSS, mean (max) | 105 MiB (110 MiB) | 124 MiB (129 MiB) |" in text
    root = ET.fromstring(render_svg(record, "t"))
    ns = "{http://www.w3.org/2000/svg}"
    assert len([e for e in root.iter(f"{ns}line") if e.get("stroke") == "red"]) == 2
    assert len(list(root.iter(f"{ns}polyline"))) == 3  # RSS, API server, replicas


@pytest.mark.unit
def test_the_report_says_which_level_took_the_lease_requests_and_which_the_reviews() -> None:
    record = _record()
    record.apf = {"level": "soak-neonvm-controller-leader-election",
                  "lease_requests_in_level": True,
                  "reviews_level": "soak-neonvm-controller-token-reviews",
                  "reviews_in_level": False, "lease_level_dispatched": 1234.0,
                  "reviews_level_dispatched": 56.0, "rejected_any_level": 0.0}
    args = argparse.Namespace(minutes=30, vms=10, churn_interval=5.0, churn_pods=5,
                              nodes=4, stuck_minutes=5.0, delete_namespace=False,
                              write_docs=False)
    text = markdown(record, args, None)
    assert ("the replicas' Lease requests in the chart's level "
            "(soak-neonvm-controller-leader-election): 1,234 requests dispatched there, "
            "0 rejected in any level; TokenReviews and issuer key fetches NOT in the "
            "chart's level (soak-neonvm-controller-token-reviews): 56 requests dispatched "
            "there.") in text


@pytest.mark.unit
def test_the_report_says_what_the_leader_held_at_the_start_middle_and_end() -> None:
    """Which memory grew, if RSS does: read from the controller's own gauge, as served."""
    metrics = ControllerMetrics()
    metrics.remembered("events_recent", lambda: 4096)
    served = generate_latest(metrics.registry).decode()
    held = gauge_by_label(served, "neonvm_controller_remembered_entries", "structure")
    assert held == {"events_recent": 4096.0, "lifecycle_pods": 0.0}
    record = _record()
    for s in record.samples:
        m = s.t / 60
        s.leader_memory = {"rss_anon_mib": 90.0 + m, "threads": 40.0,
                           "events_recent": 4096.0 - 100 * m}
    args = argparse.Namespace(minutes=30, vms=10, churn_interval=5.0, churn_pods=5,
                              nodes=4, stuck_minutes=5.0, delete_namespace=False,
                              write_docs=False)
    text = markdown(record, args, None)
    assert ("* the leader's memory at minutes 0 / 14 / 29: rss_anon_mib 90.0 / 104.0 / "
            "119.0; rss_file_mib - / - / -; threads 40 / 40 / 40; events_recent "
            "4,096 / 2,696 / 1,196") in text


@pytest.mark.unit
def test_the_leaders_memory_split_is_read_from_proc() -> None:
    mine = proc_memory(os.getpid())
    assert set(mine) == {"rss_anon_mib", "rss_file_mib", "threads"}
    assert mine["rss_anon_mib"] > 0 and mine["threads"] >= 1


def test_the_soak_gives_its_replicas_lease_requests_and_reviews_the_charts_levels() -> None:
    """The chart's objects as helm renders them, each schema's subject made the local
    replicas' identity (a client certificate's user, not the chart's ServiceAccount); the
    levels are created first, so no schema ever names a missing one."""
    objects = chart_apf_objects()
    assert [o["kind"] for o in objects] == ["PriorityLevelConfiguration"] * 2 + [
        "FlowSchema"] * 2
    levels = {o["metadata"]["name"]: o for o in objects[:2]}
    schemas = {o["metadata"]["name"]: o for o in objects[2:]}
    assert sorted(levels) == sorted(schemas) == ["soak-neonvm-controller-leader-election",
                                                 "soak-neonvm-controller-token-reviews"]
    assert levels["soak-neonvm-controller-leader-election"]["spec"]["limited"][
        "lendablePercent"] == 0
    for name, schema in schemas.items():
        assert schema["spec"]["priorityLevelConfiguration"]["name"] == name
        (rule,) = schema["spec"]["rules"]
        assert rule["subjects"] == [{"kind": "User", "user": {"name": CONTROLLER_USER}}]
    (lease,) = schemas["soak-neonvm-controller-leader-election"]["spec"]["rules"]
    assert lease["resourceRules"][0]["resources"] == ["leases"]
    assert lease["resourceRules"][0]["namespaces"] == [LEASE_NAMESPACE]
    (reviews,) = schemas["soak-neonvm-controller-token-reviews"]["spec"]["rules"]
    assert reviews["resourceRules"][0]["resources"] == ["tokenreviews"]
