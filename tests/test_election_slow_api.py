"""Three replicas reaching a real kube-apiserver through a proxy that adds 1.5 s to every
request: someone leads, and nobody's term ends.

The case of issue 29, item 0: at the chart's default timings (lease 4 s, renew deadline
2.5 s, retry 0.5 s), the old code never read the Lease (its 2.5 s budget was urllib3's
total, the TLS handshake through the proxy took 1.5 s of it, and the read timed out
after 0.99 s), and once it could, its renewals could not keep up. See
docs/leader-election.md, "Renewals in flight". ``NEONVM_SLOW_API_OBSERVE`` sets how long
the term is watched (default 60 s).

The proxy delays the TLS handshake too, so a new connection costs one round trip more
than a request on an open one: the first term of a replica whose connection pool is
still cold may end in its first window (its first renewals all open connections), and
the same replica takes the Lease back at once. That warm-up is allowed; after it, no
term ends and the holder never changes.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
from urllib.parse import urlparse

import pytest
from kubernetes import client

from neonvm.drills.proxy import LatencyProxy
from neonvm.leader.election import ElectionConfig, LeaderElector, Leadership
from neonvm.leader.lease_store import KubernetesLeaseStore
from tests.support import wait_for

LATENCY = 1.5
OBSERVE = float(os.environ.get("NEONVM_SLOW_API_OBSERVE", "60"))
WARM_UP = 15.0  # seconds after the first term started


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.long
def test_three_replicas_behind_a_slow_api_server_elect_one_leader_that_keeps_leading(
        controller_api: client.ApiClient, namespace: str) -> None:
    upstream = urlparse(controller_api.configuration.host)
    assert upstream.hostname and upstream.port
    started: list[Leadership] = []
    stopped: list[str] = []
    stop = threading.Event()
    clients: list[client.ApiClient] = []
    with LatencyProxy((upstream.hostname, upstream.port), LATENCY) as proxy:
        threads = []
        for i in range(3):
            cfg = copy.copy(controller_api.configuration)
            cfg.host = f"https://{upstream.hostname}:{proxy.port}"
            api = client.ApiClient(cfg)
            clients.append(api)
            config = ElectionConfig(namespace=namespace, name="slow", identity=f"replica-{i}")
            store = KubernetesLeaseStore(api, config.namespace, config.name)
            elector = LeaderElector(store, config, started.append,
                                    functools.partial(stopped.append, f"replica-{i}"))
            threads.append(threading.Thread(target=elector.run, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        try:
            wait_for(lambda: started, 90, interval=0.5, what="a replica to lead")
            stop.wait(WARM_UP)
            ended_before, started_before = len(stopped), len(started)
            assert started[-1].lost.is_set() is False, "nobody leads after the warm-up"
            stop.wait(OBSERVE)
            assert stopped[ended_before:] == [], (
                f"terms ended at {LATENCY} s per request: {stopped[ended_before:]}")
            assert len(started) == started_before
            assert len({lead.identity for lead in started}) == 1, "the holder changed"
            print(f"\n{len(started)} term(s) started, {ended_before} ended during the "
                  f"{WARM_UP:g} s warm-up, none in the {OBSERVE:g} s after it")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            for api in clients:
                api.close()
