"""The rights Service pointed at the leader: :class:`LeaderEndpoint` writes the
EndpointSlice that names this replica alone, so runners ask the leader and not a standby
(docs/protocol.md, "Self-fencing"; docs/security.md, "Rights endpoint")."""

from __future__ import annotations

import ipaddress
from typing import Any

from kubernetes import client

from neonvm import kube

RIGHTS_PORT_NAME = "rights"
ENDPOINT_MANAGER = "neonvm-controller"


def endpoint_ip_problem(ip: str) -> str | None:
    """Why the API server would refuse ``ip`` as the rights Service's endpoint (an
    EndpointSlice may not name an unspecified, loopback, link-local or multicast
    address), or None. Checked at start, so such a replica fails at once instead of
    leaving its runners without a right (docs/reconciler.md, the self-fencing flags)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return f"{ip!r} is not an IP address"
    for kind, bad in (("unspecified", address.is_unspecified),
                      ("loopback", address.is_loopback),
                      ("link-local", address.is_link_local),
                      ("multicast", address.is_multicast)):
        if bad:
            return (f"{ip} is a {kind} address, which an EndpointSlice may not name: "
                    "give the replica's pod IP")
    return None


class LeaderEndpoint:
    """Points a selector-less Service at the leader: an EndpointSlice
    (``kubernetes.io/service-name: <service>``) naming this replica's IP and port alone.

    Written by each term when it starts and looked at again periodically
    (:meth:`publish`: a GET, and a write only when it names someone else), so runners
    ask the leader and not a standby (each standby would answer 503 ``NotLeader``, and a
    runner that meets standbys until its right runs out kills its guest). A slice left
    by a deposed leader is overwritten by the next term; meanwhile runners' asks fail
    and are retried at their next renewal."""

    def __init__(self, api: client.ApiClient, namespace: str, service: str, ip: str,
                 port: int) -> None:
        self._api = api
        self.namespace = namespace
        self.service = service
        self.ip = ip
        self.port = port

    @property
    def _path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    def wanted(self) -> dict[str, Any]:
        family = "IPv6" if ":" in self.ip else "IPv4"
        return {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{self.service}-leader", "namespace": self.namespace,
                         "labels": {"kubernetes.io/service-name": self.service,
                                    "endpointslice.kubernetes.io/managed-by":
                                        ENDPOINT_MANAGER}},
            "addressType": family,
            "endpoints": [{"addresses": [self.ip], "conditions": {"ready": True}}],
            "ports": [{"name": RIGHTS_PORT_NAME, "port": self.port, "protocol": "TCP"}],
        }

    def publish(self) -> bool:
        """Make the slice name this replica; True when it was written."""
        wanted = self.wanted()
        name = wanted["metadata"]["name"]
        current = kube.get_or_none(self._api, f"{self._path}/{name}", timeout=10)
        if current is None:
            kube.request(self._api, "POST", self._path, body=wanted, timeout=10)
            return True
        if ([e.get("addresses") for e in current.get("endpoints") or []]
                == [[self.ip]] and current.get("ports") == wanted["ports"]):
            return False
        wanted["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get(
            "resourceVersion")
        kube.request(self._api, "PUT", f"{self._path}/{name}", body=wanted, timeout=10)
        return True

    def withdraw(self, timeout: float = 3.0) -> bool:
        """At a term's end: empty the slice if it still names this replica (a PUT with
        the resourceVersion read, so a next leader's slice is never undone); True when it
        was written. A slice left naming a replica that is gone could name whatever pod
        gets its IP next (docs/security.md, "Rights endpoint")."""
        name = self.wanted()["metadata"]["name"]
        current = kube.get_or_none(self._api, f"{self._path}/{name}", timeout=timeout)
        if current is None or not any(
                self.ip in (e.get("addresses") or []) for e in current.get("endpoints") or []) \
                or [p.get("port") for p in current.get("ports") or []] != [self.port]:
            return False
        current["endpoints"] = []
        kube.request(self._api, "PUT", f"{self._path}/{name}", body=current, timeout=timeout)
        return True
