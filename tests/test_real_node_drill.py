"""The kill-leader drill with its runner pods on the real node: real QEMU (TCG) guests.

Opt-in (``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node_drill.py -s``): five VMs
whose runner pods boot the test guest on the real kubelet node, three local controller
replicas, the leader SIGKILLed; the drill's verdict must pass (another holder, every VM
converged, no duplicate runner pod, strict or loose, the final invariant check with the
locks) and afterwards every VM's runner pod is on the real node, Ready from its guest's
marker. Figures go to docs/real-node.md ("A drill on real runner pods").
"""

from __future__ import annotations

import contextlib
import time

import pytest
from kubernetes import client

from neonvm.dev import realnode
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for
from tests.support.real_node import _images_skip_reason

VMS = 5


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_kill_leader_drill_with_runner_pods_booting_guests_on_the_real_node(
    cluster: LocalCluster, api: client.ApiClient
) -> None:
    from neonvm.dev import realguest
    from neonvm.drills import fleet
    from neonvm.drills.drills import DrillOptions, run_drill
    from neonvm.drills.target import LocalTarget

    problem = realguest.unavailable_reason()
    if problem:
        pytest.skip(f"no real guest here: {problem}")
    # The real node, the runner image (also as the replicas' DEV_RUNNER_IMAGE) and the
    # guest's root disk image imported into its containerd.
    node = realguest.prepare(cluster, print).node
    target: LocalTarget | None = None
    namespace = ""
    try:
        target = LocalTarget(cluster, 3, client.ApiClient(api.configuration))
        target.heal()
        wait_for(target.leader, timeout=120, interval=0.5, what="a leader among 3 replicas")
        said: list[str] = []

        def say(msg: str) -> None:
            said.append(msg)
            print(f"  drill: {msg}", flush=True)

        started = time.monotonic()
        verdict = run_drill("kill-leader", target, DrillOptions(
            vms=VMS, timeout=900.0, keep=True, seed=17,
            vm_spec=realguest.vm_spec(args=("drill",))), say)
        namespace = verdict.namespace
        print("\n" + "\n".join(f"{k}: {v}" for k, v in verdict.rows()))
        print(f"drill wall time {time.monotonic() - started:.1f}s")
        assert verdict.ok, verdict.failures
        assert verdict.duplicates == 0 and verdict.duplicates_loose == 0
        assert verdict.leader_after and verdict.leader_after != verdict.leader_before

        # Every VM's runner pod is a real one: on the real node, Ready from the guest.
        core = client.CoreV1Api(api)

        def all_ready() -> bool:
            pods = fleet.list_runner_pods(api, namespace)
            live = [p for p in pods if p.metadata.deletion_timestamp is None]
            return len(live) == VMS and all(
                p.spec.node_name == node.name and any(
                    c.type == "Ready" and c.status == "True"
                    for c in p.status.conditions or [])
                for p in live)

        wait_for(all_ready, timeout=900, interval=1.0,
                 what=f"{VMS} runner pods Ready on {node.name}")
        print(f"all {VMS} runner pods Ready on {node.name} "
              f"{time.monotonic() - started:.1f}s after the drill began")
        for pod in fleet.list_runner_pods(api, namespace):
            log = core.read_namespaced_pod_log(pod.metadata.name, namespace,
                                               container="neonvm-runner")
            assert "NEONVM_GUEST_READY" in log and "app: argv drill" in log, log[-3000:]
        fleet.delete_vms(api, namespace)
        gone, seconds, left = fleet.wait_gone(api, namespace, 600, say)
        assert gone, left
        print(f"VMs and runner pods gone {seconds:.1f}s after delete")
    finally:
        if namespace:
            with contextlib.suppress(Exception):
                fleet.delete_vms(api, namespace)
                fleet.wait_gone(api, namespace, 300, lambda _m: None)
                fleet.drop_namespace(api, namespace)
        if target is not None:
            for i in range(target.replicas):
                cluster.stop_component(target.replica_name(i))
            target.close()
        node.stop()


@pytest.mark.unit
def test_vm_spec_steers_drill_vms_to_the_real_node_keeping_the_other_guest_fields() -> None:
    """The drill's VMs with ``vm_spec`` merged: node selector and real guest fields set,
    the default guest's other fields kept; without it, the small default VM."""
    from neonvm.dev import realguest
    from neonvm.drills import fleet

    plain = fleet.vm_body("vm-0")
    steered = fleet.vm_body("vm-0", spec_extra=realguest.vm_spec(args=("drill",)))
    assert "nodeSelector" not in plain["spec"]
    assert steered["spec"]["nodeSelector"] == {"neonvm.dev/real-node": "true"}
    guest = steered["spec"]["guest"]
    assert guest["rootDisk"] == {"image": realguest.DISK_IMAGE, "imagePullPolicy": "Never"}
    assert guest["cpus"] == {"min": "250m", "max": 1, "use": "250m"}
    assert guest["memorySlotSize"] == "128Mi" and guest["args"] == ["drill"]
    assert steered["spec"]["terminationGracePeriodSeconds"] == 1
    assert steered["spec"]["restartPolicy"] == plain["spec"]["restartPolicy"] == "Always"
    assert plain["spec"]["guest"]["rootDisk"]["image"] != realguest.DISK_IMAGE


@pytest.mark.unit
def test_which_real_node_tests_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default tests run unless NEONVM_TEST_REAL_NODE=0 (on built binaries); the others
    only with =1; a host that cannot start a node skips both, saying why."""
    from tests.support import real_node as t

    monkeypatch.setattr(realnode, "unavailable_reason", lambda: None)
    monkeypatch.setattr(realnode, "built", lambda: True)
    monkeypatch.delenv("NEONVM_TEST_REAL_NODE", raising=False)
    assert t._skip_reason(default=True) is None
    assert "NEONVM_TEST_REAL_NODE=1" in (t._skip_reason() or "")
    monkeypatch.setattr(realnode, "built", lambda: False)
    assert "not built" in (t._skip_reason(default=True) or "")
    monkeypatch.setenv("NEONVM_TEST_REAL_NODE", "1")
    assert t._skip_reason(default=True) is None and t._skip_reason() is None
    monkeypatch.setenv("NEONVM_TEST_REAL_NODE", "0")
    assert "NEONVM_TEST_REAL_NODE=0" in (t._skip_reason(default=True) or "")
    monkeypatch.delenv("NEONVM_TEST_REAL_NODE")
    monkeypatch.setattr(realnode, "unavailable_reason", lambda: "no root")
    assert t._skip_reason(default=True) == "a real node cannot start on this host: no root"

