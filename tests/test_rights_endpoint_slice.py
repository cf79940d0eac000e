"""The rights Service's EndpointSlice at a term's end (neonvm/controller/rights.py,
``LeaderEndpoint``; docs/security.md, "Rights endpoint"): a leader whose term ends
empties the slice if it still names it, and leaves a next leader's slice alone. On the
real API server."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from neonvm.controller.leader_endpoint import LeaderEndpoint


def addresses(api: client.ApiClient, namespace: str) -> list[tuple[str, int]]:
    found: Any = client.DiscoveryV1Api(api).read_namespaced_endpoint_slice(
        "rights-leader", namespace)
    return [(a, p.port) for e in found.endpoints or [] for a in e.addresses
            for p in found.ports]


def test_a_leader_withdraws_the_slice_when_its_term_ends(
        api: client.ApiClient, namespace: str) -> None:
    a = LeaderEndpoint(api, namespace, "rights", "10.255.0.1", 8082)
    assert a.publish()
    assert addresses(api, namespace) == [("10.255.0.1", 8082)]
    assert a.withdraw()
    assert addresses(api, namespace) == []  # no stale address for a new pod to inherit
    assert not a.withdraw()
    assert a.publish() and addresses(api, namespace) == [("10.255.0.1", 8082)]


def test_a_withdrawal_never_undoes_the_next_leaders_slice(
        api: client.ApiClient, namespace: str) -> None:
    a = LeaderEndpoint(api, namespace, "rights", "10.255.0.1", 8082)
    b = LeaderEndpoint(api, namespace, "rights", "10.255.0.2", 8082)
    a.publish()
    b.publish()
    assert not a.withdraw()
    assert addresses(api, namespace) == [("10.255.0.2", 8082)]
