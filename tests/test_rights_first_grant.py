"""A term's first grant to a pod, on a real API server: the leader writes the pod (the term
mark, ``vm.neon.tech/right-term``) before granting a runner that has not started its
guest, and grants a runner whose guest has started without any write (docs/protocol.md,
"A deposed leader's delete still in flight" and "A term's first grants").

The shipped runner's renewer (its real HTTP client) asks the shipped endpoint, whose mark
is the shipped ``api_mark_pod`` as the controller's identity; the pod is a real one
(gated, never scheduled), and what was written is read back from the API server: its
``resourceVersion`` moves only on a write."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from neonvm.controller.cluster import KubeCluster
from neonvm.controller.rights import (
    TERM_ANNOTATION,
    RightsLedger,
    RightsServer,
    RightsService,
    TokenCache,
    api_mark_pod,
)
from neonvm.runner.right import RightConfig, RightKeeper, http_post
from tests.support.rights import caches, secret

pytestmark = pytest.mark.cluster

TOKEN = b"the-vms-scaling-token"
VM = "vm"


class Leader:
    """The shipped endpoint over caches naming the real pod ``vm-p`` as the VM's current
    pod; each :meth:`new_term` is a term of this process (its epoch the term mark)."""

    def __init__(self, api: client.ApiClient, namespace: str, pod_uid: str) -> None:
        self.ledger = RightsLedger()
        self.epoch = ""
        self.terms = 0

        def epoch() -> str:
            return self.epoch

        shown = caches(namespace, VM, pod_uid=pod_uid, seconds=30.0)
        service = RightsService(self.ledger, lambda: shown,
                                TokenCache(None, read=lambda _ns, _name: secret(TOKEN)),
                                api_mark_pod(api, epoch), registry=CollectorRegistry())
        self.server = RightsServer(service, "127.0.0.1", 0).start()

    def new_term(self) -> None:
        self.terms += 1
        self.epoch = str(self.terms)
        self.ledger.begin_term(lambda: True)

    def close(self) -> None:
        self.server.stop()


@pytest.fixture
def pod(api: client.ApiClient, namespace: str) -> client.V1Pod:
    """The VM's runner pod, gated (it never runs; only its metadata matters here)."""
    return client.CoreV1Api(api).create_namespaced_pod(namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{VM}-p"},
        "spec": {"containers": [{"name": "runner", "image": "neonvm-runner:test"}],
                 "schedulingGates": [{"name": "hold"}]}})


@pytest.fixture
def leader(controller_api: client.ApiClient, namespace: str,
           pod: client.V1Pod) -> Iterator[Leader]:
    served = Leader(controller_api, namespace, pod.metadata.uid)
    yield served
    served.close()


def runner(tmp_path: Path, leader: Leader, namespace: str, pod_uid: str) -> RightKeeper:
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    return RightKeeper(RightConfig(url=f"http://127.0.0.1:{leader.server.port}",
                                   seconds=30.0, namespace=namespace, vm=VM,
                                   pod_uid=pod_uid, token_file=token_file),
                       time.monotonic, http_post)


def stored(api: client.ApiClient, namespace: str) -> tuple[str, str | None]:
    """The pod's resourceVersion and term mark, as the API server has them."""
    meta = client.CoreV1Api(api).read_namespaced_pod(f"{VM}-p", namespace).metadata
    return str(meta.resource_version), (meta.annotations or {}).get(TERM_ANNOTATION)


def epoch_of(mark: str | None) -> str | None:
    """The epoch part of a term mark (``<epoch>.<nonce>``)."""
    return mark.rpartition(".")[0] if mark is not None else None


def test_a_runner_not_started_is_granted_after_a_write_and_a_started_one_with_none(
        api: client.ApiClient, namespace: str, pod: client.V1Pod, leader: Leader,
        tmp_path: Path) -> None:
    keeper = runner(tmp_path, leader, namespace, pod.metadata.uid)
    before, mark = stored(api, namespace)
    assert mark is None

    # Term 1: the runner waits for its first grant (QEMU not started): the pod is
    # written first, once in the term.
    leader.new_term()
    keeper.ask_once()
    assert keeper.granted()
    first, mark = stored(api, namespace)
    assert first != before and epoch_of(mark) == "1"
    keeper.ask_once()
    assert stored(api, namespace) == (first, mark)

    # QEMU starts; term 2 begins (a leader change): its first grant writes nothing.
    keeper.guest_started()
    leader.new_term()
    deadline = keeper.deadline
    keeper.ask_once()
    assert keeper.deadline is not None and deadline is not None and keeper.deadline > deadline
    keeper.ask_once()
    assert stored(api, namespace) == (first, mark)
    assert leader.ledger.granted_this_term(pod.metadata.uid)


def test_an_ask_that_does_not_say_started_is_written_first_in_every_term(
        api: client.ApiClient, namespace: str, pod: client.V1Pod, leader: Leader,
        tmp_path: Path) -> None:
    """A runner of the previous release never says it (its target is the bare path): every
    term's first grant to it writes the pod, as before."""
    keeper = runner(tmp_path, leader, namespace, pod.metadata.uid)
    versions = []
    for term in ("1", "2", "3"):
        leader.new_term()
        keeper.ask_once()
        version, mark = stored(api, namespace)
        assert epoch_of(mark) == term
        versions.append(version)
    assert len(set(versions)) == 3


# ---- the write changes the pod, whatever the annotation held --------------------------------


@pytest.mark.parametrize("preset", ["2", "1", "2.0", "2.00000000000000000000000000000000", ""])
def test_a_mark_preset_by_whoever_may_patch_pods_still_changes_the_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        pod: client.V1Pod, preset: str) -> None:
    """A tenant with ``edit`` may set the annotation to what it guesses the next term
    writes (the next epoch is nearly always the current one plus 1). The next term's
    write must still change the pod's resourceVersion, so a deposed leader's force-DELETE
    preconditioned on the version it read before fails (409) rather than land after the
    next term's grant (docs/protocol.md, "A deposed leader's delete still in flight")."""
    core = client.CoreV1Api(api)
    core.patch_namespaced_pod(f"{VM}-p", namespace,
                              {"metadata": {"annotations": {TERM_ANNOTATION: preset}}})
    cluster = KubeCluster(controller_api)
    read = cluster.get_pod(namespace, f"{VM}-p")  # term 1's read after its condemn
    assert read is not None
    version = read["metadata"]["resourceVersion"]

    assert api_mark_pod(controller_api, lambda: "2")(namespace, f"{VM}-p", pod.metadata.uid)
    after, mark = stored(api, namespace)
    assert after != version

    with pytest.raises(client.ApiException) as refused:  # term 1's DELETE, in flight
        cluster.delete_pod(namespace, f"{VM}-p", uid=pod.metadata.uid,
                           resource_version=version, grace_period_seconds=0)
    assert refused.value.status == 409
    assert stored(api, namespace) == (after, mark)
    assert epoch_of(mark) == "2" and mark != preset


def test_two_marks_in_one_term_each_change_the_pod(
        api: client.ApiClient, controller_api: client.ApiClient, namespace: str,
        pod: client.V1Pod) -> None:
    """A nonce per write, not per term: a term that writes a pod again (its mark dropped
    with the pod's condemn) changes it again."""
    mark = api_mark_pod(controller_api, lambda: "3")
    assert mark(namespace, f"{VM}-p", pod.metadata.uid)
    first = stored(api, namespace)
    assert mark(namespace, f"{VM}-p", pod.metadata.uid)
    second = stored(api, namespace)
    assert first[0] != second[0] and first[1] != second[1]
