"""A presence record no term can have written (neonvm/leader/epoch.py, ``keep_presence``;
docs/security.md, "etcd").

Every term claims its epoch in the floor before it keeps presence, so a presence record
whose epoch is above the floor was written by someone else (a holder of the etcd
credential), and it carries no etcd lease, so it would never go. The leading term writes
over it, with one ERROR and ``neonvm_presence_repairs_total``, instead of giving up its
presence for good (which would make the standbys ask every later term to step down). A
real later term's record (its epoch at most the floor) is still never written over.
On the session's real locks etcd.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from loguru import logger
from prometheus_client import CollectorRegistry

from neonvm.dev.cluster import LocalCluster
from neonvm.leader.epoch import MAX_EPOCH, EpochFloor
from neonvm.leader.etcd import Etcd
from neonvm.leader.lock import Installation
from tests.support import wait_for


def record(identity: str, epoch: int) -> bytes:
    return json.dumps({"identity": identity, "epoch": epoch}).encode()


@contextmanager
def errors_logged() -> Iterator[list[str]]:
    messages: list[str] = []
    sink = logger.add(lambda m: messages.append(str(m)), level="ERROR")
    try:
        yield messages
    finally:
        logger.remove(sink)


@contextmanager
def keeping(floor: EpochFloor, identity: str, epoch: int) -> Iterator[threading.Thread]:
    stop = threading.Event()
    thread = threading.Thread(target=floor.keep_presence, args=(identity, epoch, 2, stop),
                              daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.cluster
def test_a_presence_record_above_the_floor_is_written_over_once_loudly_and_counted(
        cluster: LocalCluster) -> None:
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    registry = CollectorRegistry()
    with Etcd(cluster.locks_etcd_config(prefix)) as etcd:
        floor = EpochFloor(etcd, prefix, Installation("ns", "neonvm-controller"),
                           registry=registry)
        assert floor.claim(7, "leader-a")
        etcd.put(floor.presence_key, record("nobody", MAX_EPOCH))  # no etcd lease
        with errors_logged() as errors, keeping(floor, "leader-a", 7) as thread:
            wait_for(lambda: floor.shows_presence("leader-a", 7), 30,
                     what="the term's presence over the impossible record")
            wait_for(lambda: registry.get_sample_value(
                "neonvm_presence_repairs_total") == 1, 10, what="the repair counted")
            assert thread.is_alive(), "the term keeps its presence"
        assert not thread.is_alive()
        repairs = [e for e in errors if "presence record" in e]
        assert len(repairs) == 1 and f"epoch {MAX_EPOCH} (nobody)" in repairs[0], errors


@pytest.mark.cluster
def test_a_later_terms_presence_at_most_the_floor_is_never_written_over(
        cluster: LocalCluster) -> None:
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    registry = CollectorRegistry()
    with Etcd(cluster.locks_etcd_config(prefix)) as etcd:
        floor = EpochFloor(etcd, prefix, Installation("ns", "neonvm-controller"),
                           registry=registry)
        assert floor.claim(7, "leader-a") and floor.claim(8, "leader-b")
        etcd.put(floor.presence_key, record("leader-b", 8))
        floor.keep_presence("leader-a", 7, 2, threading.Event())  # returns: a later term
        assert floor.shows_presence("leader-b", 8)
        assert registry.get_sample_value("neonvm_presence_repairs_total") == 0
